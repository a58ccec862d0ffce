//! The D core's structured reservation events, captured by a scoped subscriber. A binary of its
//! own: tracing caches a callsite's interest when the callsite is first hit, and a test on
//! another thread hitting the same callsites while this one installs its subscriber can leave
//! them cached as disabled (the event then never reaches the capture; CI saw it once).

mod common;
use common::*;
use kvwire_connector::msg::Message;
use kvwire_connector::*;

/// A subscriber that keeps the `kvwire_connector` events as `message field=value ...` lines.
mod capture {
    use std::fmt::Write as _;
    use std::sync::{Arc, Mutex};
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata, Subscriber};

    #[derive(Clone, Default)]
    pub struct Capture(pub Arc<Mutex<Vec<String>>>);

    struct Line(String);

    impl Visit for Line {
        fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
            if f.name() == "message" {
                let _ = write!(self.0, "{v:?}");
            } else {
                let _ = write!(self.0, " {}={v:?}", f.name());
            }
        }
        fn record_str(&mut self, f: &Field, v: &str) {
            if f.name() == "message" {
                self.0.push_str(v);
            } else {
                let _ = write!(self.0, " {}={v}", f.name());
            }
        }
    }

    impl Subscriber for Capture {
        fn enabled(&self, m: &Metadata<'_>) -> bool {
            m.target() == "kvwire_connector"
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, e: &Event<'_>) {
            let mut l = Line(String::new());
            e.record(&mut l);
            self.0.lock().unwrap().push(l.0);
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }
}

#[test]
fn reservation_and_release_emit_structured_events() {
    let cap = capture::Capture::default();
    let lines = cap.0.clone();
    tracing::subscriber::with_default(cap, || {
        let mut d = DSide::new(DConfig::new(Policy::Eager, LAYERS));
        arrive(&mut d, 5, 2, 0);
        reserve(&mut d, 5, &[10, 11], MS);
        let abort = Message::Abort {
            req: RequestId(5),
            reason: FailReason::Timeout,
        };
        from_p(&mut d, abort, 2 * MS);
        reserve(&mut d, 6, &[12], 3 * MS); // never arrived: stale
    });
    let lines = lines.lock().unwrap().clone();
    assert_eq!(
        lines,
        vec![
            "d reserved blocks req=5 peer=7 blocks=2 policy=eager".to_string(),
            "d released blocks req=5 peer=7 blocks=2 reason=remote_abort".to_string(),
            "d released blocks req=6 blocks=1 reason=stale".to_string(),
        ]
    );
}

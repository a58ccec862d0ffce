//! Unit tests of the D and P state machines, driven by hand, and of the invariant checker.
//!
//! One binary, a file per side: [`d_side`] (reservation policies, aborts, deadlines, peers
//! going down), [`p_side`] (send modes, failures), [`prefix_land`] (D's prefix cache and the
//! land policy), [`checker`] (the invariant checker can fail). The steps they share are here.

use kvwire_connector::msg::Message;
use kvwire_connector::*;
use kvwire_testkit::sim::check::{BlockUse, Checker, Role, Violation};

const P: PeerId = PeerId(7);
const D: PeerId = PeerId(0);
const LAYERS: u16 = 4;

fn d(policy: Policy) -> DSide {
    DSide::new(DConfig::new(policy, LAYERS))
}

fn p(mode: SendMode) -> PSide {
    PSide::new(PConfig::new(mode, LAYERS))
}

fn d_actions(d: &mut DSide) -> Vec<DAction> {
    std::iter::from_fn(|| d.poll_action()).collect()
}

fn p_actions(p: &mut PSide) -> Vec<PAction> {
    std::iter::from_fn(|| p.poll_action()).collect()
}

fn arrive(d: &mut DSide, req: u64, blocks: u32, now: Nanos) {
    d.handle(
        DEvent::Arrived {
            req: RequestId(req),
            peer: P,
            tokens: blocks * 16,
            blocks,
        },
        now,
    )
    .unwrap();
}

fn from_p(d: &mut DSide, msg: Message, now: Nanos) {
    d.handle(DEvent::Message { from: P, msg }, now).unwrap();
}

fn from_d(p: &mut PSide, msg: Message, now: Nanos) {
    p.handle(PEvent::Message { from: D, msg }, now).unwrap();
}

/// A heartbeat of a peer's life `incarnation`.
fn heartbeat(incarnation: u64, seq: u64) -> Message {
    Message::Heartbeat { incarnation, seq }
}

/// Runs D's next deadline while P stays alive (a heartbeat at the same instant); the instant.
fn d_next_deadline_p_alive(d: &mut DSide) -> Nanos {
    let now = d.poll_timeout().unwrap();
    d.handle_timeout(now);
    from_p(d, heartbeat(1, now), now);
    now
}

fn has_may_reserve(a: &[DAction], req: u64) -> bool {
    a.iter()
        .any(|x| matches!(x, DAction::MayReserve { req: r, .. } if r.0 == req))
}

fn started(req: u64, blocks: u32) -> Message {
    Message::Started {
        req: RequestId(req),
        layers: LAYERS,
        blocks,
    }
}

mod checker;
mod d_side;
mod p_side;
mod prefix_land;

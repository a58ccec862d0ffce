//! Engine metrics: after a known sequence of transfers over loopback tcp and shm (successes in
//! every size class, a read, a submit-time refusal, a dead peer, a batch with a zero deadline, a
//! refused handshake), every counter and histogram count is exactly what the observed outcomes
//! imply, and the Prometheus endpoint's text, parsed with a real exposition parser, carries the
//! same values.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::{mismatch, op_at, pattern};
use kvwire_transfer::metrics::{ERROR_KINDS, ERROR_STAGES, SIZE_CLASSES};
use kvwire_transfer::{
    Access, BatchStats, Engine, EngineConfig, Error, MetricsSnapshot, Op, TransportKind,
};
use prometheus_parse::{Scrape, Value};

const MIB: u64 = 1 << 20;

fn engine(kind: TransportKind, metrics_addr: bool) -> Engine {
    Engine::new(EngineConfig {
        transport: kind,
        metrics_addr: metrics_addr.then(|| SocketAddr::from(([127, 0, 0, 1], 0))),
        ..Default::default()
    })
    .expect("engine")
}

/// One HTTP/1.1 exchange: (status code, body).
fn http(addr: SocketAddr, request: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(request).expect("send request");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read response");
    let text = String::from_utf8(out).expect("utf-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("response head");
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status code");
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .and_then(|v| v.trim().parse().ok())
        .expect("content length");
    assert_eq!(body.len(), len, "body length matches Content-Length");
    (code, body.to_string())
}

fn scrape(addr: SocketAddr) -> Scrape {
    let (code, body) = http(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(code, 200);
    Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).expect("valid exposition text")
}

/// The value of a counter/gauge sample with exactly these labels.
fn value(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    let hits: Vec<f64> = s
        .samples
        .iter()
        .filter(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
        .filter_map(|x| match x.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => Some(v),
            _ => None,
        })
        .collect();
    assert_eq!(hits.len(), 1, "exactly one sample {name} {labels:?}");
    hits[0]
}

/// The +Inf bucket (total count) of a histogram series.
fn histogram_count(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    let hits: Vec<&Vec<prometheus_parse::HistogramCount>> = s
        .samples
        .iter()
        .filter(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
        .filter_map(|x| match &x.value {
            Value::Histogram(b) => Some(b),
            _ => None,
        })
        .collect();
    assert_eq!(hits.len(), 1, "exactly one histogram {name} {labels:?}");
    let b = hits[0];
    assert!(
        b.windows(2).all(|w| w[0].count <= w[1].count),
        "cumulative buckets"
    );
    let last = b.last().expect("buckets");
    assert!(last.less_than.is_infinite());
    last.count
}

fn label(k: TransportKind) -> &'static str {
    kvwire_transfer::metrics::transport_label(k)
}

fn class_of(bytes: u64) -> &'static str {
    match bytes {
        0..=4096 => SIZE_CLASSES[0],
        4097..=65536 => SIZE_CLASSES[1],
        65537..=1048576 => SIZE_CLASSES[2],
        1048577..=16777216 => SIZE_CLASSES[3],
        _ => SIZE_CLASSES[4],
    }
}

/// What the observed outcomes say the initiator's counters must be.
#[derive(Default)]
struct Expect {
    write_bytes: u64,
    read_bytes: u64,
    write_batches: u64,
    read_batches: u64,
    ops: u64,
    slices: u64,
    failed: u64,
    by_class: HashMap<&'static str, u64>,
    errors: HashMap<(&'static str, &'static str), u64>,
}

impl Expect {
    fn ok(&mut self, s: &BatchStats, read: bool) {
        if read {
            self.read_bytes += s.bytes;
            self.read_batches += 1;
        } else {
            self.write_bytes += s.bytes;
            self.write_batches += 1;
        }
        self.ops += s.ops as u64;
        self.slices += s.slices as u64;
        *self.by_class.entry(class_of(s.bytes)).or_default() += 1;
    }
    fn err(&mut self, stage: &'static str, e: &Error) {
        let kind = ERROR_KINDS[kvwire_transfer::metrics::error_kind(e)];
        *self.errors.entry((stage, kind)).or_default() += 1;
        if stage == "batch" {
            self.failed += 1;
        }
    }
}

fn check_target(t: &Engine, dst: kvwire_transfer::RegionHandle, off: u64, len: usize) {
    let mut buf = vec![0u8; len];
    t.local_read(dst, off, &mut buf).expect("read target");
    assert_eq!(mismatch(7, off, &buf), None, "target bytes at {off}+{len}");
}

fn run_sequence(kind: TransportKind) {
    let t = engine(kind, true);
    let i = engine(kind, true);
    let dst = t
        .alloc_region(4 * MIB as usize, Access::ReadWrite)
        .expect("dst");
    let src = i
        .alloc_region(4 * MIB as usize, Access::Local)
        .expect("src");
    let rbuf = i.alloc_region(8192, Access::Local).expect("rbuf");
    i.local_write(src, 0, &pattern(7, 0, 4 * MIB as usize))
        .expect("fill");
    let rid = t.region_id(dst);
    let p = i.connect(t.listen_addr()).expect("connect");
    assert_eq!(p.transport(), kind);
    let mut x = Expect::default();

    // A: 4 KiB with a notification.
    let st = i
        .write(&p, &[op_at(src, rid, 0, 4096)], Some(b"a"), None)
        .expect("submit A")
        .wait()
        .expect("A");
    x.ok(&st, false);
    let n = t
        .notifications()
        .recv_timeout(Duration::from_secs(10))
        .expect("notification");
    assert_eq!(n.tag, b"a");
    check_target(&t, dst, 0, 4096);
    // B: two non-contiguous ops, 100 000 bytes.
    let st = i
        .write(
            &p,
            &[
                op_at(src, rid, 8192, 50_000),
                op_at(src, rid, 100_000, 50_000),
            ],
            None,
            None,
        )
        .expect("submit B")
        .wait()
        .expect("B");
    assert_eq!(st.ops, 2);
    x.ok(&st, false);
    check_target(&t, dst, 8192, 50_000);
    check_target(&t, dst, 100_000, 50_000);
    // C: 2 MiB.
    let st = i
        .write(&p, &[op_at(src, rid, MIB, 2 * MIB)], None, None)
        .expect("submit C")
        .wait()
        .expect("C");
    x.ok(&st, false);
    check_target(&t, dst, MIB, 2 * MIB as usize);
    // D: read 8 KiB back.
    let rop = Op {
        local: rbuf,
        local_offset: 0,
        remote: rid,
        remote_offset: 0,
        len: 8192,
    };
    let st = i
        .read(&p, &[rop], None)
        .expect("submit D")
        .wait()
        .expect("D");
    x.ok(&st, true);
    let mut got = vec![0u8; 8192];
    i.local_read(rbuf, 0, &mut got).expect("read rbuf");
    let mut want = vec![0u8; 8192];
    t.local_read(dst, 0, &mut want).expect("read dst");
    assert_eq!(got, want, "read-back bytes");
    // E: out of bounds, refused at submit.
    let e = i
        .write(&p, &[op_at(src, rid, 4 * MIB - 100, 4096)], None, None)
        .expect_err("out of bounds must be refused");
    assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
    x.err("submit", &e);
    // G: 4 MiB with a zero deadline: whatever the outcome, it is counted as such.
    let r = i
        .write(
            &p,
            &[op_at(src, rid, 0, 4 * MIB)],
            None,
            Some(Duration::ZERO),
        )
        .expect("submit G")
        .wait();
    match &r {
        Ok(st) => x.ok(st, false),
        Err(e) => {
            assert!(matches!(e, Error::Timeout), "{e}");
            x.err("batch", e);
        }
    }
    eprintln!(
        "zero-deadline batch over {kind:?}: {:?}",
        r.as_ref().map(|_| "completed")
    );
    // H: a dead peer.
    let t2 = engine(kind, false);
    let p2 = i.connect(t2.listen_addr()).expect("connect t2");
    t2.shutdown();
    // Polled; the bound only stops a hang (the closed connection is seen at once).
    let until = Instant::now() + Duration::from_secs(60);
    while p2.is_alive() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!p2.is_alive(), "peer death noticed");
    // `is_alive` turns false as the closing thread starts closing the peer, which refuses new
    // batches (PeerDead) a moment later: a write in between gets past that check, and the
    // region check refuses it (`rid` is t's region, unknown to p2). Which of the two a write
    // sees depends on how the closing thread is scheduled, so writes are repeated until the
    // first PeerDead, each refusal counted as what it was.
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let e = i
            .write(&p2, &[op_at(src, rid, 0, 16)], None, None)
            .expect_err("write to a dead peer");
        x.err("submit", &e);
        match e {
            Error::PeerDead(_) => break,
            Error::UnknownRegion(_) if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(1));
            }
            e => panic!("write to a dead peer: {e}"),
        }
    }
    // A refused handshake at the target (garbage instead of Hello).
    {
        let mut s = TcpStream::connect(t.listen_addr()).expect("raw connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").expect("garbage");
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink); // reject, then closed
    }

    // ---- the initiator's snapshot
    let m: MetricsSnapshot = i.metrics();
    let tr = m.transport(kind).expect("transport series");
    assert_eq!(tr.write_bytes, x.write_bytes);
    assert_eq!(tr.read_bytes, x.read_bytes);
    assert_eq!(tr.write_batches, x.write_batches);
    assert_eq!(tr.read_batches, x.read_batches);
    assert_eq!(tr.ops, x.ops);
    assert_eq!(tr.slices, x.slices);
    assert_eq!(tr.failed_batches, x.failed);
    for other in m.transports.iter().filter(|o| o.transport != kind) {
        assert_eq!(
            other.write_bytes + other.read_bytes + other.failed_batches,
            0
        );
    }
    for h in &m.latency {
        let want = if h.transport == kind {
            x.by_class.get(h.size_class).copied().unwrap_or(0)
        } else {
            0
        };
        assert_eq!(h.count, want, "{:?} {}", h.transport, h.size_class);
        assert_eq!(h.buckets.last().map(|b| b.1), Some(want));
        assert!(h.buckets.windows(2).all(|w| w[0].1 <= w[1].1));
        assert_eq!(h.sum_seconds > 0.0, want > 0);
    }
    for stage in ERROR_STAGES {
        for kind_name in ERROR_KINDS {
            let want = x.errors.get(&(stage, kind_name)).copied().unwrap_or(0);
            assert_eq!(m.error_count(stage, kind_name), want, "{stage}/{kind_name}");
        }
    }
    assert_eq!(
        (m.inflight_bytes, m.inflight_slices, m.inflight_batches),
        (0, 0, 0)
    );
    assert_eq!(m.connections_outbound, 2);
    assert_eq!(m.connections_inbound, 0);
    assert_eq!(m.disconnects, 1);
    assert_eq!(m.peers_connected, 1);
    assert_eq!(m.registrations, 2);
    assert_eq!(m.registered_bytes, 4 * MIB + 8192);
    assert_eq!((m.regions, m.region_bytes), (2, 4 * MIB + 8192));
    assert_eq!(
        m.region_bytes_by_kind,
        [
            ("engine", 4 * MIB + 8192),
            ("host", 0),
            ("pinned", 0),
            ("device", 0)
        ]
    );
    assert_eq!(m.lanes_reestablished, 0);
    assert_eq!(m.reposts, 0);
    assert_eq!(m.peers.len(), 1);
    let ps = &m.peers[0];
    assert_eq!(ps.id, p.id().0);
    assert_eq!(ps.transport, kind);
    assert_eq!(ps.write_bytes, x.write_bytes);
    assert_eq!(ps.read_bytes, x.read_bytes);
    assert_eq!(ps.batches, x.write_batches + x.read_batches);
    assert_eq!(ps.failed_batches, x.failed);
    assert_eq!(ps.ops, x.ops);

    // ---- the target's snapshot
    let tm = t.metrics();
    assert_eq!(tm.notifications_delivered, 1);
    assert_eq!(tm.notifications_dropped + tm.notifications_suppressed, 0);
    assert_eq!(tm.connections_inbound, 1);
    assert_eq!(tm.connections_outbound, 0);
    assert_eq!(tm.error_count("connect", "protocol"), 1);
    assert_eq!(tm.registrations, 1);
    for tr in &tm.transports {
        assert_eq!(
            tr.write_batches + tr.read_batches,
            0,
            "the target submitted nothing"
        );
    }

    // ---- the same values through the endpoint
    let s = scrape(i.metrics_addr().expect("initiator endpoint"));
    let tl = label(kind);
    let w = [("transport", tl), ("dir", "write")];
    let r = [("transport", tl), ("dir", "read")];
    assert_eq!(
        value(&s, "kvwire_transfer_bytes_total", &w),
        x.write_bytes as f64
    );
    assert_eq!(
        value(&s, "kvwire_transfer_bytes_total", &r),
        x.read_bytes as f64
    );
    assert_eq!(
        value(&s, "kvwire_batches_total", &w),
        x.write_batches as f64
    );
    assert_eq!(value(&s, "kvwire_batches_total", &r), x.read_batches as f64);
    assert_eq!(
        value(&s, "kvwire_ops_total", &[("transport", tl)]),
        x.ops as f64
    );
    assert_eq!(
        value(&s, "kvwire_slices_total", &[("transport", tl)]),
        x.slices as f64
    );
    assert_eq!(
        value(&s, "kvwire_failed_batches_total", &[("transport", tl)]),
        x.failed as f64
    );
    for c in SIZE_CLASSES {
        let want = x.by_class.get(c).copied().unwrap_or(0);
        assert_eq!(
            histogram_count(
                &s,
                "kvwire_batch_latency_seconds",
                &[("transport", tl), ("size", c)]
            ),
            want as f64,
            "{c}"
        );
    }
    for ((stage, kind_name), n) in &x.errors {
        assert_eq!(
            value(
                &s,
                "kvwire_errors_total",
                &[("stage", stage), ("kind", kind_name)]
            ),
            *n as f64
        );
    }
    assert_eq!(
        value(
            &s,
            "kvwire_errors_total",
            &[("stage", "batch"), ("kind", "io")]
        ),
        0.0
    );
    assert_eq!(value(&s, "kvwire_inflight_bytes", &[]), 0.0);
    assert_eq!(value(&s, "kvwire_connections_outbound_total", &[]), 2.0);
    assert_eq!(value(&s, "kvwire_disconnects_total", &[]), 1.0);
    assert_eq!(value(&s, "kvwire_peers", &[]), 1.0);
    assert_eq!(value(&s, "kvwire_region_registrations_total", &[]), 2.0);
    assert_eq!(
        value(&s, "kvwire_region_registered_bytes_total", &[]),
        (4 * MIB + 8192) as f64
    );
    let pid = p.id().0.to_string();
    assert_eq!(
        value(
            &s,
            "kvwire_peer_write_bytes_total",
            &[("peer", pid.as_str()), ("transport", tl)]
        ),
        x.write_bytes as f64
    );
    assert!(
        s.docs.contains_key("kvwire_batch_latency_seconds"),
        "HELP lines"
    );
    let ts = scrape(t.metrics_addr().expect("target endpoint"));
    assert_eq!(value(&ts, "kvwire_notifications_delivered_total", &[]), 1.0);
    assert_eq!(value(&ts, "kvwire_connections_inbound_total", &[]), 1.0);
    assert_eq!(
        value(
            &ts,
            "kvwire_errors_total",
            &[("stage", "connect"), ("kind", "protocol")]
        ),
        1.0
    );
}

#[test]
fn exact_counters_and_endpoint_over_tcp() {
    run_sequence(TransportKind::Tcp);
}

#[test]
fn exact_counters_and_endpoint_over_shm() {
    run_sequence(TransportKind::Shm);
}

#[test]
fn disabled_metrics_count_no_batches() {
    let t = Engine::new(EngineConfig {
        transport: TransportKind::Tcp,
        metrics: false,
        ..Default::default()
    })
    .expect("engine");
    let i = Engine::new(EngineConfig {
        transport: TransportKind::Tcp,
        metrics: false,
        ..Default::default()
    })
    .expect("engine");
    let dst = t.alloc_region(4096, Access::WriteOnly).expect("dst");
    let src = i.alloc_region(4096, Access::Local).expect("src");
    i.local_write(src, 0, &pattern(7, 0, 4096)).expect("fill");
    let p = i.connect(t.listen_addr()).expect("connect");
    i.write(&p, &[op_at(src, t.region_id(dst), 0, 4096)], None, None)
        .expect("submit")
        .wait()
        .expect("batch");
    check_target(&t, dst, 0, 4096);
    let m = i.metrics();
    assert!(m.transports.iter().all(|x| x.write_batches == 0));
    assert!(m.latency.iter().all(|h| h.count == 0));
    assert_eq!(m.registrations, 1, "engine-level counters still run");
    assert_eq!(i.metrics_addr(), None);
}

#[test]
fn endpoint_answers_only_get_metrics_and_survives_junk() {
    let e = engine(TransportKind::Tcp, true);
    let addr = e.metrics_addr().expect("endpoint");
    assert_eq!(http(addr, b"GET / HTTP/1.1\r\n\r\n").0, 404);
    assert_eq!(http(addr, b"POST /metrics HTTP/1.1\r\n\r\n").0, 404);
    assert_eq!(http(addr, b"\x00\xff\xfe garbage\r\n\r\n").0, 404);
    assert_eq!(http(addr, b"GET /metrics?x=1 HTTP/1.1\r\n\r\n").0, 200);
    // Oversized head without an end: refused, connection closed.
    let big = vec![b'a'; 8 << 10];
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _ = s.write_all(&big);
    let mut line = String::new();
    let _ = std::io::BufReader::new(&mut s).read_line(&mut line);
    assert!(line.starts_with("HTTP/1.1 431"), "{line:?}");
    // A client that connects and leaves without a request.
    drop(TcpStream::connect(addr).expect("connect"));
    // Still serving.
    let s = scrape(addr);
    assert_eq!(value(&s, "kvwire_peers", &[]), 0.0);
    e.shutdown();
}

#[test]
fn totals_keep_the_counts_of_peers_that_are_gone() {
    let i = engine(TransportKind::Tcp, false);
    let src = i.alloc_region(8192, Access::Local).expect("src");
    i.local_write(src, 0, &pattern(7, 0, 8192)).expect("fill");
    let mut want = 0;
    for round in 0..3u64 {
        let t = engine(TransportKind::Tcp, false);
        let dst = t.alloc_region(8192, Access::WriteOnly).expect("dst");
        let p = i.connect(t.listen_addr()).expect("connect");
        let n = 4096 + round * 1000;
        let st = i
            .write(&p, &[op_at(src, t.region_id(dst), 0, n)], None, None)
            .expect("submit")
            .wait()
            .expect("write");
        want += st.bytes;
        check_target(&t, dst, 0, n as usize);
        t.shutdown();
        // The closing thread marks the peer dead, then counts the disconnect: wait for the
        // count (polled; the bound only stops a hang), not for `is_alive` alone, or a thread
        // preempted between the two fails the count below.
        let until = Instant::now() + Duration::from_secs(60);
        while (p.is_alive() || i.metrics().disconnects <= round) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!p.is_alive());
        drop(p);
        let m = i.metrics();
        assert!(m.peers.is_empty(), "no per-peer series for a dead peer");
        let tr = m.transport(TransportKind::Tcp).expect("tcp");
        assert_eq!(tr.write_bytes, want, "round {round}");
        assert_eq!(tr.write_batches, round + 1);
        assert_eq!(m.disconnects, round + 1);
    }
}

/// Events recorded by [`Recorder`]: (level, message, fields).
type Events = std::sync::Arc<std::sync::Mutex<Vec<(tracing::Level, HashMap<String, String>)>>>;

/// A minimal subscriber that records every event's fields (the message under "message") and
/// every span's name (as an event with "span" set).
struct Recorder {
    events: Events,
    next: std::sync::atomic::AtomicU64,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        self.0.insert(f.name().to_string(), format!("{v:?}"));
    }
    fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
        self.0.insert(f.name().to_string(), v.to_string());
    }
}

impl tracing::Subscriber for Recorder {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, a: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let mut m = HashMap::new();
        a.record(&mut Fields(&mut m));
        m.insert("span".into(), a.metadata().name().to_string());
        if let Ok(mut g) = self.events.lock() {
            g.push((*a.metadata().level(), m));
        }
        tracing::span::Id::from_u64(
            1 + self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        )
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        let mut m = HashMap::new();
        e.record(&mut Fields(&mut m));
        if let Ok(mut g) = self.events.lock() {
            g.push((*e.metadata().level(), m));
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn tracing_events_carry_structured_fields() {
    // The global default (set once, only here): engine threads report too, and no per-thread
    // interest caching can hide a callsite. Other tests' events are told apart by unusual sizes.
    let events: Events = Default::default();
    let rec = Recorder {
        events: events.clone(),
        next: Default::default(),
    };
    tracing::subscriber::set_global_default(rec).expect("the only global subscriber");
    let t = engine(TransportKind::Shm, false);
    let dst = t.alloc_region(12288, Access::WriteOnly).expect("dst");
    let i = engine(TransportKind::Shm, false);
    let src = i.alloc_region(12288, Access::Local).expect("src");
    i.local_write(src, 0, &pattern(7, 0, 12288)).expect("fill");
    let p = i.connect(t.listen_addr()).expect("connect");
    i.write(&p, &[op_at(src, t.region_id(dst), 0, 3000)], None, None)
        .expect("submit")
        .wait()
        .expect("write");
    check_target(&t, dst, 0, 3000);
    let e = i
        .write(&p, &[op_at(src, t.region_id(dst), 12000, 3000)], None, None)
        .expect_err("out of bounds");
    assert!(matches!(e, Error::OutOfBounds { .. }));
    let ev = events.lock().expect("events").clone();
    let find = |msg: &str, key: &str, val: &str| -> Vec<HashMap<String, String>> {
        ev.iter()
            .filter(|(_, m)| {
                m.get("message").map(String::as_str) == Some(msg)
                    && m.get(key).is_some_and(|v| v.contains(val))
            })
            .map(|(_, m)| m.clone())
            .collect()
    };
    assert_eq!(
        find("region registered", "bytes", "12288").len(),
        2,
        "{ev:?}"
    );
    let taddr = t.listen_addr().to_string();
    let conn = find("peer connected", "remote_addr", &taddr);
    assert_eq!(conn.len(), 1, "{ev:?}");
    assert_eq!(conn[0].get("transport").map(String::as_str), Some("shm"));
    assert_eq!(conn[0].get("initiator").map(String::as_str), Some("true"));
    assert!(ev.iter().any(|(_, m)| {
        m.get("span").map(String::as_str) == Some("kvwire.connect") && m.get("addr") == Some(&taddr)
    }));
    let done = find("batch completed", "bytes", "3000");
    assert!(!done.is_empty(), "{ev:?}");
    assert_eq!(done[0].get("transport").map(String::as_str), Some("shm"));
    assert!(done[0].contains_key("duration_us"));
    let refused = find("batch refused", "error", "offset 12000 len 3000");
    assert_eq!(refused.len(), 1, "{ev:?}");
    assert_eq!(
        refused[0].get("peer").map(String::as_str),
        Some(p.id().0.to_string().as_str())
    );
}

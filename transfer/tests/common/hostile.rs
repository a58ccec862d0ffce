//! Helpers of the hostile-client tests: small limits and long timeouts (a pass never comes from
//! a deadline expiring), resource counts of this process (`/proc/self/fd`, `/proc/self/task`)
//! and their bounds computed from a configuration, connections from other loopback addresses,
//! a verified transfer by a legitimate initiator, the peak of a metric while a test runs, a
//! counter of warning lines, and a lock that runs these tests one at a time (the counts are
//! process-wide).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kvwire_transfer::{
    Access, Engine, EngineConfig, Limits, Op, Peer, RegionHandle, TransportKind,
};

use super::{mismatch, pattern};

/// A secret as `kvwire-bench secret` makes them.
pub const SECRET: &[u8] = b"9f1c2d0e7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d";

/// Far longer than any test runs: nothing passes because a deadline expired.
pub const LONG: Duration = Duration::from_secs(600);

/// What a hung test waits at most before it fails (a failure detector, not a timing check).
pub const HANG: Duration = Duration::from_secs(120);

/// Runs hostile tests one at a time (their resource counts are process-wide).
pub fn serial() -> MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}

/// Small limits with long timeouts.
pub fn limits() -> Limits {
    Limits {
        handshake_timeout: LONG,
        max_handshakes: 8,
        max_handshakes_per_ip: 2,
        auth_failures_per_ip: 1000,
        max_peers: 4,
        max_peer_lanes: 4,
        peer_notify_bytes: 1 << 20,
        max_remote_regions: 4096,
        ctrl_queue_bytes: 256 << 10,
        idle_timeout: LONG,
        metrics_max_conns: 4,
        metrics_conn_timeout: LONG,
    }
}

/// A tcp engine with `secret`, 2 lanes, long timeouts and `limits`.
pub fn config(secret: Option<&[u8]>, limits: Limits) -> EngineConfig {
    EngineConfig {
        transport: TransportKind::Tcp,
        secret: secret.map(|s| s.to_vec()),
        lanes: 2,
        connect_timeout: LONG,
        default_deadline: LONG,
        limits,
        ..EngineConfig::default()
    }
}

/// Open file descriptors of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Threads of this process.
pub fn task_count() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// File descriptors an engine with `cfg` holds at most with `regions` regions allocated:
/// listeners, handshakes in progress (socket and the gate's clone), metrics connections (the
/// same), and per peer its control connection (socket, reader, writer), its inbound lanes
/// (socket, the peer's clone, the frame reader's) and its outbound lanes (socket, clone).
pub fn fd_bound(cfg: &EngineConfig, regions: usize) -> usize {
    let l = &cfg.limits;
    2 + 2 * l.max_handshakes
        + 2 * l.metrics_max_conns
        + regions
        + l.max_peers * (3 + 3 * l.max_peer_lanes + 2 * cfg.lanes)
}

/// Threads an engine with `cfg` runs at most (no RDMA device): acceptor, copy, timer, metrics
/// server and its connections, handshakes in progress, and per peer its control reader and
/// writer, inbound lanes and outbound lanes (sender and reader each).
pub fn thread_bound(cfg: &EngineConfig) -> usize {
    let l = &cfg.limits;
    4 + l.metrics_max_conns
        + l.max_handshakes
        + l.max_peers * (2 + l.max_peer_lanes + 2 * cfg.lanes)
}

/// Polls `cond` every millisecond until it holds; panics after [`HANG`] (a hang detector).
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let until = Instant::now() + HANG;
    while !cond() {
        assert!(Instant::now() < until, "hung waiting for: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A connection to `to` from loopback address `127.0.0.<last>`.
pub fn connect_from(last: u8, to: SocketAddr) -> TcpStream {
    let ip = Ipv4Addr::new(127, 0, 0, last);
    let s =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    s.bind(&SocketAddr::V4(SocketAddrV4::new(ip, 0)).into())
        .expect("bind to a loopback address");
    s.connect(&to.into()).expect("connect");
    let s: TcpStream = s.into();
    s.set_read_timeout(Some(HANG)).expect("timeout");
    s
}

/// A legitimate initiator (`cfg`) connects to `t` and writes 64 KiB of pattern `seed` into
/// `r` at `offset`; every byte is then checked in the target. The engine is returned (dropping
/// it closes its peer).
pub fn good_transfer(
    t: &Engine,
    r: RegionHandle,
    offset: u64,
    seed: u64,
    cfg: EngineConfig,
) -> Engine {
    let len = 64 << 10;
    let i = Engine::new(cfg).expect("initiator");
    let src = i.alloc_region(len, Access::Local).expect("alloc");
    let p = i.connect(t.listen_addr()).expect("legitimate connect");
    write_checked((&i, &p, src), (t, r, offset), seed, len);
    i
}

/// The initiator `i` fills `src` with `len` bytes of pattern `seed` (as of `offset`) and writes
/// them through `p` into the target's region `r` at `offset`; every byte is then checked there.
pub fn write_checked(
    (i, p, src): (&Engine, &Peer, RegionHandle),
    (t, r, offset): (&Engine, RegionHandle, u64),
    seed: u64,
    len: usize,
) {
    i.local_write(src, 0, &pattern(seed, offset, len))
        .expect("fill");
    let op = Op {
        local: src,
        local_offset: 0,
        remote: t.region_id(r),
        remote_offset: offset,
        len: len as u64,
    };
    i.write(p, &[op], None, None)
        .expect("submit")
        .wait()
        .expect("legitimate batch");
    let mut buf = vec![0u8; len];
    t.local_read(r, offset, &mut buf).expect("read");
    assert_eq!(
        mismatch(seed, offset, &buf),
        None,
        "transferred bytes differ"
    );
}

/// The highest value of `read(engine)`, sampled every millisecond from [`Peak::start`] to
/// [`Peak::finish`] (a bound that must hold all along, not only at the end).
pub struct Peak {
    stop: Arc<AtomicBool>,
    most: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Peak {
    /// Starts sampling `read(t)`.
    pub fn start(t: &Engine, read: impl Fn(&Engine) -> u64 + Send + 'static) -> Peak {
        let (stop, most) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let (s, m, t) = (stop.clone(), most.clone(), t.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                m.fetch_max(read(&t), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        Peak {
            stop,
            most,
            thread: Some(thread),
        }
    }

    /// Stops sampling; the highest value seen.
    pub fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("sampler");
        }
        self.most.load(Ordering::Relaxed)
    }
}

/// Warning events of `kvwire_transfer` seen so far in this process (after
/// [`count_warnings`]).
pub fn warnings() -> u64 {
    WARNINGS.load(Ordering::Relaxed)
}

static WARNINGS: AtomicU64 = AtomicU64::new(0);

/// Installs (once per test binary) a subscriber that counts the engine's warning events.
pub fn count_warnings() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let _ = tracing::subscriber::set_global_default(WarnCounter);
    });
}

struct WarnCounter;

impl tracing::Subscriber for WarnCounter {
    fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
        *m.level() <= tracing::Level::WARN && m.target().starts_with("kvwire_transfer")
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        if *e.metadata().level() == tracing::Level::WARN {
            WARNINGS.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

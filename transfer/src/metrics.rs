//! Engine metrics: lock-free counters, gauges and fixed log2-bucket latency histograms
//! (atomics only, no allocation per operation), a plain [`MetricsSnapshot`], its Prometheus
//! text exposition, and the opt-in HTTP endpoint (`EngineConfig::metrics_addr`).
//!
//! Recording points: a batch is counted as submitted when its transport registers it with the
//! peer's in-flight map, and as completed (latency, bytes, or its error kind) when its outcome is
//! decided, before any waiter can see that outcome; submit-time refusals and connect failures are
//! counted by the engine. Per-peer counters live with the peer and are summed on export: a
//! completed batch updates one cache line of its peer (latency bucket and sum, bytes, ops,
//! slices for its direction and size class; five relaxed atomics); batch counts and the
//! per-transport latency histograms are derived from those at export.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
use crate::types::{BatchStats, TransportKind};

/// Transports with their own series, in label order.
pub(crate) const TRANSPORTS: [TransportKind; 3] =
    [TransportKind::Tcp, TransportKind::Shm, TransportKind::Rdma];

/// Index of a transport in [`TRANSPORTS`] (`Auto` never carries a batch; counted as tcp).
pub(crate) fn transport_index(k: TransportKind) -> usize {
    match k {
        TransportKind::Tcp | TransportKind::Auto => 0,
        TransportKind::Shm => 1,
        TransportKind::Rdma => 2,
    }
}

/// Label value of a transport.
pub fn transport_label(k: TransportKind) -> &'static str {
    match k {
        TransportKind::Tcp => "tcp",
        TransportKind::Shm => "shm",
        TransportKind::Rdma => "rdma",
        TransportKind::Auto => "auto",
    }
}

/// Batch size classes of the latency histograms: upper bounds in bytes (the last is unbounded).
pub const SIZE_CLASS_LIMITS: [u64; 4] = [4 << 10, 64 << 10, 1 << 20, 16 << 20];
/// Label values of the size classes (`size` label).
pub const SIZE_CLASSES: [&str; 5] = ["le_4KiB", "le_64KiB", "le_1MiB", "le_16MiB", "gt_16MiB"];

fn size_class(bytes: u64) -> usize {
    SIZE_CLASS_LIMITS
        .iter()
        .position(|l| bytes <= *l)
        .unwrap_or(SIZE_CLASS_LIMITS.len())
}

/// Error kinds (one per `Error` variant), as label values.
pub const ERROR_KINDS: [&str; 13] = [
    "io",
    "protocol",
    "version_mismatch",
    "auth_failed",
    "out_of_bounds",
    "unknown_region",
    "stale_region",
    "access_denied",
    "peer_dead",
    "timeout",
    "shutdown",
    "invalid_argument",
    "unsupported",
];

/// Where an error was counted (`stage` label): refused at submit, failed batch, failed connect.
pub const ERROR_STAGES: [&str; 3] = ["submit", "batch", "connect"];

/// Index of an error's kind in [`ERROR_KINDS`].
pub fn error_kind(e: &Error) -> usize {
    match e {
        Error::Io(_) => 0,
        Error::Protocol(_) => 1,
        Error::VersionMismatch { .. } => 2,
        Error::AuthFailed => 3,
        Error::OutOfBounds { .. } => 4,
        Error::UnknownRegion(_) => 5,
        Error::StaleRegion(_) => 6,
        Error::AccessDenied(_) => 7,
        Error::PeerDead(_) => 8,
        Error::Timeout => 9,
        Error::Shutdown => 10,
        Error::InvalidArgument(_) => 11,
        Error::Unsupported(_) => 12,
    }
}

/// Stage index: refused at submit.
pub(crate) const STAGE_SUBMIT: usize = 0;
/// Stage index: a submitted batch failed.
pub(crate) const STAGE_BATCH: usize = 1;
/// Stage index: connect/handshake failed.
pub(crate) const STAGE_CONNECT: usize = 2;

/// Histogram buckets: bucket `i < BUCKETS - 1` counts durations ≤ 2^i µs; the last is +Inf.
pub const BUCKETS: usize = 26;

/// Upper bound of bucket `i` in seconds (`f64::INFINITY` for the last).
pub fn bucket_le_seconds(i: usize) -> f64 {
    if i + 1 >= BUCKETS {
        f64::INFINITY
    } else {
        (1u64 << i) as f64 * 1e-6
    }
}

fn bucket_of(d: Duration) -> usize {
    let us = d.as_nanos().div_ceil(1000).min(u64::MAX as u128) as u64;
    if us <= 1 {
        0
    } else {
        ((64 - (us - 1).leading_zeros()) as usize).min(BUCKETS - 1)
    }
}

/// What every completed batch of one peer, direction and size class updates, in one cache line
/// for fast batches: latency sum, bytes, ops, slices and the log2 latency buckets (the first
/// four, up to 8 µs, share the line). The batch count is the sum of the buckets, so it costs no
/// atomic of its own; per-transport totals and histograms are sums over peers at export.
#[repr(align(64))]
#[derive(Default)]
struct Cell {
    sum_ns: AtomicU64,
    bytes: AtomicU64,
    ops: AtomicU64,
    slices: AtomicU64,
    buckets: [AtomicU64; BUCKETS],
}

impl Cell {
    fn record(&self, d: Duration, stats: &BatchStats) {
        self.buckets[bucket_of(d)].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
        self.bytes.fetch_add(stats.bytes, Ordering::Relaxed);
        self.ops.fetch_add(stats.ops as u64, Ordering::Relaxed);
        self.slices
            .fetch_add(stats.slices as u64, Ordering::Relaxed);
    }
}

/// Plain copy of a [`Cell`] (or a sum of them).
#[derive(Clone, Copy)]
struct CellSum {
    sum_ns: u64,
    bytes: u64,
    ops: u64,
    slices: u64,
    buckets: [u64; BUCKETS],
}

impl Default for CellSum {
    fn default() -> Self {
        CellSum {
            sum_ns: 0,
            bytes: 0,
            ops: 0,
            slices: 0,
            buckets: [0; BUCKETS],
        }
    }
}

impl CellSum {
    fn add(&mut self, c: &Cell) {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        self.sum_ns += ld(&c.sum_ns);
        self.bytes += ld(&c.bytes);
        self.ops += ld(&c.ops);
        self.slices += ld(&c.slices);
        for (s, b) in self.buckets.iter_mut().zip(c.buckets.iter()) {
            *s += ld(b);
        }
    }
    fn merge(&mut self, o: &CellSum) {
        self.sum_ns += o.sum_ns;
        self.bytes += o.bytes;
        self.ops += o.ops;
        self.slices += o.slices;
        for (s, b) in self.buckets.iter_mut().zip(o.buckets.iter()) {
            *s += *b;
        }
    }
    fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }
}

/// Counters of one peer (owned by the peer; the engine's per-transport totals and latency
/// histograms are their sums).
#[derive(Default)]
pub(crate) struct PeerCounters {
    /// Completed batches, [write, read] x size class.
    cells: [[Cell; 5]; 2],
    failed_batches: AtomicU64,
}

/// Plain sums of [`PeerCounters`] (per transport).
#[derive(Clone, Copy, Default)]
struct Totals {
    cells: [[CellSum; 5]; 2],
    failed_batches: u64,
}

impl Totals {
    fn add(&mut self, c: &PeerCounters) {
        for (d, row) in c.cells.iter().enumerate() {
            for (k, cell) in row.iter().enumerate() {
                self.cells[d][k].add(cell);
            }
        }
        self.failed_batches += c.failed_batches.load(Ordering::Relaxed);
    }
    fn merge(&mut self, o: &Totals) {
        for d in 0..2 {
            for k in 0..SIZE_CLASSES.len() {
                self.cells[d][k].merge(&o.cells[d][k]);
            }
        }
        self.failed_batches += o.failed_batches;
    }
    /// Sum over size classes of one direction.
    fn dir(&self, d: usize) -> CellSum {
        let mut s = CellSum::default();
        for c in &self.cells[d] {
            s.merge(c);
        }
        s
    }
    /// Latency histogram of one size class (both directions).
    fn histogram(&self, transport: TransportKind, class: usize) -> HistogramSnapshot {
        let mut s = self.cells[0][class];
        s.merge(&self.cells[1][class]);
        let mut cum = 0u64;
        let buckets: Vec<(f64, u64)> = s
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| {
                cum += *b;
                (bucket_le_seconds(i), cum)
            })
            .collect();
        HistogramSnapshot {
            transport,
            size_class: SIZE_CLASSES[class],
            buckets,
            sum_seconds: s.sum_ns as f64 * 1e-9,
            count: cum,
        }
    }
}

#[derive(Default)]
struct PeerBook {
    /// Every peer's counters with its transport index (folded into `gone` once the peer is gone).
    live: Vec<(usize, Arc<PeerCounters>)>,
    /// Sums of peers that are gone, per transport.
    gone: [Totals; 3],
}

impl PeerBook {
    /// Folds peers whose in-flight map is gone (they can no longer record) into `gone`.
    fn fold(&mut self) {
        let PeerBook { live, gone } = self;
        live.retain(|(ti, c)| {
            if Arc::strong_count(c) == 1 {
                gone[*ti].add(c);
                false
            } else {
                true
            }
        });
    }
}

/// Engine-wide metrics.
pub(crate) struct EngineMetrics {
    book: parking_lot::Mutex<PeerBook>,
    errors: [[AtomicU64; ERROR_KINDS.len()]; ERROR_STAGES.len()],
    pub(crate) registrations: AtomicU64,
    pub(crate) registered_bytes: AtomicU64,
    pub(crate) registration_ns: AtomicU64,
    pub(crate) unregistrations: AtomicU64,
    /// Peers set up, [outbound, inbound].
    pub(crate) connections: [AtomicU64; 2],
    pub(crate) disconnects: AtomicU64,
    /// Lanes re-established on peers that are gone (live peers are summed on export).
    pub(crate) lanes_reestablished_retired: AtomicU64,
    /// Work requests re-posted on peers that are gone.
    pub(crate) reposts_retired: AtomicU64,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        EngineMetrics {
            book: Default::default(),
            errors: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            registrations: AtomicU64::new(0),
            registered_bytes: AtomicU64::new(0),
            registration_ns: AtomicU64::new(0),
            unregistrations: AtomicU64::new(0),
            connections: Default::default(),
            disconnects: AtomicU64::new(0),
            lanes_reestablished_retired: AtomicU64::new(0),
            reposts_retired: AtomicU64::new(0),
        }
    }
}

impl EngineMetrics {
    /// Counts an error at a stage.
    pub(crate) fn error(&self, stage: usize, e: &Error) {
        self.errors[stage][error_kind(e)].fetch_add(1, Ordering::Relaxed);
    }

    /// Counters for a new peer using transport `kind`.
    pub(crate) fn peer_obs(self: &Arc<Self>, kind: TransportKind) -> PeerObs {
        let peer = Arc::new(PeerCounters::default());
        let mut b = self.book.lock();
        b.fold();
        b.live.push((transport_index(kind), peer.clone()));
        PeerObs {
            engine: self.clone(),
            peer,
        }
    }

    /// Per-transport sums over every peer ever connected.
    fn totals(&self) -> [Totals; 3] {
        let mut b = self.book.lock();
        b.fold();
        let mut t = [Totals::default(); 3];
        for (ti, g) in b.gone.iter().enumerate() {
            t[ti].merge(g);
        }
        for (ti, c) in b.live.iter() {
            t[*ti].add(c);
        }
        t
    }
}

/// What a peer's in-flight map records into (set when metrics are enabled).
pub(crate) struct PeerObs {
    pub(crate) engine: Arc<EngineMetrics>,
    pub(crate) peer: Arc<PeerCounters>,
}

impl PeerObs {
    /// A registered batch finished (`read`: direction; `d`: submit to completion).
    pub(crate) fn finished(
        &self,
        stats: &BatchStats,
        read: bool,
        d: Duration,
        r: &Result<BatchStats, Error>,
    ) {
        let e = &self.engine;
        let c = &self.peer;
        match r {
            Ok(_) => c.cells[usize::from(read)][size_class(stats.bytes)].record(d, stats),
            Err(err) => {
                c.failed_batches.fetch_add(1, Ordering::Relaxed);
                e.error(STAGE_BATCH, err);
            }
        }
        if tracing::enabled!(tracing::Level::TRACE) {
            match r {
                Ok(_) => tracing::trace!(
                    transport = transport_label(stats.transport),
                    bytes = stats.bytes,
                    slices = stats.slices,
                    read,
                    duration_us = d.as_micros() as u64,
                    "batch completed"
                ),
                Err(err) => tracing::trace!(
                    transport = transport_label(stats.transport),
                    bytes = stats.bytes,
                    read,
                    duration_us = d.as_micros() as u64,
                    error = %err,
                    "batch failed"
                ),
            }
        }
    }
}

// ---------------------------------------------------------------- snapshot

/// Counters of one transport (completed batches).
#[derive(Clone, Debug, PartialEq)]
pub struct TransportSnapshot {
    /// The transport.
    pub transport: TransportKind,
    /// Bytes written by completed write batches.
    pub write_bytes: u64,
    /// Bytes read by completed read batches.
    pub read_bytes: u64,
    /// Completed write batches.
    pub write_batches: u64,
    /// Completed read batches.
    pub read_batches: u64,
    /// Ops of completed batches (as submitted, before coalescing).
    pub ops: u64,
    /// Wire slices of completed batches.
    pub slices: u64,
    /// Batches that were submitted and then failed.
    pub failed_batches: u64,
}

/// One latency histogram (batch submit to completion).
#[derive(Clone, Debug, PartialEq)]
pub struct HistogramSnapshot {
    /// The transport.
    pub transport: TransportKind,
    /// Size class label (one of [`SIZE_CLASSES`]).
    pub size_class: &'static str,
    /// Cumulative counts: (upper bound in seconds, batches with latency ≤ bound).
    pub buckets: Vec<(f64, u64)>,
    /// Sum of latencies in seconds.
    pub sum_seconds: f64,
    /// Batches recorded.
    pub count: u64,
}

/// Counters of one connected peer.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerSnapshot {
    /// The peer's id in this engine.
    pub id: u64,
    /// The peer's control connection address.
    pub remote_addr: SocketAddr,
    /// The transport used towards it.
    pub transport: TransportKind,
    /// Bytes written to it (completed batches).
    pub write_bytes: u64,
    /// Bytes read from it (completed batches).
    pub read_bytes: u64,
    /// Completed batches.
    pub batches: u64,
    /// Failed batches.
    pub failed_batches: u64,
    /// Ops of completed batches.
    pub ops: u64,
    /// Lanes towards it re-established after errors (RDMA).
    pub lanes_reestablished: u64,
    /// Work requests towards it re-posted on another lane after a lane failed (RDMA).
    pub reposts: u64,
}

/// A count of errors of one kind at one stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorCount {
    /// One of [`ERROR_STAGES`].
    pub stage: &'static str,
    /// One of [`ERROR_KINDS`].
    pub kind: &'static str,
    /// Count.
    pub count: u64,
}

/// A point-in-time copy of an engine's metrics ([`crate::Engine::metrics`]).
#[derive(Clone, Debug, PartialEq)]
pub struct MetricsSnapshot {
    /// Per transport (tcp, shm, rdma).
    pub transports: Vec<TransportSnapshot>,
    /// Latency histograms per transport and size class.
    pub latency: Vec<HistogramSnapshot>,
    /// Connected peers.
    pub peers: Vec<PeerSnapshot>,
    /// Bytes of batches in flight.
    pub inflight_bytes: u64,
    /// Slices of batches in flight.
    pub inflight_slices: u64,
    /// Batches in flight.
    pub inflight_batches: u64,
    /// Errors by stage and kind (every combination, zeros included).
    pub errors: Vec<ErrorCount>,
    /// Lanes re-established after errors (RDMA queue pairs), over all peers ever connected.
    pub lanes_reestablished: u64,
    /// Work requests re-posted on another lane after a lane failed (RDMA), all peers ever.
    pub reposts: u64,
    /// Regions registered (allocated or caller memory) since start.
    pub registrations: u64,
    /// Bytes registered since start.
    pub registered_bytes: u64,
    /// Time spent registering, seconds (includes RDMA memory registration).
    pub registration_seconds: f64,
    /// Regions unregistered since start.
    pub unregistrations: u64,
    /// Regions registered now.
    pub regions: u64,
    /// Bytes registered now.
    pub region_bytes: u64,
    /// Peers set up by `connect`.
    pub connections_outbound: u64,
    /// Peers set up by accepting.
    pub connections_inbound: u64,
    /// Peers closed.
    pub disconnects: u64,
    /// Peers connected now.
    pub peers_connected: u64,
    /// Notifications delivered to this engine's queue (as a target).
    pub notifications_delivered: u64,
    /// Notifications dropped because the queue was full.
    pub notifications_dropped: u64,
    /// Notifications never delivered because a slice of their batch was refused.
    pub notifications_suppressed: u64,
}

impl MetricsSnapshot {
    /// The count of errors of `kind` at `stage` (0 when unknown names are given).
    pub fn error_count(&self, stage: &str, kind: &str) -> u64 {
        self.errors
            .iter()
            .find(|e| e.stage == stage && e.kind == kind)
            .map_or(0, |e| e.count)
    }

    /// The counters of one transport.
    pub fn transport(&self, k: TransportKind) -> Option<&TransportSnapshot> {
        self.transports.iter().find(|t| t.transport == k)
    }

    /// The latency histogram of a transport and size class label.
    pub fn latency_of(&self, k: TransportKind, size_class: &str) -> Option<&HistogramSnapshot> {
        self.latency
            .iter()
            .find(|h| h.transport == k && h.size_class == size_class)
    }

    /// The Prometheus text exposition format (version 0.0.4) of this snapshot.
    pub fn to_prometheus_text(&self) -> String {
        let mut o = String::with_capacity(16 << 10);
        let head = |o: &mut String, name: &str, ty: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}");
            let _ = writeln!(o, "# TYPE {name} {ty}");
        };
        type DirGet = fn(&TransportSnapshot) -> (u64, u64);
        type Get = fn(&TransportSnapshot) -> u64;
        let by_dir: [(&str, &str, DirGet); 2] = [
            (
                "kvwire_transfer_bytes_total",
                "Payload bytes of completed batches, by transport and direction.",
                |t| (t.write_bytes, t.read_bytes),
            ),
            (
                "kvwire_batches_total",
                "Completed batches, by transport and direction.",
                |t| (t.write_batches, t.read_batches),
            ),
        ];
        for (name, help, get) in &by_dir {
            head(&mut o, name, "counter", help);
            for t in &self.transports {
                let tl = transport_label(t.transport);
                let (w, r) = get(t);
                let _ = writeln!(o, "{name}{{transport=\"{tl}\",dir=\"write\"}} {w}");
                let _ = writeln!(o, "{name}{{transport=\"{tl}\",dir=\"read\"}} {r}");
            }
        }
        let per_transport: [(&str, &str, Get); 3] = [
            (
                "kvwire_ops_total",
                "Ops (as submitted) of completed batches, by transport.",
                |t| t.ops,
            ),
            (
                "kvwire_slices_total",
                "Wire slices of completed batches, by transport.",
                |t| t.slices,
            ),
            (
                "kvwire_failed_batches_total",
                "Submitted batches that failed, by transport.",
                |t| t.failed_batches,
            ),
        ];
        for (name, help, get) in &per_transport {
            head(&mut o, name, "counter", help);
            for t in &self.transports {
                let _ = writeln!(
                    o,
                    "{name}{{transport=\"{}\"}} {}",
                    transport_label(t.transport),
                    get(t)
                );
            }
        }
        let name = "kvwire_batch_latency_seconds";
        head(
            &mut o,
            name,
            "histogram",
            "Batch latency from submit to completion, by transport and batch size class.",
        );
        for h in &self.latency {
            let l = format!(
                "transport=\"{}\",size=\"{}\"",
                transport_label(h.transport),
                h.size_class
            );
            for (le, c) in &h.buckets {
                let les = if le.is_infinite() {
                    "+Inf".to_string()
                } else {
                    format!("{le}")
                };
                let _ = writeln!(o, "{name}_bucket{{{l},le=\"{les}\"}} {c}");
            }
            let _ = writeln!(o, "{name}_sum{{{l}}} {}", h.sum_seconds);
            let _ = writeln!(o, "{name}_count{{{l}}} {}", h.count);
        }
        let name = "kvwire_errors_total";
        head(
            &mut o,
            name,
            "counter",
            "Errors by stage (submit, batch, connect) and kind.",
        );
        for e in &self.errors {
            let _ = writeln!(
                o,
                "{name}{{stage=\"{}\",kind=\"{}\"}} {}",
                e.stage, e.kind, e.count
            );
        }
        let gauges: [(&str, &str, &str, String); 18] = [
            (
                "kvwire_inflight_bytes",
                "gauge",
                "Bytes of batches in flight.",
                self.inflight_bytes.to_string(),
            ),
            (
                "kvwire_inflight_slices",
                "gauge",
                "Wire slices of batches in flight.",
                self.inflight_slices.to_string(),
            ),
            (
                "kvwire_inflight_batches",
                "gauge",
                "Batches in flight.",
                self.inflight_batches.to_string(),
            ),
            (
                "kvwire_reposts_total",
                "counter",
                "Work requests re-posted on another lane after a lane failed (RDMA).",
                self.reposts.to_string(),
            ),
            (
                "kvwire_lanes_reestablished_total",
                "counter",
                "Data-path lanes re-established after errors (RDMA queue pairs).",
                self.lanes_reestablished.to_string(),
            ),
            (
                "kvwire_region_registrations_total",
                "counter",
                "Regions registered.",
                self.registrations.to_string(),
            ),
            (
                "kvwire_region_registered_bytes_total",
                "counter",
                "Bytes registered.",
                self.registered_bytes.to_string(),
            ),
            (
                "kvwire_region_registration_seconds_total",
                "counter",
                "Time spent registering regions.",
                self.registration_seconds.to_string(),
            ),
            (
                "kvwire_region_unregistrations_total",
                "counter",
                "Regions unregistered.",
                self.unregistrations.to_string(),
            ),
            (
                "kvwire_regions",
                "gauge",
                "Regions registered now.",
                self.regions.to_string(),
            ),
            (
                "kvwire_region_bytes",
                "gauge",
                "Bytes registered now.",
                self.region_bytes.to_string(),
            ),
            (
                "kvwire_connections_outbound_total",
                "counter",
                "Peers set up by connect.",
                self.connections_outbound.to_string(),
            ),
            (
                "kvwire_connections_inbound_total",
                "counter",
                "Peers set up by accepting.",
                self.connections_inbound.to_string(),
            ),
            (
                "kvwire_disconnects_total",
                "counter",
                "Peers closed.",
                self.disconnects.to_string(),
            ),
            (
                "kvwire_peers",
                "gauge",
                "Peers connected now.",
                self.peers_connected.to_string(),
            ),
            (
                "kvwire_notifications_delivered_total",
                "counter",
                "Notifications queued for the application (as a target).",
                self.notifications_delivered.to_string(),
            ),
            (
                "kvwire_notifications_dropped_total",
                "counter",
                "Notifications dropped because the queue was full.",
                self.notifications_dropped.to_string(),
            ),
            (
                "kvwire_notifications_suppressed_total",
                "counter",
                "Notifications not delivered because a slice of their batch was refused.",
                self.notifications_suppressed.to_string(),
            ),
        ];
        for (name, ty, help, v) in &gauges {
            head(&mut o, name, ty, help);
            let _ = writeln!(o, "{name} {v}");
        }
        type PGet = fn(&PeerSnapshot) -> u64;
        let per_peer: [(&str, &str, PGet); 6] = [
            (
                "kvwire_peer_write_bytes_total",
                "Bytes written to a peer (completed batches).",
                |p| p.write_bytes,
            ),
            (
                "kvwire_peer_read_bytes_total",
                "Bytes read from a peer (completed batches).",
                |p| p.read_bytes,
            ),
            (
                "kvwire_peer_batches_total",
                "Completed batches towards a peer.",
                |p| p.batches,
            ),
            (
                "kvwire_peer_failed_batches_total",
                "Failed batches towards a peer.",
                |p| p.failed_batches,
            ),
            (
                "kvwire_peer_reposts_total",
                "Work requests towards a peer re-posted on another lane after a lane failed (RDMA).",
                |p| p.reposts,
            ),
            (
                "kvwire_peer_lanes_reestablished_total",
                "Lanes towards a peer re-established after errors.",
                |p| p.lanes_reestablished,
            ),
        ];
        for (name, help, get) in &per_peer {
            head(&mut o, name, "counter", help);
            for p in &self.peers {
                let _ = writeln!(
                    o,
                    "{name}{{peer=\"{}\",remote=\"{}\",transport=\"{}\"}} {}",
                    p.id,
                    p.remote_addr,
                    transport_label(p.transport),
                    get(p)
                );
            }
        }
        o
    }
}

/// Engine-side inputs of a snapshot that live outside [`EngineMetrics`].
pub(crate) struct SnapshotExtra {
    pub peers: Vec<PeerSnapshot>,
    pub lanes_reestablished_live: u64,
    pub reposts_live: u64,
    pub regions: u64,
    pub region_bytes: u64,
    pub peers_connected: u64,
    pub notifications: (u64, u64, u64),
    /// (bytes, slices, batches) in flight.
    pub inflight: (u64, u64, u64),
}

impl EngineMetrics {
    /// A snapshot of every counter.
    pub(crate) fn snapshot(&self, x: SnapshotExtra) -> MetricsSnapshot {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let totals = self.totals();
        let transports = TRANSPORTS
            .iter()
            .zip(totals.iter())
            .map(|(k, t)| {
                let (w, r) = (t.dir(0), t.dir(1));
                TransportSnapshot {
                    transport: *k,
                    write_bytes: w.bytes,
                    read_bytes: r.bytes,
                    write_batches: w.count(),
                    read_batches: r.count(),
                    ops: w.ops + r.ops,
                    slices: w.slices + r.slices,
                    failed_batches: t.failed_batches,
                }
            })
            .collect();
        let mut latency = Vec::with_capacity(15);
        for (ti, k) in TRANSPORTS.iter().enumerate() {
            for c in 0..SIZE_CLASSES.len() {
                latency.push(totals[ti].histogram(*k, c));
            }
        }
        let mut errors = Vec::with_capacity(ERROR_STAGES.len() * ERROR_KINDS.len());
        for (si, stage) in ERROR_STAGES.iter().enumerate() {
            for (ki, kind) in ERROR_KINDS.iter().enumerate() {
                errors.push(ErrorCount {
                    stage,
                    kind,
                    count: ld(&self.errors[si][ki]),
                });
            }
        }
        MetricsSnapshot {
            transports,
            latency,
            peers: x.peers,
            inflight_bytes: x.inflight.0,
            inflight_slices: x.inflight.1,
            inflight_batches: x.inflight.2,
            errors,
            lanes_reestablished: ld(&self.lanes_reestablished_retired) + x.lanes_reestablished_live,
            reposts: ld(&self.reposts_retired) + x.reposts_live,
            registrations: ld(&self.registrations),
            registered_bytes: ld(&self.registered_bytes),
            registration_seconds: ld(&self.registration_ns) as f64 * 1e-9,
            unregistrations: ld(&self.unregistrations),
            regions: x.regions,
            region_bytes: x.region_bytes,
            connections_outbound: ld(&self.connections[0]),
            connections_inbound: ld(&self.connections[1]),
            disconnects: ld(&self.disconnects),
            peers_connected: x.peers_connected,
            notifications_delivered: x.notifications.0,
            notifications_dropped: x.notifications.1,
            notifications_suppressed: x.notifications.2,
        }
    }
}

/// Reads a peer's counters (for [`SnapshotExtra::peers`]).
pub(crate) fn peer_snapshot(
    id: u64,
    remote_addr: SocketAddr,
    transport: TransportKind,
    c: Option<&PeerCounters>,
    (lanes_reestablished, reposts): (u64, u64),
) -> PeerSnapshot {
    let mut t = Totals::default();
    if let Some(c) = c {
        t.add(c);
    }
    let (w, r) = (t.dir(0), t.dir(1));
    PeerSnapshot {
        id,
        remote_addr,
        transport,
        write_bytes: w.bytes,
        read_bytes: r.bytes,
        batches: w.count() + r.count(),
        failed_batches: t.failed_batches,
        ops: w.ops + r.ops,
        lanes_reestablished,
        reposts,
    }
}

// ---------------------------------------------------------------- HTTP endpoint

/// Largest request head accepted (bytes); longer requests get 431 and are closed.
const MAX_REQUEST: usize = 8 << 10;
/// Per-connection read/write timeout.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// A request head must arrive within this time (slow clients are closed).
const REQUEST_DEADLINE: Duration = Duration::from_secs(5);

/// Produces the exposition text; `None` once the engine is gone (the server then stops).
pub(crate) type Render = Box<dyn Fn() -> Option<String> + Send>;

/// Serves `GET /metrics` on `listener` (one connection at a time, each closed after one
/// response) until `render` returns `None`.
pub(crate) fn serve(listener: TcpListener, render: Render) {
    for conn in listener.incoming() {
        let Ok(s) = conn else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let Some(text) = render() else { return };
        if let Err(e) = answer(s, &text) {
            tracing::debug!(error = %e, "metrics request failed");
        }
    }
}

fn answer(mut s: TcpStream, text: &str) -> std::io::Result<()> {
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut buf = vec![0u8; MAX_REQUEST];
    let mut n = 0;
    let start = std::time::Instant::now();
    let head_end = loop {
        if n == buf.len() {
            break None;
        }
        if start.elapsed() >= REQUEST_DEADLINE {
            return Ok(()); // too slow: closed without an answer
        }
        let k = s.read(&mut buf[n..])?;
        if k == 0 {
            return Ok(()); // closed before a full request
        }
        n += k;
        if let Some(p) = buf[..n].windows(4).position(|w| w == b"\r\n\r\n") {
            break Some(p);
        }
    };
    let (status, body, ctype) = match head_end {
        None => ("431 Request Header Fields Too Large", "", "text/plain"),
        Some(end) => {
            let line = buf[..end].split(|b| *b == b'\n').next().unwrap_or(&[]);
            let mut parts = line.split(|b| *b == b' ');
            let method = parts.next().unwrap_or(&[]);
            let target = parts.next().unwrap_or(&[]);
            let path = target.split(|b| *b == b'?').next().unwrap_or(&[]);
            if method == b"GET" && path == b"/metrics" {
                ("200 OK", text, "text/plain; version=0.0.4; charset=utf-8")
            } else {
                ("404 Not Found", "not found\n", "text/plain")
            }
        }
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    s.flush()?;
    let _ = s.shutdown(std::net::Shutdown::Both);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_log2_microseconds() {
        assert_eq!(bucket_of(Duration::ZERO), 0);
        assert_eq!(bucket_of(Duration::from_nanos(1000)), 0);
        assert_eq!(bucket_of(Duration::from_nanos(1001)), 1);
        assert_eq!(bucket_of(Duration::from_micros(2)), 1);
        assert_eq!(bucket_of(Duration::from_micros(3)), 2);
        assert_eq!(bucket_of(Duration::from_micros(4)), 2);
        assert_eq!(bucket_of(Duration::from_micros(5)), 3);
        assert_eq!(bucket_of(Duration::from_secs(1)), 20);
        assert_eq!(bucket_of(Duration::from_secs(3600)), BUCKETS - 1);
        for i in 0..BUCKETS - 1 {
            let le = Duration::from_micros(1 << i);
            assert!(bucket_le_seconds(bucket_of(le)) >= le.as_secs_f64());
        }
    }

    #[test]
    fn size_classes() {
        assert_eq!(size_class(0), 0);
        assert_eq!(size_class(4096), 0);
        assert_eq!(size_class(4097), 1);
        assert_eq!(size_class(1 << 20), 2);
        assert_eq!(size_class(16 << 20), 3);
        assert_eq!(size_class((16 << 20) + 1), 4);
    }
}

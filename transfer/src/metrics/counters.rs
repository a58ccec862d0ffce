//! The counters: transport labels, error kinds and stages, latency buckets and size classes,
//! the engine's counters ([`EngineMetrics`]) and each peer's ([`PeerObs`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
use crate::types::{BatchStats, TransportKind};

/// Transports with their own series, in label order.
pub(crate) const TRANSPORTS: [TransportKind; 4] = [
    TransportKind::Tcp,
    TransportKind::Shm,
    TransportKind::Rdma,
    TransportKind::CudaIpc,
];

/// Index of a transport in [`TRANSPORTS`] (`Auto` never carries a batch; counted as tcp).
pub(crate) fn transport_index(k: TransportKind) -> usize {
    match k {
        TransportKind::Tcp | TransportKind::Auto => 0,
        TransportKind::Shm => 1,
        TransportKind::Rdma => 2,
        TransportKind::CudaIpc => 3,
    }
}

/// Label value of a transport.
pub fn transport_label(k: TransportKind) -> &'static str {
    match k {
        TransportKind::Tcp => "tcp",
        TransportKind::Shm => "shm",
        TransportKind::Rdma => "rdma",
        TransportKind::CudaIpc => "cuda_ipc",
        TransportKind::Auto => "auto",
    }
}

/// Batch size classes of the latency histograms: upper bounds in bytes (the last is unbounded).
pub const SIZE_CLASS_LIMITS: [u64; 4] = [4 << 10, 64 << 10, 1 << 20, 16 << 20];
/// Label values of the size classes (`size` label).
pub const SIZE_CLASSES: [&str; 5] = ["le_4KiB", "le_64KiB", "le_1MiB", "le_16MiB", "gt_16MiB"];

pub(super) fn size_class(bytes: u64) -> usize {
    SIZE_CLASS_LIMITS
        .iter()
        .position(|l| bytes <= *l)
        .unwrap_or(SIZE_CLASS_LIMITS.len())
}

/// Error kinds (one per `Error` variant), as label values.
pub const ERROR_KINDS: [&str; 15] = [
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
    "resource_limit",
    "fenced",
];

/// Where an error was counted (`stage` label): refused at submit, failed batch, failed connect
/// (outbound, or an inbound handshake or lane join refused), a connected peer closed because of
/// it (a bound exceeded, idle, a protocol violation on its control connection).
pub const ERROR_STAGES: [&str; 4] = ["submit", "batch", "connect", "peer"];

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
        Error::ResourceLimit { .. } => 13,
        Error::Fenced { .. } => 14,
    }
}

/// Stage index: refused at submit.
pub(crate) const STAGE_SUBMIT: usize = 0;
/// Stage index: a submitted batch failed.
pub(crate) const STAGE_BATCH: usize = 1;
/// Stage index: connect/handshake failed.
pub(crate) const STAGE_CONNECT: usize = 2;
/// Stage index: a connected peer was closed because of the error.
pub(crate) const STAGE_PEER: usize = 3;

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

pub(super) fn bucket_of(d: Duration) -> usize {
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
pub(super) struct Cell {
    pub(super) sum_ns: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) ops: AtomicU64,
    pub(super) slices: AtomicU64,
    pub(super) buckets: [AtomicU64; BUCKETS],
}

impl Cell {
    pub(super) fn record(&self, d: Duration, stats: &BatchStats) {
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
pub(super) struct CellSum {
    pub(super) sum_ns: u64,
    pub(super) bytes: u64,
    pub(super) ops: u64,
    pub(super) slices: u64,
    pub(super) buckets: [u64; BUCKETS],
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
    pub(super) fn add(&mut self, c: &Cell) {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        self.sum_ns += ld(&c.sum_ns);
        self.bytes += ld(&c.bytes);
        self.ops += ld(&c.ops);
        self.slices += ld(&c.slices);
        for (s, b) in self.buckets.iter_mut().zip(c.buckets.iter()) {
            *s += ld(b);
        }
    }
    pub(super) fn merge(&mut self, o: &CellSum) {
        self.sum_ns += o.sum_ns;
        self.bytes += o.bytes;
        self.ops += o.ops;
        self.slices += o.slices;
        for (s, b) in self.buckets.iter_mut().zip(o.buckets.iter()) {
            *s += *b;
        }
    }
    pub(super) fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }
}

/// Counters of one peer (owned by the peer; the engine's per-transport totals and latency
/// histograms are their sums).
#[derive(Default)]
pub(crate) struct PeerCounters {
    /// Completed batches, [write, read] x size class.
    pub(super) cells: [[Cell; 5]; 2],
    pub(super) failed_batches: AtomicU64,
}

/// Plain sums of [`PeerCounters`] (per transport).
#[derive(Clone, Copy, Default)]
pub(super) struct Totals {
    pub(super) cells: [[CellSum; 5]; 2],
    pub(super) failed_batches: u64,
}

impl Totals {
    pub(super) fn add(&mut self, c: &PeerCounters) {
        for (d, row) in c.cells.iter().enumerate() {
            for (k, cell) in row.iter().enumerate() {
                self.cells[d][k].add(cell);
            }
        }
        self.failed_batches += c.failed_batches.load(Ordering::Relaxed);
    }
    pub(super) fn merge(&mut self, o: &Totals) {
        for d in 0..2 {
            for k in 0..SIZE_CLASSES.len() {
                self.cells[d][k].merge(&o.cells[d][k]);
            }
        }
        self.failed_batches += o.failed_batches;
    }
    /// Sum over size classes of one direction.
    pub(super) fn dir(&self, d: usize) -> CellSum {
        let mut s = CellSum::default();
        for c in &self.cells[d] {
            s.merge(c);
        }
        s
    }
}

#[derive(Default)]
pub(super) struct PeerBook {
    /// Every peer's counters with its transport index (folded into `gone` once the peer is gone).
    pub(super) live: Vec<(usize, Arc<PeerCounters>)>,
    /// Sums of peers that are gone, per transport.
    pub(super) gone: [Totals; TRANSPORTS.len()],
}

impl PeerBook {
    /// Folds peers whose in-flight map is gone (they can no longer record) into `gone`.
    pub(super) fn fold(&mut self) {
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

/// Counters of what peers were refused or made the engine do (see `Limits`).
#[derive(Default)]
pub(crate) struct SecurityCounters {
    /// Failed proofs (handshakes and lane joins).
    pub(crate) auth_failures: AtomicU64,
    /// Lane joins refused after a valid proof (beyond the peer's lanes, already open).
    pub(crate) lanes_refused: AtomicU64,
    /// Handshakes refused because `Limits::max_peers` peers were connected.
    pub(crate) peers_refused: AtomicU64,
    /// Region-table entries visited handling peers' region messages.
    pub(crate) remote_table_ops: AtomicU64,
}

/// Engine-wide metrics.
pub(crate) struct EngineMetrics {
    pub(super) book: parking_lot::Mutex<PeerBook>,
    pub(super) errors: [[AtomicU64; ERROR_KINDS.len()]; ERROR_STAGES.len()],
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
    pub(crate) security: SecurityCounters,
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
            security: SecurityCounters::default(),
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
    pub(super) fn totals(&self) -> [Totals; TRANSPORTS.len()] {
        let mut b = self.book.lock();
        b.fold();
        let mut t = [Totals::default(); TRANSPORTS.len()];
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

//! Snapshots: the plain [`MetricsSnapshot`] (and its parts), and how the counters become one
//! (its Prometheus text is `exposition`'s).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::types::TransportKind;

use super::counters::{
    bucket_le_seconds, EngineMetrics, PeerCounters, Totals, ERROR_KINDS, ERROR_STAGES,
    SIZE_CLASSES, TRANSPORTS,
};

/// Snapshot parts built from sums of counters.
impl Totals {
    /// Latency histogram of one size class (both directions).
    pub(super) fn histogram(&self, transport: TransportKind, class: usize) -> HistogramSnapshot {
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
    /// Its listen address (as announced; what `Engine::fence` names).
    pub listen_addr: SocketAddr,
    /// Bytes of its notifications pending here (`Limits::peer_notify_bytes`).
    pub notify_bytes: u64,
    /// Entries of its region table here (`Limits::max_remote_regions`).
    pub remote_region_entries: u64,
    /// Its withdrawn regions remembered here (`Limits::max_remote_regions`).
    pub removed_region_entries: u64,
    /// Data lanes it has open into this engine (`Limits::max_peer_lanes`).
    pub lanes_open: u64,
    /// Control bytes queued towards it (`Limits::ctrl_queue_bytes`).
    pub ctrl_queue_bytes: u64,
    /// The slice sizes its large batches are cut with now, `[write, read]` (RDMA, adaptive;
    /// `None` for other transports).
    pub slice_sizes: Option<[u64; 2]>,
}

/// What a peer holds of the engine (for [`PeerSnapshot`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PeerHolds {
    pub notify_bytes: u64,
    pub remote_region_entries: u64,
    pub removed_region_entries: u64,
    pub lanes_open: u64,
    pub ctrl_queue_bytes: u64,
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
    /// Bytes registered now by what the memory is: `engine` (allocated by the engine), `host`
    /// (the caller's, pageable), `pinned` (the caller's, pinned by the CUDA driver), `device`
    /// (the caller's CUDA device memory).
    pub region_bytes_by_kind: [(&'static str, u64); 4],
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
    /// Notifications refused because their peer's budget of pending bytes was spent.
    pub notifications_refused: u64,
    /// Handshakes and lane joins in progress (`Limits::max_handshakes`).
    pub handshakes_in_progress: u64,
    /// Connections admitted to a handshake or lane join.
    pub handshakes_admitted: u64,
    /// Handshakes closed (with a `Reject`) to admit newer ones.
    pub handshakes_evicted: u64,
    /// Connections refused at accept (every admitted one was too far along to be evicted).
    pub handshakes_refused: u64,
    /// Handshakes that ran past `Limits::handshake_timeout`.
    pub handshakes_timed_out: u64,
    /// Failed proofs (handshakes and lane joins).
    pub auth_failures: u64,
    /// Data lanes peers have open into this engine.
    pub lanes_open: u64,
    /// Lane joins refused after a valid proof.
    pub lanes_refused: u64,
    /// Handshakes refused because `Limits::max_peers` peers were connected.
    pub peers_refused: u64,
    /// Bytes of notifications pending here, all peers.
    pub notify_bytes: u64,
    /// Entries of peers' region tables here.
    pub remote_region_entries: u64,
    /// Withdrawn regions of peers remembered here.
    pub removed_region_entries: u64,
    /// Region-table entries visited handling peers' region messages.
    pub remote_table_ops: u64,
    /// Control bytes queued towards peers.
    pub ctrl_queue_bytes: u64,
    /// Threads of this engine running now.
    pub threads_live: u64,
    /// Connections of the metrics endpoint being served.
    pub metrics_conns_live: u64,
    /// Metrics connections closed with a 503 to admit newer ones.
    pub metrics_conns_evicted: u64,
    /// Fenced peer addresses.
    pub fenced_peers: u64,
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
}

/// Engine-side values of the bounds' series (see [`MetricsSnapshot`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GuardExtra {
    pub notifications_refused: u64,
    pub handshakes_in_progress: u64,
    pub handshakes_admitted: u64,
    pub handshakes_evicted: u64,
    pub handshakes_refused: u64,
    pub handshakes_timed_out: u64,
    pub lanes_open: u64,
    pub notify_bytes: u64,
    pub remote_region_entries: u64,
    pub removed_region_entries: u64,
    pub ctrl_queue_bytes: u64,
    pub threads_live: u64,
    pub metrics_conns_live: u64,
    pub metrics_conns_evicted: u64,
    pub fenced_peers: u64,
}

/// Engine-side inputs of a snapshot that live outside [`EngineMetrics`].
pub(crate) struct SnapshotExtra {
    pub peers: Vec<PeerSnapshot>,
    pub lanes_reestablished_live: u64,
    pub reposts_live: u64,
    pub regions: u64,
    pub region_bytes: u64,
    pub region_bytes_by_kind: [(&'static str, u64); 4],
    pub peers_connected: u64,
    pub notifications: (u64, u64, u64),
    /// (bytes, slices, batches) in flight.
    pub inflight: (u64, u64, u64),
    pub guard: GuardExtra,
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
            region_bytes_by_kind: x.region_bytes_by_kind,
            connections_outbound: ld(&self.connections[0]),
            connections_inbound: ld(&self.connections[1]),
            disconnects: ld(&self.disconnects),
            peers_connected: x.peers_connected,
            notifications_delivered: x.notifications.0,
            notifications_dropped: x.notifications.1,
            notifications_suppressed: x.notifications.2,
            notifications_refused: x.guard.notifications_refused,
            handshakes_in_progress: x.guard.handshakes_in_progress,
            handshakes_admitted: x.guard.handshakes_admitted,
            handshakes_evicted: x.guard.handshakes_evicted,
            handshakes_refused: x.guard.handshakes_refused,
            handshakes_timed_out: x.guard.handshakes_timed_out,
            auth_failures: ld(&self.security.auth_failures),
            lanes_open: x.guard.lanes_open,
            lanes_refused: ld(&self.security.lanes_refused),
            peers_refused: ld(&self.security.peers_refused),
            notify_bytes: x.guard.notify_bytes,
            remote_region_entries: x.guard.remote_region_entries,
            removed_region_entries: x.guard.removed_region_entries,
            remote_table_ops: ld(&self.security.remote_table_ops),
            ctrl_queue_bytes: x.guard.ctrl_queue_bytes,
            threads_live: x.guard.threads_live,
            metrics_conns_live: x.guard.metrics_conns_live,
            metrics_conns_evicted: x.guard.metrics_conns_evicted,
            fenced_peers: x.guard.fenced_peers,
        }
    }
}

/// Reads a peer's counters (for [`SnapshotExtra::peers`]).
pub(crate) fn peer_snapshot(
    id: u64,
    (remote_addr, listen_addr): (SocketAddr, SocketAddr),
    transport: TransportKind,
    c: Option<&PeerCounters>,
    (lanes_reestablished, reposts): (u64, u64),
    holds: PeerHolds,
    slice_sizes: Option<[u64; 2]>,
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
        listen_addr,
        notify_bytes: holds.notify_bytes,
        remote_region_entries: holds.remote_region_entries,
        removed_region_entries: holds.removed_region_entries,
        lanes_open: holds.lanes_open,
        ctrl_queue_bytes: holds.ctrl_queue_bytes,
        slice_sizes,
    }
}

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
//!
//! Modules:
//! * `counters`: the atomics and their labels (transports, error kinds, buckets, size classes);
//! * `snapshot`: [`MetricsSnapshot`] and how the counters become one;
//! * `guard`: the series of the engine's bounds (`Limits`);
//! * `exposition`: the Prometheus text of a snapshot;
//! * `http`: the `GET /metrics` endpoint (bounded connections, each on its own thread).

mod counters;
mod exposition;
mod guard;
mod http;
mod snapshot;

pub use counters::{
    bucket_le_seconds, error_kind, transport_label, BUCKETS, ERROR_KINDS, ERROR_STAGES,
    SIZE_CLASSES, SIZE_CLASS_LIMITS,
};
pub(crate) use counters::{EngineMetrics, PeerObs, STAGE_CONNECT, STAGE_PEER, STAGE_SUBMIT};
pub(crate) use http::{gate_counts, Render, Server};
#[doc(hidden)]
pub use http::{parse_request, Request};
pub(crate) use snapshot::{peer_snapshot, GuardExtra, PeerHolds, SnapshotExtra};
pub use snapshot::{
    ErrorCount, HistogramSnapshot, MetricsSnapshot, PeerSnapshot, TransportSnapshot,
};

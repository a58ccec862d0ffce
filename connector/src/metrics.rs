//! Connector metrics: what the D and P cores count while they run.
//!
//! Plain integers updated by the cores on their own events (the cores are driven by one thread,
//! `&mut self`; no atomics needed), fixed-size arrays only: nothing is allocated per request
//! event. Times come from the `now` the host passes in; the cores read no clock.
//!
//! Read with [`crate::DSide::metrics`] / [`crate::PSide::metrics`] (cumulative counters since the
//! core was made) and the gauges with [`crate::DSide::gauges`] (requests by state, blocks held
//! now and their block-seconds so far), which walks the live requests once: call it once per
//! scrape or engine step, not per event.

use crate::timeline::TimelineRecord;
use crate::types::{FailReason, Nanos, Policy};

/// Upper bounds (ns) of the latency histogram buckets; a last, unbounded bucket follows.
/// 100 µs … 60 s, roughly 1-2.5-5 steps.
pub const LATENCY_BOUNDS_NS: [Nanos; 18] = [
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
    30_000_000_000,
    60_000_000_000,
];

/// Buckets of a [`Histogram`]: the bounded ones plus `+Inf`.
pub const HIST_BUCKETS: usize = LATENCY_BOUNDS_NS.len() + 1;

/// Upper bound of bucket `i` in seconds (`f64::INFINITY` for the last).
pub fn bucket_le_seconds(i: usize) -> f64 {
    LATENCY_BOUNDS_NS
        .get(i)
        .map_or(f64::INFINITY, |ns| *ns as f64 / 1e9)
}

/// A latency histogram with fixed buckets ([`LATENCY_BOUNDS_NS`]). `buckets[i]` counts the
/// observations in bucket `i` alone (not cumulative).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Histogram {
    /// Observations per bucket (not cumulative); the last is `+Inf`.
    pub buckets: [u64; HIST_BUCKETS],
    /// Sum of the observations, ns.
    pub sum_ns: u128,
    /// Number of observations.
    pub count: u64,
}

impl Histogram {
    /// Records one observation of `ns` nanoseconds.
    pub fn observe(&mut self, ns: Nanos) {
        let i = LATENCY_BOUNDS_NS.partition_point(|b| *b < ns);
        self.buckets[i] += 1;
        self.sum_ns += u128::from(ns);
        self.count += 1;
    }
}

/// Names of the `decode_sent → first_token` parts ([`crate::Decomposition`]) in the order of
/// [`DMetrics::decomposition`]; the last is the whole interval.
pub const DECOMPOSITION_PARTS: [&str; 7] = {
    let s = crate::timeline::SEGMENT_NAMES;
    [s[0], s[1], s[2], s[3], s[4], s[5], "total"]
};

/// Failure reasons in the order of the `failed` arrays (index = wire code − 1).
pub const FAIL_REASONS: [FailReason; 7] = [
    FailReason::PeerDown,
    FailReason::PeerRestarted,
    FailReason::LocalAbort,
    FailReason::RemoteAbort,
    FailReason::TransferError,
    FailReason::Timeout,
    FailReason::Protocol,
];

/// Label value of a failure reason.
pub fn fail_reason_name(r: FailReason) -> &'static str {
    match r {
        FailReason::PeerDown => "peer_down",
        FailReason::PeerRestarted => "peer_restarted",
        FailReason::LocalAbort => "local_abort",
        FailReason::RemoteAbort => "remote_abort",
        FailReason::TransferError => "transfer_error",
        FailReason::Timeout => "timeout",
        FailReason::Protocol => "protocol",
    }
}

pub(crate) fn reason_index(r: FailReason) -> usize {
    usize::from(r.code() - 1)
}

/// Cumulative counters of a D core.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DMetrics {
    /// The core's reservation policy (the label of the block-seconds series).
    pub policy: Policy,
    /// Requests that arrived on D.
    pub arrived: u64,
    /// Reservations accepted ([`crate::DEvent::Reserved`]).
    pub reservations: u64,
    /// Blocks in those reservations.
    pub reserved_blocks: u64,
    /// Reservations handed back with [`crate::DAction::ReleaseBlocks`] (failures, and stale
    /// reservations for requests that had already ended).
    pub releases: u64,
    /// Blocks in those releases.
    pub released_blocks: u64,
    /// Requests whose KV fully landed (reported finished to the host).
    pub completed: u64,
    /// `land` requests that took landing-pool slots ([`crate::DEvent::Landing`]).
    pub landings: u64,
    /// `land` requests that fell back to `lazy` because the landing pool was full.
    pub land_fallbacks: u64,
    /// Requests promoted to running (their reservation became a running request).
    pub promoted: u64,
    /// Requests that produced their first token.
    pub first_tokens: u64,
    /// Requests failed, by reason (index: [`FAIL_REASONS`]); `local_abort` are the aborts.
    pub failed: [u64; 7],
    /// KV bytes received (sum over landed layers).
    pub bytes_received: u64,
    /// Block-nanoseconds held by reservations that ended (promoted or released) while waiting
    /// for their KV: `blocks × (promoted or released − reserved)`.
    pub block_ns_waiting: u128,
    /// `decode_sent → first_token` and its parts, per request that reached its first token
    /// (index: [`DECOMPOSITION_PARTS`]).
    pub decomposition: [Histogram; 7],
}

impl DMetrics {
    pub(crate) fn new(policy: Policy) -> Self {
        DMetrics {
            policy,
            arrived: 0,
            reservations: 0,
            reserved_blocks: 0,
            releases: 0,
            released_blocks: 0,
            completed: 0,
            landings: 0,
            land_fallbacks: 0,
            promoted: 0,
            first_tokens: 0,
            failed: [0; 7],
            bytes_received: 0,
            block_ns_waiting: 0,
            decomposition: [Histogram::default(); 7],
        }
    }

    /// Requests failed because the local host aborted them.
    pub fn aborted(&self) -> u64 {
        self.failed[reason_index(FailReason::LocalAbort)]
    }

    /// Requests failed, all reasons.
    pub fn failed_total(&self) -> u64 {
        self.failed.iter().sum()
    }

    /// Block-seconds of [`DMetrics::block_ns_waiting`].
    pub fn block_seconds_waiting(&self) -> f64 {
        self.block_ns_waiting as f64 / 1e9
    }

    /// Records the decomposition of a record that reached its first token.
    pub(crate) fn observe_first_token(&mut self, rec: &TimelineRecord) {
        self.first_tokens += 1;
        if let (Some(d), Some(s), Some(e)) = (rec.decompose(), rec.decode_sent, rec.first_token) {
            let parts = d.segments().into_iter().chain([e - s]);
            for (h, v) in self.decomposition.iter_mut().zip(parts) {
                h.observe(v);
            }
        }
    }
}

/// D requests by state now, and what their reservations hold ([`crate::DSide::gauges`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DGauges {
    /// Known only from P's messages (not arrived on D yet).
    pub early: u64,
    /// Arrived, no blocks reserved yet.
    pub waiting: u64,
    /// Blocks reserved (or, `land`, landing slots taken), KV landing.
    pub reserved: u64,
    /// `land`: every layer in the landing pool, waiting for KV blocks.
    pub landed: u64,
    /// Every layer landed, not yet reported to the scheduler.
    pub complete: u64,
    /// Reported finished, not yet promoted.
    pub reported: u64,
    /// Promoted to running, first token pending.
    pub promoted: u64,
    /// Failed with block ids at P: blocks held until P confirms.
    pub draining: u64,
    /// Blocks held by reservations not yet promoted or released.
    pub held_blocks: u64,
    /// Block-nanoseconds those reservations have held so far (up to the `now` given).
    pub held_block_ns: u128,
    /// Landing-pool slots held (`land`).
    pub landing_slots: u64,
}

/// State names of [`DGauges`], in field order (the `state` label values).
pub const D_STATES: [&str; 8] = [
    "early", "waiting", "reserved", "landed", "complete", "reported", "promoted", "draining",
];

impl DGauges {
    /// Requests by state, in the order of [`D_STATES`].
    pub fn by_state(&self) -> [u64; 8] {
        [
            self.early,
            self.waiting,
            self.reserved,
            self.landed,
            self.complete,
            self.reported,
            self.promoted,
            self.draining,
        ]
    }
}

/// Cumulative counters of a P core.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PMetrics {
    /// Requests scheduled on P.
    pub scheduled: u64,
    /// Layer transfers handed to the host ([`crate::PAction::Transfer`]).
    pub transfers: u64,
    /// Layer transfers reported done.
    pub transfers_done: u64,
    /// Layer transfers reported failed.
    pub transfers_failed: u64,
    /// KV bytes sent (sum over completed layer transfers).
    pub bytes_sent: u64,
    /// Requests whose layers were all sent.
    pub completed: u64,
    /// Requests failed, by reason (index: [`FAIL_REASONS`]).
    pub failed: [u64; 7],
    /// P-block releases ([`crate::PAction::ReleaseBlocks`]).
    pub releases: u64,
    /// Blocks in those releases.
    pub released_blocks: u64,
    /// Scheduled → every layer written, per completed request.
    pub send_latency: Histogram,
}

impl PMetrics {
    /// Requests failed because the local host aborted them.
    pub fn aborted(&self) -> u64 {
        self.failed[reason_index(FailReason::LocalAbort)]
    }

    /// Requests failed, all reasons.
    pub fn failed_total(&self) -> u64 {
        self.failed.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_upper_inclusive() {
        let mut h = Histogram::default();
        h.observe(0);
        h.observe(100_000); // exactly the first bound
        h.observe(100_001);
        h.observe(u64::MAX);
        assert_eq!(h.buckets[0], 2);
        assert_eq!(h.buckets[1], 1);
        assert_eq!(h.buckets[HIST_BUCKETS - 1], 1);
        assert_eq!(h.count, 4);
        assert_eq!(h.sum_ns, 200_001 + u128::from(u64::MAX));
        assert_eq!(bucket_le_seconds(0), 0.0001);
        assert!(bucket_le_seconds(HIST_BUCKETS - 1).is_infinite());
    }

    #[test]
    fn reason_indices_match_the_table() {
        for (i, r) in FAIL_REASONS.iter().enumerate() {
            assert_eq!(reason_index(*r), i);
        }
    }
}

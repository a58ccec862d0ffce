//! Per-request timeline records (JSON lines) and the decomposition of the
//! `decode_sent → first_token` clock.

use crate::types::{FailReason, Nanos, Policy, RequestId, SendMode};
use serde::{Deserialize, Serialize};

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Every layer arrived (D) or was sent (P).
    Finished,
    /// The request failed; see the record's `fail_reason`.
    Failed,
}

/// Which side wrote a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The decode side.
    D,
    /// The prefill side.
    P,
    /// A D record merged with the P record of the same request (same clock, e.g. the simulator).
    Merged,
}

/// One request's timestamps and sizes. Times are nanoseconds on the host's clock; `None` where a
/// milestone was not reached (or belongs to the other side).
///
/// D records fill `p_scheduled`/`p_last_layer_ready` with the times D *learned* of them (the
/// arrival of P's `Started`/`PrefillDone`); [`TimelineRecord::merge`] replaces them with P's own
/// times when both records share a clock.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimelineRecord {
    /// The request.
    pub req: RequestId,
    /// Who wrote the record.
    pub side: Side,
    /// D received the request (vLLM: the proxy's decode request arrived).
    pub decode_sent: Option<Nanos>,
    /// P scheduled the request (prefill started).
    pub p_scheduled: Option<Nanos>,
    /// P's first layer became ready.
    pub p_first_layer_ready: Option<Nanos>,
    /// P's last layer became ready (prefill finished).
    pub p_last_layer_ready: Option<Nanos>,
    /// D reserved the request's blocks.
    pub d_reserved: Option<Nanos>,
    /// D sent its block ids to P.
    pub blocks_to_p: Option<Nanos>,
    /// P posted the first write.
    pub first_byte: Option<Nanos>,
    /// The last layer was complete (D: landed; P: write completed).
    pub last_byte: Option<Nanos>,
    /// D's host reported the request finished to its scheduler (vLLM `finished_recving`).
    pub d_reported_finished: Option<Nanos>,
    /// D's scheduler promoted the request to running.
    pub d_promoted: Option<Nanos>,
    /// D produced the first token.
    pub first_token: Option<Nanos>,
    /// D released a reservation that did not become a running request (failures only).
    pub d_released: Option<Nanos>,
    /// KV bytes moved.
    pub bytes: u64,
    /// Layers of the request.
    pub layers: u16,
    /// Blocks per layer.
    pub blocks: u32,
    /// Of them, blocks D already held from its prefix cache (not moved).
    #[serde(default)]
    pub prefix_blocks: u32,
    /// Prompt tokens.
    pub tokens: u32,
    /// Transport label given by the host.
    pub transport: String,
    /// D's reservation policy (D records).
    pub policy: Option<Policy>,
    /// P's send mode (P records).
    pub send_mode: Option<SendMode>,
    /// How the request ended.
    pub outcome: Outcome,
    /// Why it failed, for failed requests.
    pub fail_reason: Option<FailReason>,
}

impl TimelineRecord {
    /// An empty record for `req`, written by `side`.
    pub fn new(req: RequestId, side: Side, transport: &str) -> Self {
        TimelineRecord {
            req,
            side,
            decode_sent: None,
            p_scheduled: None,
            p_first_layer_ready: None,
            p_last_layer_ready: None,
            d_reserved: None,
            blocks_to_p: None,
            first_byte: None,
            last_byte: None,
            d_reported_finished: None,
            d_promoted: None,
            first_token: None,
            d_released: None,
            bytes: 0,
            layers: 0,
            blocks: 0,
            prefix_blocks: 0,
            tokens: 0,
            transport: transport.to_string(),
            policy: None,
            send_mode: None,
            outcome: Outcome::Finished,
            fail_reason: None,
        }
    }

    /// The record as one JSON line (no trailing newline).
    pub fn to_json_line(&self) -> String {
        // Serialising plain fields and enums to a String cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parses a JSON line written by [`TimelineRecord::to_json_line`].
    pub fn from_json_line(line: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(line)
    }

    /// Merges a D record with the P record of the same request (both on one clock): P's own
    /// timestamps replace what D learned from messages; the outcome is failed if either failed,
    /// with P's reason when D only saw P's `Abort`.
    pub fn merge(d: &TimelineRecord, p: &TimelineRecord) -> TimelineRecord {
        let mut m = d.clone();
        m.side = Side::Merged;
        m.p_scheduled = p.p_scheduled.or(d.p_scheduled);
        m.p_first_layer_ready = p.p_first_layer_ready.or(d.p_first_layer_ready);
        m.p_last_layer_ready = p.p_last_layer_ready.or(d.p_last_layer_ready);
        m.first_byte = p.first_byte.or(d.first_byte);
        m.send_mode = p.send_mode;
        m.bytes = d.bytes.max(p.bytes);
        if p.outcome == Outcome::Failed
            && (m.outcome == Outcome::Finished || m.fail_reason == Some(FailReason::RemoteAbort))
        {
            // P failed first (D only saw P's Abort): P's reason is the root cause.
            m.outcome = Outcome::Failed;
            m.fail_reason = p.fail_reason;
        }
        m
    }

    /// D block-nanoseconds held by the reservation before it became a running request (or was
    /// released): `blocks × (promoted or released − reserved)`. Zero when nothing was reserved.
    pub fn d_block_ns_waiting(&self) -> u128 {
        match (self.d_reserved, self.d_promoted.or(self.d_released)) {
            (Some(r), Some(end)) if end >= r => u128::from(self.blocks) * u128::from(end - r),
            _ => 0,
        }
    }

    /// The decomposition of `decode_sent → first_token`, for records that have both.
    pub fn decompose(&self) -> Option<Decomposition> {
        decompose(self)
    }
}

/// `decode_sent → first_token` cut into consecutive segments that sum to it exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decomposition {
    /// `decode_sent → P's prefill finished` (P queueing plus prefill).
    pub wait_for_p: Nanos,
    /// `prefill finished → D's block ids sent`, when the ids were late (jit, pool pressure).
    pub reservation_wait: Nanos,
    /// `max(prefill finished, block ids sent) → last byte`: transfer not hidden behind prefill.
    pub exposed_transfer: Nanos,
    /// `last byte → D reported finished`.
    pub report_delay: Nanos,
    /// `reported finished → promoted`.
    pub promotion_delay: Nanos,
    /// `promoted → first token`.
    pub first_step: Nanos,
}

/// Names of the [`Decomposition`] segments, in [`Decomposition::segments`] order.
pub const SEGMENT_NAMES: [&str; 6] = [
    "wait_for_p",
    "reservation_wait",
    "exposed_transfer",
    "report_delay",
    "promotion_delay",
    "first_step",
];

impl Decomposition {
    /// The segments in [`SEGMENT_NAMES`] order.
    pub fn segments(&self) -> [Nanos; 6] {
        [
            self.wait_for_p,
            self.reservation_wait,
            self.exposed_transfer,
            self.report_delay,
            self.promotion_delay,
            self.first_step,
        ]
    }

    /// Sum of the segments; equals `first_token − decode_sent`.
    pub fn total(&self) -> Nanos {
        self.wait_for_p
            + self.reservation_wait
            + self.exposed_transfer
            + self.report_delay
            + self.promotion_delay
            + self.first_step
    }
}

/// Decomposes a record (see [`Decomposition`]). Milestones are clamped to be monotone inside
/// `[decode_sent, first_token]`, a missing one counting as equal to the previous milestone, so
/// the segments always telescope to `first_token − decode_sent`.
pub fn decompose(r: &TimelineRecord) -> Option<Decomposition> {
    let start = r.decode_sent?;
    let end = r.first_token?;
    if end < start {
        return None;
    }
    let p_done = r.p_last_layer_ready;
    let data_can_flow = match (p_done, r.blocks_to_p) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    let raw = [
        p_done,
        data_can_flow,
        r.last_byte,
        r.d_reported_finished,
        r.d_promoted,
    ];
    let mut prev = start;
    let mut marks = [start; 5];
    for (i, m) in raw.iter().enumerate() {
        let v = m.unwrap_or(prev).clamp(prev, end);
        marks[i] = v;
        prev = v;
    }
    Some(Decomposition {
        wait_for_p: marks[0] - start,
        reservation_wait: marks[1] - marks[0],
        exposed_transfer: marks[2] - marks[1],
        report_delay: marks[3] - marks[2],
        promotion_delay: marks[4] - marks[3],
        first_step: end - marks[4],
    })
}

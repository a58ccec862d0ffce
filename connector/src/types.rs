//! Plain value types shared by both sides of the protocol.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A point in time or a duration, in nanoseconds, on a clock the host chooses.
///
/// The core never reads a clock itself: every call that needs the time takes a `Nanos`.
pub type Nanos = u64;

/// Nanoseconds in one millisecond.
pub const MS: Nanos = 1_000_000;
/// Nanoseconds in one second.
pub const SEC: Nanos = 1_000_000_000;

/// Identifier of one P/D request, shared by both sides (vLLM's `transfer_id`, mapped to a number
/// by the glue).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// Identifier of a remote engine instance as the host's transport names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PeerId(pub u32);

/// Index of one KV block in an engine's block pool.
pub type BlockId = u32;

/// When the D side may reserve KV blocks for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Reserve as soon as the request arrives on D (stock MooncakeConnector; the baseline).
    Eager,
    /// Reserve when P announces it has started the request.
    Lazy,
    /// Reserve when P has finished prefill (fewest block-seconds, no overlap).
    Jit,
    /// Land P's layers in a bounded landing pool as they arrive (from when P started) and
    /// reserve KV blocks only once the request's KV is complete, then copy locally: jit's
    /// block-seconds with layerwise overlap. Falls back to `lazy` when the pool is full.
    Land,
}

impl Policy {
    /// All policies, in a fixed order.
    pub const ALL: [Policy; 4] = [Policy::Eager, Policy::Lazy, Policy::Jit, Policy::Land];

    /// Lower-case name, as written in the timeline.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Eager => "eager",
            Policy::Lazy => "lazy",
            Policy::Jit => "jit",
            Policy::Land => "land",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = ParseError;

    /// Parses `eager`, `lazy`, `jit` or `land`.
    fn from_str(s: &str) -> Result<Self, ParseError> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| ParseError(s.to_string()))
    }
}

/// A policy or send-mode name that is not one of the known ones.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown name {0:?}")]
pub struct ParseError(pub String);

/// When P sends a request's layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SendMode {
    /// Each layer as soon as it is ready (and D's block ids are known).
    Layerwise,
    /// All layers after prefill has finished.
    Whole,
}

impl SendMode {
    /// Both send modes, in a fixed order.
    pub const ALL: [SendMode; 2] = [SendMode::Layerwise, SendMode::Whole];

    /// Lower-case name, as written in the timeline.
    pub fn name(self) -> &'static str {
        match self {
            SendMode::Layerwise => "layerwise",
            SendMode::Whole => "whole",
        }
    }
}

impl std::str::FromStr for SendMode {
    type Err = ParseError;

    /// Parses `layerwise` or `whole`.
    fn from_str(s: &str) -> Result<Self, ParseError> {
        SendMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| ParseError(s.to_string()))
    }
}

/// Why a core gave a peer up and asks the host to tear its connection down
/// ([`crate::DAction::DisconnectPeer`], [`crate::PAction::DisconnectPeer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DownCause {
    /// The host reported the peer down (its connection failed, nothing listens there).
    Reported,
    /// The peer stayed up but never confirmed a failed request's abort within `drain_timeout`.
    DrainTimeout,
}

impl std::fmt::Display for DownCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DownCause::Reported => f.write_str("reported down by the host"),
            DownCause::DrainTimeout => f.write_str("never confirmed an abort within drain_timeout"),
        }
    }
}

/// Why a request failed. Carried in [`crate::msg::Message::Abort`] and in failure actions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailReason {
    /// The peer was reported down or stopped sending heartbeats.
    PeerDown,
    /// The peer restarted (new incarnation) and lost the request.
    PeerRestarted,
    /// The local host aborted the request (client gone, scheduler abort).
    LocalAbort,
    /// The remote side aborted the request.
    RemoteAbort,
    /// A transfer of one of the request's layers failed.
    TransferError,
    /// A deadline passed (request, stall, or wait for the peer).
    Timeout,
    /// The peer sent something inconsistent (wrong block count, layer out of range).
    Protocol,
}

impl FailReason {
    /// Wire code of the reason.
    pub fn code(self) -> u8 {
        match self {
            FailReason::PeerDown => 1,
            FailReason::PeerRestarted => 2,
            FailReason::LocalAbort => 3,
            FailReason::RemoteAbort => 4,
            FailReason::TransferError => 5,
            FailReason::Timeout => 6,
            FailReason::Protocol => 7,
        }
    }

    /// Reason from its wire code; `None` for an unknown code.
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => FailReason::PeerDown,
            2 => FailReason::PeerRestarted,
            3 => FailReason::LocalAbort,
            4 => FailReason::RemoteAbort,
            5 => FailReason::TransferError,
            6 => FailReason::Timeout,
            7 => FailReason::Protocol,
            _ => return None,
        })
    }
}

/// A cheap, deterministic hasher for integer keys (request and peer ids).
///
/// `std`'s default hasher is randomly seeded per map, which would make iteration order, and so
/// the order of emitted actions, differ between runs; the simulator must be reproducible.
#[derive(Default, Clone, Copy, Debug)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        // Final avalanche (splitmix64 finaliser) so sequential ids spread over buckets.
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, i: u32) {
        self.write_u64(u64::from(i));
    }

    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A `HashMap` keyed by ids with the deterministic [`IdHasher`].
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

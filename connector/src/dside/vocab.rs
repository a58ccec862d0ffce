//! What the host and the D core say to each other: [`DEvent`], [`DAction`], [`DError`], and
//! the counters of [`DStats`].

use super::*;

/// Something the host tells the D core.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DEvent {
    /// A request arrived on D (vLLM: the decode request was added). `blocks` is the number of
    /// blocks D will reserve for its `tokens` prompt tokens.
    Arrived {
        /// The request.
        req: RequestId,
        /// The P instance prefilling it.
        peer: PeerId,
        /// Prompt tokens.
        tokens: u32,
        /// Blocks needed for them.
        blocks: u32,
    },
    /// The host reserved these blocks for the request (after [`DSide::may_reserve`] said yes).
    Reserved {
        /// The request.
        req: RequestId,
        /// The reserved block ids, in prompt order.
        blocks: Vec<BlockId>,
    },
    /// D already holds the request's first `blocks` blocks (a local prefix-cache hit): P sends
    /// only the suffix, and the reservation ([`DEvent::Reserved`], [`DEvent::Landing`]) covers
    /// the other blocks. Valid while the request waits for its reservation; the latest wins.
    PrefixHit {
        /// The request.
        req: RequestId,
        /// Blocks D already has, from the first.
        blocks: u32,
    },
    /// Policy `land`: the host gave the request these slots of its landing pool (after
    /// [`DAction::MayLand`]); P writes the request's KV there.
    Landing {
        /// The request.
        req: RequestId,
        /// Landing-pool slots, one per block D receives.
        slots: Vec<BlockId>,
    },
    /// Policy `land`: the landing pool cannot take the request (after [`DAction::MayLand`]); it
    /// is reserved as `lazy` instead (counted in [`DMetrics::land_fallbacks`]).
    LandFallback {
        /// The request.
        req: RequestId,
    },
    /// The local transfer engine delivered the notification that a layer has fully landed.
    LayerLanded {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
        /// Its bytes.
        bytes: u64,
    },
    /// The host reported the request finished to its scheduler (vLLM `finished_recving`).
    Reported {
        /// The request.
        req: RequestId,
    },
    /// The scheduler promoted the request to running; its blocks now belong to it.
    Promoted {
        /// The request.
        req: RequestId,
    },
    /// The request produced its first token.
    FirstToken {
        /// The request.
        req: RequestId,
    },
    /// The host aborts the request (client gone).
    Abort {
        /// The request.
        req: RequestId,
    },
    /// A message from P.
    Message {
        /// The sender.
        from: PeerId,
        /// The message.
        msg: Message,
    },
    /// The transport connected to a P instance.
    PeerUp {
        /// The peer.
        peer: PeerId,
    },
    /// The transport lost a P instance (connection reset, process gone).
    PeerDown {
        /// The peer.
        peer: PeerId,
    },
}

/// Something the D core asks the host to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DAction {
    /// Send a message to P.
    Send {
        /// The P instance.
        to: PeerId,
        /// The message.
        msg: Message,
    },
    /// The request may now reserve `blocks` blocks (emitted once per request; the same answer
    /// is available any time from [`DSide::may_reserve`]).
    MayReserve {
        /// The request.
        req: RequestId,
        /// Blocks to reserve.
        blocks: u32,
    },
    /// Policy `land`: the request may now take `blocks` slots of the landing pool (emitted once
    /// per request); answer with [`DEvent::Landing`] or [`DEvent::LandFallback`].
    MayLand {
        /// The request.
        req: RequestId,
        /// Slots to take.
        blocks: u32,
    },
    /// Free these landing-pool slots: no write of P can land in them any more (a failed `land`
    /// request; a request whose KV landed keeps its slots until the host copied them).
    ReleaseLanding {
        /// The request.
        req: RequestId,
        /// The slots.
        slots: Vec<BlockId>,
    },
    /// Free these blocks: the reservation ends without becoming a running request.
    ReleaseBlocks {
        /// The request.
        req: RequestId,
        /// The blocks.
        blocks: Vec<BlockId>,
    },
    /// Every layer has landed: report the request finished (vLLM `finished_recving`). For a
    /// `land` request the KV is in its landing slots: copy them into the reserved blocks first.
    ReportFinished {
        /// The request.
        req: RequestId,
    },
    /// The request failed. `blocks` are the blocks that did not load (vLLM's load-error path;
    /// already handed back by a preceding `ReleaseBlocks`), empty when none were reserved.
    ReportFailed {
        /// The request.
        req: RequestId,
        /// Blocks that did not load.
        blocks: Vec<BlockId>,
        /// Why.
        reason: FailReason,
    },
    /// Tear down the connection to this peer so that none of its writes can land any more.
    DisconnectPeer {
        /// The peer.
        peer: PeerId,
        /// Why it was given up.
        cause: DownCause,
    },
}

/// A host event the D core refused. The core's state is unchanged; blocks passed in stay the
/// host's.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DError {
    /// The request is not known (never arrived, or already ended).
    #[error("unknown request {0:?}")]
    UnknownRequest(RequestId),
    /// `Arrived` for a request that is live or recently ended.
    #[error("request {0:?} already arrived")]
    DuplicateRequest(RequestId),
    /// `Arrived` with zero blocks.
    #[error("request {0:?} has no blocks to receive")]
    NoBlocks(RequestId),
    /// `Reserved` while the policy does not allow reserving yet.
    #[error("request {0:?} may not reserve yet")]
    NotReservable(RequestId),
    /// `Reserved` for a request that already holds a reservation.
    #[error("request {0:?} already reserved")]
    AlreadyReserved(RequestId),
    /// `Reserved` with a different number of blocks than the request needs.
    #[error("request {req:?} needs {expected} blocks, got {got}")]
    WrongBlockCount {
        /// The request.
        req: RequestId,
        /// Blocks needed.
        expected: u32,
        /// Blocks given.
        got: usize,
    },
    /// `PrefixHit` covering every block of the request (at least one must be received).
    #[error(
        "request {req:?}: a prefix hit of {hit} blocks leaves nothing of its {blocks} to receive"
    )]
    PrefixTooLong {
        /// The request.
        req: RequestId,
        /// Blocks the hit covers.
        hit: u32,
        /// Blocks of the request.
        blocks: u32,
    },
    /// A layer index at or above the model's layer count.
    #[error("layer {layer} out of range for request {req:?}")]
    LayerOutOfRange {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
    },
    /// The event does not fit the request's state (e.g. `Promoted` before `Reported`).
    #[error("request {req:?}: {event} not valid in state {state}")]
    InvalidState {
        /// The request.
        req: RequestId,
        /// The event.
        event: &'static str,
        /// The state.
        state: &'static str,
    },
    /// Bytes from P that do not decode.
    #[error("undecodable message: {0}")]
    Decode(#[from] DecodeError),
}

/// Counters of unusual but handled situations.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DStats {
    /// Messages for requests that ended recently (dropped).
    pub late_messages: u64,
    /// Repeated messages or landings (dropped); this includes P's `LayerSent`/`AllSent` for
    /// layers the local transfer engine already reported with [`DEvent::LayerLanded`].
    pub duplicate_messages: u64,
    /// Messages of the wrong direction or from the wrong peer (dropped).
    pub unexpected_messages: u64,
    /// Messages for unknown requests dropped because too many were pending.
    pub early_overflow: u64,
    /// Requests P announced that never arrived on D.
    pub orphans: u64,
    /// Reservations for requests that had already ended (released at once).
    pub stale_reservations: u64,
    /// Requests finished (promoted).
    pub finished: u64,
    /// Requests failed.
    pub failed: u64,
    /// Failed requests whose blocks waited for the drain deadline (P was disconnected).
    pub drain_timeouts: u64,
    /// Times a P with live requests fell silent for `peer_timeout` (they failed).
    pub silences: u64,
}

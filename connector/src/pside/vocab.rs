//! What the host and the P core say to each other: [`PEvent`], [`PAction`], [`PError`], and
//! the counters of [`PStats`].

use super::*;

/// Something the host tells the P core.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PEvent {
    /// P's scheduler has the request queued for `peer` (not scheduled yet): D is told, so that it
    /// waits for P's start as long as P is alive instead of timing out.
    Queued {
        /// The request.
        req: RequestId,
        /// The D instance that will decode it.
        peer: PeerId,
    },
    /// P scheduled the request's prefill; `blocks` are P's blocks holding its KV (per layer).
    Scheduled {
        /// The request.
        req: RequestId,
        /// The D instance that will decode it.
        peer: PeerId,
        /// Prompt tokens.
        tokens: u32,
        /// P's block ids, in prompt order.
        blocks: Vec<BlockId>,
    },
    /// Layer `layer` of the request is computed (its CUDA event fired).
    LayerReady {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
    },
    /// Prefill finished: every layer is ready.
    PrefillDone {
        /// The request.
        req: RequestId,
    },
    /// The transfer of one layer completed (every byte written on D).
    TransferDone {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
        /// Bytes written.
        bytes: u64,
    },
    /// The transfer of one layer failed or was cancelled. The engine guarantees that nothing of
    /// it lands on D afterwards (it cancels or tears down what is still in flight).
    TransferFailed {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
    },
    /// The host aborts the request.
    Abort {
        /// The request.
        req: RequestId,
    },
    /// A message from D.
    Message {
        /// The sender.
        from: PeerId,
        /// The message.
        msg: Message,
    },
    /// The transport connected to a D instance.
    PeerUp {
        /// The peer.
        peer: PeerId,
    },
    /// The transport lost a D instance.
    PeerDown {
        /// The peer.
        peer: PeerId,
    },
}

/// Something the P core asks the host to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PAction {
    /// Send a message to D.
    Send {
        /// The D instance.
        to: PeerId,
        /// The message.
        msg: Message,
    },
    /// Write layer `layer` of the request from P's blocks `src` into D's blocks `dst`
    /// (block `i` → block `i`), then report [`PEvent::TransferDone`] or
    /// [`PEvent::TransferFailed`]. Every transfer must be reported exactly once. `src` is the
    /// suffix of the request's blocks D asked for (D holds the others from its prefix cache).
    Transfer {
        /// The request.
        req: RequestId,
        /// The D instance.
        peer: PeerId,
        /// The layer.
        layer: u16,
        /// P's source blocks.
        src: Arc<[BlockId]>,
        /// D's destination blocks.
        dst: Arc<[BlockId]>,
        /// `dst` are slots of D's landing pool, not KV-cache blocks.
        landing: bool,
    },
    /// D's block ids for the request are known (only with [`PConfig::announce_destination`]):
    /// P's block `src[i]` goes to D's `dst[i]` in every layer.
    Destination {
        /// The request.
        req: RequestId,
        /// The D instance.
        peer: PeerId,
        /// Index of the request block `src[0]` is (blocks before it are not sent).
        first: u32,
        /// P's source blocks (the suffix D asked for).
        src: Arc<[BlockId]>,
        /// D's destination blocks.
        dst: Arc<[BlockId]>,
        /// `dst` are slots of D's landing pool.
        landing: bool,
    },
    /// Cancel the request's transfers still in flight (each still gets reported).
    CancelTransfers {
        /// The request.
        req: RequestId,
    },
    /// Free P's blocks of the request (vLLM: report it in `finished_sending`).
    ReleaseBlocks {
        /// The request.
        req: RequestId,
        /// The blocks.
        blocks: Vec<BlockId>,
    },
    /// Every layer was sent.
    ReportFinished {
        /// The request.
        req: RequestId,
    },
    /// The request failed on P.
    ReportFailed {
        /// The request.
        req: RequestId,
        /// Why.
        reason: FailReason,
    },
    /// Tear down the connection to this peer.
    DisconnectPeer {
        /// The peer.
        peer: PeerId,
        /// Why it was given up.
        cause: DownCause,
    },
}

/// A host event the P core refused; its state is unchanged.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PError {
    /// The request is not known.
    #[error("unknown request {0:?}")]
    UnknownRequest(RequestId),
    /// `Scheduled` for a request that is live or recently ended.
    #[error("request {0:?} already scheduled")]
    DuplicateRequest(RequestId),
    /// `Scheduled` with no blocks.
    #[error("request {0:?} has no blocks to send")]
    NoBlocks(RequestId),
    /// A layer index at or above the model's layer count.
    #[error("layer {layer} out of range for request {req:?}")]
    LayerOutOfRange {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
    },
    /// A transfer report for a layer that has no transfer in flight.
    #[error("request {req:?}: no transfer of layer {layer} in flight")]
    NoTransfer {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
    },
    /// Bytes from D that do not decode.
    #[error("undecodable message: {0}")]
    Decode(#[from] DecodeError),
}

/// Counters of unusual but handled situations.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PStats {
    /// Messages or host events for requests that ended recently (dropped).
    pub late: u64,
    /// Repeated messages (dropped).
    pub duplicate_messages: u64,
    /// Messages of the wrong direction or from the wrong peer (dropped).
    pub unexpected_messages: u64,
    /// Messages for unknown requests dropped because too many were pending.
    pub early_overflow: u64,
    /// Block ids from D for requests P never scheduled.
    pub orphans: u64,
    /// Requests whose layers were all sent.
    pub finished: u64,
    /// Requests failed.
    pub failed: u64,
    /// Failed requests released at the drain deadline with transfers unsettled (D was
    /// disconnected first).
    pub drain_timeouts: u64,
    /// Times a D with live requests fell silent for `peer_timeout` (they failed).
    pub silences: u64,
}

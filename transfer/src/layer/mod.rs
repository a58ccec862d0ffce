//! Layer streams: a request's KV cache sent layer by layer, as each layer's compute finishes.
//!
//! Prefill computes layer after layer; sending each layer as soon as it is complete hides the
//! transfer behind the compute of the following layers, leaving only the last layer's transfer
//! exposed (Splitwise measured ≈5–8 ms exposed instead of the whole transfer). A
//! [`LayerStream`] is opened with the request's per-layer `(src, dst)` block lists and a
//! [`KvLayout`]; [`LayerStream::layer_ready`] hands it a [`Readiness`] per layer (now, a host
//! flag, a CUDA event); the destination block ids may arrive later
//! ([`LayerStream::set_destination`]). Each layer goes out as one batch of coalesced writes
//! (K and V together) on the engine's public batch API, so it runs over whatever transport the
//! peer uses. A notification tag is delivered to the target only after every layer landed.
//!
//! Memory the engine cannot send from (CUDA device memory without GPUDirect) goes through a
//! [`Stager`] and a [`StagingPool`] of registered host buffers; see the `cuda` module.
//!
//! Nothing here spins: a worker thread per stream sleeps on a channel; readiness, staging and
//! batch completions (through the batch's waker) are messages to it.

mod layout;
mod readiness;
mod staging;
mod stream;

pub use layout::{
    coalesce_extents, synthetic_block_tables, Extent, KvLayout, KvOrder, KvPlacement, SrcSpace,
};
pub use readiness::{HostFlag, Immediate, Readiness, ReadySignal};
pub use staging::{HostStager, Lease, StageCopy, StageDone, Stager, StagingBuffer, StagingPool};
pub use stream::{BlockLists, LayerStats, LayerStream, StreamOptions, StreamStats};

use crate::Error;

/// What can go wrong with a layer stream.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LayerError {
    /// The engine refused or failed a write (dead peer, bounds, deadline of a batch...).
    #[error("engine: {0}")]
    Engine(#[from] Error),
    /// The caller passed something inconsistent (block lists, layer index, layout).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A layer's readiness reported that the layer will never be complete.
    #[error("layer {layer}: readiness failed: {reason}")]
    Readiness {
        /// The layer.
        layer: usize,
        /// Why.
        reason: String,
    },
    /// Copying a layer into a staging buffer failed.
    #[error("layer {layer}: staging failed: {reason}")]
    Staging {
        /// The layer.
        layer: usize,
        /// Why.
        reason: String,
    },
    /// The stream was aborted ([`LayerStream::abort`], or its handle was dropped).
    #[error("stream aborted: {0}")]
    Aborted(String),
    /// The stream's deadline passed before every layer landed.
    #[error("stream deadline passed")]
    Timeout,
    /// The operation does not fit the stream's state (e.g. a layer made ready twice).
    #[error("stream state: {0}")]
    State(String),
}

impl LayerError {
    /// A copy of this error, for handing one failure to several waiters.
    pub fn duplicate(&self) -> LayerError {
        match self {
            LayerError::Engine(e) => LayerError::Engine(e.duplicate()),
            LayerError::InvalidArgument(s) => LayerError::InvalidArgument(s.clone()),
            LayerError::Readiness { layer, reason } => LayerError::Readiness {
                layer: *layer,
                reason: reason.clone(),
            },
            LayerError::Staging { layer, reason } => LayerError::Staging {
                layer: *layer,
                reason: reason.clone(),
            },
            LayerError::Aborted(s) => LayerError::Aborted(s.clone()),
            LayerError::Timeout => LayerError::Timeout,
            LayerError::State(s) => LayerError::State(s.clone()),
        }
    }
}

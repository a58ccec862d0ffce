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

mod error;
mod layout;
mod options;
mod readiness;
mod staging;
mod stream;
mod worker;

pub use error::LayerError;
pub use layout::{
    coalesce_extents, synthetic_block_tables, Extent, KvLayout, KvOrder, KvPlacement, SrcSpace,
};
pub use options::{BlockLists, LayerStats, StreamOptions, StreamStats};
pub use readiness::{HostFlag, Immediate, Readiness, ReadySignal};
pub use staging::{HostStager, Lease, StageCopy, StageDone, Stager, StagingBuffer, StagingPool};
pub use stream::LayerStream;

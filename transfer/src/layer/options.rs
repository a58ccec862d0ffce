//! What a layer stream is given and what it reports: block lists, options, statistics.

use std::sync::Arc;
use std::time::Duration;

use crate::layer::error::LayerError;
use crate::layer::staging::Stager;

/// Block ids of a request, the same for every layer (vLLM's block table) or per layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockLists {
    /// One list used for every layer.
    Shared(Vec<u32>),
    /// One list per layer.
    PerLayer(Vec<Vec<u32>>),
}

impl BlockLists {
    pub(super) fn layer(&self, l: usize) -> &[u32] {
        match self {
            BlockLists::Shared(v) => v,
            BlockLists::PerLayer(v) => v.get(l).map(Vec::as_slice).unwrap_or(&[]),
        }
    }

    pub(super) fn check(&self, layers: usize, what: &str) -> Result<(), LayerError> {
        match self {
            BlockLists::PerLayer(v) if v.len() != layers => {
                Err(LayerError::InvalidArgument(format!(
                    "{what} block lists: {} layers, layout has {layers}",
                    v.len()
                )))
            }
            _ => Ok(()),
        }
    }
}

/// How to run a stream.
pub struct StreamOptions {
    /// Notification tag delivered to the target after every layer landed.
    pub tag: Option<Vec<u8>>,
    /// Deadline for the whole stream, from `open`.
    pub deadline: Duration,
    /// Stager for source memory the engine cannot send from
    /// ([`SrcSpace::Device`](crate::layer::SrcSpace::Device)).
    pub stager: Option<Arc<dyn Stager>>,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            tag: None,
            deadline: Duration::from_secs(60),
            stager: None,
        }
    }
}

impl std::fmt::Debug for StreamOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamOptions")
            .field("tag", &self.tag)
            .field("deadline", &self.deadline)
            .field("staged", &self.stager.is_some())
            .finish()
    }
}

/// What one layer sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Payload bytes.
    pub bytes: u64,
    /// Writes after coalescing (as the engine counted them).
    pub writes: usize,
    /// Batches (one per layer, or one per staged chunk).
    pub batches: usize,
}

/// What a whole stream sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Layers.
    pub layers: usize,
    /// Payload bytes.
    pub bytes: u64,
    /// Writes after coalescing, all layers.
    pub writes: usize,
    /// Data batches, all layers.
    pub batches: usize,
    /// Whether the notification needed a batch of its own (something else was still in
    /// flight when the last data batch was posted).
    pub separate_notify: bool,
}

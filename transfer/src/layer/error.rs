//! [`LayerError`]: what can go wrong with a layer stream.

use crate::error::Error;

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
    /// The stream was aborted ([`LayerStream::abort`](crate::layer::LayerStream::abort), or its
    /// handle was dropped).
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

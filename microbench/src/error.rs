//! The bench's error type.

/// What can stop a bench run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The engine returned an error.
    #[error("engine error while {context}: {source}")]
    Engine {
        /// What the bench was doing.
        context: String,
        /// The engine's error.
        #[source]
        source: kvwire_transfer::Error,
    },
    /// The target does not look like a `kvwire-bench transfer --serve` target, or broke
    /// the bench protocol.
    #[error("target: {0}")]
    Target(String),
    /// The plan cannot run against this target (e.g. its data region is too small).
    #[error("plan: {0}")]
    Plan(String),
    /// Waiting for something took longer than its bound.
    #[error("timed out waiting for {0}")]
    Timeout(String),
    /// Starting or talking to the local target process failed.
    #[error("local target process: {0}")]
    Spawn(String),
    /// File or terminal I/O.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// Writing the JSON report.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}

/// Attaches what the bench was doing to an engine error.
pub(crate) trait Context<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T, BenchError>;
}

impl<T> Context<T> for Result<T, kvwire_transfer::Error> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T, BenchError> {
        self.map_err(|source| BenchError::Engine {
            context: what(),
            source,
        })
    }
}

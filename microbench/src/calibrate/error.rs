//! What goes wrong: malformed lines and the errors that stop a calibration.

use crate::costmodel::CostModelError;

/// What to do with a malformed line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadLines {
    /// Stop with [`CalibrateError::Line`].
    Fail,
    /// Keep going; the line is listed in [`Timeline::bad_lines`](super::Timeline::bad_lines).
    Skip,
}

/// Why one line is malformed.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// Not JSON, or a field of the wrong type.
    #[error("not a timeline record: {0}")]
    Json(#[from] serde_json::Error),
    /// A field the fit needs is absent.
    #[error("missing field `{0}`")]
    Missing(&'static str),
    /// Values that cannot be a real request.
    #[error("{0}")]
    Invalid(String),
}

/// What stops a calibration.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    /// Reading the timeline failed.
    #[error("timeline {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A malformed line (under [`BadLines::Fail`]).
    #[error("timeline line {line}: {error}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        #[source]
        error: LineError,
    },
    /// A malformed line of one file of a directory of timelines (under [`BadLines::Fail`]).
    #[error("timeline {file}:{line}: {error}")]
    FileLine {
        /// The file.
        file: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        #[source]
        error: LineError,
    },
    /// Records of several transports and no choice made.
    #[error("records of several transports ({0}); pick one with --transport")]
    MixedTransports(String),
    /// Too few usable records on one side of the split.
    #[error("too few usable records: {train} for training (need {need_train}), {held_out} held out (need {need_held_out})")]
    TooFew {
        /// Training records.
        train: usize,
        /// Held-out records.
        held_out: usize,
        /// Training records needed (`MIN_TRAIN`).
        need_train: usize,
        /// Held-out records needed (`MIN_HELD_OUT`).
        need_held_out: usize,
    },
    /// The fitted model failed validation (should not happen; reported rather than written).
    #[error(transparent)]
    Model(#[from] CostModelError),
}

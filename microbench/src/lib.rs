//! kvwire microbenches.
//!
//! `kvwire-bench transfer` measures the transfer engine between two processes: writes with
//! one in flight, batches, the KV-layer pattern, and read-backs, with every byte checked
//! (see [`initiator`] and [`target`] for how). Results come out as a table with the peer
//! benches' columns and as JSON (see [`report`]).

#![deny(missing_docs)]

pub mod ab;
pub mod calibrate;
pub mod clock;
pub mod costmodel;
pub mod cpu;
pub mod error;
pub mod initiator;
pub mod pattern;
pub mod plan;
pub mod report;
pub mod spawn;
pub mod stats;
pub mod suite;
pub mod target;
pub mod venvs;
pub mod wire;

pub use error::BenchError;
pub use initiator::{run, RunConfig};
pub use plan::Plan;
pub use report::Report;
pub use target::{ServeConfig, Target};

//! A deterministic discrete-event simulator of P and D engines around the connector cores.
//!
//! P engines are step loops (batches of prefills under a token budget, layers becoming ready
//! through the step) with block pools; one D engine is a step loop that reserves when the core
//! allows, reports finished at the end of a step, promotes at the next, and decodes. Between
//! them a simulated network: control messages (encoded with the real codec, FIFO per link, with
//! delay, jitter and loss) and a data link per P with a bandwidth (per-layer transfer time) and
//! latency. Failures are injected: P crashes (and restarts with a new incarnation), D aborts,
//! transfer errors and hung transfers, lost messages, and the timeouts that follow.
//!
//! Every block operation and request end goes through a [`check::Checker`]; with
//! [`SimConfig::strict`] the run stops at the first violation. Same seed, same run.
//!
//! * [`config`]: what a run depends on ([`SimConfig`]: workload, network, failures, cores).
//! * [`report`]: what it measured ([`SimReport`]).
//! * [`check`]: the invariant checker.
//! * `world`, `events`, `p_host`, `d_host`: the simulation itself (state and event loop, event
//!   dispatch, the P engines, the D engine).

pub mod check;
pub mod config;
mod d_host;
mod events;
mod p_host;
pub mod report;
mod world;

pub use config::{Faults, HostBug, NetConfig, SimConfig, Workload, D_PEER};
pub use report::SimReport;
pub use world::run;

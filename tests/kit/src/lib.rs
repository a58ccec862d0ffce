//! kvwire-testkit: what kvwire's tests and benches share, kept out of the public crates (dev
//! only, not published).
//!
//! * [`sim`]: a deterministic discrete-event simulator of P and D engines around the connector
//!   cores, with injected failures and an invariant checker ([`sim::check`]).
//! * [`steploop`]: a per-step workload for the connector cores (the criterion bench and
//!   `kvwire-bench tax`).
//! * [`pool`]: the host block pool of the simulator and the step loops.
//! * [`queue`]: a time-ordered event queue for discrete-event step loops.
//! * [`rng`]: a small seeded PRNG and the splitmix64 mixer.
//! * [`layering`]: the circles of files of a crate that import each other.
//! * [`pattern`]: the seeded, seekable byte pattern the transfer tests and benches write and
//!   check.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod layering;
pub mod pattern;
pub mod pool;
pub mod queue;
pub mod rng;
pub mod sim;
pub mod steploop;

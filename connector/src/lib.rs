//! kvwire-connector: the prefill/decode (P/D) KV-transfer protocol as pure state machines.
//!
//! Nothing here does I/O or reads a clock. The host (vLLM glue, the microbench, the simulator in
//! the `kvwire-testkit` crate) feeds events with a timestamp ([`Nanos`]) and carries out the actions the cores
//! return, quinn-proto style:
//!
//! * [`DSide`]: the decode side — when to reserve KV blocks ([`Policy`]: eager, lazy, jit),
//!   sending block ids to P, counting layers landing, reporting finished/failed, releasing
//!   reservations exactly once on every failure path.
//! * [`PSide`]: the prefill side — holding layers until D's block ids arrive, sending them as
//!   they become ready ([`SendMode::Layerwise`]) or after prefill ([`SendMode::Whole`]),
//!   releasing P's blocks exactly once.
//! * [`msg`]: the messages between them and their bounds-checked binary codec.
//! * [`metrics`]: cumulative counters, request-state gauges and latency histograms of both
//!   cores (reservations, releases, block-seconds held waiting, the `decode_sent → first_token`
//!   parts), read by the host; reservation and release also emit `tracing` events.
//! * [`timeline`]: per-request timestamps as JSON lines and the decomposition of the
//!   `decode_sent → first_token` clock.
//!
//! # Driving the cores
//!
//! Both cores share one shape: `new(config)`, `handle(event, now)` (or `handle_bytes` for
//! bytes from the peer), `handle_timeout(now)` when `poll_timeout()` is due, then drain
//! `poll_action()` and `poll_timeline()`. A whole request, D and P wired back to back:
//!
//! ```
//! use kvwire_connector::*;
//! let (p_id, d_id) = (PeerId(1), PeerId(0));
//! let mut d = DSide::new(DConfig::new(Policy::Lazy, 2));
//! let mut p = PSide::new(PConfig::new(SendMode::Layerwise, 2));
//! let req = RequestId(42);
//! let mut now = 0;
//! d.handle(DEvent::Arrived { req, peer: p_id, tokens: 32, blocks: 2 }, now).unwrap();
//! assert!(!d.may_reserve(req)); // lazy: not before P starts
//! p.handle(PEvent::Scheduled { req, peer: d_id, tokens: 32, blocks: vec![7, 8] }, now).unwrap();
//! let mut d_pool = vec![100u32, 101, 102];
//! for step in 0..20 {
//!     now += 1_000_000;
//!     if step < 2 {
//!         p.handle(PEvent::LayerReady { req, layer: step }, now).unwrap();
//!     }
//!     if d.may_reserve(req) {
//!         // The host reserves from its own pool and tells the core which blocks.
//!         let blocks = vec![d_pool.pop().unwrap(), d_pool.pop().unwrap()];
//!         d.handle(DEvent::Reserved { req, blocks }, now).unwrap();
//!     }
//!     while let Some(a) = p.poll_action() {
//!         match a {
//!             PAction::Send { msg, .. } => {
//!                 let bytes = msg.encode().unwrap();
//!                 d.handle_bytes(p_id, &bytes, now).unwrap();
//!             }
//!             // The transfer engine writes src -> dst, then reports completion.
//!             PAction::Transfer { req, layer, .. } => {
//!                 p.handle(PEvent::TransferDone { req, layer, bytes: 4096 }, now).unwrap();
//!             }
//!             PAction::ReleaseBlocks { .. } | PAction::ReportFinished { .. } => {}
//!             other => panic!("unexpected {other:?}"),
//!         }
//!     }
//!     while let Some(a) = d.poll_action() {
//!         match a {
//!             DAction::Send { msg, .. } => {
//!                 let bytes = msg.encode().unwrap();
//!                 p.handle_bytes(d_id, &bytes, now).unwrap();
//!             }
//!             DAction::ReportFinished { req } => {
//!                 d.handle(DEvent::Reported { req }, now).unwrap();
//!                 d.handle(DEvent::Promoted { req }, now).unwrap();
//!                 d.handle(DEvent::FirstToken { req }, now + 1).unwrap();
//!             }
//!             DAction::MayReserve { .. } => {}
//!             other => panic!("unexpected {other:?}"),
//!         }
//!     }
//! }
//! let rec = d.poll_timeline().unwrap();
//! assert_eq!(rec.outcome, Outcome::Finished);
//! let parts = rec.decompose().unwrap();
//! assert_eq!(parts.total(), rec.first_token.unwrap() - rec.decode_sent.unwrap());
//! println!("{}", rec.to_json_line());
//! ```
//!
//! What a request's state means is each core's own; the bookkeeping around it (requests by id,
//! peers and their liveness, recently ended ids, deadlines, pending actions, finished records)
//! and the flows that only call back into a core (timers, a peer lost or restarted, a drain
//! that timed out) are written once, in the crate-private `book` module.
//!
//! Per-event work is O(1) amortised (hash maps by request id, a deadline heap with lazy
//! deletion, FIFO queues of pending actions): nothing walks all requests or all cached blocks.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub(crate) mod book;
pub mod dside;
pub mod metrics;
pub mod msg;
pub(crate) mod peers;
pub mod pside;
pub mod timeline;
pub(crate) mod timer;
pub mod types;

pub use dside::{DAction, DConfig, DError, DEvent, DSide, DStats};
pub use metrics::{DGauges, DMetrics, Histogram, PMetrics};
pub use msg::{DecodeError, EncodeError, Message};
pub use pside::{PAction, PConfig, PError, PEvent, PSide, PStats};
pub use timeline::{decompose, Decomposition, Outcome, Side, TimelineRecord, SEGMENT_NAMES};
pub use types::{
    BlockId, DownCause, FailReason, Nanos, PeerId, Policy, RequestId, SendMode, MS, SEC,
};

//! `kvwire.mooncake.TransferEngine`: the method names, signatures and return conventions of
//! `mooncake.engine.TransferEngine` (what vLLM's MooncakeConnector and SGLang call), over a
//! kvwire engine.
//!
//! Mooncake names remote memory by raw virtual address; kvwire peers only see region ids. So
//! each drop-in engine publishes an **address map** — `(base address, length, region id)` of
//! every buffer it registered — in a small read-only metadata region of its own, which peers
//! read over kvwire itself (an ordinary engine read) when they meet an address they cannot
//! place. An address (range) outside the peer's registered buffers is refused, as is a local
//! buffer outside ours.
//!
//! Metadata region layout (little endian): a 32-byte header `magic "KVWMOON1" | seq u64 |
//! count u32 | reserved u32 | reserved u64`, then `count` entries `base u64 | len u64 |
//! region index u32 | region generation u32`. The writer makes `seq` odd while it rewrites the
//! entries and even afterwards; a reader accepts a snapshot only if `seq` was even and unchanged
//! across the read of the entries and a re-read of the header.
//!
//! Return conventions follow Mooncake: `0` success, negative failure (the reason is logged on
//! the `kvwire.mooncake` Python logger and kept for [`TransferEngine::last_error`]).
//!
//! `last_error` describes the outcome of the engine's latest call that can fail, from whichever
//! thread: every such method clears the reason when it starts and sets it when it fails, so it
//! is empty after a success (and a failure is not reported again after a later success). With
//! calls running on several threads at once it is the one that finished last.
//!
//! Where things are: `addrmap` (the map's layout, encoding and lookups), `inner` (the engine
//! behind the Python object and our registered buffers), `segments` (peers and their address
//! maps), `engine` ([`TransferEngineBase`]: set-up, registration, managed buffers, status),
//! `transfer` ([`TransferEngine`]: the transfer calls, made from one table over one generic
//! path).

mod addrmap;
mod engine;
mod inner;
mod segments;
mod transfer;

pub use addrmap::{MAX_ENTRIES, META_LEN};
pub use engine::TransferEngineBase;
pub use transfer::TransferEngine;

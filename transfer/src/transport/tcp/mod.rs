//! TCP transport: persistent multi-lane connections per peer, pipelined slices.
//!
//! Lanes carry requests in one direction only (the engine that opened them sends writes, read
//! requests and notifications; the accepting engine answers with acks, read data and errors), so
//! two engines writing to each other at once never wait on each other's socket buffers. Each
//! lane has a reader thread on both ends and a sender thread on the initiator end; small batches
//! are written inline by the submitting thread when the lane is idle (no thread hop).
//!
//! The target checks every write against its region table (exists, generation, access,
//! `offset + len` within the region, without overflow) before a byte lands; the payload is read
//! from the socket straight into region memory (only bytes already buffered with the header are
//! copied), and on the initiator the payload goes from region memory to the socket with one
//! gather `sendmsg` per group of frames.
//!
//! Every copy into or out of region memory (payload landing, read data sent or landed, payload
//! sent) runs inside the region's gate
//! ([`RegionEntry::enter`](crate::region::RegionEntry::enter)): once the region is
//! unregistered, later copies are refused with `Error::StaleRegion` and `unregister` waits for
//! the running ones, so no lane touches caller memory after it returned. Each lane thread also
//! marks the region it copies ([`CopyMarks`](crate::transport::CopyMarks)), so a copy stuck on
//! a stalled peer can be aborted.
//!
//! Modules:
//! * `reader`: [`FrameReader`](reader::FrameReader), frames read with payloads straight into
//!   region memory;
//! * `serve`: the target side of a lane ([`serve_lane`]: bounds checks, landing, acks);
//! * `lane`: the initiator side of a lane (frames, gathered sends, sender and reader threads);
//! * `peer`: [`TcpPeer`](peer::TcpPeer) (lanes, striping, posting) and [`TcpTransport`].

mod lane;
mod peer;
mod reader;
mod serve;

pub(crate) use peer::TcpTransport;
pub(crate) use serve::serve_lane;

//! The wire format: data-lane frames and control messages (handshake, region updates,
//! notifications), with decoders that never panic on arbitrary bytes.
//!
//! Data lanes carry fixed 40-byte frame headers, optionally followed by a payload:
//!
//! ```text
//! 0..4   magic "KVWF"          4..6  version (u16 LE)    6 kind    7 flags
//! 8..16  batch id (u64)        16..20 region index       20..24 region generation
//! 24..32 offset (u64)          32..36 payload/request length (u32)  36..40 aux (u32)
//! ```
//!
//! Control messages: a 12-byte header (`"KVWC"`, version, kind, 0, body length u32) and a body.
//! All integers are little endian. Every length is bounded before anything is allocated.
//!
//! Modules (each a layer of the codec; the types are in `msg`, their encoders next to them):
//! * `msg`: constants, frame and control message types, host identity, wire regions;
//! * `problem`: [`ProtocolError`], what a peer got wrong and where;
//! * `frame`: data-lane frame headers (encode, decode, bounds);
//! * `ctrl`: control messages (encode, decode, reading one from a stream);
//! * `error_payload`: errors carried in `Error` frames and `Reject` messages;
//! * `rw`: the little-endian reader and writer every decoder uses;
//! * `fence`: the engine's own control messages (fences, their answers and refusals,
//!   heartbeats), inside `CtrlMsg::Transport`;
//! * `rdma`: the RDMA handshake blob and the RDMA control messages (reconnection, keys);
//! * `shm`: the shared-memory handshake blob (the memory-access probe).

mod ctrl;
mod error_payload;
pub(crate) mod fence;
mod frame;
mod msg;
pub(crate) mod problem;
pub(crate) mod rdma;
mod rw;
pub(crate) mod shm;

pub use msg::{
    CtrlMsg, FrameKind, HostIdentity, MrChunks, WireRegion, MAX_CTRL_BODY, MAX_ERROR_PAYLOAD,
    MAX_MR_CHUNKS, MAX_REGIONS_PER_MSG, MAX_SLICE, MAX_TAG, MAX_TRANSPORT_MSG, PROTOCOL_VERSION,
    TRANSPORT_CUDA_IPC, TRANSPORT_RDMA, TRANSPORT_SHM, TRANSPORT_TCP,
};
pub use problem::{Field, LaneSide, Layout, ProtocolError, Stage};

// The codec's entry points and header layouts are public for the tests only (fuzzing the
// decoders, raw peers that speak the protocol by hand); the engine is their one real user.
#[doc(hidden)]
pub use ctrl::{read_ctrl, read_ctrl_limited, Expect, ANY};
#[doc(hidden)]
pub use error_payload::{decode_error, encode_error};
#[doc(hidden)]
pub use msg::{
    body, kind, FrameHeader, CTRL_HEADER_LEN, CTRL_MAGIC, FLAG_TRACKED, FRAME_HEADER_LEN,
    FRAME_MAGIC,
};

/// Runs the second-stage decoders of `CtrlMsg::Transport` payloads and of handshake blobs on
/// `data` (engine messages, RDMA control messages for `lanes` lanes and `devs` devices, the
/// RDMA and shm handshake blobs): for fuzzing; returns how many accepted it.
#[doc(hidden)]
pub fn decode_second_stage(data: &[u8], lanes: usize, devs: usize) -> usize {
    let engine = fence::EngineMsg::decode(data)
        .map(|m| {
            // What decodes encodes back to the same bytes.
            assert_eq!(m.encode(), data, "engine message round trip");
        })
        .is_ok();
    let rdma_msg = rdma::RdmaMsg::decode(data, lanes, devs).is_ok();
    let blob = rdma::parse_blob(data).is_ok();
    let probe = shm::decode_probe(data).is_some();
    [engine, rdma_msg, blob, probe]
        .iter()
        .filter(|x| **x)
        .count()
}

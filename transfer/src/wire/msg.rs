//! The types and constants of the wire format (their codecs are in the sibling modules).

use crate::types::{Access, DeviceIpc, RegionId};

/// Protocol version spoken by this build. 6: regions registered for RDMA in chunks (their keys
/// in the region and in RDMA key messages). 5: device regions' CUDA IPC keys in the region
/// list. 4: the initiator proves the secret first (X25519 key
/// shares mixed with the secret, every later handshake message MAC'd over the transcript), host
/// details and transport blobs only after the proof, data lanes joined with a proof bound to the
/// session, fence refusals (`FENCE_NACK`) and heartbeats (`PING`), error codes 11 (resource
/// limit) and 12 (fenced). 3: notification fences (a `Transport` control message with bit 0x80)
/// and per-device RDMA key requests. A peer of another version is refused at the handshake.
pub const PROTOCOL_VERSION: u16 = 6;
/// Magic of data-lane frames.
pub const FRAME_MAGIC: [u8; 4] = *b"KVWF";
/// Magic of control messages.
pub const CTRL_MAGIC: [u8; 4] = *b"KVWC";
/// Size of a data-lane frame header.
pub const FRAME_HEADER_LEN: usize = 40;
/// Size of a control message header.
pub const CTRL_HEADER_LEN: usize = 12;
/// Largest slice payload accepted on a lane.
pub const MAX_SLICE: u32 = 16 << 20;
/// Largest notification tag.
pub const MAX_TAG: u32 = 64 << 10;
/// Largest payload of a `CtrlMsg::Transport` message.
pub const MAX_TRANSPORT_MSG: usize = 4096;
/// Largest error payload.
pub const MAX_ERROR_PAYLOAD: u32 = 4096;
/// Largest control message body.
pub const MAX_CTRL_BODY: u32 = 32 << 20;
/// Largest number of regions in one control message.
pub const MAX_REGIONS_PER_MSG: u32 = 1 << 20;

/// Frame flag: this write slice belongs to a batch that carries a notification.
pub const FLAG_TRACKED: u8 = 1;

/// Kinds of data-lane frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// Initiator → target: payload to land at (region, offset).
    Write,
    /// Target → initiator: `aux` (at least 1) write slices or notifications of the batch applied.
    Ack,
    /// Initiator → target: send back `len` bytes of (region, offset); aux = slice index.
    ReadReq,
    /// Target → initiator: payload of a read slice; aux = slice index.
    ReadData,
    /// Initiator → target: notification tag (payload); aux = number of write slices in the batch.
    Notify,
    /// Target → initiator: the batch failed; payload is an encoded error.
    Error,
}

/// A decoded data-lane frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame is.
    pub kind: FrameKind,
    /// Flags (`FLAG_*`).
    pub flags: u8,
    /// Batch id (chosen by the initiator; unique per initiator engine).
    pub batch: u64,
    /// Target region.
    pub region: RegionId,
    /// Offset in the region.
    pub offset: u64,
    /// Payload length (or requested length for `ReadReq`).
    pub len: u32,
    /// Kind-specific: slice index (reads), slice count (notify).
    pub aux: u32,
}

/// Identity of the host/namespace an engine runs in; equal identities mean the peers can share
/// memory (shm transport).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/random/boot_id`.
    pub boot_id: String,
    /// `/proc/self/ns/pid` link text.
    pub pid_ns: String,
    /// `/proc/self/ns/mnt` link text.
    pub mnt_ns: String,
    /// Process id (meaningful only when the other fields match).
    pub pid: u32,
}

impl HostIdentity {
    /// Whether two engines can reach each other's memory directly.
    pub fn same_host(&self, other: &HostIdentity) -> bool {
        !self.boot_id.is_empty()
            && self.boot_id == other.boot_id
            && self.pid_ns == other.pid_ns
            && self.mnt_ns == other.mnt_ns
    }
}

/// A region as described on the wire, with the keys a transport needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireRegion {
    /// Id on the owner.
    pub id: RegionId,
    /// Length.
    pub len: u64,
    /// Access granted to peers.
    pub access: Access,
    /// Same-host keys: virtual address (for `process_vm_*`), 0 when not shared.
    pub addr: u64,
    /// Same-host keys: fd number of the memfd in the owner, -1 for raw memory.
    pub fd: i32,
    /// Same-host keys: inode of the memfd (checked after opening it).
    pub ino: u64,
    /// RDMA remote key of the region's memory registration (0 = not registered for RDMA);
    /// `addr` is then the region's virtual address.
    pub rkey: u32,
    /// Where a NIC's limit on one registration cut the region's registration in chunks; `rkey`
    /// is then chunk 0's key. `None`: one registration covers the region.
    pub chunks: Option<MrChunks>,
    /// Same-host keys of a device region (CUDA IPC); `None` for host memory, and towards a
    /// peer on another host.
    pub ipc: Option<DeviceIpc>,
}

impl WireRegion {
    /// `id` described with no transport's keys: no same-host mapping, no RDMA registration, no
    /// device handle (what a peer on another host without RDMA is told). A transport's keys
    /// are set on top of it.
    pub fn keyless(id: RegionId, len: u64, access: Access) -> WireRegion {
        WireRegion {
            id,
            len,
            access,
            addr: 0,
            fd: -1,
            ino: 0,
            rkey: 0,
            chunks: None,
            ipc: None,
        }
    }
}

/// Most chunks one region's RDMA registration is cut in: every device's keys of every chunk of a
/// region fit one key message (`wire::rdma`).
pub const MAX_MR_CHUNKS: usize = (MAX_TRANSPORT_MSG - 4 - 10) / (4 * 16);

/// A region registered for RDMA in chunks (see [`WireRegion::chunks`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MrChunks {
    /// Bytes per chunk (the last one may be shorter): chunk `i` covers `i * len ..`.
    pub len: u64,
    /// The RDMA keys of chunks 1.. on the owner's first device (chunk 0's is `rkey`).
    pub rkeys: std::sync::Arc<[u32]>,
}

impl MrChunks {
    /// Chunks of `len` bytes that cover `region_len` bytes.
    pub fn count(len: u64, region_len: u64) -> u64 {
        region_len.div_ceil(len.max(1))
    }
}

/// Transport bits in `Hello.transports`.
pub const TRANSPORT_TCP: u8 = 1;
/// Shared memory supported.
pub const TRANSPORT_SHM: u8 = 2;
/// RDMA (RC queue pairs) supported.
pub const TRANSPORT_RDMA: u8 = 4;
/// CUDA IPC supported (this engine can copy into a same-host peer's device regions).
pub const TRANSPORT_CUDA_IPC: u8 = 8;

/// Control messages.
///
/// The handshake (see `engine/handshake.rs` for the rules and the key schedule in `auth`):
///
/// | # | dir | message | body |
/// |---|-----|---------|------|
/// | 1 | I→R | `Hello` | nonce_i 32, auth 1, dh_i 32 |
/// | 2 | R→I | `Challenge` | nonce_r 32, auth_required 1, dh_r 32 |
/// | 3 | I→R | `Proof` | mac 32 |
/// | 4 | R→I | `Accept` | host, transports 1, lanes 2, blobs, mac 32 |
/// | 5 | I→R | `Auth` | host, listen_port 2, transports 1, lanes 2, blobs, regions, mac 32 |
/// | 6 | R→I | `Welcome` | regions, mac 32 |
///
/// A data lane: `LaneJoin` (sid 16, lane 2, nonce_j 32), `LaneChallenge` (nonce_l 32, mac 32),
/// `LaneProof` (mac 32), `LaneOk`. `Reject` may answer any of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CtrlMsg {
    /// Initiator's opening message (nothing about it but its nonce and key share).
    Hello {
        /// Initiator's nonce.
        nonce: [u8; 32],
        /// Initiator holds a secret.
        auth: bool,
        /// Initiator's ephemeral X25519 public key.
        dh: [u8; 32],
    },
    /// Responder's answer to `Hello`: its nonce and key share, nothing derived from the secret.
    Challenge {
        /// Responder's nonce.
        nonce: [u8; 32],
        /// Responder requires the initiator to prove the secret.
        auth_required: bool,
        /// Responder's ephemeral X25519 public key.
        dh: [u8; 32],
    },
    /// Initiator's proof of the secret over the transcript so far.
    Proof {
        /// `HMAC(k_i, "proof" | th_2)`.
        mac: [u8; 32],
    },
    /// Responder accepts the proof: where it runs and what it offers, with its own proof.
    Accept {
        /// Where the responder runs.
        host: HostIdentity,
        /// Transports the responder accepts (`TRANSPORT_*` bits).
        transports: u8,
        /// Data lanes the responder opens to the initiator (at most).
        lanes: u16,
        /// Transport-specific blobs `(transport bit, bytes)`, e.g. RDMA GID/QPN.
        blobs: Vec<(u8, Vec<u8>)>,
        /// `HMAC(k_r, "accept" | th_3 | this message without the mac)`.
        mac: [u8; 32],
    },
    /// Initiator's description of itself, after it verified the responder.
    Auth {
        /// Where the initiator runs.
        host: HostIdentity,
        /// Initiator's listen port (for lanes the responder opens back).
        listen_port: u16,
        /// Transports the initiator accepts.
        transports: u8,
        /// Data lanes the initiator opens to the responder (at most).
        lanes: u16,
        /// Transport-specific blobs.
        blobs: Vec<(u8, Vec<u8>)>,
        /// Regions the initiator offers.
        regions: Vec<WireRegion>,
        /// `HMAC(k_i, "auth" | th_4 | this message without the mac)`.
        mac: [u8; 32],
    },
    /// Responder accepts; its regions.
    Welcome {
        /// Regions the responder offers.
        regions: Vec<WireRegion>,
        /// `HMAC(k_r, "welcome" | th_5 | this message without the mac)`.
        mac: [u8; 32],
    },
    /// Refusal with a typed error (encoded with [`super::encode_error`]).
    Reject {
        /// Encoded error.
        error: Vec<u8>,
    },
    /// First message of a data lane.
    LaneJoin {
        /// The session id of the lanes' direction (derived by both sides, never sent before).
        sid: [u8; 16],
        /// Lane index.
        lane: u16,
        /// Joiner's nonce.
        nonce: [u8; 32],
    },
    /// The listener's answer to `LaneJoin`: its nonce and its proof of the lane key.
    LaneChallenge {
        /// Listener's nonce.
        nonce: [u8; 32],
        /// `HMAC(K_d, "kvwire/4 lane listener" | sid | lane | nonce_j | nonce_l)`.
        mac: [u8; 32],
    },
    /// The joiner's proof of the lane key.
    LaneProof {
        /// `HMAC(K_d, "kvwire/4 lane joiner" | sid | lane | nonce_j | nonce_l)`.
        mac: [u8; 32],
    },
    /// Lane accepted.
    LaneOk,
    /// Regions offered after the handshake.
    RegionsAdded(Vec<WireRegion>),
    /// Regions withdrawn.
    RegionsRemoved(Vec<RegionId>),
    /// A notification (shm transport: sent after the copy).
    Notify(Vec<u8>),
    /// The full current list of offered regions (replaces the receiver's view).
    RegionsSet(Vec<WireRegion>),
    /// A transport's own message on the control connection (RDMA: queue pair reconnection),
    /// `bit` naming the transport (`TRANSPORT_*`).
    Transport {
        /// The transport's bit.
        bit: u8,
        /// Its payload (at most [`MAX_TRANSPORT_MSG`] bytes).
        data: Vec<u8>,
    },
}

/// Control message kinds (the byte after the version in the header).
#[doc(hidden)]
pub mod kind {
    /// `Hello`.
    pub const HELLO: u8 = 1;
    /// Retired (v3's `HelloReply`).
    pub const RETIRED_HELLO_REPLY: u8 = 2;
    /// `Auth`.
    pub const AUTH: u8 = 3;
    /// `Welcome`.
    pub const WELCOME: u8 = 4;
    /// `Reject`.
    pub const REJECT: u8 = 5;
    /// `LaneJoin`.
    pub const LANE_JOIN: u8 = 6;
    /// `LaneOk`.
    pub const LANE_OK: u8 = 7;
    /// `RegionsAdded`.
    pub const REGIONS_ADDED: u8 = 8;
    /// `RegionsRemoved`.
    pub const REGIONS_REMOVED: u8 = 9;
    /// `Notify`.
    pub const NOTIFY: u8 = 10;
    /// `RegionsSet`.
    pub const REGIONS_SET: u8 = 11;
    /// `Transport`.
    pub const TRANSPORT: u8 = 12;
    /// `Challenge`.
    pub const CHALLENGE: u8 = 13;
    /// `Proof`.
    pub const PROOF: u8 = 14;
    /// `Accept`.
    pub const ACCEPT: u8 = 15;
    /// `LaneChallenge`.
    pub const LANE_CHALLENGE: u8 = 16;
    /// `LaneProof`.
    pub const LANE_PROOF: u8 = 17;
}

/// Exact body lengths of the fixed-size handshake messages, and the largest body of any
/// message read before the peer proved the secret.
#[doc(hidden)]
pub mod body {
    /// `Hello` and `Challenge`: nonce, flag, key share.
    pub const HELLO: u32 = 65;
    /// `Challenge`.
    pub const CHALLENGE: u32 = 65;
    /// `Proof`, `LaneProof`: a MAC.
    pub const PROOF: u32 = 32;
    /// `LaneJoin`: sid, lane, nonce.
    pub const LANE_JOIN: u32 = 50;
    /// `LaneChallenge`: nonce, MAC.
    pub const LANE_CHALLENGE: u32 = 64;
    /// `Reject`: a length and an error payload.
    pub const REJECT: u32 = 4 + super::MAX_ERROR_PAYLOAD;
    /// `Accept`, and `Auth` without its regions (host, transports, lanes and blobs, with the
    /// RDMA blob of the largest configuration: under 2 KB).
    pub const HANDSHAKE: u32 = 64 << 10;
    /// Bytes of one region in a region list, at most: 42, 8 of RDMA chunk length, 2 and 4 per
    /// key of chunks 1.. for a region registered in chunks, 72 of CUDA IPC keys for a device
    /// region.
    pub const REGION: u32 = 42 + 8 + 2 + 4 * (super::MAX_MR_CHUNKS as u32 - 1) + 72;
    /// A region list of `n` regions (count and entries).
    pub const fn regions(n: u32) -> u32 {
        4 + REGION * n
    }
    /// Largest body read from a peer that has not proved the secret yet (a `Reject` aside).
    pub const MAX_PREAUTH: u32 = 256;
    const _: () = assert!(HELLO <= MAX_PREAUTH && LANE_JOIN <= MAX_PREAUTH);
    const _: () = assert!(PROOF <= MAX_PREAUTH && LANE_CHALLENGE <= MAX_PREAUTH);
}

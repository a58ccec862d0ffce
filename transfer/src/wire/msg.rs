//! The types and constants of the wire format (their codecs are in the sibling modules).

use crate::types::{Access, RegionId};

/// Protocol version spoken by this build. 3: notification fences (a `Transport` control message
/// with bit 0x80) and per-device RDMA key requests; a version-2 peer is refused at the handshake
/// instead of dropping the control connection later.
pub const PROTOCOL_VERSION: u16 = 3;
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
}

/// Transport bits in `Hello.transports`.
pub const TRANSPORT_TCP: u8 = 1;
/// Shared memory supported.
pub const TRANSPORT_SHM: u8 = 2;
/// RDMA (RC queue pairs) supported.
pub const TRANSPORT_RDMA: u8 = 4;

/// Control messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CtrlMsg {
    /// Initiator's opening message.
    Hello {
        /// Initiator's nonce.
        nonce: [u8; 32],
        /// Initiator holds a secret.
        auth: bool,
        /// Where the initiator runs.
        host: HostIdentity,
        /// Initiator's listen port (for lanes the responder opens back).
        listen_port: u16,
        /// Transports the initiator accepts (`TRANSPORT_*` bits).
        transports: u8,
        /// Transport-specific blobs `(transport bit, bytes)`, e.g. RDMA GID/QPN.
        blobs: Vec<(u8, Vec<u8>)>,
    },
    /// Responder's answer, proving its secret.
    HelloReply {
        /// Responder's nonce.
        nonce: [u8; 32],
        /// HMAC proof (empty when the responder has no secret).
        mac: Vec<u8>,
        /// Responder requires the initiator to prove the secret.
        auth_required: bool,
        /// Where the responder runs.
        host: HostIdentity,
        /// Transports the responder accepts.
        transports: u8,
        /// Token the initiator presents when it opens data lanes.
        token: [u8; 16],
        /// Transport-specific blobs.
        blobs: Vec<(u8, Vec<u8>)>,
    },
    /// Initiator's proof and choices.
    Auth {
        /// HMAC proof (empty without secret).
        mac: Vec<u8>,
        /// Chosen transport bit.
        transport: u8,
        /// Token the responder presents when it opens lanes back.
        token: [u8; 16],
        /// Regions the initiator offers.
        regions: Vec<WireRegion>,
    },
    /// Responder accepts; its regions.
    Welcome {
        /// Regions the responder offers.
        regions: Vec<WireRegion>,
    },
    /// Refusal with a typed error (encoded with [`super::encode_error`]).
    Reject {
        /// Encoded error.
        error: Vec<u8>,
    },
    /// First message of a data lane.
    LaneJoin {
        /// Token from the handshake.
        token: [u8; 16],
        /// Lane index.
        lane: u16,
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

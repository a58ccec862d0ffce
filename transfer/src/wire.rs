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

use crate::error::Error;
use crate::region::{Access, RegionId};

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

impl FrameKind {
    fn to_u8(self) -> u8 {
        match self {
            FrameKind::Write => 1,
            FrameKind::Ack => 2,
            FrameKind::ReadReq => 3,
            FrameKind::ReadData => 4,
            FrameKind::Notify => 5,
            FrameKind::Error => 6,
        }
    }
    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => FrameKind::Write,
            2 => FrameKind::Ack,
            3 => FrameKind::ReadReq,
            4 => FrameKind::ReadData,
            5 => FrameKind::Notify,
            6 => FrameKind::Error,
            _ => return None,
        })
    }
    /// Whether a payload of `len` bytes follows the header.
    pub fn has_payload(self) -> bool {
        !matches!(self, FrameKind::Ack | FrameKind::ReadReq)
    }
    fn max_len(self) -> u32 {
        match self {
            FrameKind::Write | FrameKind::ReadData | FrameKind::ReadReq => MAX_SLICE,
            FrameKind::Notify => MAX_TAG,
            FrameKind::Error => MAX_ERROR_PAYLOAD,
            FrameKind::Ack => 0,
        }
    }
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

impl FrameHeader {
    /// A header with zeroed region fields.
    pub fn simple(kind: FrameKind, batch: u64, len: u32, aux: u32) -> Self {
        FrameHeader {
            kind,
            flags: 0,
            batch,
            region: RegionId {
                index: 0,
                generation: 0,
            },
            offset: 0,
            len,
            aux,
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC);
        b[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[6] = self.kind.to_u8();
        b[7] = self.flags;
        b[8..16].copy_from_slice(&self.batch.to_le_bytes());
        b[16..20].copy_from_slice(&self.region.index.to_le_bytes());
        b[20..24].copy_from_slice(&self.region.generation.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..36].copy_from_slice(&self.len.to_le_bytes());
        b[36..40].copy_from_slice(&self.aux.to_le_bytes());
        b
    }

    /// Decodes and validates a header (magic, version, kind, length bound).
    pub fn decode(b: &[u8]) -> Result<FrameHeader, Error> {
        if b.len() < FRAME_HEADER_LEN {
            return Err(Error::Protocol(format!(
                "truncated frame header ({} bytes)",
                b.len()
            )));
        }
        if b[0..4] != FRAME_MAGIC {
            return Err(Error::Protocol(format!(
                "bad frame magic {:02x?}",
                &b[0..4]
            )));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != PROTOCOL_VERSION {
            return Err(Error::VersionMismatch {
                ours: PROTOCOL_VERSION,
                theirs: version,
            });
        }
        let kind = FrameKind::from_u8(b[6])
            .ok_or_else(|| Error::Protocol(format!("unknown frame kind {}", b[6])))?;
        let u32at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let h = FrameHeader {
            kind,
            flags: b[7],
            batch: u64at(8),
            region: RegionId {
                index: u32at(16),
                generation: u32at(20),
            },
            offset: u64at(24),
            len: u32at(32),
            aux: u32at(36),
        };
        if h.len > kind.max_len() {
            return Err(Error::Protocol(format!(
                "{:?} frame length {} exceeds bound {}",
                kind,
                h.len,
                kind.max_len()
            )));
        }
        Ok(h)
    }
}

// ---------------------------------------------------------------- error payloads

/// Encodes an error for an `Error` frame or a `Reject` message.
pub fn encode_error(e: &Error) -> Vec<u8> {
    let mut w = Writer::default();
    let (code, region, offset, len, region_len) = match e {
        Error::OutOfBounds {
            region,
            offset,
            len,
            region_len,
        } => (1u8, *region, *offset, *len, *region_len),
        Error::UnknownRegion(r) => (2, *r, 0, 0, 0),
        Error::StaleRegion(r) => (3, *r, 0, 0, 0),
        Error::AccessDenied(r) => (4, *r, 0, 0, 0),
        Error::AuthFailed => (
            5,
            RegionId {
                index: 0,
                generation: 0,
            },
            0,
            0,
            0,
        ),
        Error::VersionMismatch { ours, theirs } => (
            6,
            RegionId {
                index: 0,
                generation: 0,
            },
            *ours as u64,
            *theirs as u64,
            0,
        ),
        Error::Unsupported(_) => (
            7,
            RegionId {
                index: 0,
                generation: 0,
            },
            0,
            0,
            0,
        ),
        Error::Shutdown => (
            8,
            RegionId {
                index: 0,
                generation: 0,
            },
            0,
            0,
            0,
        ),
        Error::InvalidArgument(_) => (
            9,
            RegionId {
                index: 0,
                generation: 0,
            },
            0,
            0,
            0,
        ),
        _ => (
            10,
            RegionId {
                index: 0,
                generation: 0,
            },
            0,
            0,
            0,
        ),
    };
    w.u8(code);
    w.u32(region.index);
    w.u32(region.generation);
    w.u64(offset);
    w.u64(len);
    w.u64(region_len);
    let mut msg = e.to_string();
    msg.truncate(1000);
    w.string(&msg);
    w.buf
}

/// Decodes an error encoded by [`encode_error`]. The versions in a `VersionMismatch` are
/// reported from the receiver's point of view when `flip` is true.
pub fn decode_error(b: &[u8], flip: bool) -> Result<Error, Error> {
    let mut r = Reader::new(b);
    let code = r.u8()?;
    let region = RegionId {
        index: r.u32()?,
        generation: r.u32()?,
    };
    let offset = r.u64()?;
    let len = r.u64()?;
    let region_len = r.u64()?;
    let msg = r.string(1024)?;
    Ok(match code {
        1 => Error::OutOfBounds {
            region,
            offset,
            len,
            region_len,
        },
        2 => Error::UnknownRegion(region),
        3 => Error::StaleRegion(region),
        4 => Error::AccessDenied(region),
        5 => Error::AuthFailed,
        6 => {
            let (a, b) = (offset as u16, len as u16);
            if flip {
                Error::VersionMismatch { ours: b, theirs: a }
            } else {
                Error::VersionMismatch { ours: a, theirs: b }
            }
        }
        7 => Error::Unsupported(format!("peer: {msg}")),
        8 => Error::Shutdown,
        9 => Error::InvalidArgument(format!("peer: {msg}")),
        _ => Error::Protocol(format!("peer reported: {msg}")),
    })
}

// ---------------------------------------------------------------- control messages

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
    /// Refusal with a typed error (encoded with [`encode_error`]).
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

impl CtrlMsg {
    fn kind(&self) -> u8 {
        match self {
            CtrlMsg::Hello { .. } => 1,
            CtrlMsg::HelloReply { .. } => 2,
            CtrlMsg::Auth { .. } => 3,
            CtrlMsg::Welcome { .. } => 4,
            CtrlMsg::Reject { .. } => 5,
            CtrlMsg::LaneJoin { .. } => 6,
            CtrlMsg::LaneOk => 7,
            CtrlMsg::RegionsAdded(_) => 8,
            CtrlMsg::RegionsRemoved(_) => 9,
            CtrlMsg::Notify(_) => 10,
            CtrlMsg::RegionsSet(_) => 11,
            CtrlMsg::Transport { .. } => 12,
        }
    }

    /// Encodes header + body.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.buf.extend_from_slice(&CTRL_MAGIC);
        w.u16(PROTOCOL_VERSION);
        w.u8(self.kind());
        w.u8(0);
        w.u32(0);
        match self {
            CtrlMsg::Hello {
                nonce,
                auth,
                host,
                listen_port,
                transports,
                blobs,
            } => {
                w.bytes_fixed(nonce);
                w.u8(*auth as u8);
                w.host(host);
                w.u16(*listen_port);
                w.u8(*transports);
                w.blobs(blobs);
            }
            CtrlMsg::HelloReply {
                nonce,
                mac,
                auth_required,
                host,
                transports,
                token,
                blobs,
            } => {
                w.bytes_fixed(nonce);
                w.bytes(mac);
                w.u8(*auth_required as u8);
                w.host(host);
                w.u8(*transports);
                w.bytes_fixed(token);
                w.blobs(blobs);
            }
            CtrlMsg::Auth {
                mac,
                transport,
                token,
                regions,
            } => {
                w.bytes(mac);
                w.u8(*transport);
                w.bytes_fixed(token);
                w.regions(regions);
            }
            CtrlMsg::Welcome { regions } => w.regions(regions),
            CtrlMsg::Reject { error } => w.bytes(error),
            CtrlMsg::LaneJoin { token, lane } => {
                w.bytes_fixed(token);
                w.u16(*lane);
            }
            CtrlMsg::LaneOk => {}
            CtrlMsg::RegionsAdded(r) => w.regions(r),
            CtrlMsg::RegionsRemoved(ids) => {
                w.u32(ids.len() as u32);
                for id in ids {
                    w.u32(id.index);
                    w.u32(id.generation);
                }
            }
            CtrlMsg::Notify(tag) => w.bytes(tag),
            CtrlMsg::RegionsSet(r) => w.regions(r),
            CtrlMsg::Transport { bit, data } => {
                w.u8(*bit);
                w.bytes(data);
            }
        }
        let body = (w.buf.len() - CTRL_HEADER_LEN) as u32;
        w.buf[8..12].copy_from_slice(&body.to_le_bytes());
        w.buf
    }

    /// Decodes a control header: returns (version, kind, body length). The version is returned,
    /// not checked, so a peer's `Reject` for a version mismatch can still be read.
    pub fn decode_header(b: &[u8]) -> Result<(u16, u8, u32), Error> {
        if b.len() < CTRL_HEADER_LEN {
            return Err(Error::Protocol("truncated control header".into()));
        }
        if b[0..4] != CTRL_MAGIC {
            return Err(Error::Protocol(format!(
                "bad control magic {:02x?}",
                &b[0..4]
            )));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        let kind = b[6];
        let len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        if len > MAX_CTRL_BODY {
            return Err(Error::Protocol(format!(
                "control body length {len} exceeds bound {MAX_CTRL_BODY}"
            )));
        }
        Ok((version, kind, len))
    }

    /// Decodes a body of the given kind. Trailing bytes are an error.
    pub fn decode_body(kind: u8, b: &[u8]) -> Result<CtrlMsg, Error> {
        let mut r = Reader::new(b);
        let m = match kind {
            1 => CtrlMsg::Hello {
                nonce: r.fixed()?,
                auth: r.bool()?,
                host: r.host()?,
                listen_port: r.u16()?,
                transports: r.u8()?,
                blobs: r.blobs()?,
            },
            2 => CtrlMsg::HelloReply {
                nonce: r.fixed()?,
                mac: r.bytes(64)?,
                auth_required: r.bool()?,
                host: r.host()?,
                transports: r.u8()?,
                token: r.fixed()?,
                blobs: r.blobs()?,
            },
            3 => CtrlMsg::Auth {
                mac: r.bytes(64)?,
                transport: r.u8()?,
                token: r.fixed()?,
                regions: r.regions()?,
            },
            4 => CtrlMsg::Welcome {
                regions: r.regions()?,
            },
            5 => CtrlMsg::Reject {
                error: r.bytes(MAX_ERROR_PAYLOAD as usize)?,
            },
            6 => CtrlMsg::LaneJoin {
                token: r.fixed()?,
                lane: r.u16()?,
            },
            7 => CtrlMsg::LaneOk,
            8 => CtrlMsg::RegionsAdded(r.regions()?),
            9 => {
                let n = r.count(8)?;
                let mut ids = Vec::with_capacity(n);
                for _ in 0..n {
                    ids.push(RegionId {
                        index: r.u32()?,
                        generation: r.u32()?,
                    });
                }
                CtrlMsg::RegionsRemoved(ids)
            }
            10 => CtrlMsg::Notify(r.bytes(MAX_TAG as usize)?),
            11 => CtrlMsg::RegionsSet(r.regions()?),
            12 => CtrlMsg::Transport {
                bit: r.u8()?,
                data: r.bytes(MAX_TRANSPORT_MSG)?,
            },
            k => return Err(Error::Protocol(format!("unknown control message kind {k}"))),
        };
        if !r.rest().is_empty() {
            return Err(Error::Protocol(format!(
                "{} trailing bytes in control message",
                r.rest().len()
            )));
        }
        Ok(m)
    }

    /// Decodes a whole message (header + body) from a buffer.
    pub fn decode(b: &[u8]) -> Result<CtrlMsg, Error> {
        let (version, kind, len) = Self::decode_header(b)?;
        let body = &b[CTRL_HEADER_LEN..];
        if body.len() != len as usize {
            return Err(Error::Protocol("control body length mismatch".into()));
        }
        if version != PROTOCOL_VERSION && kind != 5 {
            return Err(Error::VersionMismatch {
                ours: PROTOCOL_VERSION,
                theirs: version,
            });
        }
        Self::decode_body(kind, body)
    }
}

/// Reads one control message from a blocking stream (bounded).
pub fn read_ctrl(r: &mut impl std::io::Read) -> Result<CtrlMsg, Error> {
    let mut h = [0u8; CTRL_HEADER_LEN];
    r.read_exact(&mut h)?;
    let (version, kind, len) = CtrlMsg::decode_header(&h)?;
    if version != PROTOCOL_VERSION && kind != 5 {
        return Err(Error::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: version,
        });
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    CtrlMsg::decode_body(kind, &body)
}

// ---------------------------------------------------------------- codec helpers

#[derive(Default)]
struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    fn u8(&mut self, v: u8) {
        self.buf.push(v)
    }
    fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes())
    }
    fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes())
    }
    fn bytes_fixed(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b)
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.buf.extend_from_slice(b)
    }
    fn string(&mut self, s: &str) {
        self.bytes(s.as_bytes())
    }
    fn host(&mut self, h: &HostIdentity) {
        self.string(&h.boot_id);
        self.string(&h.pid_ns);
        self.string(&h.mnt_ns);
        self.u32(h.pid);
    }
    fn blobs(&mut self, blobs: &[(u8, Vec<u8>)]) {
        self.u32(blobs.len() as u32);
        for (k, b) in blobs {
            self.u8(*k);
            self.bytes(b);
        }
    }
    fn regions(&mut self, rs: &[WireRegion]) {
        self.u32(rs.len() as u32);
        for r in rs {
            self.u32(r.id.index);
            self.u32(r.id.generation);
            self.u64(r.len);
            self.u8(r.access.to_wire());
            self.u64(r.addr);
            self.u32(r.fd as u32);
            self.u64(r.ino);
            self.u32(r.rkey);
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(b: &'a [u8]) -> Self {
        Reader { b }
    }
    fn rest(&self) -> &'a [u8] {
        self.b
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if self.b.len() < n {
            return Err(Error::Protocol(format!(
                "truncated message: need {n} bytes, have {}",
                self.b.len()
            )));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }
    fn bool(&mut self) -> Result<bool, Error> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(Error::Protocol(format!("bad boolean {v}"))),
        }
    }
    fn u16(&mut self) -> Result<u16, Error> {
        let t = self.take(2)?;
        Ok(u16::from_le_bytes([t[0], t[1]]))
    }
    fn u32(&mut self) -> Result<u32, Error> {
        let t = self.take(4)?;
        Ok(u32::from_le_bytes([t[0], t[1], t[2], t[3]]))
    }
    fn u64(&mut self) -> Result<u64, Error> {
        let t = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(t);
        Ok(u64::from_le_bytes(a))
    }
    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        let t = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(t);
        Ok(a)
    }
    fn bytes(&mut self, max: usize) -> Result<Vec<u8>, Error> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(Error::Protocol(format!(
                "field length {n} exceeds bound {max}"
            )));
        }
        Ok(self.take(n)?.to_vec())
    }
    fn string(&mut self, max: usize) -> Result<String, Error> {
        let b = self.bytes(max)?;
        String::from_utf8(b).map_err(|_| Error::Protocol("invalid utf-8 string".into()))
    }
    /// A count of items each at least `min_item` bytes: bounded by what remains.
    fn count(&mut self, min_item: usize) -> Result<usize, Error> {
        let n = self.u32()? as usize;
        if n > MAX_REGIONS_PER_MSG as usize || n.saturating_mul(min_item) > self.b.len() {
            return Err(Error::Protocol(format!("item count {n} exceeds message")));
        }
        Ok(n)
    }
    fn host(&mut self) -> Result<HostIdentity, Error> {
        Ok(HostIdentity {
            boot_id: self.string(256)?,
            pid_ns: self.string(256)?,
            mnt_ns: self.string(256)?,
            pid: self.u32()?,
        })
    }
    fn blobs(&mut self) -> Result<Vec<(u8, Vec<u8>)>, Error> {
        let n = self.count(5)?;
        if n > 16 {
            return Err(Error::Protocol(format!("{n} transport blobs (max 16)")));
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let k = self.u8()?;
            v.push((k, self.bytes(64 << 10)?));
        }
        Ok(v)
    }
    fn regions(&mut self) -> Result<Vec<WireRegion>, Error> {
        let n = self.count(41)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let id = RegionId {
                index: self.u32()?,
                generation: self.u32()?,
            };
            let len = self.u64()?;
            let a = self.u8()?;
            let access =
                Access::from_wire(a).ok_or_else(|| Error::Protocol(format!("bad access {a}")))?;
            v.push(WireRegion {
                id,
                len,
                access,
                addr: self.u64()?,
                fd: self.u32()? as i32,
                ino: self.u64()?,
                rkey: self.u32()?,
            });
        }
        Ok(v)
    }
}

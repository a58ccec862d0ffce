//! Data-lane frame headers: kind codes, encoding, decoding with bounds.

use super::msg::{
    FrameHeader, FrameKind, FRAME_HEADER_LEN, FRAME_MAGIC, MAX_ERROR_PAYLOAD, MAX_SLICE, MAX_TAG,
    PROTOCOL_VERSION,
};
use super::problem::{Layout, ProtocolError};
use crate::error::Error;
use crate::types::RegionId;

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

    /// Counts one more part in the `aux` field of an encoded `Ack` header (saturating): the
    /// target merges consecutive acks of one batch into one frame this way.
    pub(crate) fn bump_ack(encoded: &mut [u8]) {
        let mut a = [0u8; 4];
        a.copy_from_slice(&encoded[36..40]);
        let n = u32::from_le_bytes(a).saturating_add(1);
        encoded[36..40].copy_from_slice(&n.to_le_bytes());
    }

    /// Decodes and validates a header (magic, version, kind, length bound).
    pub fn decode(b: &[u8]) -> Result<FrameHeader, Error> {
        if b.len() < FRAME_HEADER_LEN {
            return Err(ProtocolError::Truncated {
                at: Layout::FrameHeader,
                need: FRAME_HEADER_LEN,
                have: b.len(),
            }
            .into());
        }
        if b[0..4] != FRAME_MAGIC {
            return Err(ProtocolError::BadMagic {
                at: Layout::FrameHeader,
                got: [b[0], b[1], b[2], b[3]],
            }
            .into());
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != PROTOCOL_VERSION {
            return Err(Error::VersionMismatch {
                ours: PROTOCOL_VERSION,
                theirs: version,
            });
        }
        let kind = FrameKind::from_u8(b[6]).ok_or(ProtocolError::UnknownKind {
            at: Layout::FrameHeader,
            kind: b[6],
        })?;
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
            return Err(ProtocolError::TooLong {
                at: Layout::FramePayload(kind),
                len: u64::from(h.len),
                max: u64::from(kind.max_len()),
            }
            .into());
        }
        Ok(h)
    }
}

//! Control messages: encoding, decoding (bounded, never panicking), reading from a stream.

use super::msg::{
    CtrlMsg, CTRL_HEADER_LEN, CTRL_MAGIC, MAX_CTRL_BODY, MAX_ERROR_PAYLOAD, MAX_TAG,
    MAX_TRANSPORT_MSG, PROTOCOL_VERSION,
};
use super::problem::{Layout, ProtocolError};
use super::rw::{Reader, Writer};
use crate::error::Error;
use crate::types::RegionId;

// The encoders and decoders are public for the tests only (see `wire/mod.rs`).
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
    #[doc(hidden)]
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
    #[doc(hidden)]
    pub fn decode_header(b: &[u8]) -> Result<(u16, u8, u32), Error> {
        if b.len() < CTRL_HEADER_LEN {
            return Err(ProtocolError::Truncated {
                at: Layout::CtrlHeader,
                need: CTRL_HEADER_LEN,
                have: b.len(),
            }
            .into());
        }
        if b[0..4] != CTRL_MAGIC {
            return Err(ProtocolError::BadMagic {
                at: Layout::CtrlHeader,
                got: [b[0], b[1], b[2], b[3]],
            }
            .into());
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        let kind = b[6];
        let len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        if len > MAX_CTRL_BODY {
            return Err(ProtocolError::TooLong {
                at: Layout::CtrlHeader,
                len: u64::from(len),
                max: u64::from(MAX_CTRL_BODY),
            }
            .into());
        }
        Ok((version, kind, len))
    }

    /// Decodes a body of the given kind. Trailing bytes are an error.
    #[doc(hidden)]
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
            k => {
                return Err(ProtocolError::UnknownKind {
                    at: Layout::CtrlBody,
                    kind: k,
                }
                .into())
            }
        };
        if !r.rest().is_empty() {
            return Err(ProtocolError::TrailingBytes {
                at: Layout::CtrlBody,
                n: r.rest().len(),
            }
            .into());
        }
        Ok(m)
    }

    /// Decodes a whole message (header + body) from a buffer.
    #[doc(hidden)]
    pub fn decode(b: &[u8]) -> Result<CtrlMsg, Error> {
        let (version, kind, len) = Self::decode_header(b)?;
        let body = &b[CTRL_HEADER_LEN..];
        if body.len() != len as usize {
            return Err(ProtocolError::BadLength {
                at: Layout::CtrlBody,
                len: body.len(),
            }
            .into());
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

//! Control messages: encoding, decoding (bounded, never panicking), reading from a stream.

use std::io::Read;

use super::msg::{
    body, kind, CtrlMsg, CTRL_HEADER_LEN, CTRL_MAGIC, MAX_CTRL_BODY, MAX_ERROR_PAYLOAD, MAX_TAG,
    MAX_TRANSPORT_MSG, PROTOCOL_VERSION,
};
use super::problem::{Layout, ProtocolError, Stage};
use super::rw::{Reader, Writer};
use crate::error::Error;
use crate::types::RegionId;

// The encoders and decoders are public for the tests only (see `wire/mod.rs`).
impl CtrlMsg {
    /// The kind byte of this message ([`super::msg::kind`]).
    #[doc(hidden)]
    pub fn kind(&self) -> u8 {
        match self {
            CtrlMsg::Hello { .. } => kind::HELLO,
            CtrlMsg::Auth { .. } => kind::AUTH,
            CtrlMsg::Welcome { .. } => kind::WELCOME,
            CtrlMsg::Reject { .. } => kind::REJECT,
            CtrlMsg::LaneJoin { .. } => kind::LANE_JOIN,
            CtrlMsg::LaneOk => kind::LANE_OK,
            CtrlMsg::RegionsAdded(_) => kind::REGIONS_ADDED,
            CtrlMsg::RegionsRemoved(_) => kind::REGIONS_REMOVED,
            CtrlMsg::Notify(_) => kind::NOTIFY,
            CtrlMsg::RegionsSet(_) => kind::REGIONS_SET,
            CtrlMsg::Transport { .. } => kind::TRANSPORT,
            CtrlMsg::Challenge { .. } => kind::CHALLENGE,
            CtrlMsg::Proof { .. } => kind::PROOF,
            CtrlMsg::Accept { .. } => kind::ACCEPT,
            CtrlMsg::LaneChallenge { .. } => kind::LANE_CHALLENGE,
            CtrlMsg::LaneProof { .. } => kind::LANE_PROOF,
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
            CtrlMsg::Hello { nonce, auth, dh }
            | CtrlMsg::Challenge {
                nonce,
                auth_required: auth,
                dh,
            } => {
                w.bytes_fixed(nonce);
                w.u8(*auth as u8);
                w.bytes_fixed(dh);
            }
            CtrlMsg::Proof { mac } | CtrlMsg::LaneProof { mac } => w.bytes_fixed(mac),
            CtrlMsg::Accept {
                host,
                transports,
                lanes,
                blobs,
                mac,
            } => {
                w.host(host);
                w.u8(*transports);
                w.u16(*lanes);
                w.blobs(blobs);
                w.bytes_fixed(mac);
            }
            CtrlMsg::Auth {
                host,
                listen_port,
                transports,
                lanes,
                blobs,
                regions,
                mac,
            } => {
                w.host(host);
                w.u16(*listen_port);
                w.u8(*transports);
                w.u16(*lanes);
                w.blobs(blobs);
                w.regions(regions);
                w.bytes_fixed(mac);
            }
            CtrlMsg::Welcome { regions, mac } => {
                w.regions(regions);
                w.bytes_fixed(mac);
            }
            CtrlMsg::Reject { error } => w.bytes(error),
            CtrlMsg::LaneJoin { sid, lane, nonce } => {
                w.bytes_fixed(sid);
                w.u16(*lane);
                w.bytes_fixed(nonce);
            }
            CtrlMsg::LaneChallenge { nonce, mac } => {
                w.bytes_fixed(nonce);
                w.bytes_fixed(mac);
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
    pub fn decode_body(k: u8, b: &[u8]) -> Result<CtrlMsg, Error> {
        let mut r = Reader::new(b);
        let m = match k {
            kind::HELLO => CtrlMsg::Hello {
                nonce: r.fixed()?,
                auth: r.bool()?,
                dh: r.fixed()?,
            },
            kind::CHALLENGE => CtrlMsg::Challenge {
                nonce: r.fixed()?,
                auth_required: r.bool()?,
                dh: r.fixed()?,
            },
            kind::PROOF => CtrlMsg::Proof { mac: r.fixed()? },
            kind::ACCEPT => CtrlMsg::Accept {
                host: r.host()?,
                transports: r.u8()?,
                lanes: r.u16()?,
                blobs: r.blobs()?,
                mac: r.fixed()?,
            },
            kind::AUTH => CtrlMsg::Auth {
                host: r.host()?,
                listen_port: r.u16()?,
                transports: r.u8()?,
                lanes: r.u16()?,
                blobs: r.blobs()?,
                regions: r.regions()?,
                mac: r.fixed()?,
            },
            kind::WELCOME => CtrlMsg::Welcome {
                regions: r.regions()?,
                mac: r.fixed()?,
            },
            kind::REJECT => CtrlMsg::Reject {
                error: r.bytes(MAX_ERROR_PAYLOAD as usize)?,
            },
            kind::LANE_JOIN => CtrlMsg::LaneJoin {
                sid: r.fixed()?,
                lane: r.u16()?,
                nonce: r.fixed()?,
            },
            kind::LANE_CHALLENGE => CtrlMsg::LaneChallenge {
                nonce: r.fixed()?,
                mac: r.fixed()?,
            },
            kind::LANE_PROOF => CtrlMsg::LaneProof { mac: r.fixed()? },
            kind::LANE_OK => CtrlMsg::LaneOk,
            kind::REGIONS_ADDED => CtrlMsg::RegionsAdded(r.regions()?),
            kind::REGIONS_REMOVED => {
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
            kind::NOTIFY => CtrlMsg::Notify(r.bytes(MAX_TAG as usize)?),
            kind::REGIONS_SET => CtrlMsg::RegionsSet(r.regions()?),
            kind::TRANSPORT => CtrlMsg::Transport {
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
        let (version, k, len) = Self::decode_header(b)?;
        let body = &b[CTRL_HEADER_LEN..];
        if body.len() != len as usize {
            return Err(ProtocolError::BadLength {
                at: Layout::CtrlBody,
                len: body.len(),
            }
            .into());
        }
        if version != PROTOCOL_VERSION && k != kind::REJECT {
            return Err(Error::VersionMismatch {
                ours: PROTOCOL_VERSION,
                theirs: version,
            });
        }
        Self::decode_body(k, body)
    }
}

/// Which messages a reader accepts at a point of a conversation, each with the largest body it
/// reads for it (a `Reject` is always accepted, with a body of at most [`body::REJECT`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct Expect<'a> {
    /// Where in the conversation (named in the error for another kind).
    pub stage: Stage,
    /// `(kind, largest body)` of each accepted message.
    pub kinds: &'a [(u8, u32)],
}

/// Any message, with the body bound of the header ([`MAX_CTRL_BODY`]).
#[doc(hidden)]
pub const ANY: Expect<'static> = Expect {
    stage: Stage::FirstMessage,
    kinds: &[],
};

/// Reads one control message from a blocking stream, bounded: a kind outside `expect` or a
/// body longer than its bound is refused from the header alone, before a byte of the body is
/// read or allocated, and the body buffer grows only as bytes arrive. Returns the message and
/// its encoded bytes (header and body, for transcripts).
#[doc(hidden)]
pub fn read_ctrl_limited(
    r: &mut impl std::io::Read,
    expect: Expect<'_>,
) -> Result<(CtrlMsg, Vec<u8>), Error> {
    let mut h = [0u8; CTRL_HEADER_LEN];
    r.read_exact(&mut h)?;
    let (version, k, len) = CtrlMsg::decode_header(&h)?;
    if version != PROTOCOL_VERSION && k != kind::REJECT {
        return Err(Error::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: version,
        });
    }
    let max = if k == kind::REJECT {
        body::REJECT
    } else if expect.kinds.is_empty() {
        MAX_CTRL_BODY
    } else {
        match expect.kinds.iter().find(|(kk, _)| *kk == k) {
            Some((_, m)) => *m,
            None => {
                return Err(ProtocolError::UnexpectedKind {
                    stage: expect.stage,
                    kind: k,
                }
                .into())
            }
        }
    };
    if len > max {
        return Err(ProtocolError::TooLong {
            at: Layout::CtrlBody,
            len: u64::from(len),
            max: u64::from(max),
        }
        .into());
    }
    let mut raw = Vec::with_capacity(CTRL_HEADER_LEN + (len as usize).min(READ_STEP));
    raw.extend_from_slice(&h);
    // `take` + `read_to_end`: the buffer grows with what arrives, never to `len` up front.
    let got = r.take(u64::from(len)).read_to_end(&mut raw)?;
    if got != len as usize {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "control message body truncated",
        )
        .into());
    }
    let m = CtrlMsg::decode_body(k, &raw[CTRL_HEADER_LEN..])?;
    Ok((m, raw))
}

/// Initial capacity of a body buffer (it grows as bytes arrive).
const READ_STEP: usize = 64 << 10;

/// Reads one control message of any kind from a blocking stream (body bounded by
/// [`MAX_CTRL_BODY`]; the engine itself always reads with [`read_ctrl_limited`]).
pub fn read_ctrl(r: &mut impl std::io::Read) -> Result<CtrlMsg, Error> {
    read_ctrl_limited(r, ANY).map(|(m, _)| m)
}

//! Protocol messages between P and D and their versioned, bounds-checked binary codec.
//!
//! Frame layout (little endian):
//!
//! ```text
//! offset 0  u8[2] magic  "KW"
//! offset 2  u8    version (1)
//! offset 3  u8    message type
//! offset 4  u32   body length in bytes
//! offset 8  ...   body (layout per type, fixed except BlockIds which carries an explicit count)
//! ```
//!
//! Decoding never panics and never allocates more than the frame's own (bounded) length says:
//! every length and count is checked against [`MAX_BLOCKS`], [`MAX_LAYERS`] and the bytes at hand
//! before anything is read.

use crate::types::{BlockId, FailReason, RequestId};
use thiserror::Error;

/// The two magic bytes that open every frame.
pub const MAGIC: [u8; 2] = *b"KW";
/// The codec version this crate writes and reads (2: `BlockIds` carries the first block index
/// and the landing flag).
pub const VERSION: u8 = 2;
/// Length of the fixed frame header.
pub const HEADER_LEN: usize = 8;
/// Most block ids one `BlockIds` message may carry (1,048,576 blocks of 16 tokens ≈ 16M tokens).
pub const MAX_BLOCKS: usize = 1 << 20;
/// Most layers a request may have.
pub const MAX_LAYERS: u16 = 1024;
/// Longest body any valid frame can have.
pub const MAX_BODY_LEN: usize = BLOCK_IDS_HEAD + 4 * MAX_BLOCKS;
/// Fixed part of a `BlockIds` body: request, first block, landing flag, count.
const BLOCK_IDS_HEAD: usize = 8 + 4 + 1 + 4;

const T_ANNOUNCE: u8 = 1;
const T_STARTED: u8 = 2;
const T_PREFILL_DONE: u8 = 3;
const T_BLOCK_IDS: u8 = 4;
const T_LAYER_SENT: u8 = 5;
const T_ALL_SENT: u8 = 6;
const T_ABORT: u8 = 7;
const T_HEARTBEAT: u8 = 8;
const T_QUEUED: u8 = 9;

/// One protocol message. Direction is noted per variant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// D → P: D has the request (vLLM `decode_sent`) and will need `blocks` blocks for `tokens`.
    Announce {
        /// The request.
        req: RequestId,
        /// Prompt tokens D expects to receive.
        tokens: u32,
        /// Blocks D will reserve for them.
        blocks: u32,
    },
    /// P → D: P's scheduler has the request (queued, not started yet): D no longer times out
    /// waiting to hear from P while P is alive.
    Queued {
        /// The request.
        req: RequestId,
    },
    /// P → D: P has scheduled the request (prefill started). Lets a `lazy` D reserve.
    Started {
        /// The request.
        req: RequestId,
        /// Number of layers P will send.
        layers: u16,
        /// Number of blocks P will send per layer.
        blocks: u32,
    },
    /// P → D: P has finished prefill: every layer is ready. Lets a `jit` D reserve.
    PrefillDone {
        /// The request.
        req: RequestId,
    },
    /// D → P: the D block ids P must write the request's KV into, in prompt order, starting at
    /// the request's block `first` (D already holds blocks `0..first` from its prefix cache: P
    /// sends only the suffix).
    BlockIds {
        /// The request.
        req: RequestId,
        /// Index of the request block that `blocks[0]` receives.
        first: u32,
        /// The ids are slots of D's landing pool, not KV-cache blocks (policy `land`).
        landing: bool,
        /// Destination block ids, one per block from `first` on.
        blocks: Vec<BlockId>,
    },
    /// P → D: layer `layer` of the request has been written completely into D's blocks.
    LayerSent {
        /// The request.
        req: RequestId,
        /// The layer index.
        layer: u16,
        /// Bytes of this layer.
        bytes: u64,
    },
    /// P → D: every layer has been written.
    AllSent {
        /// The request.
        req: RequestId,
        /// Number of layers written.
        layers: u16,
        /// Total bytes written.
        bytes: u64,
    },
    /// Either way: the sender gave the request up and will not touch the receiver's memory for it
    /// again (P: no write to D's blocks is in flight or will be posted).
    Abort {
        /// The request.
        req: RequestId,
        /// Why.
        reason: FailReason,
    },
    /// Either way, periodic: the sender is alive. `incarnation` changes when an engine restarts.
    Heartbeat {
        /// Identifies one life of the sending engine.
        incarnation: u64,
        /// Increases by one per heartbeat.
        seq: u64,
    },
}

impl Message {
    /// The request this message is about, if any (heartbeats are about none).
    pub fn request(&self) -> Option<RequestId> {
        match self {
            Message::Announce { req, .. }
            | Message::Started { req, .. }
            | Message::PrefillDone { req }
            | Message::Queued { req }
            | Message::BlockIds { req, .. }
            | Message::LayerSent { req, .. }
            | Message::AllSent { req, .. }
            | Message::Abort { req, .. } => Some(*req),
            Message::Heartbeat { .. } => None,
        }
    }

    fn kind(&self) -> u8 {
        match self {
            Message::Announce { .. } => T_ANNOUNCE,
            Message::Started { .. } => T_STARTED,
            Message::PrefillDone { .. } => T_PREFILL_DONE,
            Message::Queued { .. } => T_QUEUED,
            Message::BlockIds { .. } => T_BLOCK_IDS,
            Message::LayerSent { .. } => T_LAYER_SENT,
            Message::AllSent { .. } => T_ALL_SENT,
            Message::Abort { .. } => T_ABORT,
            Message::Heartbeat { .. } => T_HEARTBEAT,
        }
    }

    /// Appends the encoded frame to `out`.
    ///
    /// Fails (writing nothing) when the message exceeds the codec's limits.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        match self {
            Message::BlockIds { blocks, .. } if blocks.len() > MAX_BLOCKS => {
                return Err(EncodeError::TooManyBlocks {
                    count: blocks.len(),
                    max: MAX_BLOCKS,
                })
            }
            Message::Started { layers, .. } | Message::AllSent { layers, .. }
                if *layers > MAX_LAYERS =>
            {
                return Err(EncodeError::TooManyLayers {
                    count: *layers,
                    max: MAX_LAYERS,
                })
            }
            Message::LayerSent { layer, .. } if *layer >= MAX_LAYERS => {
                return Err(EncodeError::TooManyLayers {
                    count: *layer,
                    max: MAX_LAYERS,
                })
            }
            _ => {}
        }
        let start = out.len();
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.kind());
        out.extend_from_slice(&[0; 4]);
        match self {
            Message::Announce {
                req,
                tokens,
                blocks,
            } => {
                put_u64(out, req.0);
                put_u32(out, *tokens);
                put_u32(out, *blocks);
            }
            Message::Started {
                req,
                layers,
                blocks,
            } => {
                put_u64(out, req.0);
                put_u16(out, *layers);
                put_u32(out, *blocks);
            }
            Message::PrefillDone { req } | Message::Queued { req } => put_u64(out, req.0),
            Message::BlockIds {
                req,
                first,
                landing,
                blocks,
            } => {
                put_u64(out, req.0);
                put_u32(out, *first);
                out.push(u8::from(*landing));
                // Length checked above against MAX_BLOCKS, which fits in u32.
                put_u32(out, blocks.len() as u32);
                for b in blocks {
                    put_u32(out, *b);
                }
            }
            Message::LayerSent { req, layer, bytes } => {
                put_u64(out, req.0);
                put_u16(out, *layer);
                put_u64(out, *bytes);
            }
            Message::AllSent { req, layers, bytes } => {
                put_u64(out, req.0);
                put_u16(out, *layers);
                put_u64(out, *bytes);
            }
            Message::Abort { req, reason } => {
                put_u64(out, req.0);
                out.push(reason.code());
            }
            Message::Heartbeat { incarnation, seq } => {
                put_u64(out, *incarnation);
                put_u64(out, *seq);
            }
        }
        let body_len = (out.len() - start - HEADER_LEN) as u32;
        out[start + 4..start + 8].copy_from_slice(&body_len.to_le_bytes());
        Ok(())
    }

    /// The encoded frame as a new buffer.
    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        self.encode_into(&mut out)?;
        Ok(out)
    }

    /// Decodes the frame at the start of `buf`; returns the message and the bytes consumed.
    ///
    /// For a stream: on [`DecodeError::Truncated`], wait for `needed` bytes and call again.
    pub fn decode_prefix(buf: &[u8]) -> Result<(Message, usize), DecodeError> {
        if buf.len() < HEADER_LEN {
            return Err(DecodeError::Truncated {
                needed: HEADER_LEN,
                have: buf.len(),
            });
        }
        if buf[0..2] != MAGIC {
            return Err(DecodeError::BadMagic([buf[0], buf[1]]));
        }
        if buf[2] != VERSION {
            return Err(DecodeError::UnsupportedVersion(buf[2]));
        }
        let kind = buf[3];
        let body_len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
        if body_len > MAX_BODY_LEN {
            return Err(DecodeError::BodyTooLong {
                len: body_len,
                max: MAX_BODY_LEN,
            });
        }
        let total = HEADER_LEN + body_len;
        if buf.len() < total {
            return Err(DecodeError::Truncated {
                needed: total,
                have: buf.len(),
            });
        }
        let mut r = Reader {
            body: &buf[HEADER_LEN..total],
            pos: 0,
            kind,
        };
        let fixed = |len: usize| -> Result<(), DecodeError> {
            if body_len != len {
                Err(DecodeError::BadBodyLength {
                    kind,
                    len: body_len,
                })
            } else {
                Ok(())
            }
        };
        let msg = match kind {
            T_ANNOUNCE => {
                fixed(16)?;
                Message::Announce {
                    req: RequestId(r.u64()?),
                    tokens: r.u32()?,
                    blocks: r.u32()?,
                }
            }
            T_STARTED => {
                fixed(14)?;
                let req = RequestId(r.u64()?);
                let layers = r.layers()?;
                Message::Started {
                    req,
                    layers,
                    blocks: r.u32()?,
                }
            }
            T_PREFILL_DONE => {
                fixed(8)?;
                Message::PrefillDone {
                    req: RequestId(r.u64()?),
                }
            }
            T_QUEUED => {
                fixed(8)?;
                Message::Queued {
                    req: RequestId(r.u64()?),
                }
            }
            T_BLOCK_IDS => {
                if body_len < BLOCK_IDS_HEAD {
                    return Err(DecodeError::BadBodyLength {
                        kind,
                        len: body_len,
                    });
                }
                let req = RequestId(r.u64()?);
                let first = r.u32()?;
                let landing = match r.u8()? {
                    0 => false,
                    1 => true,
                    v => return Err(DecodeError::BadFlag(v)),
                };
                let count = r.u32()? as usize;
                if count > MAX_BLOCKS {
                    return Err(DecodeError::TooManyBlocks {
                        count,
                        max: MAX_BLOCKS,
                    });
                }
                if body_len != BLOCK_IDS_HEAD + 4 * count {
                    return Err(DecodeError::CountMismatch { count, body_len });
                }
                let mut blocks = Vec::with_capacity(count);
                for _ in 0..count {
                    blocks.push(r.u32()?);
                }
                Message::BlockIds {
                    req,
                    first,
                    landing,
                    blocks,
                }
            }
            T_LAYER_SENT => {
                fixed(18)?;
                let req = RequestId(r.u64()?);
                let layer = r.u16()?;
                if layer >= MAX_LAYERS {
                    return Err(DecodeError::TooManyLayers {
                        count: layer,
                        max: MAX_LAYERS,
                    });
                }
                Message::LayerSent {
                    req,
                    layer,
                    bytes: r.u64()?,
                }
            }
            T_ALL_SENT => {
                fixed(18)?;
                let req = RequestId(r.u64()?);
                let layers = r.layers()?;
                Message::AllSent {
                    req,
                    layers,
                    bytes: r.u64()?,
                }
            }
            T_ABORT => {
                fixed(9)?;
                let req = RequestId(r.u64()?);
                let code = r.u8()?;
                let reason = FailReason::from_code(code).ok_or(DecodeError::UnknownReason(code))?;
                Message::Abort { req, reason }
            }
            T_HEARTBEAT => {
                fixed(16)?;
                Message::Heartbeat {
                    incarnation: r.u64()?,
                    seq: r.u64()?,
                }
            }
            other => return Err(DecodeError::UnknownType(other)),
        };
        Ok((msg, total))
    }

    /// Decodes exactly one frame occupying all of `buf`.
    pub fn decode(buf: &[u8]) -> Result<Message, DecodeError> {
        let (msg, used) = Self::decode_prefix(buf)?;
        if used != buf.len() {
            return Err(DecodeError::TrailingBytes {
                extra: buf.len() - used,
            });
        }
        Ok(msg)
    }
}

/// Why a message could not be encoded.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum EncodeError {
    /// More block ids than [`MAX_BLOCKS`].
    #[error("{count} block ids exceed the limit of {max}")]
    TooManyBlocks {
        /// Block ids in the message.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A layer count or index at or above [`MAX_LAYERS`].
    #[error("layer count/index {count} exceeds the limit of {max}")]
    TooManyLayers {
        /// The offending count or index.
        count: u16,
        /// The limit.
        max: u16,
    },
}

/// Why bytes could not be decoded into a [`Message`].
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DecodeError {
    /// Fewer bytes than the frame needs.
    #[error("truncated frame: need {needed} bytes, have {have}")]
    Truncated {
        /// Bytes the frame needs in all.
        needed: usize,
        /// Bytes available.
        have: usize,
    },
    /// The frame does not start with [`MAGIC`].
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 2]),
    /// A version this crate does not speak.
    #[error("unsupported codec version {0}")]
    UnsupportedVersion(u8),
    /// An unknown message type.
    #[error("unknown message type {0}")]
    UnknownType(u8),
    /// The header announces a body longer than any valid frame.
    #[error("body length {len} exceeds the limit of {max}")]
    BodyTooLong {
        /// Announced body length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The body length does not fit the message type.
    #[error("body length {len} is wrong for message type {kind}")]
    BadBodyLength {
        /// Message type.
        kind: u8,
        /// Announced body length.
        len: usize,
    },
    /// A block count above [`MAX_BLOCKS`].
    #[error("{count} block ids exceed the limit of {max}")]
    TooManyBlocks {
        /// Announced count.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// The block count disagrees with the body length.
    #[error("block count {count} disagrees with body length {body_len}")]
    CountMismatch {
        /// Announced count.
        count: usize,
        /// Announced body length.
        body_len: usize,
    },
    /// A layer count or index at or above [`MAX_LAYERS`].
    #[error("layer count/index {count} exceeds the limit of {max}")]
    TooManyLayers {
        /// The offending count or index.
        count: u16,
        /// The limit.
        max: u16,
    },
    /// An unknown abort reason code.
    #[error("unknown abort reason {0}")]
    UnknownReason(u8),
    /// A flag byte that is neither 0 nor 1.
    #[error("bad flag byte {0}")]
    BadFlag(u8),
    /// Bytes left after the frame where exactly one frame was expected.
    #[error("{extra} bytes after the frame")]
    TrailingBytes {
        /// Bytes left over.
        extra: usize,
    },
}

struct Reader<'a> {
    body: &'a [u8],
    pos: usize,
    kind: u8,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let end = self.pos + N;
        let slice = self
            .body
            .get(self.pos..end)
            .ok_or(DecodeError::BadBodyLength {
                kind: self.kind,
                len: self.body.len(),
            })?;
        let mut out = [0u8; N];
        out.copy_from_slice(slice);
        self.pos = end;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn layers(&mut self) -> Result<u16, DecodeError> {
        let n = self.u16()?;
        if n > MAX_LAYERS {
            return Err(DecodeError::TooManyLayers {
                count: n,
                max: MAX_LAYERS,
            });
        }
        Ok(n)
    }
}

fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

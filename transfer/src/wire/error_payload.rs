//! Errors on the wire: the payload of `Error` frames and `Reject` messages.

use super::problem::ProtocolError;
use super::rw::{Reader, Writer};
use crate::error::Error;
use crate::types::RegionId;

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
        _ => ProtocolError::PeerReported { msg }.into(),
    })
}

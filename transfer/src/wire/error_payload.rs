//! Errors on the wire: the payload of `Error` frames and `Reject` messages.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use super::problem::ProtocolError;
use super::rw::{Reader, Writer};
use crate::error::Error;
use crate::limits::Resource;
use crate::types::RegionId;

const NO_REGION: RegionId = RegionId {
    index: 0,
    generation: 0,
};

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
        // The resource's code in `offset`, its bound in `len`.
        Error::ResourceLimit { resource, limit } => {
            (11, NO_REGION, u64::from(resource.code()), *limit, 0)
        }
        // The address as an IPv6 (IPv4-mapped for v4) in `offset` (high) and `len` (low), the
        // port in `region_len`.
        Error::Fenced { addr } => {
            let ip = match addr.ip() {
                IpAddr::V4(a) => a.to_ipv6_mapped(),
                IpAddr::V6(a) => a,
            };
            let b = u128::from(ip);
            (
                12,
                NO_REGION,
                (b >> 64) as u64,
                b as u64,
                u64::from(addr.port()),
            )
        }
        _ => (10, NO_REGION, 0, 0, 0),
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
        11 => match u8::try_from(offset).ok().and_then(Resource::from_code) {
            Some(resource) => Error::ResourceLimit {
                resource,
                limit: len,
            },
            None => ProtocolError::PeerReported { msg }.into(),
        },
        12 => {
            let v6 = Ipv6Addr::from((u128::from(offset) << 64) | u128::from(len));
            let ip = match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(v6),
            };
            Error::Fenced {
                addr: SocketAddr::new(ip, region_len as u16),
            }
        }
        _ => ProtocolError::PeerReported { msg }.into(),
    })
}

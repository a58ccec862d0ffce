//! The engine's error type.

use std::net::SocketAddr;

use crate::limits::Resource;
use crate::types::RegionId;
use crate::wire::problem::ProtocolError;

/// Everything that can go wrong in the engine, typed so callers can react.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system I/O error (socket, mmap, memfd...).
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent something that does not follow the wire protocol.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    /// The two engines speak different protocol versions.
    #[error("protocol version mismatch: ours {ours}, theirs {theirs}")]
    VersionMismatch {
        /// Our protocol version.
        ours: u16,
        /// The peer's protocol version.
        theirs: u16,
    },
    /// The shared-secret challenge/response failed (wrong or missing secret, on either side).
    #[error("authentication failed (wrong or missing shared secret)")]
    AuthFailed,
    /// An access outside the region's bounds.
    #[error("out of bounds: region {region:?} offset {offset} len {len} exceeds region length {region_len}")]
    OutOfBounds {
        /// The region addressed.
        region: RegionId,
        /// Offset requested.
        offset: u64,
        /// Length requested.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// No region with that index exists (never registered, or not offered to this peer).
    #[error("unknown region {0:?}")]
    UnknownRegion(RegionId),
    /// The region index exists but the generation does not match (it was unregistered).
    #[error("stale region {0:?} (unregistered)")]
    StaleRegion(RegionId),
    /// The region does not allow this kind of remote access.
    #[error("access denied to region {0:?}")]
    AccessDenied(RegionId),
    /// The peer died or its connection broke.
    #[error("peer dead: {0}")]
    PeerDead(String),
    /// A deadline passed.
    #[error("timed out")]
    Timeout,
    /// The engine was shut down.
    #[error("engine shut down")]
    Shutdown,
    /// The caller passed an invalid argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The requested feature is not available here (e.g. shm to another host).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A bound of [`crate::Limits`] was reached (on this engine or, in a `Reject` or an error
    /// frame, on the peer's): too many handshakes, peers, lanes, pending notification bytes...
    #[error("resource limit: {resource} (limit {limit})")]
    ResourceLimit {
        /// What ran out.
        resource: Resource,
        /// The bound (0 when the peer did not say).
        limit: u64,
    },
    /// The peer engine listening at `addr` is fenced ([`crate::Engine::fence`]): its
    /// connections were closed and its handshakes and lane joins are refused.
    #[error("peer {addr} is fenced")]
    Fenced {
        /// The peer's listen address.
        addr: SocketAddr,
    },
}

// Typing protocol errors did not make every `Result` carrying an `Error` larger.
const _: () = assert!(std::mem::size_of::<Error>() <= 40);

impl Error {
    /// A copy of this error, for fanning one failure out to several waiters.
    /// (`std::io::Error` is not `Clone`; its kind and message are kept.)
    pub fn duplicate(&self) -> Error {
        match self {
            Error::Io(e) => Error::Io(std::io::Error::new(e.kind(), e.to_string())),
            Error::Protocol(p) => Error::Protocol(p.clone()),
            Error::VersionMismatch { ours, theirs } => Error::VersionMismatch {
                ours: *ours,
                theirs: *theirs,
            },
            Error::AuthFailed => Error::AuthFailed,
            Error::OutOfBounds {
                region,
                offset,
                len,
                region_len,
            } => Error::OutOfBounds {
                region: *region,
                offset: *offset,
                len: *len,
                region_len: *region_len,
            },
            Error::UnknownRegion(r) => Error::UnknownRegion(*r),
            Error::StaleRegion(r) => Error::StaleRegion(*r),
            Error::AccessDenied(r) => Error::AccessDenied(*r),
            Error::PeerDead(s) => Error::PeerDead(s.clone()),
            Error::Timeout => Error::Timeout,
            Error::Shutdown => Error::Shutdown,
            Error::InvalidArgument(s) => Error::InvalidArgument(s.clone()),
            Error::Unsupported(s) => Error::Unsupported(s.clone()),
            Error::ResourceLimit { resource, limit } => Error::ResourceLimit {
                resource: *resource,
                limit: *limit,
            },
            Error::Fenced { addr } => Error::Fenced { addr: *addr },
        }
    }
}

impl From<nix::Error> for Error {
    fn from(e: nix::Error) -> Self {
        Error::Io(std::io::Error::from(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_errors_keep_their_prefix_and_copy() {
        let e = Error::from(ProtocolError::DuplicateNotify { batch: 3 });
        assert_eq!(
            e.to_string(),
            "protocol error: second notification for batch 3"
        );
        assert!(matches!(
            e.duplicate(),
            Error::Protocol(ProtocolError::DuplicateNotify { batch: 3 })
        ));
    }
}

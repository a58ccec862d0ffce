//! Errors of the verbs layer: one enum for calls, one typed status for work completions.

use std::io;
use std::time::Duration;

/// Error of a verbs call (loading, opening, creating, posting, waiting).
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// libibverbs cannot be used on this machine: the library is missing, unloadable, or
    /// lacks a symbol kvwire needs. The caller falls back to another transport.
    #[error("libibverbs not available ({path}): {reason}")]
    NotAvailable {
        /// The path or soname that was tried.
        path: String,
        /// What went wrong (the dlopen/dlsym message).
        reason: String,
    },
    /// A libibverbs entry point that is optional (newer than the loaded library) is missing.
    #[error("libibverbs has no symbol {0}")]
    MissingSymbol(&'static str),
    /// A verbs call failed with an OS error (errno).
    #[error("{op} failed: {source}")]
    Os {
        /// The verbs call that failed.
        op: &'static str,
        /// The errno it reported.
        #[source]
        source: io::Error,
    },
    /// No RDMA device of that name.
    #[error("no RDMA device named {0:?}")]
    NoSuchDevice(String),
    /// The port is not in the ACTIVE state.
    #[error("{device} port {port} is not active (state {state})")]
    PortNotActive {
        /// Device name.
        device: String,
        /// Port number (1-based).
        port: u8,
        /// The raw `ibv_port_state`.
        state: u32,
    },
    /// No GID of the port can carry RoCE/IB traffic.
    #[error("{device} port {port} has no usable GID")]
    NoUsableGid {
        /// Device name.
        device: String,
        /// Port number (1-based).
        port: u8,
    },
    /// A local slice or a request falls outside the memory region it names.
    #[error("out of bounds: offset {offset} + len {len} exceeds {what} of {size} bytes")]
    OutOfBounds {
        /// What was being addressed.
        what: &'static str,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Size of the addressed object.
        size: u64,
    },
    /// A request has more scatter-gather entries than the queue pair was created with.
    #[error("{got} scatter-gather entries, the queue pair allows {max}")]
    TooManySge {
        /// Entries in the request.
        got: usize,
        /// The queue pair's limit.
        max: usize,
    },
    /// An argument that verbs would reject (zero length, bad size, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Posting a work request failed; `index` is the first rejected request of the batch.
    #[error("posting {op} failed at request {index}: {source}")]
    PostFailed {
        /// `post_send` or `post_recv`.
        op: &'static str,
        /// Index of the first request the provider rejected.
        index: usize,
        /// The errno the provider returned.
        #[source]
        source: io::Error,
    },
    /// Waiting for completions reached its deadline.
    #[error("no completion within {0:?}")]
    Timeout(Duration),
    /// A peer endpoint description could not be decoded.
    #[error("malformed endpoint: {0}")]
    MalformedEndpoint(&'static str),
}

impl VerbsError {
    /// `Os` error from the current `errno`.
    pub(crate) fn last_os(op: &'static str) -> Self {
        VerbsError::Os {
            op,
            source: io::Error::last_os_error(),
        }
    }

    /// `Os` error from an errno value returned directly (as the post/modify verbs do).
    pub(crate) fn from_errno(op: &'static str, rc: i32) -> Self {
        VerbsError::Os {
            op,
            source: io::Error::from_raw_os_error(rc.abs()),
        }
    }
}

/// Status of a failed work completion (`enum ibv_wc_status` without `IBV_WC_SUCCESS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// Local length error: a message larger than the posted receive buffer, or a bad SGE.
    LocalLength,
    /// Local QP operation error (internal consistency error of the QP).
    LocalQpOperation,
    /// Local EE context operation error.
    LocalEecOperation,
    /// Local protection error: an SGE's lkey/address does not match a local MR.
    LocalProtection,
    /// The request was flushed because the QP entered the error state.
    WrFlush,
    /// Memory window bind error.
    MwBind,
    /// Unexpected transport opcode from the responder.
    BadResponse,
    /// Local access error (e.g. protection error on an incoming RDMA WRITE with immediate).
    LocalAccess,
    /// Remote invalid request: the responder rejected the request (e.g. too long).
    RemoteInvalidRequest,
    /// Remote access error: bad rkey, out-of-bounds remote address, or missing access right.
    RemoteAccess,
    /// Remote operation error: the responder could not complete the operation.
    RemoteOperation,
    /// Transport retry counter exceeded: the peer did not answer (dead or unreachable).
    RetryExceeded,
    /// RNR retry counter exceeded: the peer had no receive posted.
    RnrRetryExceeded,
    /// Local RDD violation.
    LocalRddViolation,
    /// Remote invalid RD request.
    RemoteInvalidRdRequest,
    /// Remote aborted.
    RemoteAbort,
    /// Invalid EE context number.
    InvalidEecn,
    /// Invalid EE context state.
    InvalidEecState,
    /// Fatal error of the device.
    Fatal,
    /// Response timeout.
    ResponseTimeout,
    /// Any other error the provider reports as general.
    General,
    /// A status value this version does not know.
    Unknown(u32),
}

impl WcStatus {
    /// Maps a raw non-success `ibv_wc_status`.
    pub(crate) fn from_raw(raw: u32) -> WcStatus {
        use super::sys::*;
        match raw {
            IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
            IBV_WC_LOC_QP_OP_ERR => WcStatus::LocalQpOperation,
            IBV_WC_LOC_EEC_OP_ERR => WcStatus::LocalEecOperation,
            IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtection,
            IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlush,
            IBV_WC_MW_BIND_ERR => WcStatus::MwBind,
            IBV_WC_BAD_RESP_ERR => WcStatus::BadResponse,
            IBV_WC_LOC_ACCESS_ERR => WcStatus::LocalAccess,
            IBV_WC_REM_INV_REQ_ERR => WcStatus::RemoteInvalidRequest,
            IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
            IBV_WC_REM_OP_ERR => WcStatus::RemoteOperation,
            IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
            IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
            IBV_WC_LOC_RDD_VIOL_ERR => WcStatus::LocalRddViolation,
            IBV_WC_REM_INV_RD_REQ_ERR => WcStatus::RemoteInvalidRdRequest,
            IBV_WC_REM_ABORT_ERR => WcStatus::RemoteAbort,
            IBV_WC_INV_EECN_ERR => WcStatus::InvalidEecn,
            IBV_WC_INV_EEC_STATE_ERR => WcStatus::InvalidEecState,
            IBV_WC_FATAL_ERR => WcStatus::Fatal,
            IBV_WC_RESP_TIMEOUT_ERR => WcStatus::ResponseTimeout,
            IBV_WC_GENERAL_ERR => WcStatus::General,
            other => WcStatus::Unknown(other),
        }
    }

    /// True when the peer (not this side) caused the failure: the transfer's target is bad or
    /// gone. Useful to tell "your request was wrong" from "the network/peer died".
    pub fn is_remote(&self) -> bool {
        matches!(
            self,
            WcStatus::RemoteAccess
                | WcStatus::RemoteInvalidRequest
                | WcStatus::RemoteOperation
                | WcStatus::RemoteAbort
                | WcStatus::RemoteInvalidRdRequest
        )
    }
}

/// A work request that completed with an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("work request {wr_id} on QP {qp_num} failed: {status:?} (vendor error {vendor_err:#x})")]
pub struct WcError {
    /// The typed status.
    pub status: WcStatus,
    /// The provider's vendor error code (diagnostic only).
    pub vendor_err: u32,
    /// The `wr_id` of the failed request.
    pub wr_id: u64,
    /// The local QP number.
    pub qp_num: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_status_maps_to_a_distinct_variant() {
        let mut seen = std::collections::HashSet::new();
        for raw in 1..=21u32 {
            let s = WcStatus::from_raw(raw);
            assert!(!matches!(s, WcStatus::Unknown(_)), "status {raw} unmapped");
            assert!(seen.insert(s), "status {raw} maps to a duplicate {s:?}");
        }
        assert_eq!(WcStatus::from_raw(10), WcStatus::RemoteAccess);
        assert_eq!(WcStatus::from_raw(5), WcStatus::WrFlush);
        assert_eq!(WcStatus::from_raw(999), WcStatus::Unknown(999));
        assert!(WcStatus::RemoteAccess.is_remote());
        assert!(!WcStatus::RetryExceeded.is_remote());
    }
}

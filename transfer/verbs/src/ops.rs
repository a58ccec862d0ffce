//! The static-inline verbs of `<infiniband/verbs.h>`, by hand.
//!
//! They are not exported by libibverbs.so; the header implements each as one indirect call
//! through the provider's ops table hanging off the context, e.g.
//! `return qp->context->ops.post_send(qp, wr, bad_wr);`. These functions do the same.
//! Missing ops (NULL function pointers) become `EOPNOTSUPP` instead of a NULL call.

use std::os::raw::c_int;

use crate::sys;

const EOPNOTSUPP: c_int = libc::EOPNOTSUPP;

/// `ibv_post_send`: returns 0 or an errno; `bad_wr` names the first rejected request.
///
/// # Safety
/// `qp` must be a live QP; `wr` a valid NULL-terminated chain whose SGE arrays stay valid
/// for the duration of the call.
pub(crate) unsafe fn post_send(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_send_wr,
    bad_wr: *mut *mut sys::ibv_send_wr,
) -> c_int {
    // SAFETY: per the function contract `qp` is live, so `qp->context` points to its open
    // device context, whose `ops` table the provider filled at open time.
    unsafe {
        let ctx = (*qp).context;
        match (*ctx).ops.post_send {
            Some(f) => f(qp, wr, bad_wr),
            None => EOPNOTSUPP,
        }
    }
}

/// `ibv_post_recv`: returns 0 or an errno.
///
/// # Safety
/// As [`post_send`], for receive requests.
pub(crate) unsafe fn post_recv(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_recv_wr,
    bad_wr: *mut *mut sys::ibv_recv_wr,
) -> c_int {
    // SAFETY: `qp` is live (contract), so its context and ops table are valid.
    unsafe {
        let ctx = (*qp).context;
        match (*ctx).ops.post_recv {
            Some(f) => f(qp, wr, bad_wr),
            None => EOPNOTSUPP,
        }
    }
}

/// `ibv_poll_cq`: returns the number of completions written to `wc` (≥ 0) or a negative value
/// on error.
///
/// # Safety
/// `cq` must be a live CQ and `wc` must point to `num_entries` writable `ibv_wc`s.
pub(crate) unsafe fn poll_cq(
    cq: *mut sys::ibv_cq,
    num_entries: c_int,
    wc: *mut sys::ibv_wc,
) -> c_int {
    // SAFETY: `cq` is live (contract), so `cq->context` and its ops table are valid.
    unsafe {
        let ctx = (*cq).context;
        match (*ctx).ops.poll_cq {
            Some(f) => f(cq, num_entries, wc),
            None => -EOPNOTSUPP,
        }
    }
}

/// `ibv_req_notify_cq`: arm the CQ so the next completion raises an event on its channel.
///
/// # Safety
/// `cq` must be a live CQ.
pub(crate) unsafe fn req_notify_cq(cq: *mut sys::ibv_cq, solicited_only: bool) -> c_int {
    // SAFETY: `cq` is live (contract), so `cq->context` and its ops table are valid.
    unsafe {
        let ctx = (*cq).context;
        match (*ctx).ops.req_notify_cq {
            Some(f) => f(cq, c_int::from(solicited_only)),
            None => EOPNOTSUPP,
        }
    }
}

//! Queue pairs: creation, the state machine, receives.

use std::collections::VecDeque;
use std::os::raw::{c_int, c_uint};
use std::sync::atomic::Ordering;

use kvwire_verbs::sys;

use crate::state::{post_chain, push_wc, set_errno, state, to_error, wc, Qp, State, NEXT_QPN};
use crate::MAX_SGE;

/// # Safety
/// `pd` is live; `init` readable and writable; its CQs live.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(
    pd: *mut sys::ibv_pd,
    init: *mut sys::ibv_qp_init_attr,
) -> *mut sys::ibv_qp {
    if pd.is_null() || init.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: readable per the contract.
    let a = unsafe { &mut *init };
    if a.qp_type != sys::IBV_QPT_RC || a.send_cq.is_null() || a.recv_cq.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    a.cap.max_send_sge = a.cap.max_send_sge.clamp(1, MAX_SGE as u32);
    a.cap.max_recv_sge = a.cap.max_recv_sge.clamp(1, MAX_SGE as u32);
    a.cap.max_inline_data = 0;
    let qpn = NEXT_QPN.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
    // SAFETY: `ibv_qp` is plain data; the zeroed mutex and cond are never used here.
    let mut qp: sys::ibv_qp = unsafe { std::mem::zeroed() };
    // SAFETY: `pd` is live (contract).
    qp.context = unsafe { (*pd).context };
    qp.qp_context = a.qp_context;
    qp.pd = pd;
    qp.send_cq = a.send_cq;
    qp.recv_cq = a.recv_cq;
    qp.handle = qpn;
    qp.qp_num = qpn;
    qp.state = sys::IBV_QPS_RESET;
    qp.qp_type = sys::IBV_QPT_RC;
    state().qps.insert(
        qpn,
        Qp {
            state: sys::IBV_QPS_RESET,
            dest: None,
            send_cq: a.send_cq as usize,
            recv_cq: a.recv_cq as usize,
            sig_all: a.sq_sig_all != 0,
            max_send_sge: a.cap.max_send_sge as usize,
            recvs: VecDeque::new(),
        },
    );
    Box::into_raw(Box::new(qp))
}

/// # Safety
/// `qp` is live; `attr` readable.
#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(
    qp: *mut sys::ibv_qp,
    attr: *mut sys::ibv_qp_attr,
    mask: c_int,
) -> c_int {
    if qp.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: live and readable per the contract.
    let (qpn, a) = unsafe { ((*qp).qp_num, &*attr) };
    let mask = mask as c_uint;
    let mut s = state();
    let Some(q) = s.qps.get_mut(&qpn) else {
        return libc::EINVAL;
    };
    if mask & sys::IBV_QP_DEST_QPN != 0 {
        q.dest = Some(a.dest_qp_num);
    }
    if mask & sys::IBV_QP_STATE != 0 {
        let to = a.qp_state;
        let ok = matches!(
            (q.state, to),
            (_, sys::IBV_QPS_RESET)
                | (_, sys::IBV_QPS_ERR)
                | (sys::IBV_QPS_RESET, sys::IBV_QPS_INIT)
                | (sys::IBV_QPS_INIT, sys::IBV_QPS_INIT)
                | (sys::IBV_QPS_INIT, sys::IBV_QPS_RTR)
                | (sys::IBV_QPS_RTR, sys::IBV_QPS_RTS)
                | (sys::IBV_QPS_RTS, sys::IBV_QPS_RTS)
        );
        if !ok {
            return libc::EINVAL;
        }
        if to == sys::IBV_QPS_RTR && q.dest.is_none() {
            return libc::EINVAL;
        }
        if to == sys::IBV_QPS_ERR {
            to_error(&mut s, qpn);
        } else {
            q.state = to;
            if to == sys::IBV_QPS_RESET {
                q.recvs.clear();
                q.dest = None;
            }
        }
    }
    let st = s.qps.get(&qpn).map_or(sys::IBV_QPS_ERR, |q| q.state);
    // SAFETY: `qp` is live; the state field is ours to keep current.
    unsafe { (*qp).state = st };
    0
}

/// # Safety
/// `qp` came from [`ibv_create_qp`], destroyed once.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut sys::ibv_qp) -> c_int {
    if qp.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: allocated as a Box by `ibv_create_qp`, freed once.
    let qp = unsafe { Box::from_raw(qp) };
    let mut s = state();
    s.qps.remove(&qp.qp_num);
    s.pending.retain(|w| w.qpn != qp.qp_num);
    0
}

pub(crate) unsafe extern "C" fn post_recv(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_recv_wr,
    bad: *mut *mut sys::ibv_recv_wr,
) -> c_int {
    // SAFETY: `qp` is live (the caller's `ibv_post_recv` contract).
    let qpn = unsafe { (*qp).qp_num };
    let each = |s: &mut State, r: &sys::ibv_recv_wr| {
        let q = s.qps.get_mut(&qpn).ok_or(libc::EINVAL)?;
        match q.state {
            sys::IBV_QPS_RESET => return Err(libc::EINVAL),
            sys::IBV_QPS_ERR => {
                let cq = q.recv_cq;
                let x = wc(r.wr_id, qpn, sys::IBV_WC_WR_FLUSH_ERR, sys::IBV_WC_RECV, 0);
                push_wc(s, cq, x);
            }
            _ => q.recvs.push_back(r.wr_id),
        }
        Ok(())
    };
    // SAFETY: `wr` and `bad` as libibverbs' contract says (passed through).
    unsafe { post_chain(wr, bad, each) }
}

//! Send requests: checked against the tables when they execute, held in flight while a test
//! holds the device, completed; the copy, hold and counter controls.

use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::LazyLock;

use kvwire_verbs::sys;

use crate::state::{
    post_chain, push_wc, state, to_error, wc, wc_opcode, State, Wr, POLLED, POSTED,
};
use crate::NOCOPY_ENV;

/// Whether requests move no byte (checked all the same): from `KVWIRE_LOOPBACK_NOCOPY` at
/// load, then [`kvwire_loopback_copy`].
pub(crate) static NOCOPY: LazyLock<AtomicBool> =
    LazyLock::new(|| AtomicBool::new(std::env::var(NOCOPY_ENV).is_ok_and(|v| v == "1")));

pub(crate) fn nocopy() -> bool {
    NOCOPY.load(Ordering::Relaxed)
}

/// Moves bytes (`on` ≠ 0) or only checks requests (`on` = 0) from now on: a bench measures
/// the posting path without the copy's cost after it verified the bytes with it.
#[no_mangle]
pub extern "C" fn kvwire_loopback_copy(on: c_int) {
    NOCOPY.store(on == 0, Ordering::Relaxed);
}

/// Work requests posted (`ibv_post_send`) and completions handed out (`poll_cq`) so far, for
/// callers that load this library themselves.
///
/// # Safety
/// Each pointer is NULL or points to a writable `u64`.
#[no_mangle]
pub unsafe extern "C" fn kvwire_loopback_counters(posted: *mut u64, polled: *mut u64) {
    if !posted.is_null() {
        // SAFETY: the caller passes a writable u64 or NULL (checked).
        unsafe { *posted = POSTED.load(Ordering::Relaxed) };
    }
    if !polled.is_null() {
        // SAFETY: as above.
        unsafe { *polled = POLLED.load(Ordering::Relaxed) };
    }
}

/// What one work request found: the bytes to move, or the status it completes with (and
/// whether the responder's queue pair fails too).
pub(crate) enum Checked {
    Move {
        local: Vec<(u64, u64)>,
        len: u64,
        dest: u32,
    },
    Fail(sys::ibv_wc_status, bool),
}

/// Checks request `w` against the tables as they are now (`s` locked), as a NIC checks a
/// request when it executes it.
pub(crate) fn check(s: &State, w: &Wr) -> Checked {
    let Some(q) = s.qps.get(&w.qpn) else {
        return Checked::Fail(sys::IBV_WC_WR_FLUSH_ERR, false);
    };
    if q.state == sys::IBV_QPS_ERR {
        return Checked::Fail(sys::IBV_WC_WR_FLUSH_ERR, false);
    }
    let mut local = Vec::with_capacity(w.sges.len());
    let mut len = 0u64;
    for &(addr, n, lkey) in &w.sges {
        let ok = s
            .mrs
            .get(&lkey)
            .is_some_and(|m| m.contains(addr, u64::from(n)));
        if !ok {
            return Checked::Fail(sys::IBV_WC_LOC_PROT_ERR, false);
        }
        local.push((addr, u64::from(n)));
        len += u64::from(n);
    }
    let Some(dest) = q.dest.filter(|d| {
        s.qps
            .get(d)
            .is_some_and(|r| matches!(r.state, sys::IBV_QPS_RTR | sys::IBV_QPS_RTS))
    }) else {
        return Checked::Fail(sys::IBV_WC_RETRY_EXC_ERR, false);
    };
    let need = if w.opcode == sys::IBV_WR_RDMA_READ {
        sys::IBV_ACCESS_REMOTE_READ
    } else {
        sys::IBV_ACCESS_REMOTE_WRITE
    };
    let ok = s
        .mrs
        .get(&w.rkey)
        .is_some_and(|m| m.access & need != 0 && (len == 0 || m.contains(w.raddr, len)));
    if !ok {
        return Checked::Fail(sys::IBV_WC_REM_ACCESS_ERR, true);
    }
    Checked::Move { local, len, dest }
}

/// Copies between the local scatter list and the remote range (`read`: remote → local).
///
/// # Safety
/// Every range was checked against a registered region, whose memory its registrant keeps
/// mapped while it is registered (the `ibv_reg_mr` contract).
pub(crate) unsafe fn copy(local: &[(u64, u64)], remote: u64, read: bool) {
    let mut at = remote;
    for &(a, n) in local {
        let (src, dst) = if read { (at, a) } else { (a, at) };
        // SAFETY: both ranges lie in registered regions (function contract); they may
        // overlap (one process), so a memmove.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n as usize) };
        at += n;
    }
}

/// Executes request `w` (`s` locked): moves its bytes or fails it, and completes it.
pub(crate) fn execute(s: &mut State, w: Wr) {
    let Some(send_cq) = s.qps.get(&w.qpn).map(|q| q.send_cq) else {
        return; // destroyed meanwhile
    };
    let op = wc_opcode(w.opcode);
    match check(s, &w) {
        Checked::Fail(status, remote) => {
            // The failing request reports first, then what its queue pair flushes.
            push_wc(s, send_cq, wc(w.wr_id, w.qpn, status, op, 0));
            if remote {
                if let Some(d) = s.qps.get(&w.qpn).and_then(|q| q.dest) {
                    to_error(s, d);
                }
            }
            to_error(s, w.qpn);
        }
        Checked::Move { local, len, dest } => {
            if w.opcode == sys::IBV_WR_RDMA_WRITE_WITH_IMM {
                let Some(rid) = s.qps.get_mut(&dest).and_then(|d| d.recvs.pop_front()) else {
                    let x = wc(w.wr_id, w.qpn, sys::IBV_WC_RNR_RETRY_EXC_ERR, op, 0);
                    push_wc(s, send_cq, x);
                    to_error(s, w.qpn);
                    return;
                };
                if !nocopy() {
                    // SAFETY: ranges checked against registered regions by `check`.
                    unsafe { copy(&local, w.raddr, false) };
                }
                let rcq = s.qps.get(&dest).map_or(0, |d| d.recv_cq);
                let mut x = wc(
                    rid,
                    dest,
                    sys::IBV_WC_SUCCESS,
                    sys::IBV_WC_RECV_RDMA_WITH_IMM,
                    len,
                );
                x.__bindgen_anon_1.imm_data = w.imm;
                x.wc_flags = sys::IBV_WC_WITH_IMM;
                push_wc(s, rcq, x);
            } else if !nocopy() {
                // SAFETY: ranges checked against registered regions by `check`.
                unsafe { copy(&local, w.raddr, w.opcode == sys::IBV_WR_RDMA_READ) };
            }
            if w.signalled {
                push_wc(s, send_cq, wc(w.wr_id, w.qpn, sys::IBV_WC_SUCCESS, op, len));
            }
        }
    }
}

/// Holds (`on` ≠ 0) or releases (`on` = 0) the device: while held, posted requests wait;
/// releasing executes them in posting order. For tests that order events around a request in
/// flight (a region withdrawn under it, a deadline it misses) without timing.
#[no_mangle]
pub extern "C" fn kvwire_loopback_hold(on: c_int) {
    let mut s = state();
    s.held = on != 0;
    if !s.held {
        while let Some(w) = s.pending.pop_front() {
            execute(&mut s, w);
        }
    }
}

pub(crate) unsafe extern "C" fn post_send(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_send_wr,
    bad: *mut *mut sys::ibv_send_wr,
) -> c_int {
    // SAFETY: `qp` is live (the caller's `ibv_post_send` contract).
    let qpn = unsafe { (*qp).qp_num };
    let each = |s: &mut State, r: &sys::ibv_send_wr| {
        let q = s.qps.get(&qpn).ok_or(libc::EINVAL)?;
        let n = r.num_sge.max(0) as usize;
        if !matches!(q.state, sys::IBV_QPS_RTS | sys::IBV_QPS_ERR)
            || !matches!(
                r.opcode,
                sys::IBV_WR_RDMA_WRITE | sys::IBV_WR_RDMA_WRITE_WITH_IMM | sys::IBV_WR_RDMA_READ
            )
            || n > q.max_send_sge
            || (n > 0 && r.sg_list.is_null())
        {
            return Err(libc::EINVAL);
        }
        let sges = (0..n)
            .map(|k| {
                // SAFETY: the entry names `num_sge` readable entries (checked non-NULL).
                let g = unsafe { *r.sg_list.add(k) };
                (g.addr, g.length, g.lkey)
            })
            .collect();
        // SAFETY: `rdma` is the member the RDMA opcodes use; `imm_data` is plain data.
        let (raddr, rkey, imm) = unsafe {
            (
                r.wr.rdma.remote_addr,
                r.wr.rdma.rkey,
                r.__bindgen_anon_1.imm_data,
            )
        };
        let req = Wr {
            qpn,
            wr_id: r.wr_id,
            opcode: r.opcode,
            sges,
            raddr,
            rkey,
            imm,
            signalled: q.sig_all || r.send_flags & sys::IBV_SEND_SIGNALED != 0,
        };
        POSTED.fetch_add(1, Ordering::Relaxed);
        if s.held {
            s.pending.push_back(req);
        } else {
            execute(s, req);
        }
        Ok(())
    };
    // SAFETY: `wr` and `bad` as libibverbs' contract says (passed through).
    unsafe { post_chain(wr, bad, each) }
}

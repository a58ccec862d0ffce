//! Completion channels and completion queues: events, arming, polling.

use std::collections::VecDeque;
use std::os::raw::{c_int, c_uint, c_void};
use std::sync::atomic::Ordering;

use kvwire_verbs::sys;

use crate::device::ctx_device;
use crate::state::{set_errno, state, Channel, Cq, POLLED};

/// # Safety
/// `ctx` is open.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(
    ctx: *mut sys::ibv_context,
) -> *mut sys::ibv_comp_channel {
    let mut fds = [0 as c_int; 2];
    // SAFETY: `fds` is two writable ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return std::ptr::null_mut();
    }
    let ch = Box::into_raw(Box::new(sys::ibv_comp_channel {
        context: ctx,
        fd: fds[0],
        refcnt: 0,
    }));
    state().channels.insert(
        ch as usize,
        Channel {
            write_fd: fds[1],
            events: VecDeque::new(),
        },
    );
    ch
}

/// # Safety
/// `ch` came from [`ibv_create_comp_channel`], destroyed once, after its queues.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut sys::ibv_comp_channel) -> c_int {
    if ch.is_null() {
        return libc::EINVAL;
    }
    if let Some(c) = state().channels.remove(&(ch as usize)) {
        // SAFETY: the write end is ours and closed once.
        unsafe { libc::close(c.write_fd) };
    }
    // SAFETY: allocated as a Box by `ibv_create_comp_channel`, freed once; its fd is ours.
    let ch = unsafe { Box::from_raw(ch) };
    // SAFETY: the read end is ours and closed once.
    unsafe { libc::close(ch.fd) };
    0
}

/// # Safety
/// `ctx` is open; `channel` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    ctx: *mut sys::ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut sys::ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut sys::ibv_cq {
    if ctx_device(ctx).is_none() || cqe <= 0 {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: `ibv_cq` is plain data; zeroed mutex and cond are never used by this library.
    let mut cq: sys::ibv_cq = unsafe { std::mem::zeroed() };
    cq.context = ctx;
    cq.channel = channel;
    cq.cq_context = cq_context;
    cq.cqe = cqe;
    let cq = Box::into_raw(Box::new(cq));
    state().cqs.insert(
        cq as usize,
        Cq {
            channel: channel as usize,
            ..Default::default()
        },
    );
    cq
}

/// # Safety
/// `cq` came from [`ibv_create_cq`], destroyed once, after its queue pairs.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut sys::ibv_cq) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    {
        let mut s = state();
        s.cqs.remove(&(cq as usize));
        for c in s.channels.values_mut() {
            c.events.retain(|&e| e != cq as usize);
        }
    }
    // SAFETY: allocated as a Box by `ibv_create_cq`, freed once.
    drop(unsafe { Box::from_raw(cq) });
    0
}

/// # Safety
/// `ch` is live; `cq` and `cq_context` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    ch: *mut sys::ibv_comp_channel,
    cq: *mut *mut sys::ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    let mut b = 0u8;
    // SAFETY: `ch` is live (contract); reading one byte into `b`.
    let n = unsafe { libc::read((*ch).fd, (&mut b as *mut u8).cast(), 1) };
    if n != 1 {
        return -1; // errno set by read (EAGAIN on a non-blocking channel)
    }
    let ev = state()
        .channels
        .get_mut(&(ch as usize))
        .and_then(|c| c.events.pop_front());
    let Some(ev) = ev else {
        set_errno(libc::EAGAIN);
        return -1;
    };
    let e = ev as *mut sys::ibv_cq;
    // SAFETY: writable per the contract; `e` is a live CQ (events of destroyed CQs are removed).
    unsafe {
        *cq = e;
        *cq_context = (*e).cq_context;
    }
    0
}

#[no_mangle]
pub extern "C" fn ibv_ack_cq_events(_cq: *mut sys::ibv_cq, _n: c_uint) {}

pub(crate) unsafe extern "C" fn poll_cq(
    cq: *mut sys::ibv_cq,
    n: c_int,
    wc: *mut sys::ibv_wc,
) -> c_int {
    let mut s = state();
    let Some(q) = s.cqs.get_mut(&(cq as usize)) else {
        return -libc::EINVAL;
    };
    let mut k = 0usize;
    while k < n.max(0) as usize {
        let Some(w) = q.wcs.pop_front() else { break };
        // SAFETY: the caller passes `n` writable completions.
        unsafe { *wc.add(k) = w };
        k += 1;
    }
    POLLED.fetch_add(k as u64, Ordering::Relaxed);
    k as c_int
}

pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut sys::ibv_cq, _solicited: c_int) -> c_int {
    match state().cqs.get_mut(&(cq as usize)) {
        Some(q) => {
            q.armed = true;
            0
        }
        None => libc::EINVAL,
    }
}

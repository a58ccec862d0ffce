//! Protection domains and memory regions (the keys every request is checked against).

use std::os::raw::{c_int, c_uint, c_void};
use std::sync::atomic::Ordering;

use kvwire_verbs::sys;

use crate::device::ctx_device;
use crate::state::{set_errno, state, Mr, NEXT_KEY};

/// # Safety
/// `ctx` is open.
#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(ctx: *mut sys::ibv_context) -> *mut sys::ibv_pd {
    if ctx_device(ctx).is_none() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    Box::into_raw(Box::new(sys::ibv_pd {
        context: ctx,
        handle: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
    }))
}

/// # Safety
/// `pd` came from [`ibv_alloc_pd`], deallocated once.
#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut sys::ibv_pd) -> c_int {
    if pd.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: allocated as a Box by `ibv_alloc_pd`, freed once.
    drop(unsafe { Box::from_raw(pd) });
    0
}

/// # Safety
/// `pd` is live; `[addr, addr + length)` is memory the caller keeps mapped while registered.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut sys::ibv_mr {
    if pd.is_null() || addr.is_null() || length == 0 || length as u64 > *crate::device::MAX_MR {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
    // SAFETY: `pd` is live (contract).
    let ctx = unsafe { (*pd).context };
    state().mrs.insert(
        key,
        Mr {
            addr: addr as u64,
            len: length as u64,
            access: access as c_uint,
        },
    );
    Box::into_raw(Box::new(sys::ibv_mr {
        context: ctx,
        pd,
        addr,
        length,
        handle: key,
        lkey: key,
        rkey: key,
    }))
}

/// # Safety
/// `mr` came from [`ibv_reg_mr`], deregistered once.
#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut sys::ibv_mr) -> c_int {
    if mr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: allocated as a Box by `ibv_reg_mr`, freed once.
    let mr = unsafe { Box::from_raw(mr) };
    state().mrs.remove(&mr.lkey);
    0
}

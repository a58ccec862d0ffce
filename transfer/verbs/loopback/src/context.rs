//! Device contexts: opened with the data path's entry points (post, poll, arm) in their
//! operations table, as a provider's are, and closed.

use std::os::raw::c_int;

use kvwire_verbs::sys;

use crate::cq::{poll_cq, req_notify_cq};
use crate::device::device_index;
use crate::qp::post_recv;
use crate::send::post_send;
use crate::state::set_errno;

/// # Safety
/// `dev` is a listed device.
#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(dev: *mut sys::ibv_device) -> *mut sys::ibv_context {
    if device_index(dev).is_none() {
        set_errno(libc::ENODEV);
        return std::ptr::null_mut();
    }
    let mut ctx = sys::ibv_context {
        device: dev,
        cmd_fd: -1,
        async_fd: -1,
        num_comp_vectors: 1,
        ..Default::default()
    };
    ctx.ops.post_send = Some(post_send);
    ctx.ops.post_recv = Some(post_recv);
    ctx.ops.poll_cq = Some(poll_cq);
    ctx.ops.req_notify_cq = Some(req_notify_cq);
    Box::into_raw(Box::new(ctx))
}

/// # Safety
/// `ctx` came from [`ibv_open_device`] and is closed once, after its children.
#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(ctx: *mut sys::ibv_context) -> c_int {
    if ctx.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: allocated by `ibv_open_device` as a Box, closed once.
    drop(unsafe { Box::from_raw(ctx) });
    0
}

//! The device list, and the port and GID queries of a device context.

use std::os::raw::{c_char, c_int};
use std::sync::LazyLock;

use kvwire_verbs::sys;

use crate::{DEVICES_ENV, MAX_MR_ENV, MAX_SGE};

/// The listed devices (created once, never freed: `ibv_device`s outlive their lists).
pub(crate) struct Devices(Vec<usize>);

pub(crate) static DEVICES: LazyLock<Devices> = LazyLock::new(|| {
    let n = std::env::var(DEVICES_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(1)
        .min(16);
    Devices(
        (0..n)
            .map(|i| {
                let mut d = sys::ibv_device {
                    node_type: sys::IBV_NODE_CA,
                    transport_type: sys::IBV_TRANSPORT_IB,
                    ..Default::default()
                };
                copy_name(&mut d.name, &format!("loop{i}"));
                copy_name(&mut d.dev_name, &format!("uverbs-loop{i}"));
                copy_name(&mut d.ibdev_path, &format!("/nonexistent/loop{i}"));
                Box::into_raw(Box::new(d)) as usize
            })
            .collect(),
    )
});

/// The devices' largest memory region (see [`MAX_MR_ENV`]).
pub(crate) static MAX_MR: LazyLock<u64> = LazyLock::new(|| {
    std::env::var(MAX_MR_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(1 << 46)
});

pub(crate) fn copy_name(dst: &mut [c_char], s: &str) {
    let n = dst.len() - 1;
    for (d, b) in dst.iter_mut().zip(s.bytes().take(n)) {
        *d = b as c_char;
    }
}

pub(crate) fn device_index(dev: *mut sys::ibv_device) -> Option<usize> {
    DEVICES.0.iter().position(|&d| d == dev as usize)
}

/// # Safety
/// `num` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut sys::ibv_device {
    let mut list: Vec<*mut sys::ibv_device> = DEVICES
        .0
        .iter()
        .map(|&d| d as *mut sys::ibv_device)
        .collect();
    if !num.is_null() {
        // SAFETY: non-NULL and writable per the contract.
        unsafe { *num = list.len() as c_int };
    }
    list.push(std::ptr::null_mut());
    Box::into_raw(list.into_boxed_slice()) as *mut *mut sys::ibv_device
}

/// # Safety
/// `list` came from [`ibv_get_device_list`] and is freed once.
#[no_mangle]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut sys::ibv_device) {
    if list.is_null() {
        return;
    }
    let n = DEVICES.0.len() + 1;
    // SAFETY: the list was a boxed slice of `n` pointers (the devices and the NULL).
    drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(list, n)) });
}

/// # Safety
/// `dev` is a listed device.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_name(dev: *mut sys::ibv_device) -> *const c_char {
    if dev.is_null() {
        return std::ptr::null();
    }
    // SAFETY: listed devices live for the whole process.
    unsafe { (*dev).name.as_ptr() }
}

#[no_mangle]
pub extern "C" fn ibv_get_device_guid(dev: *mut sys::ibv_device) -> u64 {
    device_index(dev).map_or(0, |i| (0x6b76_7769_7265_0000u64 + i as u64).to_be())
}

pub(crate) fn ctx_device(ctx: *mut sys::ibv_context) -> Option<usize> {
    if ctx.is_null() {
        return None;
    }
    // SAFETY: a non-NULL context handed to us is one of ours, live (caller's contract).
    device_index(unsafe { (*ctx).device })
}

/// # Safety
/// `ctx` is open; `attr` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(
    ctx: *mut sys::ibv_context,
    attr: *mut sys::ibv_device_attr,
) -> c_int {
    let Some(i) = ctx_device(ctx) else {
        return libc::EINVAL;
    };
    let mut a = sys::ibv_device_attr {
        node_guid: ibv_get_device_guid(DEVICES.0[i] as *mut _),
        max_mr_size: *MAX_MR,
        page_size_cap: 4096,
        max_qp: 1 << 16,
        max_qp_wr: 16384,
        max_sge: MAX_SGE as c_int,
        max_sge_rd: MAX_SGE as c_int,
        max_cq: 1 << 16,
        max_cqe: 1 << 20,
        max_mr: 1 << 20,
        max_pd: 1 << 16,
        max_qp_rd_atom: 16,
        max_qp_init_rd_atom: 16,
        phys_port_cnt: 1,
        ..Default::default()
    };
    copy_name(&mut a.fw_ver, "kvwire-loopback");
    // SAFETY: writable per the contract.
    unsafe { *attr = a };
    0
}

/// # Safety
/// `ctx` is open; `attr` points to a writable `ibv_port_attr`.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(
    ctx: *mut sys::ibv_context,
    port: u8,
    attr: *mut sys::_compat_ibv_port_attr,
) -> c_int {
    let Some(i) = ctx_device(ctx) else {
        return libc::EINVAL;
    };
    if port != 1 {
        return libc::EINVAL;
    }
    let a = sys::ibv_port_attr {
        state: sys::IBV_PORT_ACTIVE,
        max_mtu: sys::IBV_MTU_4096,
        active_mtu: sys::IBV_MTU_4096,
        gid_tbl_len: 1,
        max_msg_sz: 1 << 31,
        pkey_tbl_len: 1,
        lid: i as u16 + 1,
        link_layer: sys::IBV_LINK_LAYER_INFINIBAND as u8,
        phys_state: 5,
        ..Default::default()
    };
    // SAFETY: the compat type is libibverbs' name for the same `ibv_port_attr` layout; the
    // caller passes one, writable.
    unsafe { *(attr as *mut sys::ibv_port_attr) = a };
    0
}

/// # Safety
/// `ctx` is open; `gid` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(
    ctx: *mut sys::ibv_context,
    port: u8,
    index: c_int,
    gid: *mut sys::ibv_gid,
) -> c_int {
    let Some(i) = ctx_device(ctx) else {
        return libc::EINVAL;
    };
    if port != 1 || index != 0 {
        return libc::EINVAL;
    }
    let mut raw = [0u8; 16];
    raw[0] = 0xfe;
    raw[1] = 0x80;
    raw[8..].copy_from_slice(&ibv_get_device_guid(DEVICES.0[i] as *mut _).to_ne_bytes());
    // SAFETY: writable per the contract; every bit pattern is a valid gid.
    unsafe { (*gid).raw = raw };
    0
}

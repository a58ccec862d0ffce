//! kvwire-verbs-loopback: a software RDMA device inside one process, built as a shared library
//! that exports the libibverbs entry points kvwire loads (`KVWIRE_IBVERBS_PATH` names it).
//!
//! What it is for: running the engine's whole RDMA path — device pairing, memory registration,
//! queue pairs, the signalling plan, the completion thread, lane repair — on a machine without
//! a NIC, in the ordinary test run, and measuring the CPU that path costs per work request with
//! nothing of a NIC's own cost in it (`kvwire-bench wr-cost`). It is not a transport: every
//! peer must be in this process (a queue pair's remote end is found by its number in this
//! library's tables), which is where tests and the bench put both engines.
//!
//! Semantics, as an RC queue pair on a real NIC shows them to its user:
//! * a work request executes when it is posted (the bytes move in `ibv_post_send`), in order;
//! * every local scatter entry is checked against the region its `lkey` names, and the remote
//!   range against the region of the `rkey` and its access flags; a violation completes with
//!   `LOC_PROT_ERR` / `REM_ACCESS_ERR` and moves the queue pair (and, for a remote violation,
//!   the responder's) to the error state;
//! * a queue pair whose remote end is gone or not ready completes with `RETRY_EXC_ERR`;
//! * on a queue pair in the error state every request completes with `WR_FLUSH_ERR`, signalled
//!   or not; errors are reported whatever the signalling; a success only when signalled;
//! * WRITE_WITH_IMM consumes a receive posted on the responder (none: `RNR_RETRY_EXC_ERR`);
//! * a completion queue with a completion channel raises one event per arming.
//!
//! Devices: `KVWIRE_LOOPBACK_DEVICES` (default 1) named `loop0`, `loop1`, ...; one port each,
//! active, InfiniBand link layer (LID = index + 1), GID `fe80::<guid>`. Setting
//! `KVWIRE_LOOPBACK_NOCOPY=1` (or `kvwire_loopback_copy(0)`) checks every request as above but
//! moves no byte, for measuring the posting path alone; `kvwire_loopback_hold` holds requests
//! in flight until a test releases them.
//!
//! Every entry point takes raw pointers from its caller, as libibverbs does: all of this crate
//! is the verbs boundary, and each `unsafe` block says what the caller guarantees.

use std::collections::{HashMap, VecDeque};
use std::os::raw::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};

use kvwire_verbs::sys;

/// Environment variable: how many devices the library lists.
pub const DEVICES_ENV: &str = "KVWIRE_LOOPBACK_DEVICES";
/// Environment variable: `1` = check every request but move no byte.
pub const NOCOPY_ENV: &str = "KVWIRE_LOOPBACK_NOCOPY";

const MAX_SGE: usize = 16;

/// A registered memory region.
struct Mr {
    addr: u64,
    len: u64,
    access: c_uint,
}

impl Mr {
    fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

/// A queue pair as this library keeps it (the `ibv_qp` itself is the caller's handle).
struct Qp {
    state: sys::ibv_qp_state,
    dest: Option<u32>,
    send_cq: usize,
    recv_cq: usize,
    sig_all: bool,
    /// Posted receives, by work-request id.
    recvs: VecDeque<u64>,
}

/// A completion queue: its completions, whether it is armed, its channel.
#[derive(Default)]
struct Cq {
    wcs: VecDeque<sys::ibv_wc>,
    armed: bool,
    channel: usize,
}

/// A completion channel: a pipe (the read end is the channel's fd) and the completion queues
/// whose events wait in it, in order.
struct Channel {
    write_fd: c_int,
    events: VecDeque<usize>,
}

/// A posted send request, as the device keeps it until it executes.
struct Wr {
    qpn: u32,
    wr_id: u64,
    opcode: sys::ibv_wr_opcode,
    /// Local scatter list: (addr, length, lkey).
    sges: Vec<(u64, u32, u32)>,
    raddr: u64,
    rkey: u32,
    imm: u32,
    signalled: bool,
}

#[derive(Default)]
struct State {
    mrs: HashMap<u32, Mr>,
    qps: HashMap<u32, Qp>,
    cqs: HashMap<usize, Cq>,
    channels: HashMap<usize, Channel>,
    /// While set, posted requests wait in `pending` (in posting order) instead of executing.
    held: bool,
    pending: VecDeque<Wr>,
}

static STATE: LazyLock<Mutex<State>> = LazyLock::new(|| Mutex::new(State::default()));
static NEXT_KEY: AtomicU32 = AtomicU32::new(0x100);
static NEXT_QPN: AtomicU32 = AtomicU32::new(0x11);
/// Work requests posted and completions polled since the library was loaded.
static POSTED: AtomicU64 = AtomicU64::new(0);
static POLLED: AtomicU64 = AtomicU64::new(0);

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The listed devices (created once, never freed: `ibv_device`s outlive their lists).
struct Devices(Vec<usize>);

static DEVICES: LazyLock<Devices> = LazyLock::new(|| {
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

fn copy_name(dst: &mut [c_char], s: &str) {
    let n = dst.len() - 1;
    for (d, b) in dst.iter_mut().zip(s.bytes().take(n)) {
        *d = b as c_char;
    }
}

fn device_index(dev: *mut sys::ibv_device) -> Option<usize> {
    DEVICES.0.iter().position(|&d| d == dev as usize)
}

fn set_errno(e: c_int) {
    // SAFETY: `__errno_location` returns this thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e };
}

/// Whether requests move no byte (checked all the same): from `KVWIRE_LOOPBACK_NOCOPY` at
/// load, then [`kvwire_loopback_copy`].
static NOCOPY: LazyLock<AtomicBool> =
    LazyLock::new(|| AtomicBool::new(std::env::var(NOCOPY_ENV).is_ok_and(|v| v == "1")));

fn nocopy() -> bool {
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

// ---- devices and contexts ----

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

fn ctx_device(ctx: *mut sys::ibv_context) -> Option<usize> {
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
        max_mr_size: 1 << 46,
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

// ---- protection domains and memory ----

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
    if pd.is_null() || addr.is_null() || length == 0 {
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

// ---- completion channels and queues ----

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

/// Queues `wc` on `cq` and raises the channel event when the queue is armed.
fn push_wc(s: &mut State, cq: usize, wc: sys::ibv_wc) {
    let Some(q) = s.cqs.get_mut(&cq) else {
        return;
    };
    q.wcs.push_back(wc);
    if q.armed && q.channel != 0 {
        q.armed = false;
        let ch = q.channel;
        if let Some(c) = s.channels.get_mut(&ch) {
            c.events.push_back(cq);
            let b = 1u8;
            // SAFETY: writing one byte from `b` to our pipe's write end.
            unsafe { libc::write(c.write_fd, (&b as *const u8).cast(), 1) };
        }
    }
}

unsafe extern "C" fn poll_cq(cq: *mut sys::ibv_cq, n: c_int, wc: *mut sys::ibv_wc) -> c_int {
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

unsafe extern "C" fn req_notify_cq(cq: *mut sys::ibv_cq, _solicited: c_int) -> c_int {
    match state().cqs.get_mut(&(cq as usize)) {
        Some(q) => {
            q.armed = true;
            0
        }
        None => libc::EINVAL,
    }
}

// ---- queue pairs ----

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
            recvs: VecDeque::new(),
        },
    );
    Box::into_raw(Box::new(qp))
}

/// Moves queue pair `qpn` to the error state: its posted receives flush.
fn to_error(s: &mut State, qpn: u32) {
    let Some(q) = s.qps.get_mut(&qpn) else {
        return;
    };
    q.state = sys::IBV_QPS_ERR;
    let recvs: Vec<u64> = q.recvs.drain(..).collect();
    let (rcq, scq) = (q.recv_cq, q.send_cq);
    for id in recvs {
        push_wc(
            s,
            rcq,
            wc(id, qpn, sys::IBV_WC_WR_FLUSH_ERR, sys::IBV_WC_RECV, 0),
        );
    }
    // Requests posted and not executed flush, every one of them reported.
    let (flushed, kept): (VecDeque<Wr>, VecDeque<Wr>) = std::mem::take(&mut s.pending)
        .into_iter()
        .partition(|w| w.qpn == qpn);
    s.pending = kept;
    for w in flushed {
        push_wc(
            s,
            scq,
            wc(
                w.wr_id,
                qpn,
                sys::IBV_WC_WR_FLUSH_ERR,
                wc_opcode(w.opcode),
                0,
            ),
        );
    }
}

fn wc_opcode(op: sys::ibv_wr_opcode) -> sys::ibv_wc_opcode {
    if op == sys::IBV_WR_RDMA_READ {
        sys::IBV_WC_RDMA_READ
    } else {
        sys::IBV_WC_RDMA_WRITE
    }
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

fn wc(
    wr_id: u64,
    qpn: u32,
    status: sys::ibv_wc_status,
    opcode: sys::ibv_wc_opcode,
    len: u64,
) -> sys::ibv_wc {
    sys::ibv_wc {
        wr_id,
        status,
        opcode,
        byte_len: len.min(u32::MAX as u64) as u32,
        qp_num: qpn,
        ..Default::default()
    }
}

/// What one work request found: the bytes to move, or the status it completes with (and
/// whether the responder's queue pair fails too).
enum Checked {
    Move {
        local: Vec<(u64, u64)>,
        len: u64,
        dest: u32,
    },
    Fail(sys::ibv_wc_status, bool),
}

/// Checks request `w` against the tables as they are now (`s` locked), as a NIC checks a
/// request when it executes it.
fn check(s: &State, w: &Wr) -> Checked {
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
unsafe fn copy(local: &[(u64, u64)], remote: u64, read: bool) {
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
fn execute(s: &mut State, w: Wr) {
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

unsafe extern "C" fn post_send(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_send_wr,
    bad: *mut *mut sys::ibv_send_wr,
) -> c_int {
    // SAFETY: `qp` is live (the caller's `ibv_post_send` contract).
    let qpn = unsafe { (*qp).qp_num };
    let mut s = state();
    let mut w = wr;
    while !w.is_null() {
        // SAFETY: `w` is an element of the caller's valid NULL-terminated chain.
        let r = unsafe { &*w };
        let refuse = |w| {
            // SAFETY: `bad` is writable (contract).
            unsafe { *bad = w };
            libc::EINVAL
        };
        let Some(q) = s.qps.get(&qpn) else {
            return refuse(w);
        };
        let n = r.num_sge.max(0) as usize;
        if !matches!(q.state, sys::IBV_QPS_RTS | sys::IBV_QPS_ERR)
            || !matches!(
                r.opcode,
                sys::IBV_WR_RDMA_WRITE | sys::IBV_WR_RDMA_WRITE_WITH_IMM | sys::IBV_WR_RDMA_READ
            )
            || n > MAX_SGE
            || (n > 0 && r.sg_list.is_null())
        {
            return refuse(w);
        }
        let sges = (0..n)
            .map(|k| {
                // SAFETY: the chain's entry names `num_sge` readable entries (checked non-NULL).
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
            execute(&mut s, req);
        }
        w = r.next;
    }
    0
}

unsafe extern "C" fn post_recv(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_recv_wr,
    bad: *mut *mut sys::ibv_recv_wr,
) -> c_int {
    // SAFETY: `qp` is live (the caller's `ibv_post_recv` contract).
    let qpn = unsafe { (*qp).qp_num };
    let mut s = state();
    let mut w = wr;
    while !w.is_null() {
        // SAFETY: `w` is an element of the caller's valid NULL-terminated chain.
        let r = unsafe { &*w };
        let Some(q) = s.qps.get_mut(&qpn) else {
            // SAFETY: `bad` is writable (contract).
            unsafe { *bad = w };
            return libc::EINVAL;
        };
        if q.state == sys::IBV_QPS_RESET {
            // SAFETY: as above.
            unsafe { *bad = w };
            return libc::EINVAL;
        }
        if q.state == sys::IBV_QPS_ERR {
            let cq = q.recv_cq;
            push_wc(
                &mut s,
                cq,
                wc(r.wr_id, qpn, sys::IBV_WC_WR_FLUSH_ERR, sys::IBV_WC_RECV, 0),
            );
        } else {
            q.recvs.push_back(r.wr_id);
        }
        w = r.next;
    }
    0
}

//! The tables every entry point shares: regions, queue pairs, completion queues and channels,
//! requests held in flight; completions and the error state.

use std::collections::{HashMap, VecDeque};
use std::os::raw::{c_int, c_uint};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{LazyLock, Mutex, MutexGuard};

use kvwire_verbs::sys;

/// A registered memory region.
pub(crate) struct Mr {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: c_uint,
}

impl Mr {
    pub(crate) fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

/// A queue pair as this library keeps it (the `ibv_qp` itself is the caller's handle).
pub(crate) struct Qp {
    pub(crate) state: sys::ibv_qp_state,
    pub(crate) dest: Option<u32>,
    pub(crate) send_cq: usize,
    pub(crate) recv_cq: usize,
    pub(crate) sig_all: bool,
    /// Scatter-gather entries a send request may carry (as created: a NIC refuses more).
    pub(crate) max_send_sge: usize,
    /// Posted receives, by work-request id.
    pub(crate) recvs: VecDeque<u64>,
}

/// A completion queue: its completions, whether it is armed, its channel.
#[derive(Default)]
pub(crate) struct Cq {
    pub(crate) wcs: VecDeque<sys::ibv_wc>,
    pub(crate) armed: bool,
    pub(crate) channel: usize,
}

/// A completion channel: a pipe (the read end is the channel's fd) and the completion queues
/// whose events wait in it, in order.
pub(crate) struct Channel {
    pub(crate) write_fd: c_int,
    pub(crate) events: VecDeque<usize>,
}

/// A posted send request, as the device keeps it until it executes.
pub(crate) struct Wr {
    pub(crate) qpn: u32,
    pub(crate) wr_id: u64,
    pub(crate) opcode: sys::ibv_wr_opcode,
    /// Local scatter list: (addr, length, lkey).
    pub(crate) sges: Vec<(u64, u32, u32)>,
    pub(crate) raddr: u64,
    pub(crate) rkey: u32,
    pub(crate) imm: u32,
    pub(crate) signalled: bool,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) mrs: HashMap<u32, Mr>,
    pub(crate) qps: HashMap<u32, Qp>,
    pub(crate) cqs: HashMap<usize, Cq>,
    pub(crate) channels: HashMap<usize, Channel>,
    /// While set, posted requests wait in `pending` (in posting order) instead of executing.
    pub(crate) held: bool,
    pub(crate) pending: VecDeque<Wr>,
}

pub(crate) static STATE: LazyLock<Mutex<State>> = LazyLock::new(|| Mutex::new(State::default()));
pub(crate) static NEXT_KEY: AtomicU32 = AtomicU32::new(0x100);
pub(crate) static NEXT_QPN: AtomicU32 = AtomicU32::new(0x11);
/// Work requests posted and completions polled since the library was loaded.
pub(crate) static POSTED: AtomicU64 = AtomicU64::new(0);
pub(crate) static POLLED: AtomicU64 = AtomicU64::new(0);

pub(crate) fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn set_errno(e: c_int) {
    // SAFETY: `__errno_location` returns this thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e };
}

/// Queues `wc` on `cq` and raises the channel event when the queue is armed.
pub(crate) fn push_wc(s: &mut State, cq: usize, wc: sys::ibv_wc) {
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

/// Moves queue pair `qpn` to the error state: its posted receives flush.
pub(crate) fn to_error(s: &mut State, qpn: u32) {
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

pub(crate) fn wc_opcode(op: sys::ibv_wr_opcode) -> sys::ibv_wc_opcode {
    if op == sys::IBV_WR_RDMA_READ {
        sys::IBV_WC_RDMA_READ
    } else {
        sys::IBV_WC_RDMA_WRITE
    }
}
pub(crate) fn wc(
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

/// A request of a chain that a caller posts (`ibv_send_wr`, `ibv_recv_wr`).
pub(crate) trait Chained {
    /// The next request of the chain (NULL: the last).
    fn next_wr(&self) -> *mut Self;
}

impl Chained for sys::ibv_send_wr {
    fn next_wr(&self) -> *mut Self {
        self.next
    }
}

impl Chained for sys::ibv_recv_wr {
    fn next_wr(&self) -> *mut Self {
        self.next
    }
}

/// Gives each request of the caller's chain, from `first`, to `f` with the tables locked; the
/// first request `f` refuses goes to `bad` and its errno is returned (the ones before it stay
/// posted, as with libibverbs).
///
/// # Safety
/// `first` is NULL or a valid NULL-terminated chain whose entries stay valid for the call;
/// `bad` is writable.
pub(crate) unsafe fn post_chain<W: Chained>(
    first: *mut W,
    bad: *mut *mut W,
    mut f: impl FnMut(&mut State, &W) -> Result<(), c_int>,
) -> c_int {
    let mut s = state();
    let mut w = first;
    while !w.is_null() {
        // SAFETY: `w` is an element of the caller's valid chain (contract).
        let r = unsafe { &*w };
        if let Err(e) = f(&mut s, r) {
            // SAFETY: `bad` is writable (contract).
            unsafe { *bad = w };
            return e;
        }
        w = r.next_wr();
    }
    0
}

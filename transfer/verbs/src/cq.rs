//! Completion queues with an event channel: poll, or wait without spinning.

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::device::{Context, ContextInner};
use crate::error::VerbsError;
use crate::error::{WcError, WcStatus};
use crate::library::ibv_fn;
use crate::{ops, sys};

/// Polls made before arming the CQ and sleeping on its channel: completions that are already
/// there (or arrive within a few microseconds) are reaped without a system call.
const POLL_BURST: usize = 16;
/// Completions reaped per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

/// What a successful completion was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionOp {
    /// A SEND finished.
    Send,
    /// An RDMA WRITE (with or without immediate) finished on the sender.
    RdmaWrite,
    /// An RDMA READ finished: the bytes are in local memory.
    RdmaRead,
    /// A SEND was received into a posted receive.
    Recv,
    /// An RDMA WRITE WITH IMMEDIATE arrived: its data has landed and `imm` carries the value.
    RecvRdmaWithImm,
    /// Any other opcode (raw value).
    Other(u32),
}

/// One work completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The `wr_id` the request was posted with.
    pub wr_id: u64,
    /// Local QP number.
    pub qp_num: u32,
    /// `Ok` with what completed, or the typed error.
    pub result: Result<CompletionOp, WcError>,
    /// Bytes received (receive completions only).
    pub byte_len: u32,
    /// Immediate data (host byte order), when the completion carries one.
    pub imm: Option<u32>,
}

impl Completion {
    fn from_raw(wc: &sys::ibv_wc) -> Completion {
        let result = if wc.status == sys::IBV_WC_SUCCESS {
            Ok(match wc.opcode {
                sys::IBV_WC_SEND => CompletionOp::Send,
                sys::IBV_WC_RDMA_WRITE => CompletionOp::RdmaWrite,
                sys::IBV_WC_RDMA_READ => CompletionOp::RdmaRead,
                sys::IBV_WC_RECV => CompletionOp::Recv,
                sys::IBV_WC_RECV_RDMA_WITH_IMM => CompletionOp::RecvRdmaWithImm,
                other => CompletionOp::Other(other),
            })
        } else {
            Err(WcError {
                status: WcStatus::from_raw(wc.status),
                vendor_err: wc.vendor_err,
                wr_id: wc.wr_id,
                qp_num: wc.qp_num,
            })
        };
        let imm = if result.is_ok() && wc.wc_flags & sys::IBV_WC_WITH_IMM != 0 {
            // SAFETY: with IBV_WC_WITH_IMM set, the union holds `imm_data` (network order);
            // any bit pattern is a valid u32.
            Some(u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data }))
        } else {
            None
        };
        Completion {
            wr_id: wc.wr_id,
            qp_num: wc.qp_num,
            result,
            byte_len: wc.byte_len,
            imm,
        }
    }
}

struct ChannelInner {
    ctx: Arc<ContextInner>,
    ch: NonNull<sys::ibv_comp_channel>,
}

// SAFETY: a completion channel is a file descriptor wrapper; libibverbs allows using it from
// any thread, and destruction happens once in `Drop`.
unsafe impl Send for ChannelInner {}
// SAFETY: see `Send`.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        if let Ok(destroy) = &self.ctx.lib.raw.ibv_destroy_comp_channel {
            // SAFETY: the only CQ using this channel holds an `Arc<ChannelInner>` and has been
            // destroyed before; created once, destroyed once.
            let rc = unsafe { destroy(self.ch.as_ptr()) };
            if rc != 0 {
                tracing::warn!(rc, "ibv_destroy_comp_channel failed");
            }
        }
    }
}

pub(crate) struct CqInner {
    pub(crate) ctx: Arc<ContextInner>,
    pub(crate) cq: NonNull<sys::ibv_cq>,
    channel: Arc<ChannelInner>,
    entries: u32,
}

// SAFETY: polling and arming a CQ are thread-safe in libibverbs providers (they take the CQ
// lock); the handle is destroyed once in `Drop`.
unsafe impl Send for CqInner {}
// SAFETY: see `Send`.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        if let Ok(destroy) = &self.ctx.lib.raw.ibv_destroy_cq {
            // SAFETY: QPs using this CQ hold an `Arc<CqInner>`, so none remain; every event
            // taken from the channel was acknowledged right away in `wait` (destroy would
            // otherwise block); created once, destroyed once. The channel outlives this call
            // (`self.channel` is dropped after this body).
            let rc = unsafe { destroy(self.cq.as_ptr()) };
            if rc != 0 {
                tracing::warn!(rc, "ibv_destroy_cq failed");
            }
        }
    }
}

/// A completion queue with its own completion channel.
#[derive(Clone)]
pub struct Cq {
    pub(crate) inner: Arc<CqInner>,
}

impl std::fmt::Debug for Cq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cq")
            .field("entries", &self.inner.entries)
            .finish()
    }
}

impl Context {
    /// Creates a CQ of at least `entries` entries, with a dedicated completion channel so that
    /// [`Cq::wait`] can sleep in the kernel instead of spinning.
    pub fn create_cq(&self, entries: u32) -> Result<Cq, VerbsError> {
        let max = self.inner.limits.max_cqe;
        if entries == 0 || (max != 0 && entries > max) {
            return Err(VerbsError::InvalidArgument(format!(
                "CQ of {entries} entries (device max {max})"
            )));
        }
        let lib = &self.inner.lib;
        let create_ch = ibv_fn!(lib, ibv_create_comp_channel);
        let create_cq = ibv_fn!(lib, ibv_create_cq);
        // SAFETY: the context is open for as long as `self.inner` lives.
        let ch = NonNull::new(unsafe { create_ch(self.inner.ctx.as_ptr()) })
            .ok_or_else(|| VerbsError::last_os("ibv_create_comp_channel"))?;
        let channel = Arc::new(ChannelInner {
            ctx: self.inner.clone(),
            ch,
        });
        // SAFETY: `ch` is a live channel; its fd belongs to it; setting O_NONBLOCK only changes
        // how `ibv_get_cq_event` behaves when no event is pending (EAGAIN instead of blocking).
        let fd = unsafe { (*ch.as_ptr()).fd };
        // SAFETY: plain fcntl calls on a descriptor we own (through the channel).
        let rc = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags < 0 {
                flags
            } else {
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
            }
        };
        if rc < 0 {
            return Err(VerbsError::last_os(
                "fcntl(O_NONBLOCK) on completion channel",
            ));
        }
        let cqe = i32::try_from(entries)
            .map_err(|_| VerbsError::InvalidArgument(format!("CQ of {entries} entries")))?;
        // SAFETY: context and channel are live; NULL cq_context; completion vector 0 exists
        // on every device.
        let raw = unsafe {
            create_cq(
                self.inner.ctx.as_ptr(),
                cqe,
                std::ptr::null_mut(),
                ch.as_ptr(),
                0,
            )
        };
        let cq = NonNull::new(raw).ok_or_else(|| VerbsError::last_os("ibv_create_cq"))?;
        Ok(Cq {
            inner: Arc::new(CqInner {
                ctx: self.inner.clone(),
                cq,
                channel,
                entries,
            }),
        })
    }
}

impl Cq {
    /// Reaps up to `max` completions without blocking, appending them to `out`; returns how
    /// many were appended.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize, VerbsError> {
        let mut total = 0;
        let mut wcs = [sys::ibv_wc::default(); POLL_BATCH];
        while total < max {
            let want = (max - total).min(POLL_BATCH);
            // SAFETY: the CQ is live (held by `self.inner`); `wcs` has room for `want` entries.
            let n = unsafe { ops::poll_cq(self.inner.cq.as_ptr(), want as i32, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(VerbsError::from_errno("ibv_poll_cq", n));
            }
            let n = n as usize;
            out.extend(wcs[..n].iter().map(Completion::from_raw));
            total += n;
            if n < want {
                break;
            }
        }
        Ok(total)
    }

    /// Waits until at least one completion is available (up to `max` are appended to `out`),
    /// or `timeout` passes ([`VerbsError::Timeout`]).
    ///
    /// Event-driven: after a short poll burst the CQ is armed (`ibv_req_notify_cq`), polled
    /// once more to close the race with a completion that arrived before arming, and the thread
    /// sleeps in `poll(2)` on the completion channel; the event is taken with
    /// `ibv_get_cq_event` and acknowledged immediately.
    pub fn wait(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: Duration,
    ) -> Result<usize, VerbsError> {
        if max == 0 {
            return Ok(0);
        }
        let deadline = Instant::now() + timeout;
        let get_event = ibv_fn!(self.inner.ctx.lib, ibv_get_cq_event);
        let ack = ibv_fn!(self.inner.ctx.lib, ibv_ack_cq_events);
        let ch = self.inner.channel.ch.as_ptr();
        // SAFETY: the channel is live (held through `self.inner`); `fd` is plain data.
        let fd = unsafe { (*ch).fd };
        loop {
            for _ in 0..POLL_BURST {
                let n = self.poll(out, max)?;
                if n > 0 {
                    return Ok(n);
                }
                std::hint::spin_loop();
            }
            // SAFETY: the CQ is live.
            let rc = unsafe { ops::req_notify_cq(self.inner.cq.as_ptr(), false) };
            if rc != 0 {
                return Err(VerbsError::from_errno("ibv_req_notify_cq", rc));
            }
            let n = self.poll(out, max)?;
            if n > 0 {
                return Ok(n);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(VerbsError::Timeout(timeout));
            }
            let left_ms = (deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32;
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is one valid pollfd for the channel's descriptor.
            let prc = unsafe { libc::poll(&mut pfd, 1, left_ms) };
            if prc < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(VerbsError::Os {
                    op: "poll(completion channel)",
                    source: err,
                });
            }
            if prc == 0 {
                continue; // deadline is checked after the next poll burst
            }
            let mut ev_cq: *mut sys::ibv_cq = std::ptr::null_mut();
            let mut ev_ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; the out-pointers are valid.
            let rc = unsafe { get_event(ch, &mut ev_cq, &mut ev_ctx) };
            if rc == 0 {
                // SAFETY: the event is for our CQ (the channel is dedicated to it); each event
                // is acknowledged exactly once, before the CQ can be destroyed.
                unsafe { ack(ev_cq, 1) };
            }
            // rc != 0: EAGAIN (another waiter took the event); poll again either way.
        }
    }
}

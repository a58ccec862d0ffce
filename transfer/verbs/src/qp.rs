//! Reliable-connected queue pairs: creation, connection (INIT → RTR → RTS), posting.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::cq::{Cq, CqInner};
use crate::device::{Gid, Mtu};
use crate::error::VerbsError;
use crate::library::ibv_fn;
use crate::memory::{Pd, PdInner, RemoteSlice, Sge};
use crate::{ops, sys};

/// Sizes of a QP's queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send requests.
    pub max_send_wr: u32,
    /// Outstanding receive requests.
    pub max_recv_wr: u32,
    /// Scatter-gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter-gather entries per receive request.
    pub max_recv_sge: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_send_sge: 16,
            max_recv_sge: 1,
        }
    }
}

/// What a peer needs to connect its QP to ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// The GID the QP sends from (the peer's `dgid`).
    pub gid: Gid,
    /// QP number.
    pub qpn: u32,
    /// First packet sequence number this side will send (24 bits).
    pub psn: u32,
    /// LID (InfiniBand link layer; 0 on RoCE).
    pub lid: u16,
}

impl Endpoint {
    /// Encoded size of [`Endpoint::to_bytes`].
    pub const ENCODED_LEN: usize = 26;

    /// Fixed 26-byte big-endian encoding for handshakes: gid(16) qpn(4) psn(4) lid(2).
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[..16].copy_from_slice(&self.gid.0);
        b[16..20].copy_from_slice(&self.qpn.to_be_bytes());
        b[20..24].copy_from_slice(&self.psn.to_be_bytes());
        b[24..26].copy_from_slice(&self.lid.to_be_bytes());
        b
    }

    /// Decodes [`Endpoint::to_bytes`]; rejects wrong lengths and out-of-range QPN/PSN.
    pub fn from_bytes(b: &[u8]) -> Result<Endpoint, VerbsError> {
        if b.len() != Self::ENCODED_LEN {
            return Err(VerbsError::MalformedEndpoint("length is not 26"));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[..16]);
        let word = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let (qpn, psn) = (word(16), word(20));
        if qpn > 0x00ff_ffff || qpn == 0 {
            return Err(VerbsError::MalformedEndpoint("QPN out of range"));
        }
        if psn > 0x00ff_ffff {
            return Err(VerbsError::MalformedEndpoint("PSN out of range"));
        }
        Ok(Endpoint {
            gid: Gid(gid),
            qpn,
            psn,
            lid: u16::from_be_bytes([b[24], b[25]]),
        })
    }
}

/// Parameters of [`Qp::connect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectParams {
    /// Local port (1-based).
    pub port: u8,
    /// Local source GID index (from [`crate::Context::select_gid`]).
    pub sgid_index: u8,
    /// Path MTU: the smaller of both ports' active MTUs.
    pub mtu: Mtu,
    /// The peer's endpoint.
    pub remote: Endpoint,
    /// Our first send PSN (what we advertised in our endpoint).
    pub local_psn: u32,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (14 ≈ 67 ms).
    pub timeout: u8,
    /// Transport retries before `RetryExceeded` (max 7; some providers treat 7 as infinite).
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite) before `RnrRetryExceeded`.
    pub rnr_retry: u8,
    /// Traffic class (DSCP << 2) for RoCE v2.
    pub traffic_class: u8,
    /// Service level.
    pub sl: u8,
}

impl ConnectParams {
    /// Defaults used by kvwire: ≈67 ms ACK timeout, 6 transport retries (a dead peer completes
    /// with `RetryExceeded` after ≈0.5 s), RNR retry 7 (wait for receives).
    pub fn new(port: u8, sgid_index: u8, mtu: Mtu, remote: Endpoint, local_psn: u32) -> Self {
        ConnectParams {
            port,
            sgid_index,
            mtu,
            remote,
            local_psn,
            timeout: 14,
            // 6, not 7: SoftRoCE (rxe) treats 7 as "retry forever", so a dead peer would never
            // complete (measured in the VM: 881 retries in 60 s, no error completion).
            retry_cnt: 6,
            rnr_retry: 7,
            traffic_class: 0,
            sl: 0,
        }
    }
}

/// An operation of a [`SendRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// RDMA WRITE the local SGEs to the remote address.
    Write,
    /// RDMA WRITE WITH IMMEDIATE: also consumes one receive at the peer, whose completion
    /// carries the value (after all the data has landed).
    WriteWithImm(u32),
    /// RDMA READ the remote bytes into the local SGEs.
    Read,
}

/// One request of a [`Qp::post_send`] batch.
#[derive(Debug, Clone, Copy)]
pub struct SendRequest<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local scatter-gather list (source of writes, destination of reads).
    pub local: &'a [Sge],
    /// Remote target.
    pub remote: RemoteSlice,
    /// Generate a completion on success (errors always complete).
    pub signaled: bool,
}

/// An RC queue pair. Destroyed on drop (in-flight requests are flushed by the device).
pub struct Qp {
    pd: Arc<PdInner>,
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
    qp: NonNull<sys::ibv_qp>,
    caps: QpCaps,
    qpn: u32,
}

// SAFETY: posting to a QP is thread-safe in libibverbs providers (they lock the send and
// receive queues); modify/destroy are done through `&self`/`Drop` and libibverbs serialises them.
unsafe impl Send for Qp {}
// SAFETY: see `Send`.
unsafe impl Sync for Qp {}

impl Drop for Qp {
    fn drop(&mut self) {
        if let Ok(destroy) = &self.pd.ctx.lib.raw.ibv_destroy_qp {
            // SAFETY: created once by ibv_create_qp, destroyed once; its CQs and PD are kept
            // alive by the `Arc`s in `self` until after this call.
            let rc = unsafe { destroy(self.qp.as_ptr()) };
            if rc != 0 {
                tracing::warn!(rc, qpn = self.qpn, "ibv_destroy_qp failed");
            }
        }
    }
}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp")
            .field("qpn", &self.qpn)
            .field("caps", &self.caps)
            .finish()
    }
}

impl Pd {
    /// Creates an RC QP (in RESET) using `send_cq` and `recv_cq`; the caps are clamped to the
    /// device limits and the granted ones are reported by [`Qp::caps`].
    pub fn create_rc_qp(&self, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp, VerbsError> {
        let ctx = &self.inner.ctx;
        let create = ibv_fn!(ctx.lib, ibv_create_qp);
        let lim = &ctx.limits;
        let clamp = |v: u32, max: u32| if max == 0 { v } else { v.min(max) };
        let mut attr = sys::ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: send_cq.inner.cq.as_ptr(),
            recv_cq: recv_cq.inner.cq.as_ptr(),
            srq: std::ptr::null_mut(),
            cap: sys::ibv_qp_cap {
                max_send_wr: clamp(caps.max_send_wr, lim.max_qp_wr),
                max_recv_wr: clamp(caps.max_recv_wr, lim.max_qp_wr),
                max_send_sge: clamp(caps.max_send_sge, lim.max_sge),
                max_recv_sge: clamp(caps.max_recv_sge, lim.max_sge),
                max_inline_data: 0,
            },
            qp_type: sys::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the PD and both CQs are live (held by `self` and the `Cq`s, and by the
        // returned `Qp` afterwards); `attr` is a fully initialised init-attr struct that the
        // library reads and updates with the granted caps.
        let raw = unsafe { create(self.inner.pd.as_ptr(), &mut attr) };
        let qp = NonNull::new(raw).ok_or_else(|| VerbsError::last_os("ibv_create_qp"))?;
        // SAFETY: `qp` was just created and is valid.
        let qpn = unsafe { (*qp.as_ptr()).qp_num };
        Ok(Qp {
            pd: self.inner.clone(),
            _send_cq: send_cq.inner.clone(),
            _recv_cq: recv_cq.inner.clone(),
            qp,
            caps: QpCaps {
                max_send_wr: attr.cap.max_send_wr,
                max_recv_wr: attr.cap.max_recv_wr,
                max_send_sge: attr.cap.max_send_sge,
                max_recv_sge: attr.cap.max_recv_sge,
            },
            qpn,
        })
    }
}

impl Qp {
    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The granted queue sizes.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// This QP's endpoint for the peer, given the chosen source GID, LID and first PSN.
    pub fn endpoint(&self, gid: Gid, lid: u16, psn: u32) -> Endpoint {
        Endpoint {
            gid,
            qpn: self.qpn,
            psn: psn & 0x00ff_ffff,
            lid,
        }
    }

    fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        mask: u32,
        op: &'static str,
    ) -> Result<(), VerbsError> {
        let modify = ibv_fn!(self.pd.ctx.lib, ibv_modify_qp);
        let mask =
            i32::try_from(mask).map_err(|_| VerbsError::InvalidArgument("qp attr mask".into()))?;
        // SAFETY: the QP is live; `attr` is a valid attribute struct whose fields named by
        // `mask` are initialised.
        let rc = unsafe { modify(self.qp.as_ptr(), attr, mask) };
        if rc != 0 {
            return Err(VerbsError::from_errno(op, rc));
        }
        Ok(())
    }

    /// Connects to the peer: RESET → INIT (remote read/write allowed) → RTR → RTS.
    pub fn connect(&self, p: &ConnectParams) -> Result<(), VerbsError> {
        let lim = &self.pd.ctx.limits;
        let rd_atom = |max: u8| if max == 0 { 1 } else { max.min(16) };

        let mut a = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: p.port,
            qp_access_flags: sys::IBV_ACCESS_LOCAL_WRITE
                | sys::IBV_ACCESS_REMOTE_WRITE
                | sys::IBV_ACCESS_REMOTE_READ,
            ..Default::default()
        };
        self.modify(
            &mut a,
            sys::IBV_QP_STATE
                | sys::IBV_QP_PKEY_INDEX
                | sys::IBV_QP_PORT
                | sys::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )?;

        let mut a = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTR,
            path_mtu: p.mtu.raw(),
            dest_qp_num: p.remote.qpn,
            rq_psn: p.remote.psn & 0x00ff_ffff,
            max_dest_rd_atomic: rd_atom(lim.max_qp_rd_atom),
            min_rnr_timer: 12,
            ..Default::default()
        };
        a.ah_attr.dlid = p.remote.lid;
        a.ah_attr.sl = p.sl;
        a.ah_attr.port_num = p.port;
        if !p.remote.gid.is_zero() {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = p.remote.gid.0;
            a.ah_attr.grh.sgid_index = p.sgid_index;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.grh.traffic_class = p.traffic_class;
        }
        self.modify(
            &mut a,
            sys::IBV_QP_STATE
                | sys::IBV_QP_AV
                | sys::IBV_QP_PATH_MTU
                | sys::IBV_QP_DEST_QPN
                | sys::IBV_QP_RQ_PSN
                | sys::IBV_QP_MAX_DEST_RD_ATOMIC
                | sys::IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(RTR)",
        )?;

        let mut a = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTS,
            sq_psn: p.local_psn & 0x00ff_ffff,
            timeout: p.timeout,
            retry_cnt: p.retry_cnt.min(7),
            rnr_retry: p.rnr_retry.min(7),
            max_rd_atomic: rd_atom(lim.max_qp_init_rd_atom),
            ..Default::default()
        };
        self.modify(
            &mut a,
            sys::IBV_QP_STATE
                | sys::IBV_QP_SQ_PSN
                | sys::IBV_QP_TIMEOUT
                | sys::IBV_QP_RETRY_CNT
                | sys::IBV_QP_RNR_RETRY
                | sys::IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTS)",
        )
    }

    /// Moves the QP to the ERROR state: every outstanding request completes with
    /// [`crate::WcStatus::WrFlush`] (how a transport drains a QP before destroying it).
    pub fn set_error(&self) -> Result<(), VerbsError> {
        let mut a = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(&mut a, sys::IBV_QP_STATE, "ibv_modify_qp(ERR)")
    }

    /// Posts a chain of send-queue requests with one doorbell. On error, `index` in
    /// [`VerbsError::PostFailed`] is the first request not posted (earlier ones were).
    pub fn post_send(&self, reqs: &[SendRequest<'_>]) -> Result<(), VerbsError> {
        if reqs.is_empty() {
            return Ok(());
        }
        let total_sge: usize = reqs.iter().map(|r| r.local.len()).sum();
        let mut sges: Vec<sys::ibv_sge> = Vec::with_capacity(total_sge);
        for r in reqs {
            if r.local.len() > self.caps.max_send_sge as usize {
                return Err(VerbsError::TooManySge {
                    got: r.local.len(),
                    max: self.caps.max_send_sge as usize,
                });
            }
            sges.extend(r.local.iter().map(|s| sys::ibv_sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            }));
        }
        // `sges` is never resized below, so pointers into it stay valid.
        let mut wrs: Vec<sys::ibv_send_wr> = Vec::with_capacity(reqs.len());
        let mut at = 0usize;
        for r in reqs {
            let n = r.local.len();
            let sg_list = if n == 0 {
                std::ptr::null_mut()
            } else {
                sges[at..].as_mut_ptr()
            };
            at += n;
            let (opcode, imm) = match r.op {
                SendOp::Write => (sys::IBV_WR_RDMA_WRITE, None),
                SendOp::WriteWithImm(v) => (sys::IBV_WR_RDMA_WRITE_WITH_IMM, Some(v)),
                SendOp::Read => (sys::IBV_WR_RDMA_READ, None),
            };
            let mut wr = sys::ibv_send_wr {
                wr_id: r.wr_id,
                sg_list,
                num_sge: n as i32,
                opcode,
                send_flags: if r.signaled {
                    sys::IBV_SEND_SIGNALED
                } else {
                    0
                },
                ..Default::default()
            };
            if let Some(v) = imm {
                wr.__bindgen_anon_1.imm_data = v.to_be();
            }
            wr.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                remote_addr: r.remote.addr,
                rkey: r.remote.rkey,
            };
            wrs.push(wr);
        }
        // link the chain now that `wrs` will not move any more
        let base = wrs.as_mut_ptr();
        for i in 0..wrs.len().saturating_sub(1) {
            // SAFETY: `i + 1 < wrs.len()`, so the pointer is inside the allocation.
            wrs[i].next = unsafe { base.add(i + 1) };
        }
        let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is live; `wrs` is a NULL-terminated chain (the last `next` is NULL
        // from `Default`) whose SGE lists point into `sges`, both alive for the call. Local
        // memory is named only by (lkey, addr, len), which the device validates.
        let rc = unsafe { ops::post_send(self.qp.as_ptr(), base, &mut bad) };
        if rc != 0 {
            let index = if bad.is_null() {
                0
            } else {
                // SAFETY: the provider sets `bad` to an element of the chain we passed.
                usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
            };
            return Err(VerbsError::PostFailed {
                op: "post_send",
                index,
                source: std::io::Error::from_raw_os_error(rc.abs()),
            });
        }
        Ok(())
    }

    /// Posts one RDMA WRITE.
    pub fn post_write(
        &self,
        wr_id: u64,
        local: &[Sge],
        remote: RemoteSlice,
        signaled: bool,
    ) -> Result<(), VerbsError> {
        self.post_send(&[SendRequest {
            wr_id,
            op: SendOp::Write,
            local,
            remote,
            signaled,
        }])
    }

    /// Posts one RDMA WRITE WITH IMMEDIATE (always signaled).
    pub fn post_write_with_imm(
        &self,
        wr_id: u64,
        local: &[Sge],
        remote: RemoteSlice,
        imm: u32,
    ) -> Result<(), VerbsError> {
        self.post_send(&[SendRequest {
            wr_id,
            op: SendOp::WriteWithImm(imm),
            local,
            remote,
            signaled: true,
        }])
    }

    /// Posts one RDMA READ (always signaled: its completion says the bytes are local).
    pub fn post_read(
        &self,
        wr_id: u64,
        local: &[Sge],
        remote: RemoteSlice,
    ) -> Result<(), VerbsError> {
        self.post_send(&[SendRequest {
            wr_id,
            op: SendOp::Read,
            local,
            remote,
            signaled: true,
        }])
    }

    /// Posts one receive (an empty `local` list is enough for WRITE WITH IMMEDIATE).
    pub fn post_recv(&self, wr_id: u64, local: &[Sge]) -> Result<(), VerbsError> {
        if local.len() > self.caps.max_recv_sge as usize {
            return Err(VerbsError::TooManySge {
                got: local.len(),
                max: self.caps.max_recv_sge as usize,
            });
        }
        let mut sges: Vec<sys::ibv_sge> = local
            .iter()
            .map(|s| sys::ibv_sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            })
            .collect();
        let mut wr = sys::ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: if sges.is_empty() {
                std::ptr::null_mut()
            } else {
                sges.as_mut_ptr()
            },
            num_sge: sges.len() as i32,
        };
        let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the QP is live; `wr` is a single request (next = NULL) whose SGE list
        // points into `sges`, alive for the call; the device validates lkeys and bounds.
        let rc = unsafe { ops::post_recv(self.qp.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::PostFailed {
                op: "post_recv",
                index: 0,
                source: std::io::Error::from_raw_os_error(rc.abs()),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trips_and_rejects_garbage() {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[10, 0, 0, 2]);
        let e = Endpoint {
            gid: Gid(g),
            qpn: 0x11,
            psn: 0xabcdef,
            lid: 7,
        };
        let b = e.to_bytes();
        assert_eq!(Endpoint::from_bytes(&b).expect("decode"), e);
        assert!(matches!(
            Endpoint::from_bytes(&b[..25]),
            Err(VerbsError::MalformedEndpoint(_))
        ));
        let mut bad = b;
        bad[16] = 0xff; // qpn > 24 bits
        assert!(Endpoint::from_bytes(&bad).is_err());
        let mut bad = b;
        bad[20] = 1; // psn > 24 bits
        assert!(Endpoint::from_bytes(&bad).is_err());
        let mut zero_qpn = b;
        zero_qpn[16..20].copy_from_slice(&[0; 4]);
        assert!(Endpoint::from_bytes(&zero_qpn).is_err());
    }
}

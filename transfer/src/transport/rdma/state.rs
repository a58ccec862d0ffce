//! The state of the RDMA transport and of its peers: devices and registrations shared with
//! the completion threads ([`Shared`]), a peer's lanes and work requests ([`PeerShared`]).
//!
//! The methods of [`PeerShared`] are spread over the sibling modules by concern: `lane`
//! (posting, breaking, re-routing, asking to reconnect), `completion`, `ctrl` (the peer's
//! reconnection messages), `keys` (remote keys on further devices).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};

use kvwire_verbs::{ConnectParams, Endpoint, Mtu, Qp};

use super::devices::{verbs_err, Dev, DevQp, Nic};
use super::mrs::MrSet;
use super::slice::{Change, SliceSizer};
use super::wr::Wr;
use crate::batch::BatchState;
use crate::ctrl::CtrlWriter;
use crate::error::Error;
use crate::transport::api::OnDead;
use crate::types::{Dir, RegionId};

/// Flushed WRs are re-posted on another lane at most this many times.
pub(super) const MAX_RETRIES: u8 = 3;
/// Tracing target of the per-work-request events (posted, completion, re-posted) and of lane
/// breaks and re-establishments, for diagnosing the data path (`trace`/`debug` level).
pub(super) const WR_TRACE: &str = "kvwire::rdma::wr";

/// State shared by the transport and its peers.
pub(super) struct Shared {
    /// The engine's devices (shared with the other engines of the process that use them).
    pub(super) devs: Vec<Arc<Nic>>,
    pub(super) mrs: RwLock<HashMap<RegionId, Arc<MrSet>>>,
    /// Signal one WR in this many (≥ 1).
    pub(super) signal_every: usize,
    /// Local pieces one WR may gather at most (≥ 1; the devices may allow fewer).
    pub(super) max_sge: u32,
    /// A region longer than this is registered in chunks of this many bytes (a multiple of
    /// the page size; `u64::MAX`: no limit).
    pub(super) mr_chunk: u64,
}

/// A lane is re-established at most this many times (then it stays broken).
const MAX_RECONNECTS: u32 = 64;

pub(super) struct LaneState {
    pub(super) qp: Arc<DevQp>,
    /// WRs posted on `qp` and not completed yet.
    pub(super) outstanding: usize,
    pub(super) backlog: VecDeque<u64>,
    pub(super) broken: bool,
    /// Our reconnection request in flight: the new QP, its PSN, our tie-break nonce.
    pub(super) pending: Option<(Arc<DevQp>, u32, u64)>,
    pub(super) reconnects: u32,
    /// The WR whose successful completion `qp` reported last: that QP, the WR's id, and its
    /// entry while its batch still waits for other WRs (`None` once the batch completed). If
    /// the provider then moves the QP to the error state without an error completion, that
    /// success is not trusted and the WR is posted again (see `complete_one`).
    pub(super) last_ok: Option<(Arc<DevQp>, u64, Option<WrEntry>)>,
}

pub(super) struct Lane {
    /// Local device index.
    pub(super) ldev: usize,
    /// Remote device index.
    pub(super) rdev: usize,
    pub(super) mtu: Mtu,
    /// The local device's count of WRs on the NIC.
    pub(super) inflight: Arc<AtomicUsize>,
    pub(super) depth: usize,
    pub(super) st: Mutex<LaneState>,
    pub(super) posted: AtomicU64,
    /// Times this lane's QP was replaced after an error (either side's request).
    pub(super) reestablished: AtomicU64,
}

pub(super) struct BatchCtx {
    pub(super) state: Arc<BatchState>,
    pub(super) left: AtomicU32,
    pub(super) notify: Mutex<Option<Vec<u8>>>,
    /// WRs of the batch posted and not completed (the NIC may still touch their memory).
    pub(super) on_nic: AtomicU32,
    /// Lanes the batch's WRs were posted on (bit per lane).
    pub(super) lanes: AtomicU64,
    /// Set when the batch is failing and its WRs are being flushed off the NIC
    /// ([`PeerShared::quiesce`]): none of them is posted again.
    pub(super) quiescing: AtomicBool,
    /// What the slice sizer learns from the batch when its last WR completed.
    pub(super) sample: Sample,
}

/// A batch as the slice sizer sees it ([`super::slice`]).
pub(super) struct Sample {
    pub(super) dir: Dir,
    /// The slice it was cut with, and into how many WRs.
    pub(super) slice: u64,
    pub(super) wrs: u64,
    pub(super) bytes: u64,
    pub(super) posted: Instant,
}

impl BatchCtx {
    /// Whether the batch's WRs are no longer to be posted: it ended, or it is failing.
    pub(super) fn stopped(&self) -> bool {
        self.quiescing.load(Ordering::Acquire) || self.state.is_done()
    }
}

pub(super) struct WrEntry {
    // Field order: the QP reference goes before the MR reference.
    pub(super) qp: Option<Arc<DevQp>>,
    pub(super) batch: Arc<BatchCtx>,
    pub(super) lane: usize,
    pub(super) wr: Wr,
    pub(super) retries: u8,
    pub(super) region: RegionId,
    pub(super) mr: Arc<MrSet>,
    /// Set on a signalled WR: the unsignalled WRs posted before it on the same QP since the
    /// previous signalled one. RC completes a QP's WRs in order, and a failed or flushed WR
    /// always produces its own completion, so when this WR's completion arrives, those of
    /// them still waiting (posted on the same QP) completed successfully.
    pub(super) covers: Vec<u64>,
}

pub(super) struct PeerShared {
    // Field order: the lanes' QPs are released before the MRs the entries hold.
    pub(super) lanes: Vec<Lane>,
    pub(super) key: u32,
    /// Signal one WR in this many.
    pub(super) signal_every: usize,
    pub(super) tr: Weak<Shared>,
    /// Devices the peer listed in its blob.
    pub(super) remote_devs: usize,
    pub(super) wrs: Mutex<HashMap<u64, WrEntry>>,
    pub(super) next_wr: AtomicU32,
    pub(super) next_lane: AtomicU32,
    /// The slice size of WRITE batches and of READ batches.
    pub(super) slices: [Mutex<SliceSizer>; 2],
    /// Local scatter-gather entries one WRITE and one READ may carry on every lane.
    pub(super) sge_write: usize,
    pub(super) sge_read: usize,
    pub(super) ctrl: Arc<CtrlWriter>,
    pub(super) on_dead: OnDead,
    pub(super) closed: AtomicBool,
    /// Work requests re-posted on another lane after a flush (metrics).
    pub(super) reposts: AtomicU64,
    /// Completions ignored because they came from a QP the WR was not posted on (metrics).
    pub(super) stale: AtomicU64,
    /// The peer's rkeys of its regions (index 0 of each chunk comes with the region).
    pub(super) keys: RwLock<HashMap<RegionId, ChunkKeys>>,
    /// Regions whose keys were asked for.
    pub(super) asked: Mutex<HashSet<RegionId>>,
}

/// A remote region's rkeys: per chunk (one unless it is registered in chunks), per remote
/// device.
pub(super) type ChunkKeys = Arc<[Arc<[u32]>]>;

/// Per-peer RDMA state.
pub(crate) struct RdmaPeer {
    pub(super) sh: Arc<PeerShared>,
}

impl PeerShared {
    pub(super) fn wr_id(&self) -> u64 {
        (u64::from(self.key) << 32) | u64::from(self.next_wr.fetch_add(1, Ordering::Relaxed))
    }

    fn sizer(&self, dir: Dir) -> &Mutex<SliceSizer> {
        &self.slices[usize::from(dir == Dir::Read)]
    }

    /// The slice size to cut a batch of `bytes` in direction `dir` into now.
    pub(super) fn slice(&self, dir: Dir, bytes: u64) -> u64 {
        self.sizer(dir).lock().slice_for(bytes)
    }

    /// The slice sizes of large batches now, `[write, read]`.
    pub(super) fn slice_sizes(&self) -> [u64; 2] {
        [Dir::Write, Dir::Read].map(|d| self.sizer(d).lock().slice())
    }

    /// Tells the slice sizer how a batch whose WRs all completed went.
    pub(super) fn sampled(&self, s: &Sample) {
        let ns = u64::try_from(s.posted.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let change = self
            .sizer(s.dir)
            .lock()
            .observe(s.slice, s.wrs, s.bytes, ns);
        match change {
            Some(Change::Probing(n)) => {
                tracing::debug!(dir = ?s.dir, slice = n, "rdma: trying another slice size");
            }
            Some(Change::Settled(n)) => {
                tracing::debug!(dir = ?s.dir, slice = n, "rdma: slice size settled");
            }
            None => {}
        }
    }

    pub(super) fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub(super) fn recoverable(&self, st: &LaneState) -> bool {
        !self.closed() && st.reconnects < MAX_RECONNECTS
    }

    /// Lanes that post now, and broken lanes that will be re-established.
    pub(super) fn lane_sets(&self) -> (Vec<usize>, Vec<usize>) {
        let (mut ok, mut later) = (Vec::new(), Vec::new());
        for (i, l) in self.lanes.iter().enumerate() {
            let st = l.st.lock();
            if !st.broken {
                ok.push(i);
            } else if self.recoverable(&st) {
                later.push(i);
            }
        }
        (ok, later)
    }

    pub(super) fn dev(&self, lane: usize) -> Result<Arc<Dev>, Error> {
        let t = self.tr.upgrade().ok_or(Error::Shutdown)?;
        t.devs
            .get(self.lanes[lane].ldev)
            .map(|n| n.dev.clone())
            .ok_or(Error::Shutdown)
    }

    pub(super) fn new_qp(&self, lane: usize) -> Result<(Arc<DevQp>, u32, Endpoint), Error> {
        let dev = self.dev(lane)?;
        let qp = dev.create_qp()?;
        let psn = u32::from_le_bytes(crate::auth::random::<4>()) & 0x00ff_ffff;
        let ep = qp.endpoint(dev.gid.gid, dev.lid, psn);
        Ok((Arc::new(qp), psn, ep))
    }

    pub(super) fn connect_qp(
        &self,
        lane: usize,
        qp: &Qp,
        psn: u32,
        remote: Endpoint,
    ) -> Result<(), Error> {
        let dev = self.dev(lane)?;
        qp.connect(&ConnectParams::new(
            dev.port,
            dev.gid.index,
            self.lanes[lane].mtu,
            remote,
            psn,
        ))
        .map_err(verbs_err)
    }
}

//! RDMA transport: RC queue pairs over one verbs device per engine, one-sided WRITE and READ.
//!
//! * **Device**: the engine opens one device ([`crate::EngineConfig::rdma_device`], else
//!   `$KVWIRE_RDMA_DEVICE`, else the first device with an active port), allocates one PD and
//!   one CQ (with its completion channel) and starts one completion thread that sleeps on the
//!   channel when idle (a short bounded poll burst first, inside `Cq::wait`).
//! * **Regions**: every region is registered as an MR of that PD when it is added (local ones
//!   with local write only; offered ones with the remote rights their `Access` grants), so the
//!   NIC enforces the region's bounds and rights; the rkey and address travel in the region
//!   announcements (`WireRegion::rkey`, `WireRegion::addr`). The MR holds the region memory
//!   alive; an in-flight work request holds its MR alive.
//! * **Queue pairs**: the handshake blob is made per handshake: `cfg.lanes` fresh RC QPs are
//!   created and their endpoints sent, keyed by a random nonce; [`RdmaTransport::establish`]
//!   takes them back by the nonce found in our own blob and connects lane *i* to the peer's
//!   lane *i*. Unclaimed QPs expire. Both sides connect their QPs whenever both offered RDMA,
//!   whatever each chose for its own direction (the other may write into us).
//! * **Posting**: each coalesced transfer is cut into slices of at most `cfg.slice_size`,
//!   striped round-robin over the healthy lanes; each lane posts its WRs as one chain, at most
//!   the QP's send depth outstanding (the rest waits in the lane's backlog, posted by the
//!   completion thread as slots free). Every WR is signalled.
//! * **Completion**: the batch completes when every WR completed; a notification is then sent
//!   over the control connection (so it always follows the data), then the batch completes.
//! * **Errors**: a failed WR breaks its lane (the QP is moved to the error state, so its other
//!   WRs flush); flushed WRs of other batches are re-posted on a healthy lane (bounded retries);
//!   the failing batch gets a typed error (`AccessDenied` for a remote access/bounds violation
//!   found by the NIC, `PeerDead` for a retry exhaustion). When every lane is broken the peer is
//!   declared dead (the engine fails its in-flight batches; reconnect to recover).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::tcp::OnDead;
use super::{Dir, EstablishCtx, PeerTransport, Posted, Transport};
use crate::batch::{BatchState, BatchStats, Pending};
use crate::config::{EngineConfig, TransportKind};
use crate::engine::CtrlWriter;
use crate::error::Error;
use crate::mem::RegionMem;
use crate::region::{RegionEntry, RegionId};
use crate::verbs::{
    self, ConnectParams, Context, Cq, Endpoint, GidSelection, Mr, Mtu, Pd, Qp, QpCaps, RemoteSlice,
    SendOp, SendRequest, Sge, Verbs, VerbsError, WcStatus,
};
use crate::wire::{CtrlMsg, HostIdentity, TRANSPORT_RDMA};

/// Environment variable naming the RDMA device when the config does not.
pub(crate) const DEVICE_ENV: &str = "KVWIRE_RDMA_DEVICE";
/// Unclaimed pre-created QP sets live this long beyond the connect timeout.
const PRE_EXPIRY_SLACK: Duration = Duration::from_secs(5);
/// At most this many unclaimed QP sets at once (beyond: RDMA is not offered in that handshake).
const MAX_PRE: usize = 128;
/// Flushed WRs are re-posted on another lane at most this many times.
const MAX_RETRIES: u8 = 3;
/// Send queue depth per QP.
const QP_DEPTH: u32 = 256;
/// Completion queue entries (shared by every QP of the device, capped by the device's limit).
/// Every WR is signalled, so at most `CQ entries / QP_DEPTH` QPs exist at once (counting QPs
/// prepared for handshakes); beyond that a handshake does not offer rdma.
const CQ_ENTRIES: u32 = 65536;
const BLOB_HEAD: usize = 16 + 4;

/// A registered region: the MR and the memory it covers (kept alive next to it).
pub(crate) struct MrEntry {
    mr: Mr,
    _mem: Arc<RegionMem>,
}

struct Dev {
    name: String,
    _ctx: Context,
    pd: Pd,
    cq: Cq,
    port: u8,
    gid: GidSelection,
    lid: u16,
    mtu: Mtu,
    mrs: RwLock<HashMap<RegionId, Arc<MrEntry>>>,
    peers: Mutex<HashMap<u32, Weak<PeerShared>>>,
    next_peer: AtomicU32,
    stop: AtomicBool,
    cq_entries: usize,
    live_qps: Arc<AtomicUsize>,
}

struct PreQps {
    created: Instant,
    qps: Vec<(DevQp, u32)>,
}

/// A QP of the device, counted against the device's QP budget while it lives (every QP's
/// signalled WRs must fit the shared CQ).
pub(crate) struct DevQp {
    qp: Qp,
    live: Arc<AtomicUsize>,
}

impl std::ops::Deref for DevQp {
    type Target = Qp;
    fn deref(&self) -> &Qp {
        &self.qp
    }
}

impl Drop for DevQp {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Dev {
    /// A new RC QP, or an error when the CQ could not absorb one more QP's worth of WRs.
    fn create_qp(&self) -> Result<DevQp, Error> {
        let max = (self.cq_entries / QP_DEPTH as usize).max(1);
        if self.live_qps.fetch_add(1, Ordering::AcqRel) >= max {
            self.live_qps.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::Unsupported(format!(
                "RDMA device {}: {max} queue pairs in use (completion queue budget)",
                self.name
            )));
        }
        match self.pd.create_rc_qp(&self.cq, &self.cq, qp_caps()) {
            Ok(qp) => Ok(DevQp {
                qp,
                live: self.live_qps.clone(),
            }),
            Err(e) => {
                self.live_qps.fetch_sub(1, Ordering::AcqRel);
                Err(verbs_err(e))
            }
        }
    }
}

/// The RDMA transport of one engine (one device).
pub(crate) struct RdmaTransport {
    dev: Arc<Dev>,
    lanes: usize,
    expiry: Duration,
    pre: Mutex<HashMap<[u8; 16], PreQps>>,
}

impl RdmaTransport {
    /// Opens the configured device; `Ok(None)` when RDMA is not available here (no library, no
    /// device), with the reason logged.
    pub fn open(cfg: &EngineConfig) -> Result<Option<RdmaTransport>, Error> {
        let verbs = match Verbs::load() {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(error = %e, "libibverbs not available: no rdma transport");
                return Ok(None);
            }
        };
        let devices = match verbs.devices() {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!(error = %e, "cannot list RDMA devices: no rdma transport");
                return Ok(None);
            }
        };
        if devices.is_empty() {
            tracing::debug!("no RDMA device: no rdma transport");
            return Ok(None);
        }
        let wanted = cfg
            .rdma_device
            .clone()
            .or_else(|| std::env::var(DEVICE_ENV).ok().filter(|s| !s.is_empty()));
        let candidates: Vec<String> = match &wanted {
            Some(n) => vec![n.clone()],
            None => devices.iter().map(|d| d.name.clone()).collect(),
        };
        let mut last: Option<VerbsError> = None;
        for name in candidates {
            match Self::open_dev(&verbs, &name) {
                Ok(dev) => {
                    let dev = Arc::new(dev);
                    let d2 = dev.clone();
                    std::thread::Builder::new()
                        .name("kvwire-rdma-cq".into())
                        .spawn(move || completion_loop(d2))?;
                    tracing::debug!(device = %name, "rdma transport ready");
                    return Ok(Some(RdmaTransport {
                        dev,
                        lanes: cfg.lanes,
                        expiry: cfg.connect_timeout * 2 + PRE_EXPIRY_SLACK,
                        pre: Mutex::new(HashMap::new()),
                    }));
                }
                Err(e) => {
                    tracing::debug!(device = %name, error = %e, "RDMA device not usable");
                    last = Some(e);
                }
            }
        }
        match (wanted, last) {
            (Some(n), Some(e)) => Err(Error::Unsupported(format!("RDMA device {n}: {e}"))),
            _ => Ok(None),
        }
    }

    fn open_dev(verbs: &Verbs, name: &str) -> Result<Dev, VerbsError> {
        let ctx = verbs.open(name)?;
        let port = ctx.query_port(1)?;
        if !port.active {
            return Err(VerbsError::InvalidArgument(format!(
                "port 1 of {name} is not active"
            )));
        }
        let gid = ctx.select_gid(1)?;
        let pd = ctx.alloc_pd()?;
        let cq_entries = CQ_ENTRIES.min(ctx.max_cqe().max(1));
        let cq = ctx.create_cq(cq_entries)?;
        Ok(Dev {
            name: name.to_string(),
            pd,
            cq,
            port: 1,
            gid,
            lid: port.lid,
            mtu: port.active_mtu,
            _ctx: ctx,
            mrs: RwLock::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            next_peer: AtomicU32::new(1),
            stop: AtomicBool::new(false),
            cq_entries: cq_entries as usize,
            live_qps: Arc::new(AtomicUsize::new(0)),
        })
    }

    fn make_blob(&self) -> Result<Vec<u8>, Error> {
        {
            let now = Instant::now();
            self.pre
                .lock()
                .retain(|_, p| now.duration_since(p.created) < self.expiry);
        }
        let mut qps = Vec::with_capacity(self.lanes);
        for _ in 0..self.lanes {
            let qp = self.dev.create_qp()?;
            let psn = u32::from_le_bytes(crate::auth::random::<4>()) & 0x00ff_ffff;
            qps.push((qp, psn));
        }
        let nonce: [u8; 16] = crate::auth::random();
        let mut b = Vec::with_capacity(BLOB_HEAD + qps.len() * Endpoint::ENCODED_LEN);
        b.extend_from_slice(&nonce);
        b.push(self.dev.port);
        b.push(self.dev.gid.index);
        b.push(mtu_code(self.dev.mtu));
        b.push(qps.len() as u8);
        for (qp, psn) in &qps {
            b.extend_from_slice(&qp.endpoint(self.dev.gid.gid, self.dev.lid, *psn).to_bytes());
        }
        let mut pre = self.pre.lock();
        let now = Instant::now();
        pre.retain(|_, p| now.duration_since(p.created) < self.expiry);
        if pre.len() >= MAX_PRE {
            return Err(Error::Unsupported(
                "too many unclaimed RDMA queue pair sets".into(),
            ));
        }
        pre.insert(nonce, PreQps { created: now, qps });
        Ok(b)
    }

    /// The rkey of a region, when registered.
    pub fn rkey(&self, id: RegionId) -> Option<u32> {
        self.dev.mrs.read().get(&id).map(|m| m.mr.rkey())
    }

    /// Registers a region's memory with the device.
    pub fn add_region(&self, e: &RegionEntry) -> Result<(), Error> {
        let mut access = verbs::Access::LOCAL_WRITE;
        if e.access.remote_write() {
            access = access | verbs::Access::REMOTE_WRITE;
        }
        if e.access.remote_read() {
            access = access | verbs::Access::REMOTE_READ;
        }
        let mem = e.mem.clone();
        // SAFETY: the memory `mem.addr() .. + mem.len()` is owned (memfd mapping) or promised
        // valid by `Engine::register_raw`'s contract for as long as the `RegionMem` lives; the
        // `MrEntry` holds that `Arc<RegionMem>`, and every work request naming the MR holds the
        // `MrEntry`, so the memory outlives the registration and every use of it by the NIC.
        // The engine never hands out Rust references into region memory (copies go through
        // `RegionMem`), so concurrent NIC access races with no Rust reference.
        let mr = unsafe {
            self.dev
                .pd
                .register_raw(mem.addr() as *mut u8, mem.len(), access)
        }
        .map_err(verbs_err)?;
        self.dev
            .mrs
            .write()
            .insert(e.id, Arc::new(MrEntry { mr, _mem: mem }));
        Ok(())
    }

    /// Deregisters a region (in-flight work requests keep their MR until they complete).
    pub fn remove_region(&self, id: RegionId) {
        self.dev.mrs.write().remove(&id);
    }

    fn take_pre(&self, blob: &[u8]) -> Option<Vec<(DevQp, u32)>> {
        if blob.len() < 16 {
            return None;
        }
        let mut n = [0u8; 16];
        n.copy_from_slice(&blob[..16]);
        self.pre.lock().remove(&n).map(|p| p.qps)
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.dev.stop.store(true, Ordering::Release);
    }
}

fn qp_caps() -> QpCaps {
    QpCaps {
        max_send_wr: QP_DEPTH,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
    }
}

fn mtu_code(m: Mtu) -> u8 {
    match m {
        Mtu::M256 => 1,
        Mtu::M512 => 2,
        Mtu::M1024 => 3,
        Mtu::M2048 => 4,
        Mtu::M4096 => 5,
    }
}

fn mtu_from_code(c: u8) -> Option<Mtu> {
    Some(match c {
        1 => Mtu::M256,
        2 => Mtu::M512,
        3 => Mtu::M1024,
        4 => Mtu::M2048,
        5 => Mtu::M4096,
        _ => return None,
    })
}

/// A parsed remote blob.
struct RemoteBlob {
    mtu: Mtu,
    endpoints: Vec<Endpoint>,
}

fn parse_blob(b: &[u8]) -> Result<RemoteBlob, Error> {
    if b.len() < BLOB_HEAD {
        return Err(Error::Protocol("rdma blob too short".into()));
    }
    let mtu = mtu_from_code(b[18]).ok_or_else(|| Error::Protocol("rdma blob: bad MTU".into()))?;
    let n = b[19] as usize;
    if n == 0 || b.len() != BLOB_HEAD + n * Endpoint::ENCODED_LEN {
        return Err(Error::Protocol("rdma blob: bad endpoint count".into()));
    }
    let endpoints = b[BLOB_HEAD..]
        .chunks_exact(Endpoint::ENCODED_LEN)
        .map(Endpoint::from_bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Protocol(format!("rdma blob: {e}")))?;
    Ok(RemoteBlob { mtu, endpoints })
}

fn verbs_err(e: VerbsError) -> Error {
    Error::Io(std::io::Error::other(e.to_string()))
}

impl Transport for RdmaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }
    fn bit(&self) -> u8 {
        TRANSPORT_RDMA
    }
    fn hello_blob(&self) -> Option<Vec<u8>> {
        match self.make_blob() {
            Ok(b) => Some(b),
            Err(e) => {
                tracing::warn!(error = %e, "cannot prepare RDMA queue pairs; not offering rdma");
                None
            }
        }
    }
    fn usable_with(&self, _remote_host: &HostIdentity, remote_blob: Option<&[u8]>) -> bool {
        remote_blob.is_some_and(|b| parse_blob(b).is_ok())
    }
    fn attach_always(&self) -> bool {
        true
    }
    fn region_added(&self, e: &RegionEntry) -> Result<(), Error> {
        self.add_region(e)
    }
    fn region_removed(&self, id: RegionId) {
        self.remove_region(id)
    }
    fn region_rkey(&self, id: RegionId) -> u32 {
        self.rkey(id).unwrap_or(0)
    }
    fn establish(&self, ctx: EstablishCtx<'_>) -> Result<Arc<dyn PeerTransport>, Error> {
        let remote = parse_blob(
            ctx.remote_blob
                .ok_or_else(|| Error::Unsupported("peer did not offer rdma".into()))?,
        )?;
        let ours = ctx
            .local_blob
            .and_then(|b| self.take_pre(b))
            .ok_or_else(|| {
                Error::Unsupported("no RDMA queue pairs prepared for this peer".into())
            })?;
        let mtu = self.dev.mtu.min(remote.mtu);
        let mut lanes = Vec::new();
        for ((qp, psn), ep) in ours.into_iter().zip(remote.endpoints.iter()) {
            qp.connect(&ConnectParams::new(
                self.dev.port,
                self.dev.gid.index,
                mtu,
                *ep,
                psn,
            ))
            .map_err(verbs_err)?;
            let depth = qp.caps().max_send_wr.max(1) as usize;
            lanes.push(Lane {
                depth,
                st: Mutex::new(LaneState {
                    qp: Arc::new(qp),
                    outstanding: 0,
                    backlog: VecDeque::new(),
                    broken: false,
                    pending: None,
                    reconnects: 0,
                }),
                posted: AtomicU64::new(0),
                reestablished: AtomicU64::new(0),
            });
        }
        let key = self.dev.next_peer.fetch_add(1, Ordering::Relaxed);
        let sh = Arc::new(PeerShared {
            lanes,
            key,
            dev: Arc::downgrade(&self.dev),
            mtu,
            wrs: Mutex::new(HashMap::new()),
            next_wr: AtomicU32::new(1),
            next_lane: AtomicU32::new(0),
            slice: ctx.cfg.slice_size.min(1 << 30) as u64,
            ctrl: ctx.ctrl,
            on_dead: ctx.on_dead,
            closed: AtomicBool::new(false),
            reposts: AtomicU64::new(0),
        });
        self.dev.peers.lock().insert(key, Arc::downgrade(&sh));
        tracing::debug!(device = %self.dev.name, lanes = sh.lanes.len(), ?mtu, "rdma peer connected");
        Ok(Arc::new(RdmaPeer { sh }))
    }
}

// ---------------------------------------------------------------- per peer

/// Reconnection request: `[1][lane][nonce u64][endpoint]`; answer: `[2][lane][nonce][endpoint]`.
const MSG_RECONNECT: u8 = 1;
const MSG_RECONNECT_ACK: u8 = 2;
const MSG_LEN: usize = 10 + Endpoint::ENCODED_LEN;
/// A lane is re-established at most this many times (then it stays broken).
const MAX_RECONNECTS: u32 = 64;

#[derive(Clone, Copy)]
struct Wr {
    op: SendOp,
    sge: Sge,
    remote: RemoteSlice,
}

struct LaneState {
    qp: Arc<DevQp>,
    /// WRs posted on `qp` and not completed yet.
    outstanding: usize,
    backlog: VecDeque<u64>,
    broken: bool,
    /// Our reconnection request in flight: the new QP, its PSN, our tie-break nonce.
    pending: Option<(Arc<DevQp>, u32, u64)>,
    reconnects: u32,
}

struct Lane {
    depth: usize,
    st: Mutex<LaneState>,
    posted: AtomicU64,
    /// Times this lane's QP was replaced after an error (either side's request).
    reestablished: AtomicU64,
}

struct BatchCtx {
    state: Arc<BatchState>,
    left: AtomicU32,
    notify: Mutex<Option<Vec<u8>>>,
    /// WRs of the batch posted and not completed (the NIC may still touch their memory).
    on_nic: AtomicU32,
    /// Lanes the batch's WRs were posted on (bit per lane).
    lanes: AtomicU64,
}

/// How long a failing READ batch waits for its flushed WRs before the failure is published.
const QUIESCE_MAX: Duration = Duration::from_secs(5);

struct WrEntry {
    // Field order: the QP reference goes before the MR reference.
    qp: Option<Arc<DevQp>>,
    batch: Arc<BatchCtx>,
    lane: usize,
    wr: Wr,
    retries: u8,
    region: RegionId,
    _mr: Arc<MrEntry>,
}

struct PeerShared {
    // Field order: the lanes' QPs are released before the MRs the entries hold.
    lanes: Vec<Lane>,
    key: u32,
    dev: Weak<Dev>,
    mtu: Mtu,
    wrs: Mutex<HashMap<u64, WrEntry>>,
    next_wr: AtomicU32,
    next_lane: AtomicU32,
    slice: u64,
    ctrl: Arc<CtrlWriter>,
    on_dead: OnDead,
    closed: AtomicBool,
    /// Work requests re-posted on another lane after a flush (metrics).
    reposts: AtomicU64,
}

impl Drop for PeerShared {
    fn drop(&mut self) {
        if let Some(d) = self.dev.upgrade() {
            d.peers.lock().remove(&self.key);
        }
    }
}

/// Per-peer RDMA state.
pub(crate) struct RdmaPeer {
    sh: Arc<PeerShared>,
}

impl PeerShared {
    fn wr_id(&self) -> u64 {
        (u64::from(self.key) << 32) | u64::from(self.next_wr.fetch_add(1, Ordering::Relaxed))
    }

    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn recoverable(&self, st: &LaneState) -> bool {
        !self.closed() && st.reconnects < MAX_RECONNECTS
    }

    /// Lanes that post now, and broken lanes that will be re-established.
    fn lane_sets(&self) -> (Vec<usize>, Vec<usize>) {
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

    /// Posts what fits of the lane's backlog. Called with the lane state locked.
    fn pump(&self, lane: usize, st: &mut LaneState) -> Result<(), VerbsError> {
        let l = &self.lanes[lane];
        while !st.broken && !st.backlog.is_empty() && st.outstanding < l.depth {
            let k = (l.depth - st.outstanding).min(st.backlog.len());
            let ids: Vec<u64> = st.backlog.drain(..k).collect();
            let wrs: Vec<(u64, Wr)> = {
                let mut m = self.wrs.lock();
                let mut v = Vec::with_capacity(ids.len());
                for id in ids {
                    let done = match m.get(&id) {
                        Some(e) => e.batch.state.is_done(),
                        None => continue,
                    };
                    if done {
                        m.remove(&id); // timed out or failed meanwhile: not posted at all
                        continue;
                    }
                    if let Some(e) = m.get_mut(&id) {
                        e.qp = Some(st.qp.clone());
                        e.batch.on_nic.fetch_add(1, Ordering::AcqRel);
                        e.batch
                            .lanes
                            .fetch_or(1u64 << (lane % 64), Ordering::AcqRel);
                        v.push((id, e.wr));
                    }
                }
                v
            };
            if wrs.is_empty() {
                continue;
            }
            let reqs: Vec<SendRequest<'_>> = wrs
                .iter()
                .map(|(id, w)| SendRequest {
                    wr_id: *id,
                    op: w.op,
                    local: std::slice::from_ref(&w.sge),
                    remote: w.remote,
                    signaled: true,
                })
                .collect();
            if let Err(e) = st.qp.post_send(&reqs) {
                // A failed chain may have posted a prefix; the QP goes to the error state, so
                // whatever was posted flushes. Count it as posted (its completions come back) and
                // requeue the rest.
                let index = match &e {
                    VerbsError::PostFailed { index, .. } => *index,
                    _ => 0,
                };
                {
                    let mut m = self.wrs.lock();
                    for (id, _) in &wrs[index..] {
                        if let Some(x) = m.get_mut(id) {
                            x.qp = None;
                            x.batch.on_nic.fetch_sub(1, Ordering::AcqRel);
                        }
                        st.backlog.push_back(*id);
                    }
                }
                st.outstanding += index;
                return Err(e);
            }
            st.outstanding += wrs.len();
            l.posted.fetch_add(wrs.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Marks a lane broken: its QP goes to the error state, so every WR posted on it flushes.
    fn break_lane(&self, lane: usize, st: &mut LaneState) {
        if !st.broken {
            tracing::debug!(lane, "rdma lane broken");
            st.broken = true;
            let _ = st.qp.set_error();
        }
    }

    /// Queues WRs on a lane and posts what fits.
    fn submit(&self, lane: usize, ids: Vec<u64>) {
        let failed = {
            let mut st = self.lanes[lane].st.lock();
            if st.broken && !self.recoverable(&st) {
                ids
            } else {
                st.backlog.extend(ids);
                match self.pump(lane, &mut st) {
                    Ok(()) => Vec::new(),
                    Err(e) => {
                        tracing::warn!(lane, error = %e, "rdma post failed; lane broken");
                        self.break_lane(lane, &mut st);
                        Vec::new()
                    }
                }
            }
        };
        if !failed.is_empty() {
            self.reroute(failed, "lane broken");
        }
        self.maybe_reconnect(lane);
    }

    /// Moves WRs to a healthy lane (or one being re-established), or fails their batches.
    fn reroute(&self, ids: Vec<u64>, why: &str) {
        let (ok, later) = self.lane_sets();
        let targets = if ok.is_empty() { &later } else { &ok };
        let closed = self.closed();
        let mut by_lane: HashMap<usize, Vec<u64>> = HashMap::new();
        let mut fail: Vec<WrEntry> = Vec::new();
        {
            let mut m = self.wrs.lock();
            for id in ids {
                let Some(e) = m.get_mut(&id) else { continue };
                if closed
                    || targets.is_empty()
                    || e.retries >= MAX_RETRIES
                    || e.batch.state.is_done()
                {
                    if let Some(e) = m.remove(&id) {
                        fail.push(e);
                    }
                    continue;
                }
                e.retries += 1;
                e.qp = None;
                let l = targets[(id as usize) % targets.len()];
                e.lane = l;
                by_lane.entry(l).or_default().push(id);
            }
        }
        for e in fail {
            e.batch.state.fail(Error::PeerDead(format!(
                "rdma: {why}; no queue pair left for the transfer"
            )));
        }
        let n: usize = by_lane.values().map(Vec::len).sum();
        if n > 0 {
            self.reposts.fetch_add(n as u64, Ordering::Relaxed);
            tracing::debug!(wrs = n, why, "rdma work requests re-posted");
        }
        for (l, ids) in by_lane {
            self.submit(l, ids);
        }
        if targets.is_empty() && !closed {
            (self.on_dead)(format!("rdma: every queue pair failed ({why})"));
        }
    }

    /// One completion of ours.
    fn complete(&self, wr_id: u64, result: Result<(), WcStatus>) {
        let Some(mut e) = self.wrs.lock().remove(&wr_id) else {
            return;
        };
        let lane = e.lane;
        if e.qp.is_some() {
            e.batch.on_nic.fetch_sub(1, Ordering::AcqRel);
        }
        {
            let mut st = self.lanes[lane].st.lock();
            let current = e.qp.as_ref().is_some_and(|q| Arc::ptr_eq(q, &st.qp));
            if current {
                st.outstanding = st.outstanding.saturating_sub(1);
                if result.is_err() {
                    self.break_lane(lane, &mut st);
                }
            }
            if let Err(err) = self.pump(lane, &mut st) {
                tracing::warn!(lane, error = %err, "rdma post failed; lane broken");
                self.break_lane(lane, &mut st);
            }
        }
        e.qp = None;
        match result {
            Ok(()) => {
                if e.batch.left.fetch_sub(1, Ordering::AcqRel) == 1 {
                    self.finish(&e.batch);
                }
            }
            Err(WcStatus::WrFlush) => {
                // Flushed by a broken queue pair: post it again elsewhere.
                self.wrs.lock().insert(wr_id, e);
                self.reroute(vec![wr_id], "queue pair flushed");
            }
            Err(s) => {
                let err = match s {
                    WcStatus::RemoteAccess
                    | WcStatus::RemoteInvalidRequest
                    | WcStatus::RemoteInvalidRdRequest
                    | WcStatus::LocalProtection
                    | WcStatus::LocalAccess => Error::AccessDenied(e.region),
                    WcStatus::RetryExceeded
                    | WcStatus::RnrRetryExceeded
                    | WcStatus::ResponseTimeout => {
                        Error::PeerDead(format!("rdma: {s:?} (peer unreachable)"))
                    }
                    other => Error::Io(std::io::Error::other(format!(
                        "rdma work request failed: {other:?}"
                    ))),
                };
                tracing::debug!(lane, status = ?s, "rdma work request failed");
                e.batch.state.fail(err);
            }
        }
        self.maybe_reconnect(lane);
        if result.is_err() && !self.closed() {
            let (ok, later) = self.lane_sets();
            if ok.is_empty() && later.is_empty() {
                (self.on_dead)("rdma: every queue pair failed".into());
            }
        }
    }

    fn finish(&self, b: &BatchCtx) {
        if b.state.is_done() {
            return;
        }
        if let Some(tag) = b.notify.lock().take() {
            if let Err(e) = self.ctrl.send(&CtrlMsg::Notify(tag)) {
                b.state
                    .fail(Error::PeerDead(format!("sending notification: {e}")));
                return;
            }
        }
        b.state.part_done();
    }

    /// Breaks the lanes carrying a batch's WRs and waits (bounded) until none is on the NIC.
    fn quiesce(&self, b: &BatchCtx) {
        let mask = b.lanes.load(Ordering::Acquire);
        for (i, l) in self.lanes.iter().enumerate() {
            if mask & (1u64 << (i % 64)) != 0 && b.on_nic.load(Ordering::Acquire) > 0 {
                let mut st = l.st.lock();
                self.break_lane(i, &mut st);
            }
        }
        let t0 = Instant::now();
        while b.on_nic.load(Ordering::Acquire) > 0 && t0.elapsed() < QUIESCE_MAX {
            std::thread::sleep(Duration::from_micros(200));
        }
        if b.on_nic.load(Ordering::Acquire) > 0 {
            tracing::warn!("rdma: READs of a failed batch did not flush in time");
        }
    }

    fn new_qp(&self) -> Result<(Arc<DevQp>, u32, Endpoint), Error> {
        let dev = self.dev.upgrade().ok_or(Error::Shutdown)?;
        let qp = dev.create_qp()?;
        let psn = u32::from_le_bytes(crate::auth::random::<4>()) & 0x00ff_ffff;
        let ep = qp.endpoint(dev.gid.gid, dev.lid, psn);
        Ok((Arc::new(qp), psn, ep))
    }

    fn connect_qp(&self, qp: &Qp, psn: u32, remote: Endpoint) -> Result<(), Error> {
        let dev = self.dev.upgrade().ok_or(Error::Shutdown)?;
        qp.connect(&ConnectParams::new(
            dev.port,
            dev.gid.index,
            self.mtu,
            remote,
            psn,
        ))
        .map_err(verbs_err)
    }

    fn send_msg(&self, op: u8, lane: usize, nonce: u64, ep: &Endpoint) -> Result<(), Error> {
        let mut d = Vec::with_capacity(MSG_LEN);
        d.push(op);
        d.push(lane as u8);
        d.extend_from_slice(&nonce.to_le_bytes());
        d.extend_from_slice(&ep.to_bytes());
        self.ctrl.send(&CtrlMsg::Transport {
            bit: TRANSPORT_RDMA,
            data: d,
        })
    }

    /// A broken lane whose QP has drained asks the peer to re-establish it.
    fn maybe_reconnect(&self, lane: usize) {
        let (nonce, ep) = {
            let mut st = self.lanes[lane].st.lock();
            if !st.broken || st.pending.is_some() || st.outstanding > 0 || !self.recoverable(&st) {
                return;
            }
            let (qp, psn, ep) = match self.new_qp() {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(lane, error = %e, "cannot create a queue pair to reconnect");
                    return;
                }
            };
            let nonce = u64::from_le_bytes(crate::auth::random::<8>());
            st.pending = Some((qp, psn, nonce));
            st.reconnects += 1;
            (nonce, ep)
        };
        tracing::debug!(lane, "rdma lane: asking the peer to reconnect");
        if let Err(e) = self.send_msg(MSG_RECONNECT, lane, nonce, &ep) {
            tracing::debug!(lane, error = %e, "reconnect request not sent");
            self.lanes[lane].st.lock().pending = None;
        }
    }

    fn on_msg(&self, d: &[u8]) -> Result<(), Error> {
        if d.len() != MSG_LEN {
            return Err(Error::Protocol("rdma control message: bad length".into()));
        }
        let lane = d[1] as usize;
        if lane >= self.lanes.len() {
            return Err(Error::Protocol(format!(
                "rdma control message: lane {lane}"
            )));
        }
        let mut n = [0u8; 8];
        n.copy_from_slice(&d[2..10]);
        let nonce = u64::from_le_bytes(n);
        let ep = Endpoint::from_bytes(&d[10..])
            .map_err(|e| Error::Protocol(format!("rdma control message: {e}")))?;
        if self.closed() {
            return Ok(());
        }
        match d[0] {
            MSG_RECONNECT => {
                let mut st = self.lanes[lane].st.lock();
                if let Some((_, _, mine)) = &st.pending {
                    if *mine > nonce {
                        return Ok(()); // both asked: the larger nonce wins, the peer answers ours
                    }
                }
                st.pending = None;
                let made = self.new_qp().and_then(|(qp, psn, my_ep)| {
                    self.connect_qp(&qp, psn, ep).map(|()| (qp, my_ep))
                });
                let (qp, my_ep) = match made {
                    Ok(x) => x,
                    Err(e) => {
                        // The peer's lane stays broken; its batches go to the other lanes.
                        tracing::warn!(lane, error = %e, "cannot re-establish a queue pair");
                        return Ok(());
                    }
                };
                let old = std::mem::replace(&mut st.qp, qp);
                let _ = old.set_error(); // whatever was posted on it flushes and is re-posted
                st.outstanding = 0;
                st.broken = false;
                if let Err(e) = self.pump(lane, &mut st) {
                    tracing::warn!(lane, error = %e, "rdma post failed; lane broken");
                    self.break_lane(lane, &mut st);
                }
                drop(st);
                self.lanes[lane]
                    .reestablished
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(lane, "rdma lane re-established (peer's request)");
                self.send_msg(MSG_RECONNECT_ACK, lane, nonce, &my_ep)
            }
            MSG_RECONNECT_ACK => {
                let mut st = self.lanes[lane].st.lock();
                let Some((qp, psn, mine)) = st.pending.take() else {
                    return Ok(()); // stale answer
                };
                if mine != nonce {
                    st.pending = Some((qp, psn, mine));
                    return Ok(());
                }
                if let Err(e) = self.connect_qp(&qp, psn, ep) {
                    tracing::warn!(lane, error = %e, "cannot re-establish a queue pair");
                    return Ok(());
                }
                st.qp = qp;
                st.outstanding = 0;
                st.broken = false;
                if let Err(e) = self.pump(lane, &mut st) {
                    tracing::warn!(lane, error = %e, "rdma post failed; lane broken");
                    self.break_lane(lane, &mut st);
                }
                self.lanes[lane]
                    .reestablished
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(lane, "rdma lane re-established");
                Ok(())
            }
            op => Err(Error::Protocol(format!("rdma control message: op {op}"))),
        }
    }
}

impl PeerTransport for RdmaPeer {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn post(&self, b: Posted, pending: &Arc<Pending>) -> Result<Arc<BatchState>, Error> {
        let sh = &self.sh;
        if sh.closed() {
            return Err(Error::PeerDead("peer closed".into()));
        }
        let dev = sh.dev.upgrade().ok_or(Error::Shutdown)?;
        // Cut into WRs first (typed errors before anything is posted).
        struct Cut {
            wr: Wr,
            region: RegionId,
            mr: Arc<MrEntry>,
        }
        let mut cuts: Vec<Cut> = Vec::new();
        {
            let mrs = dev.mrs.read();
            for x in &b.xfers {
                // Not registered any more: the region was unregistered meanwhile.
                let mr = mrs
                    .get(&x.local.id)
                    .cloned()
                    .ok_or(Error::StaleRegion(x.local.id))?;
                if x.remote.rkey == 0 {
                    return Err(Error::Unsupported(format!(
                        "remote region {:?} carries no RDMA key",
                        x.remote.id
                    )));
                }
                let base = x
                    .remote
                    .addr
                    .checked_add(x.remote_offset)
                    .ok_or_else(|| Error::InvalidArgument("remote address overflow".into()))?;
                let mut done = 0u64;
                while done < x.len {
                    let n = (x.len - done).min(sh.slice);
                    let lo = usize::try_from(x.local_offset + done)
                        .map_err(|_| Error::InvalidArgument("offset too large".into()))?;
                    let sge = mr
                        .mr
                        .sge(lo, n as usize)
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    cuts.push(Cut {
                        wr: Wr {
                            op: match b.dir {
                                Dir::Write => SendOp::Write,
                                Dir::Read => SendOp::Read,
                            },
                            sge,
                            remote: RemoteSlice {
                                addr: base + done,
                                rkey: x.remote.rkey,
                            },
                        },
                        region: x.remote.id,
                        mr: mr.clone(),
                    });
                    done += n;
                }
            }
        }
        let stats = BatchStats {
            bytes: b.bytes,
            ops: b.ops,
            writes: b.xfers.len(),
            slices: cuts.len(),
            transport: TransportKind::Rdma,
        };
        let st = BatchState::new(b.id, 1, stats, b.deadline, Vec::new(), &b.timer).posted_as(&b);
        pending.insert(&st)?;
        let ctx = Arc::new(BatchCtx {
            state: st.clone(),
            left: AtomicU32::new(cuts.len() as u32),
            notify: Mutex::new(b.notify),
            on_nic: AtomicU32::new(0),
            lanes: AtomicU64::new(0),
        });
        if b.dir == Dir::Read {
            // At a deadline (or any failure from outside the data path), READs still in flight
            // could land in the caller's memory after the caller saw the error: break the lanes
            // they are on (their WRs flush, other batches' WRs are re-posted, the lanes are
            // re-established) and wait, bounded, for the flush.
            let (w, c) = (Arc::downgrade(sh), Arc::downgrade(&ctx));
            st.set_on_fail(Box::new(move |e: &Error| {
                if !matches!(e, Error::Timeout) {
                    return;
                }
                let (Some(sh), Some(c)) = (w.upgrade(), c.upgrade()) else {
                    return;
                };
                sh.quiesce(&c);
            }));
        }
        if cuts.is_empty() {
            sh.finish(&ctx);
            return Ok(st);
        }
        let (ok, later) = sh.lane_sets();
        let targets = if ok.is_empty() { later } else { ok };
        if targets.is_empty() {
            let e = Error::PeerDead("rdma: no usable queue pair".into());
            st.fail(e.duplicate());
            return Err(e);
        }
        let start = sh.next_lane.fetch_add(1, Ordering::Relaxed) as usize;
        let mut by_lane: Vec<Vec<u64>> = vec![Vec::new(); sh.lanes.len()];
        {
            let mut m = sh.wrs.lock();
            for (i, c) in cuts.into_iter().enumerate() {
                let lane = targets[(start + i) % targets.len()];
                let id = sh.wr_id();
                m.insert(
                    id,
                    WrEntry {
                        qp: None,
                        batch: ctx.clone(),
                        lane,
                        wr: c.wr,
                        retries: 0,
                        region: c.region,
                        _mr: c.mr,
                    },
                );
                by_lane[lane].push(id);
            }
        }
        for (lane, ids) in by_lane.into_iter().enumerate() {
            if !ids.is_empty() {
                sh.submit(lane, ids);
            }
        }
        Ok(st)
    }

    fn lane_counters(&self) -> Vec<u64> {
        self.sh
            .lanes
            .iter()
            .map(|l| l.posted.load(Ordering::Relaxed))
            .collect()
    }

    fn on_ctrl(&self, data: &[u8]) -> Result<(), Error> {
        self.sh.on_msg(data)
    }

    fn reposts(&self) -> u64 {
        self.sh.reposts.load(Ordering::Relaxed)
    }

    fn lanes_reestablished(&self) -> u64 {
        self.sh
            .lanes
            .iter()
            .map(|l| l.reestablished.load(Ordering::Relaxed))
            .sum()
    }

    fn close(&self) {
        if self.sh.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        for l in &self.sh.lanes {
            let mut st = l.st.lock();
            st.broken = true;
            st.backlog.clear();
            st.pending = None;
            let _ = st.qp.set_error();
        }
        // The engine fails in-flight batches; drop their entries (the QPs flush what was posted).
        let all: Vec<WrEntry> = self.sh.wrs.lock().drain().map(|(_, e)| e).collect();
        for e in all {
            e.batch.state.fail(Error::PeerDead("peer closed".into()));
        }
    }
}

fn completion_loop(dev: Arc<Dev>) {
    let mut out = Vec::with_capacity(64);
    while !dev.stop.load(Ordering::Acquire) {
        out.clear();
        match dev.cq.wait(&mut out, 64, Duration::from_millis(200)) {
            Ok(_) => {}
            Err(VerbsError::Timeout(_)) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "rdma completion queue failed");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        }
        for c in out.drain(..) {
            let key = (c.wr_id >> 32) as u32;
            let peer = dev.peers.lock().get(&key).and_then(|w| w.upgrade());
            let Some(p) = peer else { continue };
            p.complete(c.wr_id, c.result.map(|_| ()).map_err(|e| e.status));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blob_parsing_rejects_malformed_input() {
        assert!(parse_blob(&[]).is_err());
        let mut b = vec![0u8; BLOB_HEAD];
        b[18] = 5;
        b[19] = 0;
        assert!(parse_blob(&b).is_err()); // no endpoints
        b[19] = 1;
        assert!(parse_blob(&b).is_err()); // count without bytes
        let ep = Endpoint {
            gid: verbs::Gid([1; 16]),
            qpn: 17,
            psn: 3,
            lid: 0,
        };
        b.extend_from_slice(&ep.to_bytes());
        let p = parse_blob(&b).expect("valid blob");
        assert_eq!(p.endpoints, vec![ep]);
        assert_eq!(p.mtu, Mtu::M4096);
        b[18] = 9;
        assert!(parse_blob(&b).is_err()); // bad MTU
        b[18] = 5;
        b[BLOB_HEAD + 16..BLOB_HEAD + 20].copy_from_slice(&0u32.to_be_bytes());
        assert!(parse_blob(&b).is_err()); // QPN 0
    }
}

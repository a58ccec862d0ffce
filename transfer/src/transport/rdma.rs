//! RDMA transport: RC queue pairs over one or several verbs devices per engine, one-sided WRITE
//! and READ.
//!
//! * **Devices**: the engine opens every device it is given
//!   ([`crate::EngineConfig::rdma_devices`], else [`crate::EngineConfig::rdma_device`], else
//!   [`crate::EngineConfig::rdma_device_fallback`], which `EngineConfig::from_env` fills from
//!   `$KVWIRE_RDMA_DEVICE`; the last two may be comma lists) or, when none is named, every
//!   device with an active port (in natural name order: `mlx5_2` before `mlx5_10`). Each device gets one PD, one CQ with its completion
//!   channel and one completion thread that sleeps on the channel when idle (a short bounded
//!   poll burst first, inside `Cq::wait`). See `docs/rdma_hardware_plan.md` for why "all active
//!   devices" is the default and when to name devices instead (NUMA/PCIe locality).
//! * **Regions**: every region is registered as an MR on every device when it is added (local
//!   ones with local write only; offered ones with the remote rights their `Access` grants), so
//!   the NIC enforces the region's bounds and rights. The rkey on the first device and the
//!   address travel in the region announcements (`WireRegion::rkey`, `WireRegion::addr`); the
//!   rkeys on the other devices are fetched by the initiator over the control connection the
//!   first time it writes to or reads from the region (key request and answer, `wire::rdma`); until they
//!   arrive, that region's slices use the queue pairs that reach the remote's first device. The
//!   MR holds the region memory alive; an in-flight work request holds its MR alive.
//! * **Device pairs**: the handshake blob lists our devices (port, GID index, MTU, link class)
//!   and `lanes` fresh RC QPs per device, keyed by a random nonce. Both sides compute the same
//!   pairing of local and remote devices (the side with the smaller nonce's device order
//!   decides; device *i* is matched with the first unmatched remote device of the same link
//!   class, starting at index *i*, so equally ordered rails pair rail to rail), and connect
//!   lane *i* of each pair to the peer's lane *i* of the same pair. Lanes are numbered
//!   interleaved over the pairs (lane 0 on pair 0, lane 1 on pair 1, …) so that round-robin
//!   striping alternates devices. Unclaimed QPs expire. Both sides connect their QPs whenever
//!   both offered RDMA, whatever each chose for its own direction (the other may write into us).
//! * **Posting**: each coalesced transfer is cut into slices of at most `cfg.slice_size`,
//!   striped round-robin over the healthy lanes (of every device pair) whose remote device key
//!   is known; each lane posts its WRs as one chain, at most the QP's send depth outstanding
//!   (the rest waits in the lane's backlog, posted by the completion thread as slots free).
//!   One WR in [`crate::EngineConfig::rdma_signal_every`] (default 1: all) and the last of every chain are
//!   signalled (`signal_plan`); a signalled WR's *successful* completion also completes the
//!   unsignalled WRs before it on its QP (RC completes in order; failed and flushed WRs always
//!   report). When the signalled WR fails or is flushed, the unsignalled WRs it covers that are
//!   still on that QP are not inferred done: they are posted again like flushed ones
//!   (`covered_outcome`; WRITE and READ are idempotent). A completion is accepted only from
//!   the QP its WR is posted on now (`completion_is_current`); one from a QP the WR left is
//!   ignored. Values above 1 are still experimental (see that field).
//! * **Completion threads**: one per device; after a round that reaped completions, while WRs
//!   are on the NIC, the CQ is polled for up to [`crate::EngineConfig::rdma_poll`] (default 0: off) before
//!   the thread arms it and sleeps on the completion channel (never polled while idle).
//! * **Completion**: when every WR of a batch completed, its notification (if any) is sent over
//!   the control connection (so it always follows the data) with the engine's fence, and the
//!   batch completes when the target confirms it queued the notification; without one, at once.
//! * **Errors**: a failed WR breaks its lane (the QP is moved to the error state, so its other
//!   WRs flush); flushed WRs of other batches are re-posted on a healthy lane, possibly of
//!   another device pair (bounded retries); the failing batch gets a typed error
//!   (`AccessDenied` for a remote access/bounds violation found by the NIC). A WR the peer did
//!   not answer (transport retries exhausted) is retried on another lane like a flushed one;
//!   when its retries run out the batch fails with `PeerDead`. When every lane is broken the
//!   peer is declared dead (the engine fails its in-flight batches; reconnect to recover).
//! * **Provider-failed queue pairs**: a flush from a QP the engine did not move to the error
//!   state, with no error completion before it, means the provider failed a WR without saying
//!   so. SoftRoCE (Linux 6.1) does this when a READ's response stream is interrupted by packet
//!   drops (a NAK mid-sequence): it reports that READ *successful*, though its data never
//!   landed, and errors the QP. So the WR a lane's QP reported successful last is kept while
//!   its batch is in flight, and posted again on such a flush (`repost_suspect`); the batch
//!   cannot complete before it completes again. If the failed READ was the last WR on its QP
//!   and its batch completed, nothing shows it until the next post there (then logged).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::{EstablishCtx, OnDead, PeerTransport, Transport};
use crate::batch::{BatchState, Pending, Posted};
use crate::config::{EngineConfig, RDMA_SIGNAL_ENV};
use crate::ctrl::CtrlWriter;
use crate::error::Error;
use crate::mem::RegionMrs;
use crate::region::RegionEntry;
use crate::types::{BatchStats, Dir, RegionId, TransportKind};
use crate::wire::rdma::{
    blob_nonce, encode_blob, keys_per_msg, parse_blob, BlobDev, LaneOp, RdmaMsg, KEYS_REQ_PER_MSG,
    LINK_ETH_V4, LINK_ETH_V6, LINK_IB, MAX_DEVICES, MAX_LANES,
};
use crate::wire::{HostIdentity, ProtocolError, TRANSPORT_RDMA};
use kvwire_verbs::{
    ConnectParams, Context, Cq, Endpoint, GidSelection, LinkLayer, Mtu, Pd, Qp, QpCaps,
    RemoteSlice, SendOp, SendRequest, Sge, Verbs, VerbsError, WcStatus, DEFAULT_LIBRARY,
};

/// Unclaimed pre-created QP sets live this long beyond the connect timeout.
const PRE_EXPIRY_SLACK: Duration = Duration::from_secs(5);
/// At most this many unclaimed QP sets at once (beyond: RDMA is not offered in that handshake).
const MAX_PRE: usize = 128;
/// Flushed WRs are re-posted on another lane at most this many times.
const MAX_RETRIES: u8 = 3;
/// Send queue depth per QP.
const QP_DEPTH: u32 = 256;
/// Completion queue entries per device (shared by every QP of the device, capped by the
/// device's limit). Sized as if every WR were signalled: at most `CQ entries / QP_DEPTH` QPs exist at once
/// on a device (counting QPs prepared for handshakes); beyond that a handshake does not offer
/// rdma.
const CQ_ENTRIES: u32 = 65536;
/// Remote key entries kept per peer (beyond: the table is cleared and refilled on demand).
const MAX_KEYS: usize = 1 << 16;
/// Tracing target of the per-work-request events (posted, completion, re-posted) and of lane
/// breaks and re-establishments, for diagnosing the data path (`trace`/`debug` level).
pub(crate) const WR_TRACE: &str = "kvwire::rdma::wr";
/// Signal one WR in this many when the configuration does not say
/// ([`EngineConfig::rdma_signal_every`]: experimental above 1).
const SIGNAL_EVERY: usize = 1;
/// The completion threads' poll window when the configuration does not say
/// ([`EngineConfig::rdma_poll`]; 0 = never).
const POLL_US: u64 = 0;
/// The largest poll window.
const MAX_POLL_US: u64 = 10_000;

/// A registered region: one MR per device and the memory they cover (kept alive next to them).
pub(crate) struct MrSet {
    /// Index = local device index.
    mrs: RegionMrs,
    /// Offered to peers (remote rights granted).
    offered: bool,
}

struct Dev {
    index: usize,
    name: String,
    _ctx: Context,
    pd: Pd,
    cq: Cq,
    port: u8,
    gid: GidSelection,
    lid: u16,
    mtu: Mtu,
    link: u8,
    cq_entries: usize,
    live_qps: Arc<AtomicUsize>,
    /// WRs posted on this device's QPs and not completed yet (a hint for the completion
    /// thread's poll window).
    inflight: Arc<AtomicUsize>,
}

/// State shared by the transport, its completion threads and its peers.
struct Shared {
    devs: Vec<Arc<Dev>>,
    mrs: RwLock<HashMap<RegionId, Arc<MrSet>>>,
    peers: Mutex<HashMap<u32, Weak<PeerShared>>>,
    next_peer: AtomicU32,
    stop: AtomicBool,
    /// Signal one WR in this many (≥ 1).
    signal_every: usize,
    /// Completion-thread poll window.
    poll: Duration,
}

struct PreQps {
    created: Instant,
    /// Per local device: its QPs and their first PSNs.
    per_dev: Vec<Vec<(DevQp, u32)>>,
}

/// A QP of a device, counted against the device's QP budget while it lives (every QP's
/// signalled WRs must fit the device's shared CQ).
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

fn link_class(link: LinkLayer, gid: &GidSelection) -> u8 {
    match link {
        LinkLayer::Infiniband => LINK_IB,
        _ if gid.gid.ipv4().is_some() => LINK_ETH_V4,
        _ => LINK_ETH_V6,
    }
}

/// Splits a comma list of device names (blanks ignored, duplicates dropped, order kept).
pub(crate) fn device_list(s: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for n in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if !out.iter().any(|x| x == n) {
            out.push(n.to_string());
        }
    }
    out
}

/// Natural order of device names: `mlx5_2` before `mlx5_10`.
fn natural_key(name: &str) -> (String, u64, String) {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (stem, num) = name.split_at(name.len() - digits);
    (
        stem.to_string(),
        num.parse().unwrap_or(u64::MAX),
        name.to_string(),
    )
}

/// The devices the configuration names (`None` = every usable device).
fn wanted_devices(cfg: &EngineConfig) -> Option<Vec<String>> {
    if !cfg.rdma_devices.is_empty() {
        let v = device_list(&cfg.rdma_devices.join(","));
        return (!v.is_empty()).then_some(v);
    }
    if let Some(d) = &cfg.rdma_device {
        let v = device_list(d);
        if !v.is_empty() {
            return Some(v);
        }
    }
    cfg.rdma_device_fallback
        .as_deref()
        .map(device_list)
        .filter(|v| !v.is_empty())
}

/// Pairs the devices of the side whose order decides (`first`, link classes) with the other
/// side's (`second`): device *i* takes the first unmatched device of the same class, scanning
/// from index *i*. Returns `(first index, second index)` in `first` order.
fn pair_devices(first: &[u8], second: &[u8]) -> Vec<(usize, usize)> {
    let m = second.len();
    let mut used = vec![false; m];
    let mut out = Vec::new();
    if m == 0 {
        return out;
    }
    for (i, c) in first.iter().enumerate() {
        for k in 0..m {
            let j = (i + k) % m;
            if !used[j] && second[j] == *c {
                used[j] = true;
                out.push((i, j));
                break;
            }
        }
    }
    out
}

/// The RDMA transport of one engine (one or several devices).
pub(crate) struct RdmaTransport {
    sh: Arc<Shared>,
    /// QPs prepared per device and handshake (= lanes per device pair).
    lanes: usize,
    expiry: Duration,
    pre: Mutex<HashMap<[u8; 16], PreQps>>,
}

impl RdmaTransport {
    /// Opens the configured devices; `Ok(None)` when RDMA is not available here (no library, no
    /// usable device), with the reason logged. A device named in the configuration that cannot
    /// be opened is an error.
    pub fn open(cfg: &EngineConfig) -> Result<Option<RdmaTransport>, Error> {
        let path = cfg
            .ibverbs_path
            .as_deref()
            .filter(|p| !p.is_empty())
            .unwrap_or(DEFAULT_LIBRARY);
        let verbs = match Verbs::load_from(path) {
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
        let wanted = wanted_devices(cfg);
        let candidates: Vec<String> = match &wanted {
            Some(v) => v.clone(),
            None => {
                let mut v: Vec<String> = devices.iter().map(|d| d.name.clone()).collect();
                v.sort_by_key(|n| natural_key(n));
                v
            }
        };
        if candidates.len() > MAX_DEVICES && wanted.is_some() {
            return Err(Error::InvalidArgument(format!(
                "{} RDMA devices named (at most {MAX_DEVICES})",
                candidates.len()
            )));
        }
        let mut devs: Vec<Arc<Dev>> = Vec::new();
        for name in candidates {
            if devs.len() == MAX_DEVICES {
                break;
            }
            match Self::open_dev(&verbs, &name, devs.len()) {
                Ok(dev) => devs.push(Arc::new(dev)),
                Err(e) if wanted.is_some() => {
                    return Err(Error::Unsupported(format!("RDMA device {name}: {e}")));
                }
                Err(e) => {
                    tracing::debug!(device = %name, error = %e, "RDMA device not usable");
                }
            }
        }
        if devs.is_empty() {
            return Ok(None);
        }
        let signal_every = cfg
            .rdma_signal_every
            .unwrap_or(SIGNAL_EVERY as u64)
            .min(u64::from(QP_DEPTH))
            .max(1) as usize;
        if signal_every > 1 {
            tracing::warn!(
                var = RDMA_SIGNAL_ENV,
                value = signal_every,
                "selective signalling is an unfinished experiment (in the SoftRoCE VM, READ \
                 batches over two devices were seen completing with a slice unwritten); do not \
                 use it for real data"
            );
        }
        let sh = Arc::new(Shared {
            devs,
            mrs: RwLock::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            next_peer: AtomicU32::new(1),
            stop: AtomicBool::new(false),
            signal_every,
            poll: cfg
                .rdma_poll
                .unwrap_or(Duration::from_micros(POLL_US))
                .min(Duration::from_micros(MAX_POLL_US)),
        });
        for d in &sh.devs {
            let (s2, i) = (sh.clone(), d.index);
            let spawned = std::thread::Builder::new()
                .name(format!("kvwire-rdma-cq{i}"))
                .spawn(move || completion_loop(s2, i));
            if let Err(e) = spawned {
                sh.stop.store(true, Ordering::Release);
                return Err(e.into());
            }
        }
        let names: Vec<&str> = sh.devs.iter().map(|d| d.name.as_str()).collect();
        if wanted.is_none() {
            let mut numa: Vec<u32> = devices
                .iter()
                .filter(|d| names.contains(&d.name.as_str()))
                .filter_map(|d| d.numa_node)
                .collect();
            numa.sort_unstable();
            numa.dedup();
            if numa.len() > 1 {
                tracing::warn!(
                    devices = ?names,
                    numa_nodes = ?numa,
                    "rdma: no device named, so every active device is used, on several NUMA \
                     nodes; name the NICs close to the memory (EngineConfig::rdma_devices or \
                     KVWIRE_RDMA_DEVICE), see docs/rdma_hardware_plan.md"
                );
            }
        }
        tracing::debug!(devices = ?names, "rdma transport ready");
        let ndev = sh.devs.len();
        Ok(Some(RdmaTransport {
            sh,
            lanes: cfg.lanes.clamp(1, (MAX_LANES / ndev).max(1)),
            expiry: cfg.connect_timeout * 2 + PRE_EXPIRY_SLACK,
            pre: Mutex::new(HashMap::new()),
        }))
    }

    fn open_dev(verbs: &Verbs, name: &str, index: usize) -> Result<Dev, VerbsError> {
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
            index,
            name: name.to_string(),
            pd,
            cq,
            port: 1,
            link: link_class(port.link_layer, &gid),
            gid,
            lid: port.lid,
            mtu: port.active_mtu,
            _ctx: ctx,
            cq_entries: cq_entries as usize,
            live_qps: Arc::new(AtomicUsize::new(0)),
            inflight: Arc::new(AtomicUsize::new(0)),
        })
    }

    fn make_blob(&self) -> Result<Vec<u8>, Error> {
        {
            let now = Instant::now();
            self.pre
                .lock()
                .retain(|_, p| now.duration_since(p.created) < self.expiry);
        }
        let mut per_dev = Vec::with_capacity(self.sh.devs.len());
        for d in &self.sh.devs {
            let mut qps = Vec::with_capacity(self.lanes);
            for _ in 0..self.lanes {
                let qp = d.create_qp()?;
                let psn = u32::from_le_bytes(crate::auth::random::<4>()) & 0x00ff_ffff;
                qps.push((qp, psn));
            }
            per_dev.push(qps);
        }
        let nonce: [u8; 16] = crate::auth::random();
        let devs: Vec<BlobDev> = self
            .sh
            .devs
            .iter()
            .zip(&per_dev)
            .map(|(d, qps)| BlobDev {
                port: d.port,
                gid_index: d.gid.index,
                mtu: d.mtu,
                link: d.link,
                endpoints: qps
                    .iter()
                    .map(|(qp, psn)| qp.endpoint(d.gid.gid, d.lid, *psn))
                    .collect(),
            })
            .collect();
        let b = encode_blob(&nonce, &devs);
        let mut pre = self.pre.lock();
        let now = Instant::now();
        pre.retain(|_, p| now.duration_since(p.created) < self.expiry);
        if pre.len() >= MAX_PRE {
            return Err(Error::Unsupported(
                "too many unclaimed RDMA queue pair sets".into(),
            ));
        }
        pre.insert(
            nonce,
            PreQps {
                created: now,
                per_dev,
            },
        );
        Ok(b)
    }

    /// The rkey of a region on the first device, when registered.
    pub fn rkey(&self, id: RegionId) -> Option<u32> {
        self.sh
            .mrs
            .read()
            .get(&id)
            .and_then(|m| m.mrs.get(0).map(|mr| mr.rkey()))
    }

    /// Registers a region's memory with every device.
    pub fn add_region(&self, e: &RegionEntry) -> Result<(), Error> {
        let mut access = kvwire_verbs::Access::LOCAL_WRITE;
        if e.access.remote_write() {
            access = access | kvwire_verbs::Access::REMOTE_WRITE;
        }
        if e.access.remote_read() {
            access = access | kvwire_verbs::Access::REMOTE_READ;
        }
        let mrs = RegionMrs::register(&e.mem, self.sh.devs.iter().map(|d| &d.pd), access).map_err(
            |(i, err)| {
                Error::Io(std::io::Error::other(format!(
                    "registering region {:?} on {}: {err}",
                    e.id, self.sh.devs[i].name
                )))
            },
        )?;
        self.sh.mrs.write().insert(
            e.id,
            Arc::new(MrSet {
                mrs,
                offered: e.access.offered(),
            }),
        );
        Ok(())
    }

    /// Deregisters a region (in-flight work requests keep their MRs until they complete).
    pub fn remove_region(&self, id: RegionId) {
        self.sh.mrs.write().remove(&id);
    }

    fn take_pre(&self, blob: &[u8]) -> Option<Vec<Vec<(DevQp, u32)>>> {
        let n = blob_nonce(blob)?;
        self.pre.lock().remove(&n).map(|p| p.per_dev)
    }

    fn local_classes(&self) -> Vec<u8> {
        self.sh.devs.iter().map(|d| d.link).collect()
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.sh.stop.store(true, Ordering::Release);
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
        let Some(r) = remote_blob.and_then(|b| parse_blob(b).ok()) else {
            return false;
        };
        let theirs: Vec<u8> = r.devs.iter().map(|d| d.link).collect();
        !pair_devices(&self.local_classes(), &theirs).is_empty()
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
    // Lane `i` of every pair indexes the prepared QPs, the remote endpoints and the pair list.
    #[allow(clippy::needless_range_loop)]
    fn establish(&self, ctx: EstablishCtx<'_>) -> Result<Arc<dyn PeerTransport>, Error> {
        let remote = parse_blob(
            ctx.remote_blob
                .ok_or_else(|| Error::Unsupported("peer did not offer rdma".into()))?,
        )?;
        let local_blob = ctx
            .local_blob
            .ok_or_else(|| Error::Unsupported("we did not offer rdma to this peer".into()))?;
        let mut ours = self.take_pre(local_blob).ok_or_else(|| {
            Error::Unsupported("no RDMA queue pairs prepared for this peer".into())
        })?;
        if local_blob[..16] == remote.nonce {
            return Err(ProtocolError::EchoedNonce.into());
        }
        // Both sides pair the devices in the order of the side with the smaller nonce.
        let mine = self.local_classes();
        let theirs: Vec<u8> = remote.devs.iter().map(|d| d.link).collect();
        let pairs: Vec<(usize, usize)> = if local_blob[..16] < remote.nonce[..] {
            pair_devices(&mine, &theirs)
        } else {
            pair_devices(&theirs, &mine)
                .into_iter()
                .map(|(r, l)| (l, r))
                .collect()
        };
        if pairs.is_empty() {
            return Err(Error::Unsupported(
                "no local RDMA device can reach a device of the peer".into(),
            ));
        }
        // Per pair, the lanes both sides prepared; lanes interleaved over the pairs.
        let per_pair: Vec<usize> = pairs
            .iter()
            .map(|&(l, r)| ours[l].len().min(remote.devs[r].endpoints.len()))
            .collect();
        let mut slots: Vec<Vec<Option<(DevQp, u32)>>> = ours
            .iter_mut()
            .map(|v| v.drain(..).map(Some).collect())
            .collect();
        let mut lanes = Vec::new();
        let most = per_pair.iter().copied().max().unwrap_or(0);
        'outer: for i in 0..most {
            for (p, &(l, r)) in pairs.iter().enumerate() {
                if i >= per_pair[p] {
                    continue;
                }
                if lanes.len() == MAX_LANES {
                    break 'outer;
                }
                let Some((qp, psn)) = slots[l][i].take() else {
                    continue;
                };
                let dev = &self.sh.devs[l];
                let rd = &remote.devs[r];
                let mtu = dev.mtu.min(rd.mtu);
                qp.connect(&ConnectParams::new(
                    dev.port,
                    dev.gid.index,
                    mtu,
                    rd.endpoints[i],
                    psn,
                ))
                .map_err(verbs_err)?;
                let depth = qp.caps().max_send_wr.max(1) as usize;
                lanes.push(Lane {
                    ldev: l,
                    rdev: r,
                    inflight: dev.inflight.clone(),
                    mtu,
                    depth,
                    st: Mutex::new(LaneState {
                        qp: Arc::new(qp),
                        outstanding: 0,
                        backlog: VecDeque::new(),
                        broken: false,
                        pending: None,
                        reconnects: 0,
                        last_ok: None,
                    }),
                    posted: AtomicU64::new(0),
                    reestablished: AtomicU64::new(0),
                });
            }
        }
        drop(slots); // QPs of devices without a partner
        let key = self.sh.next_peer.fetch_add(1, Ordering::Relaxed);
        let sh = Arc::new(PeerShared {
            lanes,
            key,
            signal_every: self.sh.signal_every,
            tr: Arc::downgrade(&self.sh),
            remote_devs: remote.devs.len(),
            wrs: Mutex::new(HashMap::new()),
            next_wr: AtomicU32::new(1),
            next_lane: AtomicU32::new(0),
            slice: ctx.cfg.slice_size.min(1 << 30) as u64,
            ctrl: ctx.ctrl,
            on_dead: ctx.on_dead,
            closed: AtomicBool::new(false),
            reposts: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            keys: RwLock::new(HashMap::new()),
            asked: Mutex::new(HashSet::new()),
        });
        self.sh.peers.lock().insert(key, Arc::downgrade(&sh));
        let names: Vec<String> = pairs
            .iter()
            .map(|&(l, r)| format!("{}->remote#{r}", self.sh.devs[l].name))
            .collect();
        tracing::debug!(pairs = ?names, lanes = sh.lanes.len(), "rdma peer connected");
        Ok(Arc::new(RdmaPeer { sh }))
    }
}

// ---------------------------------------------------------------- per peer

/// A lane is re-established at most this many times (then it stays broken).
const MAX_RECONNECTS: u32 = 64;

/// Which WRs of a chain of `n` (posted in order on one QP) are signalled, and which
/// unsignalled ones each signalled WR covers: every `every`-th WR and the last one are
/// signalled; a signalled WR covers the unsignalled WRs since the previous signalled one of
/// the chain. Every WR of the chain is either signalled or covered by exactly one later
/// signalled WR (the last WR is always signalled), so no WR is left without a completion.
fn signal_plan(n: usize, every: usize) -> Vec<(usize, Vec<usize>)> {
    let every = every.max(1);
    let mut out = Vec::with_capacity(n / every + 1);
    let mut cover = Vec::new();
    for j in 0..n {
        if (j + 1) % every == 0 || j + 1 == n {
            out.push((j, std::mem::take(&mut cover)));
        } else {
            cover.push(j);
        }
    }
    out
}

/// What a signalled WR's completion says about the unsignalled WRs it covers that are still
/// posted on its QP. Success: RC completes a QP's WRs in order and an unsignalled WR that fails
/// or is flushed reports on its own, so they completed. Any error: they are treated as flushed
/// and posted again (WRITE and READ are idempotent: the same bytes land twice at worst), so a
/// WR is reported successful only by its own successful completion or a later successful one on
/// the same QP, never inferred from an error path (QP re-creation, flushes, retries).
fn covered_outcome(signalled: &Result<(), WcStatus>) -> Result<(), WcStatus> {
    match signalled {
        Ok(()) => Ok(()),
        Err(_) => Err(WcStatus::WrFlush),
    }
}

/// Whether a completion reported by QP `wc_qpn` belongs to the current posting of a WR whose
/// entry says it is posted on `posted_on` (`None`: not on any QP now, waiting in a backlog).
/// Completions are matched by `wr_id`; this check keeps a completion from an earlier posting
/// of the same WR (on a QP it has since left) from completing a later posting still in flight.
fn completion_is_current(posted_on: Option<u32>, wc_qpn: u32) -> bool {
    posted_on == Some(wc_qpn)
}

/// A slice, independent of the lane (device pair) it ends up on.
#[derive(Clone)]
struct Wr {
    op: SendOp,
    /// Local address and length (inside the region of the entry's `MrSet`).
    laddr: u64,
    len: u32,
    /// Remote address and the region's rkey per remote device (0 = unknown).
    raddr: u64,
    rkeys: Arc<[u32]>,
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
    /// The WR whose successful completion `qp` reported last: that QP, the WR's id, and its
    /// entry while its batch still waits for other WRs (`None` once the batch completed). If
    /// the provider then moves the QP to the error state without an error completion, that
    /// success is not trusted and the WR is posted again (see `complete_one`).
    last_ok: Option<(Arc<DevQp>, u64, Option<WrEntry>)>,
}

struct Lane {
    /// Local device index.
    ldev: usize,
    /// Remote device index.
    rdev: usize,
    mtu: Mtu,
    /// The local device's count of WRs on the NIC.
    inflight: Arc<AtomicUsize>,
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
    mr: Arc<MrSet>,
    /// Set on a signalled WR: the unsignalled WRs posted before it on the same QP since the
    /// previous signalled one. RC completes a QP's WRs in order, and a failed or flushed WR
    /// always produces its own completion, so when this WR's completion arrives, those of
    /// them still waiting (posted on the same QP) completed successfully.
    covers: Vec<u64>,
}

struct PeerShared {
    // Field order: the lanes' QPs are released before the MRs the entries hold.
    lanes: Vec<Lane>,
    key: u32,
    /// Signal one WR in this many.
    signal_every: usize,
    tr: Weak<Shared>,
    /// Devices the peer listed in its blob.
    remote_devs: usize,
    wrs: Mutex<HashMap<u64, WrEntry>>,
    next_wr: AtomicU32,
    next_lane: AtomicU32,
    slice: u64,
    ctrl: Arc<CtrlWriter>,
    on_dead: OnDead,
    closed: AtomicBool,
    /// Work requests re-posted on another lane after a flush (metrics).
    reposts: AtomicU64,
    /// Completions ignored because they came from a QP the WR was not posted on (metrics).
    stale: AtomicU64,
    /// The peer's rkeys per remote device for its regions (index 0 comes with the region).
    keys: RwLock<HashMap<RegionId, Arc<[u32]>>>,
    /// Regions whose keys were asked for.
    asked: Mutex<HashSet<RegionId>>,
}

impl Drop for PeerShared {
    fn drop(&mut self) {
        if let Some(t) = self.tr.upgrade() {
            t.peers.lock().remove(&self.key);
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
            let wrs: Vec<(u64, SendOp, Sge, RemoteSlice, bool)> = {
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
                        let (Some(mr), Some(&rkey)) =
                            (e.mr.mrs.get(l.ldev), e.wr.rkeys.get(l.rdev))
                        else {
                            continue; // cannot happen: lanes are chosen where keys exist
                        };
                        e.qp = Some(st.qp.clone());
                        e.batch.on_nic.fetch_add(1, Ordering::AcqRel);
                        e.batch
                            .lanes
                            .fetch_or(1u64 << (lane % 64), Ordering::AcqRel);
                        let sge = Sge {
                            addr: e.wr.laddr,
                            length: e.wr.len,
                            lkey: mr.lkey(),
                        };
                        let remote = RemoteSlice {
                            addr: e.wr.raddr,
                            rkey,
                        };
                        v.push((id, e.wr.op, sge, remote, false));
                    }
                }
                // Signal every `signal_every`-th WR and the last one of the chain; each
                // signalled WR covers the unsignalled ones before it.
                for (signalled, covers) in signal_plan(v.len(), self.signal_every) {
                    v[signalled].4 = true;
                    if let Some(e) = m.get_mut(&v[signalled].0) {
                        e.covers = covers.iter().map(|&j| v[j].0).collect();
                    }
                }
                v
            };
            if wrs.is_empty() {
                continue;
            }
            let reqs: Vec<SendRequest<'_>> = wrs
                .iter()
                .map(|(id, op, sge, remote, signaled)| SendRequest {
                    wr_id: *id,
                    op: *op,
                    local: std::slice::from_ref(sge),
                    remote: *remote,
                    signaled: *signaled,
                })
                .collect();
            if let Err(e) = st.qp.post_send(&reqs) {
                // A failed chain may have posted a prefix; the QP goes to the error state, so
                // whatever was posted and not executed flushes. Count it as posted (its
                // completions come back) and requeue the rest. (An unsignalled WR of the
                // prefix after its last signalled one that did execute produces no
                // completion: its batch ends at its deadline. Posting fails only when the
                // QP is already broken or its queue full, which the depth accounting avoids.)
                let index = match &e {
                    VerbsError::PostFailed { index, .. } => *index,
                    _ => 0,
                };
                {
                    let mut m = self.wrs.lock();
                    for (id, ..) in &wrs[index..] {
                        if let Some(x) = m.get_mut(id) {
                            x.qp = None;
                            x.covers.clear();
                            x.batch.on_nic.fetch_sub(1, Ordering::AcqRel);
                        }
                        st.backlog.push_back(*id);
                    }
                }
                st.outstanding += index;
                l.inflight.fetch_add(index, Ordering::AcqRel);
                return Err(e);
            }
            st.outstanding += wrs.len();
            l.inflight.fetch_add(wrs.len(), Ordering::AcqRel);
            l.posted.fetch_add(wrs.len() as u64, Ordering::Relaxed);
            if tracing::enabled!(target: WR_TRACE, tracing::Level::TRACE) {
                let qpn = st.qp.qpn();
                for (id, ..) in &wrs {
                    tracing::trace!(target: WR_TRACE, wr = id & 0xffff_ffff, lane, qpn, "posted");
                }
            }
        }
        Ok(())
    }

    /// Marks a lane broken: its QP goes to the error state, so every WR posted on it flushes.
    fn break_lane(&self, lane: usize, st: &mut LaneState) {
        if !st.broken {
            tracing::debug!(target: WR_TRACE, lane, qpn = st.qp.qpn(), "rdma lane broken");
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
                let eligible: Vec<usize> = targets
                    .iter()
                    .copied()
                    .filter(|&l| e.wr.rkeys.get(self.lanes[l].rdev).is_some_and(|k| *k != 0))
                    .collect();
                if eligible.is_empty() {
                    if let Some(e) = m.remove(&id) {
                        fail.push(e);
                    }
                    continue;
                }
                e.retries += 1;
                e.qp = None;
                let l = eligible[(id as usize) % eligible.len()];
                tracing::trace!(target: WR_TRACE, wr = id & 0xffff_ffff, from = e.lane, to = l, why, "re-posted");
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

    /// One completion of ours, reported by QP number `qpn`: first the unsignalled WRs it
    /// covers (those still posted on the same QP), then the WR itself. A completion from a QP
    /// the WR is not posted on now is stale and ignored (see `completion_is_current`).
    fn complete(&self, wr_id: u64, qpn: u32, result: Result<(), WcStatus>) {
        let covered: Vec<u64> = {
            let mut m = self.wrs.lock();
            let Some(e) = m.get_mut(&wr_id) else {
                return;
            };
            tracing::trace!(
                target: WR_TRACE,
                wr = wr_id & 0xffff_ffff,
                lane = e.lane,
                qpn,
                status = ?result,
                posted_on = ?e.qp.as_ref().map(|q| q.qpn()),
                "completion"
            );
            if !completion_is_current(e.qp.as_ref().map(|q| q.qpn()), qpn) {
                self.stale.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    wr_id,
                    qpn,
                    "rdma completion from a queue pair the work request is not posted on; ignored"
                );
                return;
            }
            let covers = std::mem::take(&mut e.covers);
            let qp = e.qp.clone();
            covers
                .into_iter()
                .filter(|id| {
                    m.get(id).is_some_and(|c| match (&c.qp, &qp) {
                        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                        _ => false,
                    })
                })
                .collect()
        };
        let covered_result = covered_outcome(&result);
        for id in covered {
            self.complete_one(id, covered_result);
        }
        self.complete_one(wr_id, result);
    }

    fn complete_one(&self, wr_id: u64, result: Result<(), WcStatus>) {
        let Some(mut e) = self.wrs.lock().remove(&wr_id) else {
            return;
        };
        let lane = e.lane;
        if e.qp.is_some() {
            e.batch.on_nic.fetch_sub(1, Ordering::AcqRel);
            let _ =
                self.lanes[lane]
                    .inflight
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
        let (current, suspect) = {
            let mut st = self.lanes[lane].st.lock();
            let current = e.qp.as_ref().is_some_and(|q| Arc::ptr_eq(q, &st.qp));
            let mut suspect = None;
            if current && !st.broken && result == Err(WcStatus::WrFlush) {
                // A flush from the lane's current QP, which we did not move to the error state,
                // and no error completion before it: the provider errored the QP without
                // reporting the failing WR. SoftRoCE (rxe, Linux 6.1) does this on a NAK in the
                // middle of a READ response sequence and reports that READ *successful*
                // although its data never landed (`tests/rdma_read_stress_vm.rs`).
                tracing::warn!(
                    target: WR_TRACE,
                    lane,
                    qpn = st.qp.qpn(),
                    "rdma: the provider moved a queue pair to the error state without an error \
                     completion; the WR last reported successful on it is not trusted"
                );
                // RC completes in order and every WR here is signalled or covered: the WR whose
                // success this QP reported last is the one the provider failed.
                suspect = st
                    .last_ok
                    .take()
                    .filter(|(q, ..)| Arc::ptr_eq(q, &st.qp))
                    .map(|(_, id, x)| (id, x));
            }
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
            (current, suspect)
        };
        let posted_on = e.qp.take();
        if let Some((id, x)) = suspect {
            self.repost_suspect(id, x);
        }
        match result {
            Ok(()) => {
                let finished = e.batch.left.fetch_sub(1, Ordering::AcqRel) == 1;
                if finished {
                    self.finish(&e.batch);
                }
                if let (true, Some(q)) = (current, posted_on) {
                    // Remembered until the QP's next completion; the entry only while its batch
                    // still waits (it can be posted again then).
                    let mut st = self.lanes[lane].st.lock();
                    if Arc::ptr_eq(&q, &st.qp) && !st.broken {
                        st.last_ok = Some((q, wr_id, (!finished).then_some(e)));
                    }
                }
            }
            Err(WcStatus::WrFlush) => {
                // Flushed by a broken queue pair: post it again elsewhere.
                self.wrs.lock().insert(wr_id, e);
                self.reroute(vec![wr_id], "queue pair flushed");
            }
            Err(
                s @ (WcStatus::RemoteInvalidRequest
                | WcStatus::RemoteInvalidRdRequest
                | WcStatus::RemoteOperation),
            ) => {
                // The peer's NIC refused the request as malformed although it was well formed
                // (a bad key or an out-of-bounds address is `RemoteAccess`): a transport-level
                // fault (SoftRoCE does this after packet loss under load). Retried elsewhere,
                // bounded, like a flushed WR.
                tracing::debug!(lane, status = ?s, "rdma work request refused; retrying elsewhere");
                self.wrs.lock().insert(wr_id, e);
                self.reroute(vec![wr_id], "remote invalid request");
            }
            Err(
                s @ (WcStatus::RetryExceeded
                | WcStatus::RnrRetryExceeded
                | WcStatus::ResponseTimeout),
            ) => {
                // No answer from the peer on this queue pair: congestion or a dead peer. The
                // lane is broken (and re-established over the control connection); the WR is
                // tried again on another lane, a bounded number of times, so a congested path
                // costs a retry while a dead peer still fails (every lane times out, or the
                // control connection dies) with `PeerDead`.
                tracing::debug!(lane, status = ?s, "rdma work request unanswered; retrying elsewhere");
                self.wrs.lock().insert(wr_id, e);
                self.reroute(vec![wr_id], "peer unreachable");
            }
            Err(s) => {
                let err = match s {
                    WcStatus::RemoteAccess => Error::AccessDenied(e.region),
                    // Our own keys refused by our NIC: a defect here, not the caller's input.
                    s @ (WcStatus::LocalProtection | WcStatus::LocalAccess) => {
                        Error::Io(std::io::Error::other(format!(
                            "rdma work request failed: {s:?} (local key of lane {lane})"
                        )))
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

    /// Posts again a WR that its QP reported successful right before the provider moved that
    /// QP to the error state without an error completion (SoftRoCE reports a READ it failed
    /// this way; its data never landed). Only while its batch still waits for other WRs: the
    /// batch's count goes up again first, so it cannot complete before this WR completes again.
    /// A batch that already completed cannot be repaired (logged).
    fn repost_suspect(&self, id: u64, e: Option<WrEntry>) {
        let e = e.filter(|e| {
            e.batch
                .left
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n > 0).then_some(n + 1)
                })
                .is_ok()
        });
        let Some(e) = e else {
            tracing::warn!(
                target: WR_TRACE,
                wr = id & 0xffff_ffff,
                "rdma: a WR reported successful by a queue pair that then failed belongs to a \
                 batch that already completed; its data may be missing"
            );
            return;
        };
        tracing::debug!(target: WR_TRACE, wr = id & 0xffff_ffff, "posting a suspect WR again");
        self.wrs.lock().insert(id, e);
        self.reroute(
            vec![id],
            "provider failed the queue pair after reporting success",
        );
    }

    fn finish(&self, b: &BatchCtx) {
        if b.state.is_done() {
            return;
        }
        let tag = b.notify.lock().take();
        match tag {
            // Every WR completed, so every byte landed: the notification goes out now, and the
            // batch's part completes when the target confirms it queued it (the engine's fence),
            // so a completed batch's notification is already at the target.
            Some(tag) => {
                if let Err(e) = self.ctrl.send_notify(b.state.id, tag) {
                    b.state
                        .fail(Error::PeerDead(format!("sending notification: {e}")));
                }
            }
            None => b.state.part_done(),
        }
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

    fn dev(&self, lane: usize) -> Result<Arc<Dev>, Error> {
        let t = self.tr.upgrade().ok_or(Error::Shutdown)?;
        t.devs
            .get(self.lanes[lane].ldev)
            .cloned()
            .ok_or(Error::Shutdown)
    }

    fn new_qp(&self, lane: usize) -> Result<(Arc<DevQp>, u32, Endpoint), Error> {
        let dev = self.dev(lane)?;
        let qp = dev.create_qp()?;
        let psn = u32::from_le_bytes(crate::auth::random::<4>()) & 0x00ff_ffff;
        let ep = qp.endpoint(dev.gid.gid, dev.lid, psn);
        Ok((Arc::new(qp), psn, ep))
    }

    fn connect_qp(&self, lane: usize, qp: &Qp, psn: u32, remote: Endpoint) -> Result<(), Error> {
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

    fn send_msg(&self, op: LaneOp, lane: usize, nonce: u64, ep: &Endpoint) -> Result<(), Error> {
        let m = RdmaMsg::Lane {
            op,
            lane,
            nonce,
            ep: *ep,
        };
        self.ctrl.send(&m.to_ctrl())
    }

    /// A broken lane whose QP has drained asks the peer to re-establish it.
    fn maybe_reconnect(&self, lane: usize) {
        let (nonce, ep) = {
            let mut st = self.lanes[lane].st.lock();
            if !st.broken || st.pending.is_some() || st.outstanding > 0 || !self.recoverable(&st) {
                return;
            }
            let (qp, psn, ep) = match self.new_qp(lane) {
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
        if let Err(e) = self.send_msg(LaneOp::Reconnect, lane, nonce, &ep) {
            tracing::debug!(lane, error = %e, "reconnect request not sent");
            self.lanes[lane].st.lock().pending = None;
        }
    }

    fn on_msg(&self, d: &[u8]) -> Result<(), Error> {
        let (op, lane, nonce, ep) = match RdmaMsg::decode(d, self.lanes.len(), self.remote_devs)? {
            RdmaMsg::KeysReq(ids) => return self.on_keys_req(&ids),
            RdmaMsg::Keys { entries, .. } => {
                self.on_keys(entries);
                return Ok(());
            }
            RdmaMsg::Lane {
                op,
                lane,
                nonce,
                ep,
            } => (op, lane, nonce, ep),
        };
        if self.closed() {
            return Ok(());
        }
        match op {
            LaneOp::Reconnect => {
                let mut st = self.lanes[lane].st.lock();
                if let Some((_, _, mine)) = &st.pending {
                    if *mine > nonce {
                        return Ok(()); // both asked: the larger nonce wins, the peer answers ours
                    }
                }
                st.pending = None;
                let made = self.new_qp(lane).and_then(|(qp, psn, my_ep)| {
                    self.connect_qp(lane, &qp, psn, ep).map(|()| (qp, my_ep))
                });
                let (qp, my_ep) = match made {
                    Ok(x) => x,
                    Err(e) => {
                        // The peer's lane stays broken; its batches go to the other lanes.
                        tracing::warn!(lane, error = %e, "cannot re-establish a queue pair");
                        return Ok(());
                    }
                };
                st.last_ok = None;
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
                tracing::debug!(target: WR_TRACE, lane, "rdma lane re-established (peer's request)");
                self.send_msg(LaneOp::ReconnectAck, lane, nonce, &my_ep)
            }
            LaneOp::ReconnectAck => {
                let mut st = self.lanes[lane].st.lock();
                let Some((qp, psn, mine)) = st.pending.take() else {
                    return Ok(()); // stale answer
                };
                if mine != nonce {
                    st.pending = Some((qp, psn, mine));
                    return Ok(());
                }
                if let Err(e) = self.connect_qp(lane, &qp, psn, ep) {
                    tracing::warn!(lane, error = %e, "cannot re-establish a queue pair");
                    return Ok(());
                }
                st.qp = qp;
                st.last_ok = None;
                st.outstanding = 0;
                st.broken = false;
                if let Err(e) = self.pump(lane, &mut st) {
                    tracing::warn!(lane, error = %e, "rdma post failed; lane broken");
                    self.break_lane(lane, &mut st);
                }
                self.lanes[lane]
                    .reestablished
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(target: WR_TRACE, lane, "rdma lane re-established");
                Ok(())
            }
            LaneOp::Unknown(op) => Err(ProtocolError::UnknownRdmaOp { op }.into()),
        }
    }

    /// The region's rkey per remote device: index 0 from the announcement, the others from
    /// the key table (0 = not known yet; asked for once).
    fn rkeys_for(&self, id: RegionId, first: u32, ask: &mut Vec<RegionId>) -> Arc<[u32]> {
        if self.remote_devs <= 1 {
            return Arc::from(vec![first]);
        }
        if let Some(k) = self.keys.read().get(&id) {
            if k.first() == Some(&first) {
                return k.clone();
            }
            let mut v = k.to_vec();
            v[0] = first;
            return Arc::from(v);
        }
        if self.lanes.iter().any(|l| l.rdev != 0) {
            let mut asked = self.asked.lock();
            if asked.len() >= MAX_KEYS {
                asked.clear();
            }
            if asked.insert(id) {
                ask.push(id);
            }
        }
        let mut v = vec![0u32; self.remote_devs];
        v[0] = first;
        Arc::from(v)
    }

    /// Asks the peer for the rkeys of its regions on every device.
    fn request_keys(&self, ids: &[RegionId]) {
        for chunk in ids.chunks(KEYS_REQ_PER_MSG) {
            let sent = self.ctrl.send(&RdmaMsg::KeysReq(chunk.to_vec()).to_ctrl());
            if let Err(e) = sent {
                tracing::debug!(error = %e, "rdma key request not sent");
                let mut asked = self.asked.lock();
                for id in chunk {
                    asked.remove(id);
                }
            }
        }
    }

    /// The peer asks for our rkeys of some regions: answer with every device's key (zeros for
    /// a region that is not offered).
    fn on_keys_req(&self, ids: &[RegionId]) -> Result<(), Error> {
        let Some(t) = self.tr.upgrade() else {
            return Ok(());
        };
        let ndev = t.devs.len();
        for chunk in ids.chunks(keys_per_msg(ndev).max(1)) {
            let entries = {
                let mrs = t.mrs.read();
                chunk
                    .iter()
                    .map(|id| {
                        let set = mrs.get(id).filter(|m| m.offered);
                        let keys = (0..ndev)
                            .map(|i| set.and_then(|m| m.mrs.get(i)).map_or(0, |mr| mr.rkey()))
                            .collect();
                        (*id, keys)
                    })
                    .collect()
            };
            let m = RdmaMsg::Keys {
                ndev: ndev as u8,
                entries,
            };
            self.ctrl.send(&m.to_ctrl())?;
        }
        Ok(())
    }

    /// The peer's rkeys for some of its regions.
    fn on_keys(&self, entries: Vec<(RegionId, Vec<u32>)>) {
        let mut keys = self.keys.write();
        for (id, v) in entries {
            if v.iter().all(|k| *k == 0) {
                keys.remove(&id);
                continue;
            }
            if keys.len() >= MAX_KEYS && !keys.contains_key(&id) {
                keys.clear();
                self.asked.lock().clear();
            }
            keys.insert(id, Arc::from(v));
        }
    }

    /// The peer withdrew regions: forget their keys.
    fn forget_keys(&self, ids: &[RegionId]) {
        let mut keys = self.keys.write();
        let mut asked = self.asked.lock();
        for id in ids {
            keys.remove(id);
            asked.remove(id);
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
        let tr = sh.tr.upgrade().ok_or(Error::Shutdown)?;
        // Cut into WRs first (typed errors before anything is posted).
        struct Cut {
            wr: Wr,
            region: RegionId,
            mr: Arc<MrSet>,
        }
        let mut cuts: Vec<Cut> = Vec::new();
        let mut ask: Vec<RegionId> = Vec::new();
        {
            let mrs = tr.mrs.read();
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
                let rkeys = sh.rkeys_for(x.remote.id, x.remote.rkey, &mut ask);
                let first = mr
                    .mrs
                    .get(0)
                    .ok_or_else(|| Error::Unsupported("no RDMA device".into()))?;
                let mut done = 0u64;
                while done < x.len {
                    let n = (x.len - done).min(sh.slice);
                    let lo = usize::try_from(x.local_offset + done)
                        .map_err(|_| Error::InvalidArgument("offset too large".into()))?;
                    let sge = first
                        .sge(lo, n as usize)
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    cuts.push(Cut {
                        wr: Wr {
                            op: match b.dir {
                                Dir::Write => SendOp::Write,
                                Dir::Read => SendOp::Read,
                            },
                            laddr: sge.addr,
                            len: sge.length,
                            raddr: base + done,
                            rkeys: rkeys.clone(),
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
        // Round-robin over the target lanes whose remote device has the region's key (the
        // announced key of the remote's first device is always there).
        let n = cuts.len() as u32;
        let start = sh.next_lane.fetch_add(n, Ordering::Relaxed) as usize;
        let mut by_lane: Vec<Vec<u64>> = vec![Vec::new(); sh.lanes.len()];
        let mut eligible: Vec<usize> = Vec::with_capacity(targets.len());
        let mut eligible_for: Option<Arc<[u32]>> = None;
        {
            let mut m = sh.wrs.lock();
            for (i, c) in cuts.into_iter().enumerate() {
                if !eligible_for
                    .as_ref()
                    .is_some_and(|k| Arc::ptr_eq(k, &c.wr.rkeys))
                {
                    eligible.clear();
                    eligible.extend(
                        targets
                            .iter()
                            .copied()
                            .filter(|&l| c.wr.rkeys.get(sh.lanes[l].rdev).is_some_and(|k| *k != 0)),
                    );
                    eligible_for = Some(c.wr.rkeys.clone());
                }
                if eligible.is_empty() {
                    for id in by_lane.iter().flatten() {
                        m.remove(id);
                    }
                    drop(m);
                    let e = Error::PeerDead(
                        "rdma: no usable queue pair reaches the region's device".into(),
                    );
                    st.fail(e.duplicate());
                    return Err(e);
                }
                let lane = eligible[(start + i) % eligible.len()];
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
                        mr: c.mr,
                        covers: Vec::new(),
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
        if !ask.is_empty() {
            sh.request_keys(&ask);
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

    fn device_counters(&self) -> Vec<(String, u64)> {
        let Some(t) = self.sh.tr.upgrade() else {
            return Vec::new();
        };
        t.devs
            .iter()
            .map(|d| {
                let n = self
                    .sh
                    .lanes
                    .iter()
                    .filter(|l| l.ldev == d.index)
                    .map(|l| l.posted.load(Ordering::Relaxed))
                    .sum();
                (d.name.clone(), n)
            })
            .collect()
    }

    fn regions_removed(&self, ids: &[RegionId]) {
        self.sh.forget_keys(ids);
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
        let stale = self.sh.stale.load(Ordering::Relaxed);
        if stale > 0 {
            tracing::warn!(
                stale,
                "rdma: completions from a queue pair a WR had left were ignored"
            );
        }
        for l in &self.sh.lanes {
            let mut st = l.st.lock();
            st.broken = true;
            st.backlog.clear();
            st.pending = None;
            st.last_ok = None;
            let _ = st.qp.set_error();
        }
        // The engine fails in-flight batches; drop their entries (the QPs flush what was posted).
        let all: Vec<WrEntry> = self.sh.wrs.lock().drain().map(|(_, e)| e).collect();
        for e in all {
            e.batch.state.fail(Error::PeerDead("peer closed".into()));
        }
    }
}

fn completion_loop(sh: Arc<Shared>, dev: usize) {
    let mut out = Vec::with_capacity(64);
    let Some(d) = sh.devs.get(dev).cloned() else {
        return;
    };
    // After a round that reaped completions, and while WRs of this device are still on the
    // NIC, poll the CQ for up to `sh.poll` before arming it and sleeping on the channel: the
    // next completion is usually that close, and the sleep/wake-up costs more. Never while
    // idle: a round that reaped nothing (the wait timed out) disables the window.
    let mut active = false;
    while !sh.stop.load(Ordering::Acquire) {
        out.clear();
        if active && !sh.poll.is_zero() && d.inflight.load(Ordering::Acquire) > 0 {
            let t0 = Instant::now();
            loop {
                match d.cq.poll(&mut out, 64) {
                    Ok(0) => {}
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!(device = %d.name, error = %e, "rdma completion queue poll failed");
                        break;
                    }
                }
                if t0.elapsed() >= sh.poll || d.inflight.load(Ordering::Acquire) == 0 {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        if out.is_empty() {
            match d.cq.wait(&mut out, 64, Duration::from_millis(200)) {
                Ok(_) => {}
                Err(VerbsError::Timeout(_)) => {
                    active = false;
                    continue;
                }
                Err(e) => {
                    tracing::warn!(device = %d.name, error = %e, "rdma completion queue failed");
                    std::thread::sleep(Duration::from_millis(50));
                    active = false;
                    continue;
                }
            }
        }
        active = !out.is_empty();
        for c in out.drain(..) {
            let key = (c.wr_id >> 32) as u32;
            let peer = sh.peers.lock().get(&key).and_then(|w| w.upgrade());
            let Some(p) = peer else { continue };
            p.complete(
                c.wr_id,
                c.qp_num,
                c.result.map(|_| ()).map_err(|e| e.status),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One QP's send queue as the accounting sees it: WRs posted in chains (signal plan of
    /// `pump`), executed in order by a model NIC, completions consumed in order with the rules
    /// of `complete` (covers of a signalled WR resolved by `covered_outcome`).
    struct QpModel {
        /// Per posted WR: (batch, signalled).
        wrs: Vec<(u8, bool)>,
        /// Signalled WR -> the unsignalled ones it covers.
        covers: HashMap<usize, Vec<usize>>,
    }

    impl QpModel {
        /// Posts `batches` (each a list of WR counts per chain, interleaved chain by chain).
        fn post(chains: &[(u8, usize)], every: usize) -> QpModel {
            let mut m = QpModel {
                wrs: Vec::new(),
                covers: HashMap::new(),
            };
            for &(batch, n) in chains {
                let base = m.wrs.len();
                m.wrs.extend(std::iter::repeat_n((batch, false), n));
                for (sig, cov) in signal_plan(n, every) {
                    m.wrs[base + sig].1 = true;
                    m.covers
                        .insert(base + sig, cov.into_iter().map(|j| base + j).collect());
                }
            }
            m
        }

        /// The completions an RC QP reports when its first `ok` WRs execute and the rest fail
        /// (the first with `fail`, the others flushed): successes only when signalled, errors
        /// always. `lose_flush` drops the flush report of that WR (a misbehaving provider).
        fn cqes(
            &self,
            ok: usize,
            fail: WcStatus,
            lose_flush: Option<usize>,
        ) -> Vec<(usize, Result<(), WcStatus>)> {
            let mut out = Vec::new();
            for (i, &(_, sig)) in self.wrs.iter().enumerate() {
                if i < ok {
                    if sig {
                        out.push((i, Ok(())));
                    }
                } else if i == ok {
                    out.push((i, Err(fail)));
                } else if lose_flush != Some(i) {
                    out.push((i, Err(WcStatus::WrFlush)));
                }
            }
            out
        }

        /// Consumes completions like `complete`: returns each WR's resolution (first one wins;
        /// a WR resolved twice is a defect and panics).
        fn account(
            &self,
            cqes: &[(usize, Result<(), WcStatus>)],
        ) -> HashMap<usize, Result<(), WcStatus>> {
            let mut done: HashMap<usize, Result<(), WcStatus>> = HashMap::new();
            let mut settle = |i: usize, r: Result<(), WcStatus>| {
                assert!(done.insert(i, r).is_none(), "WR {i} resolved twice");
            };
            let mut resolved: HashSet<usize> = HashSet::new();
            for (i, r) in cqes {
                if let Some(cov) = self.covers.get(i) {
                    for &c in cov {
                        // `complete` only resolves covered WRs still posted on the QP.
                        if resolved.insert(c) {
                            settle(c, covered_outcome(r));
                        }
                    }
                }
                if resolved.insert(*i) {
                    settle(*i, *r);
                }
            }
            done
        }
    }

    #[test]
    fn signal_plan_signals_every_nth_and_the_last_and_covers_the_rest_once() {
        for every in 1..=20 {
            for n in 0..70 {
                let plan = signal_plan(n, every);
                let mut seen = vec![0u8; n];
                let mut prev = None;
                for (sig, cov) in &plan {
                    assert!(prev.is_none_or(|p| p < *sig), "in order");
                    assert!((sig + 1) % every == 0 || sig + 1 == n);
                    assert!(cov.iter().all(|c| c < sig && prev.is_none_or(|p| *c > p)));
                    seen[*sig] += 1;
                    for &c in cov {
                        seen[c] += 1;
                    }
                    prev = Some(*sig);
                }
                assert!(
                    seen.iter().all(|&k| k == 1),
                    "n={n} every={every}: {seen:?}"
                );
                if n > 0 {
                    assert_eq!(plan.last().map(|p| p.0), Some(n - 1), "last is signalled");
                }
                if every == 1 {
                    assert!(plan.iter().all(|(_, c)| c.is_empty()));
                }
            }
        }
    }

    #[test]
    fn selective_signalling_never_reports_a_wr_done_that_did_not_execute() {
        // Chains of two batches interleaved on one QP (as the backlog posts them), every
        // failure point, every failure status the NIC reports: each WR is resolved exactly
        // once, and a WR resolved Ok really executed.
        let chains = [(1u8, 7), (2, 16), (1, 3), (2, 1), (1, 33), (2, 5)];
        for every in [1usize, 2, 4, 16, 64] {
            let q = QpModel::post(&chains, every);
            let n = q.wrs.len();
            for ok in 0..=n {
                for fail in [
                    WcStatus::RetryExceeded,
                    WcStatus::RemoteAccess,
                    WcStatus::WrFlush,
                    WcStatus::RemoteInvalidRequest,
                ] {
                    let done = q.account(&q.cqes(ok, fail, None));
                    assert_eq!(done.len(), n, "every={every} ok={ok}: a WR left unresolved");
                    for (i, r) in &done {
                        if r.is_ok() {
                            assert!(*i < ok, "every={every} ok={ok}: WR {i} reported done");
                        }
                    }
                    // Nothing that executed is lost either: a WR is Ok or re-posted (error).
                    let oks = done.values().filter(|r| r.is_ok()).count();
                    assert!(oks <= ok);
                }
            }
        }
    }

    #[test]
    fn a_lost_flush_report_does_not_turn_into_success() {
        // A provider that drops the flush completion of an unsignalled WR (rxe does when its CQ
        // is full): the signalled WR after it reports a flush, and the covered WR is re-posted,
        // not reported done.
        let q = QpModel::post(&[(1, 16), (2, 16)], 16);
        let n = q.wrs.len();
        for ok in 0..n {
            for lost in ok + 1..n {
                if q.wrs[lost].1 {
                    continue; // only unsignalled WRs are covered
                }
                let done = q.account(&q.cqes(ok, WcStatus::RetryExceeded, Some(lost)));
                assert_eq!(done.len(), n);
                assert!(
                    done.iter().all(|(i, r)| r.is_err() || *i < ok),
                    "ok={ok} lost={lost}: a WR that never ran reported done"
                );
            }
        }
    }

    #[test]
    fn completions_from_a_queue_pair_the_wr_left_are_stale() {
        assert!(completion_is_current(Some(17), 17));
        assert!(
            !completion_is_current(Some(18), 17),
            "re-posted on another QP"
        );
        assert!(
            !completion_is_current(None, 17),
            "waiting in a backlog, not on any QP"
        );
    }

    #[test]
    fn device_pairing_is_rail_aligned_and_the_same_from_both_sides() {
        let e4 = LINK_ETH_V4;
        // equal lists: rail to rail
        assert_eq!(
            pair_devices(&[e4, e4, e4], &[e4, e4, e4]),
            vec![(0, 0), (1, 1), (2, 2)]
        );
        // fewer remote devices: the extra local ones have no partner
        assert_eq!(pair_devices(&[e4, e4, e4], &[e4, e4]), vec![(0, 0), (1, 1)]);
        // link classes must match: IB never pairs with RoCE
        assert_eq!(
            pair_devices(&[LINK_IB, e4], &[e4, LINK_IB]),
            vec![(0, 1), (1, 0)]
        );
        assert!(pair_devices(&[LINK_IB], &[e4, LINK_ETH_V6]).is_empty());
        assert!(pair_devices(&[e4], &[]).is_empty());
        // the side that decides is the same for both (smaller nonce): transposing the result
        // from the other side gives the same pairs
        let a = [e4, LINK_IB, e4];
        let b = [LINK_IB, e4];
        let from_a = pair_devices(&a, &b);
        let seen_by_b: Vec<(usize, usize)> = from_a.iter().map(|&(x, y)| (y, x)).collect();
        assert_eq!(from_a, vec![(0, 1), (1, 0)]);
        assert_eq!(seen_by_b, vec![(1, 0), (0, 1)]);
    }

    #[test]
    fn device_lists_and_natural_order() {
        assert_eq!(device_list(" rxe0, rxe1 ,,rxe0"), vec!["rxe0", "rxe1"]);
        assert!(device_list(" , ").is_empty());
        let mut v = vec!["mlx5_10", "mlx5_2", "mlx5_1", "irdma0"];
        v.sort_by_key(|n| natural_key(n));
        assert_eq!(v, vec!["irdma0", "mlx5_1", "mlx5_2", "mlx5_10"]);
        let cfg = EngineConfig {
            rdma_device: Some("a,b".into()),
            ..Default::default()
        };
        assert_eq!(wanted_devices(&cfg), Some(vec!["a".into(), "b".into()]));
        let cfg = EngineConfig {
            rdma_device: Some("a".into()),
            rdma_devices: vec!["c".into(), "d,e".into()],
            ..Default::default()
        };
        assert_eq!(
            wanted_devices(&cfg),
            Some(vec!["c".into(), "d".into(), "e".into()])
        );
    }
}

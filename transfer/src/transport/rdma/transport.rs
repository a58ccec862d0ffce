//! [`RdmaTransport`]: the engine's RDMA devices opened, queue pairs prepared per handshake,
//! regions registered on every device, and the per-peer state built in `establish`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use kvwire_verbs::{ConnectParams, DeviceInfo, Verbs, DEFAULT_LIBRARY};

use super::devices::{
    natural_key, nearness_groups, pair_devices, pci_sysfs_path, verbs_err, wanted_devices, DevQp,
    Nic, MAX_SGE, QP_DEPTH,
};
use super::mrs::{register_device, MrSet};
use super::nics;
use super::slice::SliceSizer;
use super::state::{Lane, LaneState, PeerShared, RdmaPeer, Shared};
use crate::config::EngineConfig;
use crate::error::Error;
use crate::mem::RegionMrs;
use crate::region::RegionEntry;
use crate::transport::api::{EstablishCtx, PeerTransport, Transport};
use crate::types::{RegionId, TransportKind};
use crate::wire::rdma::{blob_nonce, encode_blob, parse_blob, BlobDev, MAX_DEVICES, MAX_LANES};
use crate::wire::{HostIdentity, MrChunks, ProtocolError, MAX_MR_CHUNKS, TRANSPORT_RDMA};

/// Where sysfs lists PCI devices by address.
const PCI_DEVICES: &str = "/sys/bus/pci/devices";
/// Unclaimed pre-created QP sets live this long beyond the connect timeout.
const PRE_EXPIRY_SLACK: Duration = Duration::from_secs(5);
/// At most this many unclaimed QP sets at once (beyond: RDMA is not offered in that handshake).
const MAX_PRE: usize = 128;
/// Signal one WRITE in this many when the configuration does not say
/// ([`EngineConfig::rdma_signal_every`]); READs are always signalled (`signal_plan`).
const SIGNAL_EVERY: usize = 16;
/// The completion threads' poll window when the configuration does not say
/// ([`EngineConfig::rdma_poll`]; 0 = never).
const POLL_US: u64 = 0;
/// The largest poll window.
const MAX_POLL_US: u64 = 10_000;

struct PreQps {
    created: Instant,
    /// Per local device: its QPs and their first PSNs.
    per_dev: Vec<Vec<(DevQp, u32)>>,
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
        let near = cfg.rdma_near.as_deref().filter(|n| !n.trim().is_empty());
        // Groups of devices to try, in order; the first group with a usable device is used.
        let groups: Vec<Vec<String>> = match &wanted {
            Some(v) => vec![v.clone()],
            None => {
                let mut all: Vec<&DeviceInfo> = devices.iter().collect();
                all.sort_by_key(|d| natural_key(&d.name));
                match near.map(|n| (n, pci_sysfs_path(n, Path::new(PCI_DEVICES)))) {
                    Some((_, Some(at))) => {
                        let devs: Vec<(String, Option<PathBuf>)> = all
                            .iter()
                            .map(|d| (d.name.clone(), d.pci_path.clone()))
                            .collect();
                        nearness_groups(&at, &devs)
                    }
                    Some((n, None)) => {
                        tracing::warn!(
                            near = n,
                            "rdma_near names no PCI device sysfs knows; every active RDMA \
                             device is used"
                        );
                        vec![all.iter().map(|d| d.name.clone()).collect()]
                    }
                    None => vec![all.iter().map(|d| d.name.clone()).collect()],
                }
            }
        };
        if let Some(v) = &wanted {
            if v.len() > MAX_DEVICES {
                return Err(Error::InvalidArgument(format!(
                    "{} RDMA devices named (at most {MAX_DEVICES})",
                    v.len()
                )));
            }
        }
        let poll = cfg
            .rdma_poll
            .unwrap_or(Duration::from_micros(POLL_US))
            .min(Duration::from_micros(MAX_POLL_US));
        let mut devs: Vec<Arc<Nic>> = Vec::new();
        for group in groups {
            for name in group {
                if devs.len() == MAX_DEVICES {
                    break;
                }
                match nics::nic(&verbs, path, &name, poll) {
                    Ok(nic) => devs.push(nic),
                    Err(e) if wanted.is_some() => {
                        return Err(Error::Unsupported(format!("RDMA device {name}: {e}")));
                    }
                    Err(e) => {
                        tracing::debug!(device = %name, error = %e, "RDMA device not usable");
                    }
                }
            }
            if !devs.is_empty() {
                break;
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
        let max_sge = match cfg.rdma_max_sge {
            None | Some(0) => u64::from(MAX_SGE),
            Some(n) => n.min(u64::from(MAX_SGE)),
        } as u32;
        let mr_chunk = mr_chunk(cfg.rdma_mr_chunk, devs.iter().map(|d| d.max_mr));
        let sh = Arc::new(Shared {
            devs,
            mrs: RwLock::new(HashMap::new()),
            signal_every,
            max_sge,
            mr_chunk,
        });
        let names: Vec<&str> = sh.devs.iter().map(|d| d.name.as_str()).collect();
        let near_set = cfg
            .rdma_near
            .as_deref()
            .is_some_and(|n| !n.trim().is_empty());
        if wanted.is_none() && !near_set {
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
                     KVWIRE_RDMA_DEVICE) or the device they serve (EngineConfig::rdma_near or \
                     KVWIRE_RDMA_NEAR), see docs/rdma_hardware_plan.md"
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

    /// What peers need to address a region: its rkey on the first device (0: not registered)
    /// and, when it is registered in chunks, the chunk length and the other chunks' rkeys.
    pub fn keys(&self, id: RegionId) -> (u32, Option<MrChunks>) {
        let mrs = self.sh.mrs.read();
        let Some(m) = mrs.get(&id) else {
            return (0, None);
        };
        let first = m.mrs.chunks_on(0);
        let chunks = (first.len() > 1).then(|| MrChunks {
            len: m.mrs.chunk_len(),
            rkeys: first[1..].iter().map(|mr| mr.rkey()).collect(),
        });
        (first.first().map_or(0, |mr| mr.rkey()), chunks)
    }

    /// The chunk length to register `len` bytes with (0: one registration), or why it cannot
    /// be registered at all.
    fn chunk_for(&self, len: usize) -> Result<u64, Error> {
        let len = len as u64;
        if len <= self.sh.mr_chunk {
            return Ok(0);
        }
        let n = MrChunks::count(self.sh.mr_chunk, len);
        if n > MAX_MR_CHUNKS as u64 {
            return Err(Error::Unsupported(format!(
                "a region of {len} bytes needs {n} RDMA registrations of {} bytes (the NIC's \
                 limit, or rdma_mr_chunk); at most {MAX_MR_CHUNKS}",
                self.sh.mr_chunk
            )));
        }
        Ok(self.sh.mr_chunk)
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
        if let Some((ordinal, _)) = e.mem.device_ipc() {
            // GPUDirect RDMA where the NICs take device memory; else no memory region, and a
            // work request naming the region is refused like an unregistered region's.
            let names: Vec<String> = self.sh.devs.iter().map(|d| d.name.clone()).collect();
            let pds = self.sh.devs.iter().map(|d| &d.pd);
            let chunk = match self.chunk_for(e.mem.len()) {
                Ok(c) => c,
                Err(why) => {
                    tracing::warn!(region = ?e.id, "rdma: device memory not registered with the \
                                   NICs, RDMA refuses it (cuda_ipc still reaches it): {why}");
                    return Ok(());
                }
            };
            if let Some(mrs) = register_device(e, ordinal, pds, &names, access, chunk) {
                let set = MrSet {
                    mrs,
                    offered: e.access.offered(),
                };
                self.sh.mrs.write().insert(e.id, Arc::new(set));
            }
            return Ok(());
        }
        let chunk = self.chunk_for(e.mem.len())?;
        let pds = self.sh.devs.iter().map(|d| &d.pd);
        let mrs = RegionMrs::register(&e.mem, pds, access, chunk).map_err(|(i, err)| {
            Error::Io(std::io::Error::other(format!(
                "registering region {:?} on {}: {err}",
                e.id, self.sh.devs[i].name
            )))
        })?;
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
    fn discard_blob(&self, blob: &[u8]) {
        drop(self.take_pre(blob));
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
    fn region_keys(&self, id: RegionId) -> (u32, Option<MrChunks>) {
        self.keys(id)
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
        // Scatter-gather entries a WR may carry on every lane (WRs are cut before their lane
        // is chosen, and may move to another lane).
        let (mut sge_write, mut sge_read) = (self.sh.max_sge, self.sh.max_sge);
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
                sge_write = sge_write.min(qp.caps().max_send_sge.min(dev.sge_write));
                sge_read = sge_read.min(dev.sge_read);
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
        let (slice, slice_max) = ctx.cfg.rdma_slices();
        let nlanes = lanes.len();
        let sh = nics::add_peer(|key| {
            Arc::new(PeerShared {
                lanes,
                key,
                signal_every: self.sh.signal_every,
                tr: Arc::downgrade(&self.sh),
                remote_devs: remote.devs.len(),
                wrs: Mutex::new(HashMap::new()),
                next_wr: AtomicU32::new(1),
                next_lane: AtomicU32::new(0),
                slices: [(); 2].map(|_| Mutex::new(SliceSizer::new(slice, slice_max, nlanes))),
                sge_write: sge_write.max(1) as usize,
                sge_read: sge_read.min(sge_write).max(1) as usize,
                ctrl: ctx.ctrl,
                on_dead: ctx.on_dead,
                closed: AtomicBool::new(false),
                reposts: AtomicU64::new(0),
                stale: AtomicU64::new(0),
                keys: RwLock::new(HashMap::new()),
                asked: Mutex::new(HashSet::new()),
            })
        });
        let names: Vec<String> = pairs
            .iter()
            .map(|&(l, r)| format!("{}->remote#{r}", self.sh.devs[l].name))
            .collect();
        tracing::debug!(pairs = ?names, lanes = sh.lanes.len(), "rdma peer connected");
        Ok(Arc::new(RdmaPeer { sh }))
    }
}

/// The chunk length regions are registered in: `asked` (`EngineConfig::rdma_mr_chunk`; `None`
/// or 0: no limit of ours) and every device's limit (`max_mr`, 0: none said), whichever is
/// smallest, rounded down to whole pages (at least one); `u64::MAX` when nothing limits it.
fn mr_chunk(asked: Option<u64>, max_mr: impl Iterator<Item = u64>) -> u64 {
    const PAGE: u64 = 4096;
    let limit = max_mr
        .filter(|m| *m > 0)
        .chain(asked.filter(|a| *a > 0))
        .min();
    match limit {
        None => u64::MAX,
        Some(l) => (l / PAGE * PAGE).max(PAGE),
    }
}

#[cfg(test)]
mod tests {
    use super::mr_chunk;

    #[test]
    fn the_chunk_is_the_smallest_limit_in_whole_pages() {
        assert_eq!(mr_chunk(None, [0, 0].into_iter()), u64::MAX);
        assert_eq!(
            mr_chunk(Some(0), [u64::MAX].into_iter()),
            u64::MAX / 4096 * 4096
        );
        assert_eq!(mr_chunk(None, [1 << 32, 1 << 31].into_iter()), 1 << 31);
        assert_eq!(mr_chunk(Some(100_000), [1 << 31].into_iter()), 24 * 4096);
        assert_eq!(mr_chunk(Some(1), [0].into_iter()), 4096);
    }
}

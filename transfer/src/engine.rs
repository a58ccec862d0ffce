//! The engine: regions, peers (handshake, control connection), batches.

use std::collections::HashMap;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::{Mutex, RwLock};

use crate::auth;
use crate::batch::{Batch, Pending, Posted, Timer, Xfer, DEFAULT_WAIT_SPIN, MAX_WAIT_SPIN};
use crate::coalesce::coalesce;
use crate::config::EngineConfig;
use crate::ctrl::CtrlWriter;
use crate::error::Error;
use crate::host::host_identity;
use crate::mem::RegionMem;
use crate::metrics::{self, EngineMetrics, MetricsSnapshot};
use crate::notify::{Notification, Notifications, NotifyQueue};
use crate::region::{check_bounds, RegionEntry, RegionTable};
use crate::transport::rdma::RdmaTransport;
use crate::transport::shm::ShmTransport;
use crate::transport::tcp::{serve_lane, TcpTransport};
use crate::transport::{
    CopyJob, CopyMarks, EstablishCtx, NotifyTracker, OnDead, PeerTransport, TargetCtx, Transport,
};
use crate::types::{Access, Dir, Op, PeerId, RegionHandle, RegionId, RemoteRegion, TransportKind};
use crate::wire::fence::{EngineMsg, FenceKind, ENGINE_MSG_BIT};
use crate::wire::{
    self, CtrlMsg, HostIdentity, ProtocolError, Stage, WireRegion, TRANSPORT_RDMA, TRANSPORT_SHM,
    TRANSPORT_TCP,
};

/// What a peer learns about this engine: where to connect, where it runs, what it offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// Listen address.
    pub addr: SocketAddr,
    /// Host identity (same identity = shared memory possible).
    pub host: HostIdentity,
    /// Regions offered to peers.
    pub regions: Vec<RemoteRegion>,
}

/// Concurrent handshakes accepted at once (beyond this, new connections are closed).
const MAX_HANDSHAKES: usize = 64;

#[derive(Default)]
struct RemoteTable {
    by_index: HashMap<u32, WireRegion>,
    /// Last generation seen removed per index (to tell stale from unknown).
    removed: HashMap<u32, u32>,
}

impl RemoteTable {
    fn upsert(&mut self, r: WireRegion) {
        self.removed.remove(&r.id.index);
        self.by_index.insert(r.id.index, r);
    }
    fn remove(&mut self, id: RegionId) {
        if self.by_index.get(&id.index).is_some_and(|r| r.id == id) {
            self.by_index.remove(&id.index);
        }
        let g = self.removed.entry(id.index).or_insert(0);
        *g = (*g).max(id.generation);
    }
    fn check(&self, id: RegionId, offset: u64, len: u64, write: bool) -> Result<WireRegion, Error> {
        let r = match self.by_index.get(&id.index) {
            Some(r) if r.id.generation == id.generation => *r,
            Some(r) if id.generation < r.id.generation => return Err(Error::StaleRegion(id)),
            None if self
                .removed
                .get(&id.index)
                .is_some_and(|g| id.generation <= *g) =>
            {
                return Err(Error::StaleRegion(id))
            }
            _ => return Err(Error::UnknownRegion(id)),
        };
        let ok = if write {
            r.access.remote_write()
        } else {
            r.access.remote_read()
        };
        if !ok {
            return Err(Error::AccessDenied(id));
        }
        check_bounds(id, offset, len, r.len)?;
        Ok(r)
    }
}

pub(crate) struct PeerInner {
    id: PeerId,
    kind: TransportKind,
    remote_addr: SocketAddr,
    remote_host: HostIdentity,
    ctrl: Arc<CtrlWriter>,
    ctrl_stream: TcpStream,
    remote: RwLock<RemoteTable>,
    pending: Arc<Pending>,
    tracker: Arc<NotifyTracker>,
    transport: Arc<dyn PeerTransport>,
    /// Per-peer state of transports both sides offered but this side did not choose (RDMA
    /// queue pairs the remote may write through).
    passive: Vec<Arc<dyn PeerTransport>>,
    our_token: [u8; 16],
    inbound_lanes: Mutex<Vec<TcpStream>>,
    /// What this peer's TCP lane threads are copying (see `Core::await_copies`).
    marks: Arc<CopyMarks>,
    dead: AtomicBool,
    /// Same host: region announcements carry the shm keys (fd, inode, address).
    same_host: bool,
    core: Weak<Core>,
}

/// A connected peer (outbound from `connect`, or inbound). Cheap to clone.
#[derive(Clone)]
pub struct Peer {
    pub(crate) inner: Arc<PeerInner>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("id", &self.inner.id)
            .field("transport", &self.inner.kind)
            .field("remote_addr", &self.inner.remote_addr)
            .finish()
    }
}

impl Peer {
    /// This peer's id within our engine.
    pub fn id(&self) -> PeerId {
        self.inner.id
    }
    /// The transport this engine uses towards the peer (`Tcp`, `Shm` or `Rdma`). Each side
    /// chooses for its own direction: shm needs the same host and permission to access the
    /// peer's memory (probed during the handshake); rdma needs both engines to offer it (a
    /// usable verbs device on each); otherwise tcp.
    pub fn transport(&self) -> TransportKind {
        self.inner.transport.kind()
    }
    /// Regions the remote offers to us, kept current as it registers and unregisters.
    pub fn regions(&self) -> Vec<RemoteRegion> {
        let mut v: Vec<RemoteRegion> = self
            .inner
            .remote
            .read()
            .by_index
            .values()
            .map(|r| RemoteRegion {
                id: r.id,
                len: r.len,
                access: r.access,
            })
            .collect();
        v.sort_by_key(|r| r.id.index);
        v
    }
    /// The address of the peer's control connection.
    pub fn remote_addr(&self) -> SocketAddr {
        self.inner.remote_addr
    }
    /// The peer's host identity.
    pub fn remote_host(&self) -> HostIdentity {
        self.inner.remote_host.clone()
    }
    /// Whether the peer is still connected.
    pub fn is_alive(&self) -> bool {
        !self.inner.dead.load(Ordering::Acquire)
    }
    /// Work requests posted so far on each lane of the data path towards this peer (RDMA: one
    /// entry per queue pair); empty for transports without per-lane accounting. For tests and
    /// diagnostics (spread of traffic over queue pairs).
    pub fn lane_counters(&self) -> Vec<u64> {
        self.inner.transport.lane_counters()
    }
    /// Work requests posted so far towards this peer per local RDMA device, as `(device,
    /// count)` for every device of the engine; empty for other transports. For tests and
    /// diagnostics (spread of traffic over devices).
    pub fn device_counters(&self) -> Vec<(String, u64)> {
        self.inner.transport.device_counters()
    }
    /// How many times a lane of the data path towards this peer was re-established after an
    /// error (RDMA: a queue pair replaced, on either side's request); 0 for other transports.
    pub fn lanes_reestablished(&self) -> u64 {
        std::iter::once(&self.inner.transport)
            .chain(self.inner.passive.iter())
            .map(|t| t.lanes_reestablished())
            .sum()
    }
}

pub(crate) struct Core {
    cfg: EngineConfig,
    listen_addr: SocketAddr,
    listener: TcpListener,
    regions: Arc<RegionTable>,
    peers: Mutex<HashMap<PeerId, Arc<PeerInner>>>,
    tokens: Mutex<HashMap<[u8; 16], Weak<PeerInner>>>,
    /// Held while (region table change + broadcast) and while (peer insert + region snapshot),
    /// so every peer sees every region change exactly in order.
    reg_lock: Mutex<()>,
    /// Region withdrawals awaiting confirmation from same-host peers.
    fences: RegionFences,
    notify: Arc<NotifyQueue>,
    timer: Arc<Timer>,
    shut: AtomicBool,
    host: HostIdentity,
    next_batch: AtomicU64,
    next_peer: AtomicU64,
    handshakes: AtomicUsize,
    copy_tx: Mutex<Option<Sender<CopyJob>>>,
    transports: Vec<Box<dyn Transport>>,
    metrics: Arc<EngineMetrics>,
    /// Bound address of the Prometheus endpoint, if one was asked for.
    metrics_addr: Option<SocketAddr>,
}

/// Region withdrawals (unregister of caller memory) awaiting each same-host peer's answer.
#[derive(Default)]
struct RegionFences {
    next: AtomicU64,
    /// Fence number -> its state.
    m: Mutex<HashMap<u64, Fence>>,
    cv: parking_lot::Condvar,
}

#[derive(Default)]
struct Fence {
    /// Peers that have not answered yet.
    waiting: std::collections::HashSet<PeerId>,
    /// Processes of peers disconnected before answering.
    lost: Vec<u32>,
}

impl RegionFences {
    fn acked(&self, seq: u64, peer: PeerId) {
        if let Some(f) = self.m.lock().get_mut(&seq) {
            f.waiting.remove(&peer);
        }
        self.cv.notify_all();
    }

    /// A peer was disconnected: it cannot answer any more.
    fn peer_gone(&self, peer: PeerId, pid: u32) {
        for f in self.m.lock().values_mut() {
            if f.waiting.remove(&peer) {
                f.lost.push(pid);
            }
        }
        self.cv.notify_all();
    }
}

struct Handle {
    core: Arc<Core>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.core.shutdown();
    }
}

/// The transfer engine. Cheap to clone; dropping the last clone shuts it down.
#[derive(Clone)]
pub struct Engine {
    h: Arc<Handle>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("listen", &self.h.core.listen_addr)
            .finish_non_exhaustive()
    }
}

fn wire_region(e: &RegionEntry, shm: bool, rkey: u32) -> WireRegion {
    let (addr, fd, ino) = if shm {
        (
            e.mem.addr(),
            e.mem.memfd().map(|f| f.as_raw_fd()).unwrap_or(-1),
            e.mem.memfd_ino(),
        )
    } else if rkey != 0 {
        (e.mem.addr(), -1, 0)
    } else {
        (0, -1, 0)
    };
    WireRegion {
        id: e.id,
        len: e.mem.len() as u64,
        access: e.access,
        addr,
        fd,
        ino,
        rkey,
    }
}

struct Handshaken {
    kind: TransportKind,
    remote_host: HostIdentity,
    remote_regions: Vec<WireRegion>,
    remote_token: [u8; 16],
    our_token: [u8; 16],
    lane_addr: SocketAddr,
    remote_blobs: Vec<(u8, Vec<u8>)>,
    our_blobs: Vec<(u8, Vec<u8>)>,
}

impl Engine {
    /// Binds the listener and starts the acceptor.
    pub fn new(cfg: EngineConfig) -> Result<Engine, Error> {
        if cfg.lanes == 0 || cfg.lanes > 64 {
            return Err(Error::InvalidArgument(format!(
                "lanes must be 1..=64, got {}",
                cfg.lanes
            )));
        }
        if cfg.slice_size == 0 {
            return Err(Error::InvalidArgument("slice_size must be > 0".into()));
        }
        if cfg.secret.as_ref().is_some_and(|s| s.is_empty()) {
            return Err(Error::InvalidArgument(
                "empty secret (use None for no authentication)".into(),
            ));
        }
        let mut transports: Vec<Box<dyn Transport>> =
            vec![Box::new(TcpTransport), Box::new(ShmTransport::new())];
        // Only engines that may use RDMA open a device (Tcp/Shm engines never offer it).
        if matches!(cfg.transport, TransportKind::Rdma | TransportKind::Auto) {
            match RdmaTransport::open(&cfg) {
                Ok(Some(t)) => transports.push(Box::new(t)),
                Ok(None) if cfg.transport == TransportKind::Rdma => {
                    return Err(Error::Unsupported(
                        "TransportKind::Rdma, but no RDMA device is usable here".into(),
                    ))
                }
                Ok(None) => {}
                Err(e) if cfg.transport == TransportKind::Rdma => return Err(e),
                Err(e) => tracing::info!(error = %e, "rdma not available; using tcp/shm"),
            }
        }
        let listener = TcpListener::bind(cfg.listen)?;
        let listen_addr = listener.local_addr()?;
        let metrics_listener = match cfg.metrics_addr {
            Some(a) => Some(TcpListener::bind(a)?),
            None => None,
        };
        let metrics_addr = match &metrics_listener {
            Some(l) => Some(l.local_addr()?),
            None => None,
        };
        let timer = Arc::new(Timer::default());
        timer.start()?;
        let (copy_tx, copy_rx) = crossbeam_channel::unbounded::<CopyJob>();
        std::thread::Builder::new()
            .name("kvwire-copy".into())
            .spawn(move || {
                while let Ok(job) = copy_rx.recv() {
                    job();
                }
            })?;
        let core = Arc::new(Core {
            cfg,
            listen_addr,
            listener,
            regions: Arc::new(RegionTable::default()),
            peers: Mutex::new(HashMap::new()),
            tokens: Mutex::new(HashMap::new()),
            reg_lock: Mutex::new(()),
            fences: RegionFences::default(),
            notify: Arc::new(NotifyQueue::default()),
            timer,
            shut: AtomicBool::new(false),
            host: host_identity(),
            next_batch: AtomicU64::new(1),
            next_peer: AtomicU64::new(1),
            handshakes: AtomicUsize::new(0),
            copy_tx: Mutex::new(Some(copy_tx)),
            transports,
            metrics: Arc::new(EngineMetrics::default()),
            metrics_addr,
        });
        let c = core.clone();
        std::thread::Builder::new()
            .name("kvwire-accept".into())
            .spawn(move || accept_loop(c))?;
        if let Some(l) = metrics_listener {
            let wc = Arc::downgrade(&core);
            let render: metrics::Render = Box::new(move || {
                let c = wc.upgrade()?;
                if c.shut.load(Ordering::Acquire) {
                    return None;
                }
                Some(c.metrics_snapshot().to_prometheus_text())
            });
            std::thread::Builder::new()
                .name("kvwire-metrics".into())
                .spawn(move || metrics::serve(l, render))?;
            tracing::info!(addr = ?metrics_addr, "metrics endpoint listening");
        }
        Ok(Engine {
            h: Arc::new(Handle { core }),
        })
    }

    fn core(&self) -> &Arc<Core> {
        &self.h.core
    }

    /// The bound listen address.
    pub fn listen_addr(&self) -> SocketAddr {
        self.core().listen_addr
    }

    /// A snapshot of the engine's metrics (see [`MetricsSnapshot::to_prometheus_text`]).
    pub fn metrics(&self) -> MetricsSnapshot {
        self.core().metrics_snapshot()
    }

    /// The bound address of the Prometheus endpoint (`EngineConfig::metrics_addr`).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.core().metrics_addr
    }

    /// Closes every connection and fails in-flight batches with `Error::Shutdown`.
    pub fn shutdown(&self) {
        self.core().shutdown();
    }

    /// Allocates an engine-owned region: zeroed, page aligned, backed by a memfd (so same-host
    /// peers can map it).
    pub fn alloc_region(&self, len: usize, access: Access) -> Result<RegionHandle, Error> {
        let mem = RegionMem::alloc_memfd(len).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidInput => Error::InvalidArgument(e.to_string()),
            _ => Error::Io(e),
        })?;
        self.core().add_region(Arc::new(mem), access)
    }

    /// Registers caller-owned memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid for reads and writes until [`Engine::unregister`] of the
    /// region returned `Ok` (after an error it must stay valid, see there), and, over RDMA,
    /// until every batch that used the region has completed; the caller must not hold Rust
    /// references into it while peers may write (remote writes land at any time).
    #[allow(unsafe_code)] // the caller's contract, forwarded to `RegionMem::from_raw`
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<RegionHandle, Error> {
        // SAFETY: forwarded contract of this function.
        let mem = unsafe { RegionMem::from_raw(ptr, len) }
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        self.core().add_region(Arc::new(mem), access)
    }

    /// Unregisters a region; its handle and id become stale everywhere.
    ///
    /// From the moment this begins, this engine's threads refuse every copy into or out of the
    /// region's memory with [`Error::StaleRegion`]: TCP slices a peer writes into it or reads
    /// from it (the peer's batch fails with `StaleRegion`), data of our TCP reads landing in it,
    /// payload of our TCP writes sent from it, our shm copies from or into it, `local_write` and
    /// `local_read`. A batch already submitted that still needed the region fails with
    /// `StaleRegion`, and a notification it carries is not delivered. (RDMA work requests
    /// already posted are the NIC's and complete.)
    ///
    /// For caller memory ([`Engine::register_raw`]) this also waits until every such copy that
    /// was already running ended: once it returns `Ok`, neither this engine nor any peer reads
    /// or writes the memory any more (RDMA work requests aside), and the caller may reuse or
    /// free it. A TCP copy still running after `EngineConfig::default_deadline` (a peer stalled
    /// in the middle of a frame) is aborted by disconnecting that peer, after which this
    /// returns `Ok` as well; if even then it does not end within another `default_deadline`,
    /// this returns [`Error::Timeout`] and the memory must not be reused.
    ///
    /// Offered caller memory is also written directly by same-host peers (shm), so this waits
    /// until every such peer confirmed that it withdrew the region and that none of its copies
    /// into it is still running; copies it has not started fail with [`Error::StaleRegion`]. A
    /// peer that does not confirm within `EngineConfig::default_deadline` is disconnected and
    /// this returns [`Error::Timeout`]; one disconnected before answering while its process
    /// lives gives [`Error::PeerDead`]. In both cases the region is withdrawn, but a copy that
    /// peer had already begun may still land, so the memory must not be reused then.
    pub fn unregister(&self, r: RegionHandle) -> Result<(), Error> {
        let core = self.core();
        let (e, fence) = {
            let _g = core.reg_lock.lock();
            let e = core.regions.remove(r)?;
            e.gate.close();
            for t in &core.transports {
                t.region_removed(e.id);
            }
            core.metrics.unregistrations.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(region = ?e.id, "region unregistered");
            let fence = if e.access.offered() {
                core.withdraw(e.id, e.mem.memfd().is_none())
            } else {
                None
            };
            (e, fence)
        };
        let fenced = match fence {
            Some(seq) => core.await_fence(seq),
            None => Ok(()),
        };
        // Engine-allocated memory lives as long as the copies that hold it; caller memory must
        // be left alone once this returns.
        let copies = if e.mem.memfd().is_none() {
            core.await_copies(&e)
        } else {
            Ok(())
        };
        fenced.and(copies)
    }

    /// Copies `data` into a local region.
    pub fn local_write(&self, r: RegionHandle, offset: u64, data: &[u8]) -> Result<(), Error> {
        let e = self.core().regions.get(r.id())?;
        check_bounds(r.id(), offset, data.len() as u64, e.mem.len() as u64)?;
        let _g = e.enter()?;
        e.mem.copy_in(offset, data)?;
        Ok(())
    }

    /// Copies bytes out of a local region.
    pub fn local_read(&self, r: RegionHandle, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        let e = self.core().regions.get(r.id())?;
        check_bounds(r.id(), offset, out.len() as u64, e.mem.len() as u64)?;
        let _g = e.enter()?;
        e.mem.copy_out(offset, out)?;
        Ok(())
    }

    /// The id under which peers see a region.
    pub fn region_id(&self, r: RegionHandle) -> RegionId {
        r.id()
    }

    /// Length of a local region.
    pub fn region_len(&self, r: RegionHandle) -> Result<u64, Error> {
        Ok(self.core().regions.get(r.id())?.mem.len() as u64)
    }

    /// What a peer receives: listen address, host identity, offered regions.
    pub fn descriptor(&self) -> Descriptor {
        let mut regions = self.core().regions.offered();
        regions.sort_by_key(|r| r.id.index);
        Descriptor {
            addr: self.listen_addr(),
            host: self.core().host.clone(),
            regions,
        }
    }

    /// Connects to a peer engine: handshake (version, mutual secret proof, region descriptors,
    /// transport choice), then data lanes for TCP.
    pub fn connect(&self, addr: SocketAddr) -> Result<Peer, Error> {
        let _span = tracing::debug_span!("kvwire.connect", %addr).entered();
        let r = self.connect_inner(addr);
        match &r {
            Ok(p) => tracing::debug!(
                peer = p.id().0,
                transport = metrics::transport_label(p.transport()),
                "connected"
            ),
            Err(e) => {
                self.core().metrics.error(metrics::STAGE_CONNECT, e);
                tracing::debug!(error = %e, "connect failed");
            }
        }
        r
    }

    fn connect_inner(&self, addr: SocketAddr) -> Result<Peer, Error> {
        let core = self.core();
        core.check_open()?;
        let t = core.cfg.connect_timeout;
        let mut s = TcpStream::connect_timeout(&addr, t).map_err(|e| match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Error::Timeout,
            _ => Error::Io(e),
        })?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(t))?;
        s.set_write_timeout(Some(t))?;
        let hs = initiator_handshake(core, &mut s, addr).map_err(timeout_err)?;
        let peer = core.make_peer(s, hs, true)?;
        if let Err(e) = peer.transport.warm_up() {
            core.kill_peer(
                peer.id,
                &format!("setting up the data path failed: {e}"),
                false,
            );
            return Err(timeout_err(e));
        }
        Ok(Peer { inner: peer })
    }

    /// Every connected peer, inbound ones included.
    pub fn peers(&self) -> Vec<Peer> {
        let mut v: Vec<Peer> = self
            .core()
            .peers
            .lock()
            .values()
            .map(|p| Peer { inner: p.clone() })
            .collect();
        v.sort_by_key(|p| p.id());
        v
    }

    /// Submits a batch of writes (local → remote), with an optional notification delivered to
    /// the target after every byte landed. One completion for the whole batch.
    ///
    /// Notification guarantees, on every transport:
    /// * a notification is delivered at most once, and only after every byte of its batch
    ///   landed; a batch with a refused slice never delivers it;
    /// * when the batch completes successfully, its notification is already queued at the
    ///   target ([`Engine::notifications`]). Hence notifications follow completion order: if
    ///   batch A completed before batch B was submitted (to the same target engine, from any
    ///   thread or peer connection), A's notification is received before B's. Batches in flight
    ///   at the same time carry no order between each other (TCP spreads them over lanes),
    ///   except over shm, where batches submitted one after the other to a peer are notified in
    ///   submission order.
    ///
    /// A failed batch (deadline, dead peer) may or may not have delivered its notification.
    pub fn write(
        &self,
        peer: &Peer,
        ops: &[Op],
        notify: Option<&[u8]>,
        deadline: Option<Duration>,
    ) -> Result<Batch, Error> {
        if let Some(t) = notify {
            if t.len() > wire::MAX_TAG as usize {
                return Err(Error::InvalidArgument(format!(
                    "notification tag of {} bytes exceeds {}",
                    t.len(),
                    wire::MAX_TAG
                )));
            }
        }
        self.submit(peer, ops, notify.map(|t| t.to_vec()), deadline, Dir::Write)
    }

    /// Submits a batch of reads (remote → local). `Op::local` is the destination.
    pub fn read(
        &self,
        peer: &Peer,
        ops: &[Op],
        deadline: Option<Duration>,
    ) -> Result<Batch, Error> {
        self.submit(peer, ops, None, deadline, Dir::Read)
    }

    fn submit(
        &self,
        peer: &Peer,
        ops: &[Op],
        notify: Option<Vec<u8>>,
        deadline: Option<Duration>,
        dir: Dir,
    ) -> Result<Batch, Error> {
        let r = self.submit_inner(peer, ops, notify, deadline, dir);
        if let Err(e) = &r {
            self.core().metrics.error(metrics::STAGE_SUBMIT, e);
            if tracing::enabled!(tracing::Level::DEBUG) {
                tracing::debug!(peer = peer.id().0, ?dir, ops = ops.len(), error = %e, "batch refused");
            }
        } else if tracing::enabled!(tracing::Level::TRACE) {
            tracing::trace!(
                peer = peer.id().0,
                transport = metrics::transport_label(peer.transport()),
                ?dir,
                ops = ops.len(),
                "batch submitted"
            );
        }
        r
    }

    fn submit_inner(
        &self,
        peer: &Peer,
        ops: &[Op],
        notify: Option<Vec<u8>>,
        deadline: Option<Duration>,
        dir: Dir,
    ) -> Result<Batch, Error> {
        let core = self.core();
        core.check_open()?;
        let p = &peer.inner;
        if !p.core.ptr_eq(&Arc::downgrade(core)) {
            return Err(Error::InvalidArgument(
                "peer belongs to another engine".into(),
            ));
        }
        if let Some(r) = p.pending.closed_reason() {
            return Err(Error::PeerDead(r));
        }
        // Declared dead, its batches not yet failed (kill_peer sets the flag first): a peer
        // that is not alive refuses new work with PeerDead, never with a region error.
        if p.dead.load(Ordering::Acquire) {
            return Err(Error::PeerDead("peer is being closed".into()));
        }
        let start = Instant::now();
        let deadline = start + deadline.unwrap_or(core.cfg.default_deadline);
        let write = dir == Dir::Write;
        // Check every op as submitted (errors name the caller's op), then coalesce.
        let mut cache: Vec<Arc<RegionEntry>> = Vec::new();
        let mut local = |h: RegionHandle| -> Result<Arc<RegionEntry>, Error> {
            if let Some(e) = cache.iter().find(|e| e.id == h.id()) {
                return Ok(e.clone());
            }
            let e = core.regions.get(h.id())?;
            cache.push(e.clone());
            Ok(e)
        };
        {
            let remote = p.remote.read();
            for op in ops {
                let e = local(op.local)?;
                check_bounds(op.local.id(), op.local_offset, op.len, e.mem.len() as u64)?;
                remote.check(op.remote, op.remote_offset, op.len, write)?;
            }
        }
        let merged = coalesce(ops);
        let mut xfers = Vec::with_capacity(merged.len());
        let mut bytes = 0u64;
        {
            let remote = p.remote.read();
            for op in &merged {
                let r = remote.check(op.remote, op.remote_offset, op.len, write)?;
                xfers.push(Xfer {
                    local: local(op.local)?,
                    local_offset: op.local_offset,
                    remote: r,
                    remote_offset: op.remote_offset,
                    len: op.len,
                });
                bytes += op.len;
            }
        }
        let posted = Posted {
            id: core.next_batch.fetch_add(1, Ordering::Relaxed),
            dir,
            xfers,
            notify,
            ops: ops.len(),
            bytes,
            deadline,
            timer: core.timer.clone(),
            start,
            spin: core
                .cfg
                .wait_spin
                .unwrap_or(DEFAULT_WAIT_SPIN)
                .min(MAX_WAIT_SPIN),
        };
        let state = p.transport.post(posted, &p.pending)?;
        Ok(Batch { state })
    }

    /// Notifications delivered to this engine as a target.
    pub fn notifications(&self) -> Notifications {
        Notifications {
            q: self.core().notify.clone(),
        }
    }
}

/// Work requests re-posted towards a peer (every transport state it has).
fn peer_reposts(p: &PeerInner) -> u64 {
    std::iter::once(&p.transport)
        .chain(p.passive.iter())
        .map(|t| t.reposts())
        .sum()
}

fn timeout_err(e: Error) -> Error {
    match e {
        Error::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Error::Timeout
        }
        e => e,
    }
}

impl Core {
    fn check_open(&self) -> Result<(), Error> {
        if self.shut.load(Ordering::Acquire) {
            Err(Error::Shutdown)
        } else {
            Ok(())
        }
    }

    fn add_region(&self, mem: Arc<RegionMem>, access: Access) -> Result<RegionHandle, Error> {
        let t0 = Instant::now();
        let len = mem.len() as u64;
        let h = self.add_region_inner(mem, access)?;
        let ns = t0.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        let m = &self.metrics;
        m.registrations.fetch_add(1, Ordering::Relaxed);
        m.registered_bytes.fetch_add(len, Ordering::Relaxed);
        m.registration_ns.fetch_add(ns, Ordering::Relaxed);
        tracing::debug!(region = ?h.id(), bytes = len, duration_us = ns / 1000, "region registered");
        Ok(h)
    }

    fn metrics_snapshot(&self) -> MetricsSnapshot {
        let peers: Vec<Arc<PeerInner>> = self.peers.lock().values().cloned().collect();
        let mut lanes = 0;
        let mut reposts = 0;
        let mut inflight = (0, 0, 0);
        let mut ps: Vec<metrics::PeerSnapshot> = peers
            .iter()
            .map(|p| {
                let re = Peer { inner: p.clone() }.lanes_reestablished();
                lanes += re;
                let rp = peer_reposts(p);
                reposts += rp;
                let f = p.pending.inflight();
                inflight = (inflight.0 + f.0, inflight.1 + f.1, inflight.2 + f.2);
                metrics::peer_snapshot(
                    p.id.0,
                    p.remote_addr,
                    p.transport.kind(),
                    p.pending.obs.as_ref().map(|o| &*o.peer),
                    (re, rp),
                )
            })
            .collect();
        ps.sort_by_key(|p| p.id);
        let all = self.regions.all();
        let n = &self.notify;
        self.metrics.snapshot(metrics::SnapshotExtra {
            peers: ps,
            lanes_reestablished_live: lanes,
            reposts_live: reposts,
            regions: all.len() as u64,
            region_bytes: all.iter().map(|e| e.mem.len() as u64).sum(),
            peers_connected: peers.len() as u64,
            notifications: (
                n.delivered.load(Ordering::Relaxed),
                n.dropped.load(Ordering::Relaxed),
                n.suppressed.load(Ordering::Relaxed),
            ),
            inflight,
        })
    }

    fn add_region_inner(&self, mem: Arc<RegionMem>, access: Access) -> Result<RegionHandle, Error> {
        self.check_open()?;
        let _g = self.reg_lock.lock();
        let h = self.regions.insert(mem, access)?;
        let e = self.regions.get(h.id())?;
        for (i, t) in self.transports.iter().enumerate() {
            if let Err(err) = t.region_added(&e) {
                for t in &self.transports[..i] {
                    t.region_removed(e.id);
                }
                let _ = self.regions.remove(h);
                return Err(err);
            }
        }
        if access.offered() {
            let rkey = self.rkey(e.id);
            self.broadcast(|p| CtrlMsg::RegionsAdded(vec![wire_region(&e, p.same_host, rkey)]));
        }
        Ok(h)
    }

    /// Tells every peer that region `id` is gone (callers hold `reg_lock`). For caller memory,
    /// same-host peers (which may be copying into it) also get a fence; returns its number.
    fn withdraw(&self, id: RegionId, raw: bool) -> Option<u64> {
        let peers: Vec<_> = self.peers.lock().values().cloned().collect();
        let seq = self.fences.next.fetch_add(1, Ordering::Relaxed);
        let fenced: Vec<(PeerId, u32)> = peers
            .iter()
            .filter(|p| raw && p.same_host)
            .map(|p| (p.id, p.remote_host.pid))
            .collect();
        if !fenced.is_empty() {
            // Registered before anything is sent: an answer may come back at once.
            self.fences.m.lock().insert(
                seq,
                Fence {
                    waiting: fenced.iter().map(|f| f.0).collect(),
                    lost: Vec::new(),
                },
            );
        }
        for p in peers {
            let mut buf = CtrlMsg::RegionsRemoved(vec![id]).encode();
            let fence = raw && p.same_host;
            if fence {
                buf.extend_from_slice(
                    &EngineMsg::Fence(FenceKind::Regions, seq).to_ctrl().encode(),
                );
            }
            let sent = p.ctrl.write_encoded(&buf);
            if let Err(e) = sent {
                tracing::debug!(peer = ?p.id, error = %e, "region withdrawal not sent");
                if fence {
                    // It cannot answer (counted as lost by `kill_peer`).
                    self.kill_peer(p.id, &format!("region withdrawal not sent: {e}"), false);
                }
            }
        }
        // Peers disconnected since the snapshot will never answer.
        for (peer, pid) in &fenced {
            if !self.peers.lock().contains_key(peer) {
                self.fences.peer_gone(*peer, *pid);
            }
        }
        (!fenced.is_empty()).then_some(seq)
    }

    /// Waits until every peer of fence `seq` confirmed it or went away (bounded by
    /// `default_deadline`; peers still silent then are disconnected, `Error::Timeout`).
    fn await_fence(&self, seq: u64) -> Result<(), Error> {
        let until = Instant::now() + self.cfg.default_deadline;
        let mut m = self.fences.m.lock();
        loop {
            let left = m.get(&seq).map_or(0, |f| f.waiting.len());
            if left == 0 {
                let f = m.remove(&seq).unwrap_or_default();
                drop(m);
                // A peer that went away without answering is harmless only if its process is
                // gone too (a live one may still be inside a copy it began).
                let alive: Vec<u32> = f
                    .lost
                    .into_iter()
                    .filter(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
                    .collect();
                if alive.is_empty() {
                    return Ok(());
                }
                return Err(Error::PeerDead(format!(
                    "same-host peer process(es) {alive:?} disconnected before confirming the \
                     region withdrawal; a copy already begun may still land"
                )));
            }
            if self.fences.cv.wait_until(&mut m, until).timed_out() {
                let silent = m.remove(&seq).map(|f| f.waiting).unwrap_or_default();
                drop(m);
                if silent.is_empty() {
                    return Ok(());
                }
                for id in silent {
                    self.kill_peer(
                        id,
                        "did not confirm a region withdrawal before the deadline",
                        false,
                    );
                }
                return Err(Error::Timeout);
            }
        }
    }

    /// Waits until no engine thread copies into or out of withdrawn region `e` any more (its
    /// gate is closed). A copy still running after `default_deadline` is stuck on a stalled
    /// peer (a TCP lane inside a frame): the peers whose lanes are inside a copy of the region
    /// are disconnected, which ends it; `Error::Timeout` if it still did not end within a
    /// second `default_deadline`.
    fn await_copies(&self, e: &RegionEntry) -> Result<(), Error> {
        if e.gate.wait_idle(Instant::now() + self.cfg.default_deadline) {
            return Ok(());
        }
        let until = Instant::now() + self.cfg.default_deadline;
        loop {
            let stuck: Vec<PeerId> = self
                .peers
                .lock()
                .values()
                .filter(|p| p.marks.holds(e.id))
                .map(|p| p.id)
                .collect();
            for id in stuck {
                tracing::warn!(peer = id.0, region = ?e.id, "peer stalled inside a copy of an unregistered region");
                self.kill_peer(
                    id,
                    "stalled inside a copy of a region being unregistered",
                    false,
                );
            }
            // Re-checked now and then: a lane may mark its copy just after the scan.
            let next = (Instant::now() + Duration::from_millis(50)).min(until);
            if e.gate.wait_idle(next) {
                return Ok(());
            }
            if Instant::now() >= until {
                tracing::warn!(region = ?e.id, running = e.gate.running(), "copies of an unregistered region did not end");
                return Err(Error::Timeout);
            }
        }
    }

    /// Sends a control message to every peer (callers hold `reg_lock`).
    fn broadcast(&self, msg: impl Fn(&PeerInner) -> CtrlMsg) {
        let peers: Vec<_> = self.peers.lock().values().cloned().collect();
        for p in peers {
            if let Err(e) = p.ctrl.send(&msg(&p)) {
                tracing::debug!(peer = ?p.id, error = %e, "region update not sent");
            }
        }
    }

    fn rkey(&self, id: RegionId) -> u32 {
        self.transports
            .iter()
            .map(|t| t.region_rkey(id))
            .find(|k| *k != 0)
            .unwrap_or(0)
    }

    fn has_rdma(&self) -> bool {
        self.transports
            .iter()
            .any(|t| t.kind() == TransportKind::Rdma)
    }

    /// Our handshake blobs for the transports we allow and the peer accepts (`theirs`).
    fn hello_blobs(&self, theirs: u8) -> Vec<(u8, Vec<u8>)> {
        let allowed = allowed_transports(self) & theirs;
        self.transports
            .iter()
            .filter(|t| t.bit() & allowed != 0)
            .filter_map(|t| t.hello_blob().map(|b| (t.bit(), b)))
            .collect()
    }

    fn offered_wire(&self, shm: bool) -> Vec<WireRegion> {
        self.regions
            .all()
            .iter()
            .filter(|e| e.access.offered())
            .map(|e| wire_region(e, shm, self.rkey(e.id)))
            .collect()
    }

    fn make_peer(
        self: &Arc<Self>,
        s: TcpStream,
        hs: Handshaken,
        initiator: bool,
    ) -> Result<Arc<PeerInner>, Error> {
        let id = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        let remote_addr = s.peer_addr()?;
        s.set_read_timeout(None)?;
        s.set_write_timeout(Some(self.cfg.connect_timeout.max(Duration::from_secs(1))))?;
        let ctrl = Arc::new(CtrlWriter::new(s.try_clone()?));
        let obs = self.cfg.metrics.then(|| self.metrics.peer_obs(hs.kind));
        let pending = Arc::new(Pending::with_obs(obs));
        let weak_core = Arc::downgrade(self);
        let on_dead: OnDead = {
            let wc = weak_core.clone();
            Arc::new(move |reason: String| {
                if let Some(c) = wc.upgrade() {
                    c.kill_peer(id, &reason, false);
                }
            })
        };
        let t = self
            .transports
            .iter()
            .find(|t| t.kind() == hs.kind)
            .ok_or_else(|| Error::Unsupported(format!("transport {:?} not available", hs.kind)))?;
        let blob_of = |v: &[(u8, Vec<u8>)], bit: u8| -> Option<Vec<u8>> {
            v.iter().find(|(k, _)| *k == bit).map(|(_, b)| b.clone())
        };
        let copy_tx = self.copy_tx.lock().clone().ok_or(Error::Shutdown)?;
        let marks = Arc::new(CopyMarks::default());
        let mut passive: Vec<Arc<dyn PeerTransport>> = Vec::new();
        for other in &self.transports {
            if other.kind() == hs.kind || !other.attach_always() {
                continue;
            }
            let (Some(rb), Some(lb)) = (
                blob_of(&hs.remote_blobs, other.bit()),
                blob_of(&hs.our_blobs, other.bit()),
            ) else {
                continue;
            };
            match other.establish(EstablishCtx {
                remote_blob: Some(&rb),
                local_blob: Some(&lb),
                remote_host: &hs.remote_host,
                lane_addr: hs.lane_addr,
                remote_token: hs.remote_token,
                cfg: &self.cfg,
                ctrl: ctrl.clone(),
                pending: pending.clone(),
                on_dead: on_dead.clone(),
                copy_tx: copy_tx.clone(),
                marks: marks.clone(),
            }) {
                Ok(p) => passive.push(p),
                Err(e) => {
                    tracing::warn!(kind = ?other.kind(), error = %e, "passive transport setup failed")
                }
            }
        }
        let rb = blob_of(&hs.remote_blobs, t.bit());
        let lb = blob_of(&hs.our_blobs, t.bit());
        let transport = t.establish(EstablishCtx {
            remote_blob: rb.as_deref(),
            local_blob: lb.as_deref(),
            remote_host: &hs.remote_host,
            lane_addr: hs.lane_addr,
            remote_token: hs.remote_token,
            cfg: &self.cfg,
            ctrl: ctrl.clone(),
            pending: pending.clone(),
            on_dead,
            copy_tx,
            marks: marks.clone(),
        })?;
        let mut table = RemoteTable::default();
        for r in hs.remote_regions {
            if r.access.offered() {
                table.upsert(r);
            }
        }
        let same_host = self.host.same_host(&hs.remote_host);
        let peer = Arc::new(PeerInner {
            id,
            kind: hs.kind,
            remote_addr,
            remote_host: hs.remote_host,
            ctrl,
            ctrl_stream: s,
            remote: RwLock::new(table),
            pending,
            tracker: Arc::new(NotifyTracker::default()),
            transport,
            passive,
            our_token: hs.our_token,
            inbound_lanes: Mutex::new(Vec::new()),
            marks,
            dead: AtomicBool::new(false),
            same_host,
            core: weak_core,
        });
        {
            let _g = self.reg_lock.lock();
            if self.shut.load(Ordering::Acquire) {
                return Err(Error::Shutdown);
            }
            self.tokens
                .lock()
                .insert(hs.our_token, Arc::downgrade(&peer));
            self.peers.lock().insert(id, peer.clone());
            // Counted before the handshake's last message goes out (visible to the remote).
            self.metrics.connections[usize::from(!initiator)].fetch_add(1, Ordering::Relaxed);
            let shm = peer.same_host;
            let msg = if initiator {
                // Our region list went out in `Auth` before the peer existed: resend the current
                // one now that updates reach this peer.
                Some(CtrlMsg::RegionsSet(self.offered_wire(shm)))
            } else {
                Some(CtrlMsg::Welcome {
                    regions: self.offered_wire(shm),
                })
            };
            if let Some(m) = msg {
                if let Err(e) = peer.ctrl.send(&m) {
                    drop(_g);
                    self.kill_peer(id, &format!("control send failed: {e}"), false);
                    return Err(e);
                }
            }
        }
        let reader = peer.ctrl_stream.try_clone()?;
        let (wc, p2) = (Arc::downgrade(self), peer.clone());
        std::thread::Builder::new()
            .name("kvwire-ctrl".into())
            .spawn(move || ctrl_loop(wc, p2, reader))?;
        tracing::info!(
            peer = id.0,
            transport = metrics::transport_label(hs.kind),
            %remote_addr,
            initiator,
            "peer connected"
        );
        Ok(peer)
    }

    fn kill_peer(&self, id: PeerId, reason: &str, shutdown: bool) {
        let p = self.peers.lock().remove(&id);
        let Some(p) = p else { return };
        if p.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::info!(peer = id.0, reason, "peer closed");
        self.metrics.disconnects.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .reposts_retired
            .fetch_add(peer_reposts(&p), Ordering::Relaxed);
        self.metrics.lanes_reestablished_retired.fetch_add(
            Peer { inner: p.clone() }.lanes_reestablished(),
            Ordering::Relaxed,
        );
        self.tokens.lock().remove(&p.our_token);
        p.pending.close(reason, shutdown);
        p.transport.close();
        for t in &p.passive {
            t.close();
        }
        p.tracker.clear();
        p.ctrl.forget_all();
        let _ = p.ctrl_stream.shutdown(Shutdown::Both);
        self.fences.peer_gone(id, p.remote_host.pid);
        for s in p.inbound_lanes.lock().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn shutdown(&self) {
        if self.shut.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ =
            nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        // Wake the acceptor in case shutdown(2) on a listener does not (it does on Linux).
        let _ = TcpStream::connect_timeout(&self.listen_addr, Duration::from_millis(100));
        if let Some(a) = self.metrics_addr {
            // Wake the metrics server so it sees the shutdown and exits.
            let _ = TcpStream::connect_timeout(&a, Duration::from_millis(100));
        }
        let ids: Vec<PeerId> = self.peers.lock().keys().copied().collect();
        for id in ids {
            self.kill_peer(id, "engine shut down", true);
        }
        self.notify.close();
        self.timer.stop();
        self.copy_tx.lock().take();
    }
}

// ---------------------------------------------------------------- handshake

fn allowed_transports(core: &Core) -> u8 {
    let rdma = if core.has_rdma() { TRANSPORT_RDMA } else { 0 };
    match core.cfg.transport {
        TransportKind::Tcp => TRANSPORT_TCP,
        TransportKind::Shm => TRANSPORT_SHM,
        TransportKind::Rdma => rdma,
        TransportKind::Auto => TRANSPORT_TCP | TRANSPORT_SHM | rdma,
    }
}

fn kind_bit(k: TransportKind) -> u8 {
    match k {
        TransportKind::Shm => TRANSPORT_SHM,
        TransportKind::Rdma => TRANSPORT_RDMA,
        TransportKind::Tcp | TransportKind::Auto => TRANSPORT_TCP,
    }
}

/// This side's transport towards a peer: shm when both allow it and the peer's memory is
/// reachable (same host, probe read succeeds), else tcp when both allow it.
fn choose_transport(
    core: &Core,
    theirs: u8,
    rhost: &HostIdentity,
    rblobs: &[(u8, Vec<u8>)],
) -> Result<TransportKind, Error> {
    let ours = allowed_transports(core);
    let both = ours & theirs;
    // Shared memory before RDMA on one host, unless `EngineConfig::prefer_rdma`.
    let mut order: Vec<&dyn Transport> = core.transports.iter().map(|t| t.as_ref()).collect();
    if core.cfg.prefer_rdma.unwrap_or(false) {
        order.sort_by_key(|t| t.kind() != TransportKind::Rdma);
    }
    for t in order {
        if both & t.bit() == 0 || t.kind() == TransportKind::Tcp {
            continue;
        }
        let blob = rblobs
            .iter()
            .find(|(k, _)| *k == t.bit())
            .map(|(_, b)| b.as_slice());
        if t.usable_with(rhost, blob) {
            return Ok(t.kind());
        }
    }
    if both & TRANSPORT_TCP != 0 {
        return Ok(TransportKind::Tcp);
    }
    Err(Error::Unsupported(format!(
        "no usable common transport (ours {ours:#x}, theirs {theirs:#x}, same host: {})",
        core.host.same_host(rhost)
    )))
}

fn send_reject(s: &mut TcpStream, e: &Error) {
    let _ = s.write_all(
        &CtrlMsg::Reject {
            error: wire::encode_error(e),
        }
        .encode(),
    );
}

fn initiator_handshake(
    core: &Arc<Core>,
    s: &mut TcpStream,
    addr: SocketAddr,
) -> Result<Handshaken, Error> {
    let nonce_i: [u8; 32] = auth::random();
    let secret = core.cfg.secret.as_deref();
    let our_blobs = core.hello_blobs(u8::MAX);
    s.write_all(
        &CtrlMsg::Hello {
            nonce: nonce_i,
            auth: secret.is_some(),
            host: core.host.clone(),
            listen_port: core.listen_addr.port(),
            transports: allowed_transports(core),
            blobs: our_blobs.clone(),
        }
        .encode(),
    )?;
    let (nonce_r, mac_r, auth_required, rhost, rtransports, rtoken, rblobs) =
        match wire::read_ctrl(s)? {
            CtrlMsg::HelloReply {
                nonce,
                mac,
                auth_required,
                host,
                transports,
                token,
                blobs,
            } => (nonce, mac, auth_required, host, transports, token, blobs),
            CtrlMsg::Reject { error } => return Err(wire::decode_error(&error, true)?),
            m => {
                return Err(ProtocolError::Unexpected {
                    stage: Stage::HelloReply,
                    got: Some(Box::new(m)),
                }
                .into())
            }
        };
    // Mutual proof: the responder must prove the secret when we hold one; we must prove it when
    // the responder requires it.
    let mac_i = match secret {
        Some(k) => {
            if !auth::verify_responder(k, &nonce_i, &nonce_r, &mac_r) {
                send_reject(s, &Error::AuthFailed);
                return Err(Error::AuthFailed);
            }
            auth::initiator_proof(k, &nonce_i, &nonce_r)
        }
        None => {
            if auth_required {
                send_reject(s, &Error::AuthFailed);
                return Err(Error::AuthFailed);
            }
            Vec::new()
        }
    };
    let kind = match choose_transport(core, rtransports, &rhost, &rblobs) {
        Ok(k) => k,
        Err(e) => {
            send_reject(s, &e);
            return Err(e);
        }
    };
    let same = core.host.same_host(&rhost);
    let our_token: [u8; 16] = auth::random();
    s.write_all(
        &CtrlMsg::Auth {
            mac: mac_i,
            transport: kind_bit(kind),
            token: our_token,
            regions: core.offered_wire(same),
        }
        .encode(),
    )?;
    let regions = match wire::read_ctrl(s)? {
        CtrlMsg::Welcome { regions } => regions,
        CtrlMsg::Reject { error } => return Err(wire::decode_error(&error, true)?),
        m => {
            return Err(ProtocolError::Unexpected {
                stage: Stage::Welcome,
                got: Some(Box::new(m)),
            }
            .into())
        }
    };
    Ok(Handshaken {
        kind,
        remote_host: rhost,
        remote_regions: regions,
        remote_token: rtoken,
        our_token,
        lane_addr: addr,
        remote_blobs: rblobs,
        our_blobs,
    })
}

fn responder_handshake(
    core: &Arc<Core>,
    s: &mut TcpStream,
    hello: CtrlMsg,
) -> Result<Handshaken, Error> {
    let CtrlMsg::Hello {
        nonce: nonce_i,
        auth: _,
        host: ihost,
        listen_port,
        transports: itransports,
        blobs: iblobs,
    } = hello
    else {
        return Err(ProtocolError::Unexpected {
            stage: Stage::Hello,
            got: None,
        }
        .into());
    };
    let secret = core.cfg.secret.as_deref();
    let nonce_r: [u8; 32] = auth::random();
    let our_token: [u8; 16] = auth::random();
    let our_blobs = core.hello_blobs(itransports);
    let ours = allowed_transports(core);
    if ours & itransports == 0 {
        let e = Error::Unsupported(format!(
            "no common transport (ours {ours:#x}, theirs {itransports:#x})"
        ));
        send_reject(s, &e);
        return Err(e);
    }
    s.write_all(
        &CtrlMsg::HelloReply {
            nonce: nonce_r,
            mac: secret
                .map(|k| auth::responder_proof(k, &nonce_i, &nonce_r))
                .unwrap_or_default(),
            auth_required: secret.is_some(),
            host: core.host.clone(),
            transports: ours,
            token: our_token,
            blobs: our_blobs.clone(),
        }
        .encode(),
    )?;
    let (mac_i, transport, rtoken, regions) = match wire::read_ctrl(s)? {
        CtrlMsg::Auth {
            mac,
            transport,
            token,
            regions,
        } => (mac, transport, token, regions),
        CtrlMsg::Reject { error } => return Err(wire::decode_error(&error, true)?),
        m => {
            return Err(ProtocolError::Unexpected {
                stage: Stage::Auth,
                got: Some(Box::new(m)),
            }
            .into())
        }
    };
    if let Some(k) = secret {
        if !auth::verify_initiator(k, &nonce_i, &nonce_r, &mac_i) {
            send_reject(s, &Error::AuthFailed);
            return Err(Error::AuthFailed);
        }
    }
    // The initiator's choice is for its direction; ours is made the same way for ours.
    if transport == TRANSPORT_SHM && !core.host.same_host(&ihost) {
        let e = Error::from(ProtocolError::ShmAcrossHosts);
        send_reject(s, &e);
        return Err(e);
    }
    let kind = match choose_transport(core, itransports, &ihost, &iblobs) {
        Ok(k) => k,
        Err(e) => {
            send_reject(s, &e);
            return Err(e);
        }
    };
    let peer_ip = s.peer_addr()?.ip();
    Ok(Handshaken {
        kind,
        remote_host: ihost,
        remote_regions: regions,
        remote_token: rtoken,
        our_token,
        lane_addr: SocketAddr::new(peer_ip, listen_port),
        remote_blobs: iblobs,
        our_blobs,
    })
}

// ---------------------------------------------------------------- threads

fn accept_loop(core: Arc<Core>) {
    loop {
        let r = core.listener.accept();
        if core.shut.load(Ordering::Acquire) {
            return;
        }
        match r {
            Ok((s, addr)) => {
                if core.handshakes.load(Ordering::Acquire) >= MAX_HANDSHAKES {
                    tracing::warn!(%addr, "too many concurrent handshakes; closing connection");
                    continue;
                }
                core.handshakes.fetch_add(1, Ordering::AcqRel);
                let c = core.clone();
                let spawned = std::thread::Builder::new()
                    .name("kvwire-conn".into())
                    .spawn(move || handle_conn(c, s, addr));
                if let Err(e) = spawned {
                    core.handshakes.fetch_sub(1, Ordering::AcqRel);
                    tracing::warn!(error = %e, "cannot spawn connection thread");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn handle_conn(core: Arc<Core>, mut s: TcpStream, addr: SocketAddr) {
    let first = (|| -> Result<CtrlMsg, Error> {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(core.cfg.connect_timeout))?;
        s.set_write_timeout(Some(core.cfg.connect_timeout))?;
        wire::read_ctrl(&mut s)
    })();
    let r = match first {
        Err(e) => Err(e),
        Ok(m @ CtrlMsg::Hello { .. }) => match responder_handshake(&core, &mut s, m) {
            Ok(hs) => {
                core.handshakes.fetch_sub(1, Ordering::AcqRel);
                if let Err(e) = core.make_peer(s, hs, false) {
                    tracing::warn!(%addr, error = %e, "peer setup failed");
                }
                return;
            }
            Err(e) => Err(e),
        },
        Ok(CtrlMsg::LaneJoin { token, lane }) => {
            let peer = core.tokens.lock().get(&token).and_then(|w| w.upgrade());
            match peer {
                Some(p) => Ok((p, lane)),
                None => Err(Error::AuthFailed),
            }
        }
        Ok(m) => Err(ProtocolError::Unexpected {
            stage: Stage::FirstMessage,
            got: Some(Box::new(m)),
        }
        .into()),
    };
    core.handshakes.fetch_sub(1, Ordering::AcqRel);
    match r {
        Ok((p, lane)) => {
            let setup = (|| -> Result<TcpStream, Error> {
                s.write_all(&CtrlMsg::LaneOk.encode())?;
                s.set_read_timeout(None)?;
                s.set_write_timeout(None)?;
                Ok(s.try_clone()?)
            })();
            match setup {
                Ok(c) => {
                    p.inbound_lanes.lock().push(c);
                    if p.dead.load(Ordering::Acquire) {
                        return;
                    }
                    tracing::debug!(peer = ?p.id, lane, "lane accepted");
                    let ctx = TargetCtx {
                        regions: core.regions.clone(),
                        notify: core.notify.clone(),
                        peer: p.id,
                        tracker: p.tracker.clone(),
                        marks: p.marks.clone(),
                    };
                    drop(p);
                    drop(core);
                    serve_lane(s, ctx);
                }
                Err(e) => tracing::warn!(%addr, error = %e, "lane setup failed"),
            }
        }
        Err(e) => {
            tracing::warn!(%addr, error = %e, "connection refused");
            let e = timeout_err(e);
            core.metrics.error(metrics::STAGE_CONNECT, &e);
            if !matches!(e, Error::Io(_)) {
                send_reject(&mut s, &e);
            }
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn ctrl_loop(core: Weak<Core>, p: Arc<PeerInner>, mut s: TcpStream) {
    let reason = loop {
        let m = match wire::read_ctrl(&mut s) {
            Ok(m) => m,
            Err(e) => break format!("control connection: {e}"),
        };
        match m {
            CtrlMsg::RegionsAdded(v) => {
                let mut t = p.remote.write();
                for r in v {
                    if r.access.offered() {
                        t.upsert(r);
                    }
                }
            }
            CtrlMsg::RegionsSet(v) => {
                let mut t = p.remote.write();
                let old: Vec<RegionId> = t.by_index.values().map(|r| r.id).collect();
                for id in old {
                    if !v.iter().any(|r| r.id == id) {
                        t.remove(id);
                    }
                }
                for r in v {
                    if r.access.offered() {
                        t.upsert(r);
                    }
                }
            }
            CtrlMsg::RegionsRemoved(ids) => {
                {
                    let mut t = p.remote.write();
                    for id in &ids {
                        t.remove(*id);
                    }
                }
                p.transport.regions_removed(&ids);
            }
            CtrlMsg::Notify(tag) => {
                if let Some(c) = core.upgrade() {
                    c.notify.push(Notification { peer: p.id, tag });
                }
            }
            CtrlMsg::Transport {
                bit: ENGINE_MSG_BIT,
                data,
            } => {
                if let Err(e) = on_engine_msg(&core, &p, &data) {
                    break format!("engine control message: {e}");
                }
            }
            CtrlMsg::Transport { bit, data } => {
                let t = std::iter::once(&p.transport)
                    .chain(p.passive.iter())
                    .find(|t| kind_bit(t.kind()) == bit);
                let r = match t {
                    Some(t) => t.on_ctrl(&data),
                    None => Err(ProtocolError::TransportNotInUse { bit }.into()),
                };
                if let Err(e) = r {
                    break format!("transport message: {e}");
                }
            }
            m => break format!("unexpected control message {m:?}"),
        }
    };
    if let Some(c) = core.upgrade() {
        c.kill_peer(p.id, &reason, c.shut.load(Ordering::Acquire));
    }
}

/// An engine control message from peer `p` (fences and their answers).
fn on_engine_msg(core: &Weak<Core>, p: &Arc<PeerInner>, data: &[u8]) -> Result<(), Error> {
    match EngineMsg::decode(data)? {
        // Everything the peer sent before the fence was handled (in order, on this thread):
        // its notification is queued, its region withdrawal took effect.
        EngineMsg::Fence(kind, id) => p.ctrl.send(&EngineMsg::FenceAck(kind, id).to_ctrl()),
        EngineMsg::FenceAck(FenceKind::Notify, id) => {
            if p.ctrl.confirm(id) {
                if let Some(st) = p.pending.get(id) {
                    st.part_done();
                }
                Ok(())
            } else {
                Err(ProtocolError::UnexpectedFenceAck { batch: id }.into())
            }
        }
        EngineMsg::FenceAck(FenceKind::Regions, id) => {
            if let Some(c) = core.upgrade() {
                c.fences.acked(id, p.id);
            }
            Ok(())
        }
    }
}

//! Peers: [`Peer`] (the public handle), its state ([`PeerInner`]) and its view of the regions
//! the remote offers ([`RemoteTable`]).

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::batch::Pending;
use crate::ctrl::CtrlWriter;
use crate::error::Error;
use crate::region::check_bounds;
use crate::transport::{CopyMarks, NotifyTracker, PeerTransport};
use crate::types::{PeerId, RegionId, RemoteRegion, TransportKind};
use crate::wire::{HostIdentity, WireRegion};

/// Tells engines apart (a peer handle used with another engine is refused). Never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EngineId(u64);

impl EngineId {
    /// A new id.
    pub(super) fn next() -> EngineId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        EngineId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

#[derive(Default)]
pub(super) struct RemoteTable {
    pub(super) by_index: HashMap<u32, WireRegion>,
    /// Last generation seen removed per index (to tell stale from unknown).
    pub(super) removed: HashMap<u32, u32>,
}

impl RemoteTable {
    pub(super) fn upsert(&mut self, r: WireRegion) {
        self.removed.remove(&r.id.index);
        self.by_index.insert(r.id.index, r);
    }
    pub(super) fn remove(&mut self, id: RegionId) {
        if self.by_index.get(&id.index).is_some_and(|r| r.id == id) {
            self.by_index.remove(&id.index);
        }
        let g = self.removed.entry(id.index).or_insert(0);
        *g = (*g).max(id.generation);
    }
    pub(super) fn check(
        &self,
        id: RegionId,
        offset: u64,
        len: u64,
        write: bool,
    ) -> Result<WireRegion, Error> {
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
    pub(super) id: PeerId,
    pub(super) kind: TransportKind,
    pub(super) remote_addr: SocketAddr,
    pub(super) remote_host: HostIdentity,
    pub(super) ctrl: Arc<CtrlWriter>,
    pub(super) ctrl_stream: TcpStream,
    pub(super) remote: RwLock<RemoteTable>,
    pub(super) pending: Arc<Pending>,
    pub(super) tracker: Arc<NotifyTracker>,
    pub(super) transport: Arc<dyn PeerTransport>,
    /// Per-peer state of transports both sides offered but this side did not choose (RDMA
    /// queue pairs the remote may write through).
    pub(super) passive: Vec<Arc<dyn PeerTransport>>,
    pub(super) our_token: [u8; 16],
    pub(super) inbound_lanes: Mutex<Vec<TcpStream>>,
    /// What this peer's TCP lane threads are copying (see `Core::await_copies`).
    pub(super) marks: Arc<CopyMarks>,
    pub(super) dead: AtomicBool,
    /// Same host: region announcements carry the shm keys (fd, inode, address).
    pub(super) same_host: bool,
    /// The engine this peer belongs to.
    pub(super) engine: EngineId,
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

/// Work requests re-posted towards a peer (every transport state it has).
pub(super) fn peer_reposts(p: &PeerInner) -> u64 {
    std::iter::once(&p.transport)
        .chain(p.passive.iter())
        .map(|t| t.reposts())
        .sum()
}

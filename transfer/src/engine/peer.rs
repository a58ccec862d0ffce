//! Peers: [`Peer`] (the public handle), its state ([`PeerInner`]), its view of the regions the
//! remote offers ([`RemoteTable`]), the lanes it has open into us ([`InboundLanes`]) and its
//! place among the engine's peers ([`PeerSlot`]).

use std::collections::{HashMap, VecDeque};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, RwLock};

use crate::auth::LaneCred;
use crate::batch::Pending;
use crate::ctrl::CtrlWriter;
use crate::error::Error;
use crate::limits::Resource;
use crate::notify::Budget;
use crate::region::{check_bounds, RegionGate};
use crate::transport::{CopyMarks, NotifyTracker, PeerTransport};
use crate::types::{PeerId, RegionId, RemoteRegion, TransportKind};
use crate::wire::{HostIdentity, ProtocolError, WireRegion};

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

/// The regions a peer offers us, bounded (`Limits::max_remote_regions` entries, and as many
/// remembered withdrawals). Every operation is linear in the entries it names.
pub(super) struct RemoteTable {
    pub(super) by_index: HashMap<u32, WireRegion>,
    /// Last generation seen removed per index (to tell stale from unknown), with the sequence
    /// number of that removal (for [`RemoteTable::order`]).
    removed: HashMap<u32, (u32, u64)>,
    /// Removals, oldest first (entries superseded by a later removal of the index are skipped
    /// when popped).
    order: VecDeque<(u32, u64)>,
    seq: u64,
    cap: usize,
}

impl RemoteTable {
    pub(super) fn new(cap: usize) -> RemoteTable {
        RemoteTable {
            by_index: HashMap::new(),
            removed: HashMap::new(),
            order: VecDeque::new(),
            seq: 0,
            cap,
        }
    }

    fn too_many(&self) -> Error {
        Error::ResourceLimit {
            resource: Resource::RemoteRegions,
            limit: self.cap as u64,
        }
    }

    /// Withdrawals remembered now.
    pub(super) fn removed_len(&self) -> usize {
        self.removed.len()
    }

    /// Remembers that `id` was removed (only for an index the table knows of).
    fn note_removed(&mut self, id: RegionId) {
        self.seq += 1;
        let g = self
            .removed
            .get(&id.index)
            .map_or(0, |r| r.0)
            .max(id.generation);
        self.removed.insert(id.index, (g, self.seq));
        self.order.push_back((id.index, self.seq));
        while self.removed.len() > self.cap {
            match self.order.pop_front() {
                Some((idx, seq)) => {
                    if self.removed.get(&idx).is_some_and(|r| r.1 == seq) {
                        self.removed.remove(&idx);
                    }
                }
                None => break,
            }
        }
        // Superseded entries are bounded too.
        if self.order.len() > 2 * self.cap + 16 {
            let removed = &self.removed;
            self.order
                .retain(|(i, s)| removed.get(i).is_some_and(|r| r.1 == *s));
        }
    }

    /// Adds or replaces regions (those offered). Returns the entries visited;
    /// `Error::ResourceLimit` (nothing changed) when the table would exceed its bound.
    pub(super) fn upsert_many(&mut self, v: Vec<WireRegion>) -> Result<u64, Error> {
        let fresh = v
            .iter()
            .filter(|r| r.access.offered() && !self.by_index.contains_key(&r.id.index))
            .count();
        if self.by_index.len() + fresh > self.cap {
            return Err(self.too_many());
        }
        let n = v.len() as u64;
        for r in v {
            if r.access.offered() {
                self.removed.remove(&r.id.index);
                self.by_index.insert(r.id.index, r);
            }
        }
        Ok(n)
    }

    /// Replaces the whole table (a `RegionsSet`): regions not in `v` are removed. Linear in the
    /// old and the new entries; `Error::ResourceLimit` when `v` is beyond the bound.
    pub(super) fn replace_all(&mut self, v: Vec<WireRegion>) -> Result<u64, Error> {
        let visited = (self.by_index.len() + v.len()) as u64;
        let mut next: HashMap<u32, WireRegion> = HashMap::with_capacity(v.len());
        for r in v {
            if r.access.offered() {
                next.insert(r.id.index, r);
            }
        }
        if next.len() > self.cap {
            return Err(self.too_many());
        }
        let old = std::mem::replace(&mut self.by_index, next);
        for (idx, r) in old {
            if self.by_index.get(&idx).map(|n| n.id) != Some(r.id) {
                self.note_removed(r.id);
            }
        }
        let present: Vec<u32> = self
            .by_index
            .keys()
            .copied()
            .filter(|i| self.removed.contains_key(i))
            .collect();
        for i in present {
            self.removed.remove(&i);
        }
        Ok(visited)
    }

    /// Removes regions; an index the table never knew of is not remembered. Returns the
    /// entries visited.
    pub(super) fn remove_many(&mut self, ids: &[RegionId]) -> u64 {
        for id in ids {
            let known = match self.by_index.get(&id.index) {
                Some(r) if r.id == *id => {
                    self.by_index.remove(&id.index);
                    true
                }
                Some(_) => false,
                None => self.removed.contains_key(&id.index),
            };
            if known {
                self.note_removed(*id);
            }
        }
        ids.len() as u64
    }

    pub(super) fn check(
        &self,
        id: RegionId,
        offset: u64,
        len: u64,
        write: bool,
    ) -> Result<WireRegion, Error> {
        let r = match self.by_index.get(&id.index) {
            Some(r) if r.id.generation == id.generation => r.clone(),
            Some(r) if id.generation < r.id.generation => return Err(Error::StaleRegion(id)),
            None if self
                .removed
                .get(&id.index)
                .is_some_and(|g| id.generation <= g.0) =>
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

/// The data lanes a peer has open into this engine, at most `allowed` (what it announced,
/// within `Limits::max_peer_lanes`), each under its own index.
pub(super) struct InboundLanes {
    /// A clone of each open lane's socket (to shut it down when the peer is closed).
    live: HashMap<u16, TcpStream>,
    allowed: u16,
    closed: bool,
}

impl InboundLanes {
    pub(super) fn new(allowed: u16) -> InboundLanes {
        InboundLanes {
            live: HashMap::new(),
            allowed,
            closed: false,
        }
    }
    /// Lanes open now.
    pub(super) fn open(&self) -> usize {
        self.live.len()
    }
    /// Shuts every lane down; later joins are refused.
    pub(super) fn close(&mut self) {
        self.closed = true;
        for s in self.live.values() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// An open inbound lane: its entry goes (and its socket clone is closed) when this drops.
pub(super) struct LaneGuard {
    peer: Weak<PeerInner>,
    lane: u16,
}

impl Drop for LaneGuard {
    fn drop(&mut self) {
        if let Some(p) = self.peer.upgrade() {
            p.lanes_in.lock().live.remove(&self.lane);
        }
    }
}

impl PeerInner {
    /// Admits inbound lane `lane` (its socket clone `s`), or refuses it: beyond what the peer
    /// announced (`Error::ResourceLimit`), already open, or the peer closed.
    pub(super) fn join_lane(self: &Arc<Self>, lane: u16, s: TcpStream) -> Result<LaneGuard, Error> {
        let mut l = self.lanes_in.lock();
        if l.closed {
            return Err(Error::PeerDead("peer closed".into()));
        }
        if lane >= l.allowed {
            return Err(Error::ResourceLimit {
                resource: Resource::Lanes,
                limit: u64::from(l.allowed),
            });
        }
        if l.live.contains_key(&lane) {
            return Err(ProtocolError::LaneAlreadyOpen { lane }.into());
        }
        l.live.insert(lane, s);
        Ok(LaneGuard {
            peer: Arc::downgrade(self),
            lane,
        })
    }
}

/// A place among the engine's connected peers (`Limits::max_peers`), given back when dropped.
pub(super) struct PeerSlot(Arc<AtomicUsize>);

impl PeerSlot {
    /// Takes a place; `Error::ResourceLimit` when `max` are taken.
    pub(super) fn take(count: &Arc<AtomicUsize>, max: usize) -> Result<PeerSlot, Error> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| Error::ResourceLimit {
                resource: Resource::Peers,
                limit: max as u64,
            })?;
        Ok(PeerSlot(count.clone()))
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
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
    /// The peer engine's listen address (as it announced it; what `Engine::fence` names).
    pub(super) listen_addr: SocketAddr,
    /// Credentials of the lanes this peer opens into us (their sid is registered with the
    /// engine while the peer lives).
    pub(super) lane_in: LaneCred,
    pub(super) lanes_in: Mutex<InboundLanes>,
    /// Every copy this peer's lanes make into or out of our memory runs inside this gate;
    /// closed when the peer is closed (so a fence can wait until none runs).
    pub(super) gate: Arc<RegionGate>,
    /// The peer's budget of pending notification bytes here.
    pub(super) notify_budget: Arc<Budget>,
    /// Its place among the engine's peers (given back when it is closed).
    pub(super) slot: Mutex<Option<PeerSlot>>,
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
    /// The slice sizes this peer's large batches are cut with now, `[write, read]`: RDMA's,
    /// which adapt between `slice_size` and `EngineConfig::rdma_slice_max`; `None` for other
    /// transports.
    pub fn slice_sizes(&self) -> Option<[u64; 2]> {
        std::iter::once(&self.inner.transport)
            .chain(self.inner.passive.iter())
            .find_map(|t| t.slice_sizes())
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

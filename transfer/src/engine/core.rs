//! The engine's core: the [`Engine`] handle and the state behind it ([`Core`]), what tears a
//! peer or the whole engine down, and the engine-wide accessors.

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use super::fence::RegionFences;
use super::fenced::FencedAddrs;
use super::peer::{peer_reposts, EngineId, Peer, PeerInner};
use crate::batch::Timer;
use crate::config::EngineConfig;
use crate::error::Error;
use crate::gate::{AuthThrottle, ConnGate};
use crate::mem::MemKind;
use crate::metrics::{self, EngineMetrics, MetricsSnapshot};
use crate::net::{LogLimiter, Threads};
use crate::notify::{Notifications, NotifyQueue};
use crate::region::RegionTable;
use crate::transport::{CopyJob, Transport};
use crate::types::{PeerId, RegionId, RemoteRegion, TransportKind};
use crate::wire::{CtrlMsg, HostIdentity};

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

pub(crate) struct Core {
    pub(super) cfg: EngineConfig,
    pub(super) listen_addr: SocketAddr,
    pub(super) listener: TcpListener,
    pub(super) regions: Arc<RegionTable>,
    pub(super) peers: Mutex<HashMap<PeerId, Arc<PeerInner>>>,
    /// Session ids of the lanes peers open into us (see `auth`), while their peer lives.
    pub(super) sessions: Mutex<HashMap<[u8; 16], Weak<PeerInner>>>,
    /// Fenced peer engines (by listen address, with their processes and session ids) and the
    /// process last seen at each peer address.
    pub(super) fenced: FencedAddrs,
    /// Held while (region table change + broadcast) and while (peer insert + region snapshot),
    /// so every peer sees every region change exactly in order.
    pub(super) reg_lock: Mutex<()>,
    /// Region withdrawals awaiting confirmation from same-host peers.
    pub(super) fences: RegionFences,
    pub(super) notify: Arc<NotifyQueue>,
    pub(super) timer: Arc<Timer>,
    pub(super) shut: AtomicBool,
    pub(super) host: HostIdentity,
    pub(super) next_batch: AtomicU64,
    pub(super) next_peer: AtomicU64,
    /// Handshakes and lane joins in progress (`Limits::max_handshakes`).
    pub(super) gate: Arc<ConnGate>,
    /// Failed proofs per source address.
    pub(super) throttle: AuthThrottle,
    /// Peers connected or being set up (`Limits::max_peers`).
    pub(super) peer_count: Arc<AtomicUsize>,
    /// Threads of this engine running now.
    pub(super) threads: Threads,
    /// Rate limits of the log lines peers can cause.
    pub(super) logs: Logs,
    /// The metrics endpoint's admission (when it runs).
    pub(super) metrics_gate: Option<Arc<ConnGate>>,
    pub(super) copy_tx: Mutex<Option<Sender<CopyJob>>>,
    pub(super) transports: Vec<Box<dyn Transport>>,
    pub(super) metrics: Arc<EngineMetrics>,
    /// Bound address of the Prometheus endpoint, if one was asked for.
    pub(super) metrics_addr: Option<SocketAddr>,
    /// Tells this engine's peers from other engines' (see `Engine::submit_inner`).
    pub(super) id: EngineId,
}

/// The rate limits of log lines a peer can cause at will (see [`LogLimiter`]).
#[derive(Default)]
pub(super) struct Logs {
    pub(super) refused: LogLimiter,
    pub(super) auth: LogLimiter,
    pub(super) lane: LogLimiter,
    pub(super) peer: LogLimiter,
}

pub(super) struct Handle {
    pub(super) core: Arc<Core>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.core.shutdown();
    }
}

/// The transfer engine. Cheap to clone; dropping the last clone shuts it down.
#[derive(Clone)]
pub struct Engine {
    pub(super) h: Arc<Handle>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("listen", &self.h.core.listen_addr)
            .finish_non_exhaustive()
    }
}

impl Engine {
    pub(super) fn core(&self) -> &Arc<Core> {
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

    /// Notifications delivered to this engine as a target.
    pub fn notifications(&self) -> Notifications {
        Notifications {
            q: self.core().notify.clone(),
        }
    }
}

pub(super) fn timeout_err(e: Error) -> Error {
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
    pub(super) fn check_open(&self) -> Result<(), Error> {
        if self.shut.load(Ordering::Acquire) {
            Err(Error::Shutdown)
        } else {
            Ok(())
        }
    }

    pub(super) fn metrics_snapshot(&self) -> MetricsSnapshot {
        let peers: Vec<Arc<PeerInner>> = self.peers.lock().values().cloned().collect();
        let mut lanes = 0;
        let mut reposts = 0;
        let mut inflight = (0, 0, 0);
        let mut guard = metrics::GuardExtra::default();
        let mut ps: Vec<metrics::PeerSnapshot> = peers
            .iter()
            .map(|p| {
                let peer = Peer { inner: p.clone() };
                let re = peer.lanes_reestablished();
                lanes += re;
                let rp = peer_reposts(p);
                reposts += rp;
                let f = p.pending.inflight();
                inflight = (inflight.0 + f.0, inflight.1 + f.1, inflight.2 + f.2);
                let holds = {
                    let t = p.remote.read();
                    metrics::PeerHolds {
                        notify_bytes: p.notify_budget.used() as u64,
                        remote_region_entries: t.by_index.len() as u64,
                        removed_region_entries: t.removed_len() as u64,
                        lanes_open: p.lanes_in.lock().open() as u64,
                        ctrl_queue_bytes: p.ctrl.queued_bytes() as u64,
                    }
                };
                guard.notify_bytes += holds.notify_bytes;
                guard.remote_region_entries += holds.remote_region_entries;
                guard.removed_region_entries += holds.removed_region_entries;
                guard.lanes_open += holds.lanes_open;
                guard.ctrl_queue_bytes += holds.ctrl_queue_bytes;
                metrics::peer_snapshot(
                    p.id.0,
                    (p.remote_addr, p.listen_addr),
                    p.transport.kind(),
                    p.pending.obs.as_ref().map(|o| &*o.peer),
                    (re, rp),
                    holds,
                    peer.slice_sizes(),
                )
            })
            .collect();
        ps.sort_by_key(|p| p.id);
        let all = self.regions.all();
        let n = &self.notify;
        let gs = &self.gate.stats;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        guard.notifications_refused = ld(&n.refused);
        guard.handshakes_in_progress = self.gate.in_progress() as u64;
        guard.handshakes_admitted = ld(&gs.admitted);
        guard.handshakes_evicted = ld(&gs.evicted);
        guard.handshakes_refused = ld(&gs.refused_total) + ld(&gs.refused_per_ip);
        guard.handshakes_timed_out = ld(&gs.timed_out);
        guard.threads_live = self.threads.load(Ordering::Acquire);
        if let Some(g) = &self.metrics_gate {
            (guard.metrics_conns_live, guard.metrics_conns_evicted) = metrics::gate_counts(g);
        }
        guard.fenced_peers = self.fenced.len() as u64;
        self.metrics.snapshot(metrics::SnapshotExtra {
            peers: ps,
            lanes_reestablished_live: lanes,
            reposts_live: reposts,
            regions: all.len() as u64,
            region_bytes: all.iter().map(|e| e.mem.len() as u64).sum(),
            region_bytes_by_kind: MemKind::REGION_KINDS.map(|k| {
                let n = all.iter().filter(|e| e.mem.kind() == k);
                (k.label(), n.map(|e| e.mem.len() as u64).sum())
            }),
            peers_connected: peers.len() as u64,
            notifications: (
                n.delivered.load(Ordering::Relaxed),
                n.dropped.load(Ordering::Relaxed),
                n.suppressed.load(Ordering::Relaxed),
            ),
            inflight,
            guard,
        })
    }

    /// Sends a control message to every peer (callers hold `reg_lock`).
    pub(super) fn broadcast(&self, msg: impl Fn(&PeerInner) -> CtrlMsg) {
        let peers: Vec<_> = self.peers.lock().values().cloned().collect();
        for p in peers {
            if let Err(e) = p.ctrl.send(&msg(&p)) {
                tracing::debug!(peer = ?p.id, error = %e, "region update not sent");
            }
        }
    }

    /// The RDMA keys peers use for region `id`: its key on the first device (0: none) and,
    /// when its registration is cut in chunks, theirs.
    pub(super) fn rdma_keys(&self, id: RegionId) -> (u32, Option<crate::wire::MrChunks>) {
        self.transports
            .iter()
            .map(|t| t.region_keys(id))
            .find(|k| k.0 != 0)
            .unwrap_or((0, None))
    }

    pub(super) fn has_cuda_ipc(&self) -> bool {
        self.transports
            .iter()
            .any(|t| t.kind() == TransportKind::CudaIpc)
    }

    /// Whether a region of ours is device memory (`Auto` then prefers `cuda_ipc`).
    pub(super) fn has_device_region(&self) -> bool {
        self.regions
            .all()
            .iter()
            .any(|e| e.mem.device_ipc().is_some())
    }

    pub(super) fn has_rdma(&self) -> bool {
        self.transports
            .iter()
            .any(|t| t.kind() == TransportKind::Rdma)
    }

    /// Closes a peer because of `e` (counted under stage `peer`).
    pub(super) fn peer_failed(&self, id: PeerId, e: &Error) {
        if self.peers.lock().contains_key(&id) {
            self.metrics.error(metrics::STAGE_PEER, e);
            if let Some(count) = self.logs.peer.hit() {
                tracing::warn!(peer = id.0, error = %e, count, "peer closed on error");
            }
        }
        self.kill_peer(id, &e.to_string(), false);
    }

    pub(super) fn kill_peer(&self, id: PeerId, reason: &str, shutdown: bool) {
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
        self.sessions.lock().remove(&p.lane_in.sid);
        // No copy of its lanes starts any more (see `Engine::fence`).
        p.gate.close();
        p.pending.close(reason, shutdown);
        p.transport.close();
        for t in &p.passive {
            t.close();
        }
        p.tracker.clear();
        p.ctrl.forget_all();
        p.ctrl.close();
        let _ = p.ctrl_stream.shutdown(Shutdown::Both);
        self.fences.peer_gone(id, p.remote_host.pid);
        p.lanes_in.lock().close();
        p.slot.lock().take();
    }

    pub(super) fn shutdown(&self) {
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

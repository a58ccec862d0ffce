//! Fencing a peer engine ([`Engine::fence`]): every connection from it closed, its handshakes
//! and lane joins refused, and no copy of it into our memory still running when it returns.
//!
//! Which processes a fence refuses, and for how long, is `fenced`'s.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::core::{Core, Engine};
use super::fence::Fence;
use super::peer::PeerInner;
use crate::error::Error;
use crate::types::RegionId;
use crate::wire::fence::{EngineMsg, FenceKind};
use crate::wire::CtrlMsg;

impl Engine {
    /// Fences the peer engine whose listen address (as it announced it in its handshake, or
    /// the address this engine connected to) is `addr`: closes every connection between this
    /// engine and it, refuses its handshakes and lane joins from then on (`Error::Fenced`, in
    /// a `Reject`; [`Engine::connect`] to `addr` fails the same way), and returns once no copy
    /// by it into this engine's memory is still running:
    /// * TCP: its lanes are shut down and every copy of theirs runs inside a per-peer gate,
    ///   closed first and then waited for;
    /// * shm (same host): the peer's engine copies into our memory itself, so every offered
    ///   region is withdrawn from it first, as `unregister` does, and its confirmation that no
    ///   copy into them runs any more (it refuses later ones) is awaited;
    /// * RDMA: its queue pairs here are moved to the error state, so the NIC refuses its
    ///   writes before a byte lands.
    ///
    /// A same-host peer that does not confirm within `EngineConfig::default_deadline` gives
    /// [`Error::Timeout`]; one that disconnects before confirming while its process lives gives
    /// [`Error::PeerDead`]: it is fenced all the same, but a copy it had begun may still land.
    /// The processes refused are those of the peers connected from `addr` now or last seen
    /// there (their host identity, pid included), until [`Engine::unfence`]; another process
    /// at that address (the peer restarted) is accepted. Fencing an address where no peer was
    /// ever seen refuses every process there.
    pub fn fence(&self, addr: SocketAddr) -> Result<(), Error> {
        let core = self.core();
        let peers: Vec<Arc<PeerInner>> = {
            // Under `reg_lock`: a peer being set up either is in this list or sees the fence.
            let _g = core.reg_lock.lock();
            let ps: Vec<Arc<PeerInner>> = core
                .peers
                .lock()
                .values()
                .filter(|p| p.listen_addr == addr)
                .cloned()
                .collect();
            core.fenced
                .fence(addr, ps.iter().map(|p| (p.lane_in.sid, &p.remote_host)));
            ps
        };
        tracing::info!(%addr, peers = peers.len(), "fencing peer");
        let same_host: Vec<&Arc<PeerInner>> = peers.iter().filter(|p| p.same_host).collect();
        let mut result = Ok(());
        if !same_host.is_empty() {
            result = core.withdraw_all(&same_host);
        }
        for p in &peers {
            core.kill_peer(p.id, &format!("fenced ({addr})"), false);
        }
        let until = Instant::now() + core.cfg.default_deadline;
        for p in &peers {
            if !p.gate.wait_idle(until) {
                tracing::warn!(peer = p.id.0, %addr, "a copy of a fenced peer did not end");
                result = result.and(Err(Error::Timeout));
            }
        }
        result
    }

    /// Lifts the fence of `addr` ([`Engine::fence`]): its handshakes are accepted again (a
    /// restarted peer there is a new incarnation). Returns whether it was fenced.
    pub fn unfence(&self, addr: SocketAddr) -> bool {
        let core = self.core();
        let _g = core.reg_lock.lock();
        core.fenced.unfence(addr)
    }

    /// The fenced addresses.
    pub fn fenced(&self) -> Vec<SocketAddr> {
        self.core().fenced.addrs()
    }
}

impl Core {
    /// Withdraws every offered region from same-host peers `peers` and waits for their
    /// confirmation that none of their copies into them runs any more (see
    /// `Engine::unregister`).
    fn withdraw_all(&self, peers: &[&Arc<PeerInner>]) -> Result<(), Error> {
        let seq = {
            let _g = self.reg_lock.lock();
            let ids: Vec<RegionId> = self
                .regions
                .all()
                .iter()
                .filter(|e| e.access.offered())
                .map(|e| e.id)
                .collect();
            let seq = self.fences.next.fetch_add(1, Ordering::Relaxed);
            // Registered before anything is sent: an answer may come back at once.
            self.fences.m.lock().insert(
                seq,
                Fence {
                    waiting: peers.iter().map(|p| p.id).collect(),
                    lost: Vec::new(),
                },
            );
            for p in peers {
                let mut buf = CtrlMsg::RegionsRemoved(ids.clone()).encode();
                buf.extend_from_slice(
                    &EngineMsg::Fence(FenceKind::Regions, seq).to_ctrl().encode(),
                );
                if let Err(e) = p.ctrl.write_encoded(&buf) {
                    self.kill_peer(p.id, &format!("fence not sent: {e}"), false);
                }
            }
            for p in peers {
                if !self.peers.lock().contains_key(&p.id) {
                    self.fences.peer_gone(p.id, p.remote_host.pid);
                }
            }
            seq
        };
        self.await_fence(seq)
    }
}

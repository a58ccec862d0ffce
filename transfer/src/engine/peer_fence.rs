//! Fencing a peer engine ([`Engine::fence`]): every connection from it closed, its handshakes
//! and lane joins refused, and no copy of it into our memory still running when it returns.
//!
//! A fence is on a listen address and on the processes seen there: a later process at that
//! address (the peer restarted: another host identity) is not the one fenced and is accepted,
//! so a restart never waits for the fence's owner to lift it. An address where no peer was
//! ever seen is fenced for every process.

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
use crate::wire::HostIdentity;

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
            let last = core.seen.lock().get(&addr).cloned();
            let mut f = core.fenced.lock();
            let fence = f.entry(addr).or_default();
            for p in &ps {
                fence.add(Some(p.lane_in.sid), &p.remote_host);
            }
            if let Some(h) = last {
                fence.add(None, &h);
            }
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
        core.fenced.lock().remove(&addr).is_some()
    }

    /// The fenced addresses.
    pub fn fenced(&self) -> Vec<SocketAddr> {
        let mut v: Vec<SocketAddr> = self.core().fenced.lock().keys().copied().collect();
        v.sort();
        v
    }
}

/// The fence on one listen address.
#[derive(Default)]
pub(super) struct AddrFence {
    /// Lane session ids of the peers fenced (their lane joins are refused).
    pub(super) sids: Vec<[u8; 16]>,
    /// The processes fenced there; none known: every process at the address.
    procs: Vec<HostIdentity>,
}

impl AddrFence {
    fn add(&mut self, sid: Option<[u8; 16]>, host: &HostIdentity) {
        if let Some(sid) = sid.filter(|s| !self.sids.contains(s)) {
            self.sids.push(sid);
        }
        if !self.procs.contains(host) {
            self.procs.push(host.clone());
        }
    }

    /// Whether a peer at the fenced address is refused: `host` is its identity once its
    /// handshake told it, `None` before (a dial is refused only when every process is).
    pub(super) fn refuses(&self, host: Option<&HostIdentity>) -> bool {
        self.procs.is_empty() || host.is_some_and(|h| self.procs.contains(h))
    }
}

/// How many listen addresses `Core::seen` remembers per peer slot.
const SEEN_PER_PEER: usize = 4;

impl Core {
    /// Whether the peer engine listening at `addr`, with identity `host` when known, is
    /// fenced.
    pub(super) fn is_fenced(&self, addr: SocketAddr, host: Option<&HostIdentity>) -> bool {
        self.fenced
            .lock()
            .get(&addr)
            .is_some_and(|f| f.refuses(host))
    }

    /// Remembers the process last seen at listen address `addr` (so that a fence after it has
    /// gone still names it). Bounded: past `SEEN_PER_PEER` × `max_peers` addresses, one
    /// remembered address is forgotten for each new one.
    pub(super) fn saw_peer(&self, addr: SocketAddr, host: &HostIdentity) {
        let cap = self
            .cfg
            .limits
            .max_peers
            .saturating_mul(SEEN_PER_PEER)
            .max(1);
        let mut seen = self.seen.lock();
        if seen.len() >= cap && !seen.contains_key(&addr) {
            if let Some(k) = seen.keys().next().copied() {
                seen.remove(&k);
            }
        }
        seen.insert(addr, host.clone());
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    fn proc_(pid: u32) -> HostIdentity {
        HostIdentity {
            boot_id: "b".into(),
            pid_ns: "p".into(),
            mnt_ns: "m".into(),
            pid,
        }
    }

    #[test]
    fn a_fence_refuses_its_processes_and_every_one_when_none_is_known() {
        let mut f = AddrFence::default();
        assert!(
            f.refuses(None),
            "no process known: every one refused, dials too"
        );
        assert!(f.refuses(Some(&proc_(7))));
        f.add(Some([1; 16]), &proc_(7));
        f.add(None, &proc_(7));
        assert_eq!(f.sids, vec![[1; 16]]);
        assert!(f.refuses(Some(&proc_(7))), "the fenced process");
        assert!(
            !f.refuses(Some(&proc_(8))),
            "another process there: a restart"
        );
        assert!(!f.refuses(None), "a dial is let through to its handshake");
    }
}

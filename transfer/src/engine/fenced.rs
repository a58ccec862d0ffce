//! The fenced peer addresses ([`FencedAddrs`]): which listen addresses are fenced, which of
//! the processes seen there are refused, and the process last seen at each address.
//!
//! A fence is on a listen address and on the processes seen there: a later process at that
//! address (the peer restarted: another host identity) is not the one fenced and is accepted,
//! so a restart never waits for the fence's owner to lift it. An address where no peer was
//! ever seen is fenced for every process. Fencing itself (closing the peer's connections and
//! waiting out its copies) is `Engine::fence`, in `peer_fence`.

use std::collections::HashMap;
use std::net::SocketAddr;

use parking_lot::Mutex;

use crate::wire::HostIdentity;

/// How many listen addresses are remembered per peer slot (see [`FencedAddrs::saw`]).
const SEEN_PER_PEER: usize = 4;

/// The fence on one listen address.
#[derive(Default)]
struct AddrFence {
    /// Lane session ids of the peers fenced (their lane joins are refused).
    sids: Vec<[u8; 16]>,
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
    fn refuses(&self, host: Option<&HostIdentity>) -> bool {
        self.procs.is_empty() || host.is_some_and(|h| self.procs.contains(h))
    }
}

/// An engine's fenced listen addresses, and the process last seen at each peer address.
pub(super) struct FencedAddrs {
    fenced: Mutex<HashMap<SocketAddr, AddrFence>>,
    /// Bounded at `seen_cap` addresses.
    seen: Mutex<HashMap<SocketAddr, HostIdentity>>,
    seen_cap: usize,
}

impl FencedAddrs {
    /// Remembers the last process of at most `SEEN_PER_PEER` × `max_peers` addresses.
    pub(super) fn new(max_peers: usize) -> FencedAddrs {
        FencedAddrs {
            fenced: Mutex::new(HashMap::new()),
            seen: Mutex::new(HashMap::new()),
            seen_cap: max_peers.saturating_mul(SEEN_PER_PEER).max(1),
        }
    }

    /// Fences `addr`: the processes of `peers` (lane session id and identity of each peer
    /// connected from there now) and the process last seen there are refused from now on.
    pub(super) fn fence<'a>(
        &self,
        addr: SocketAddr,
        peers: impl IntoIterator<Item = ([u8; 16], &'a HostIdentity)>,
    ) {
        let last = self.seen.lock().get(&addr).cloned();
        let mut f = self.fenced.lock();
        let fence = f.entry(addr).or_default();
        for (sid, host) in peers {
            fence.add(Some(sid), host);
        }
        if let Some(h) = last {
            fence.add(None, &h);
        }
    }

    /// Lifts the fence of `addr`; whether it was fenced.
    pub(super) fn unfence(&self, addr: SocketAddr) -> bool {
        self.fenced.lock().remove(&addr).is_some()
    }

    /// The fenced addresses, sorted.
    pub(super) fn addrs(&self) -> Vec<SocketAddr> {
        let mut v: Vec<SocketAddr> = self.fenced.lock().keys().copied().collect();
        v.sort();
        v
    }

    /// How many addresses are fenced.
    pub(super) fn len(&self) -> usize {
        self.fenced.lock().len()
    }

    /// Whether the peer engine listening at `addr`, with identity `host` when known, is
    /// fenced.
    pub(super) fn refuses(&self, addr: SocketAddr, host: Option<&HostIdentity>) -> bool {
        self.fenced
            .lock()
            .get(&addr)
            .is_some_and(|f| f.refuses(host))
    }

    /// The fenced address whose peers held lane session `sid`, if any.
    pub(super) fn of_session(&self, sid: &[u8; 16]) -> Option<SocketAddr> {
        self.fenced
            .lock()
            .iter()
            .find(|(_, f)| f.sids.contains(sid))
            .map(|(addr, _)| *addr)
    }

    /// Remembers the process last seen at listen address `addr` (so that a fence after it has
    /// gone still names it). Bounded: past the cap, one remembered address is forgotten for
    /// each new one.
    pub(super) fn saw(&self, addr: SocketAddr, host: &HostIdentity) {
        let mut seen = self.seen.lock();
        if seen.len() >= self.seen_cap && !seen.contains_key(&addr) {
            if let Some(k) = seen.keys().next().copied() {
                seen.remove(&k);
            }
        }
        seen.insert(addr, host.clone());
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

    #[test]
    fn the_process_last_seen_is_fenced_and_the_memory_is_bounded() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let f = FencedAddrs::new(1);
        for port in 10..10 + 2 * SEEN_PER_PEER as u16 {
            f.saw(SocketAddr::from(([127, 0, 0, 1], port)), &proc_(1));
        }
        assert_eq!(f.seen.lock().len(), SEEN_PER_PEER);
        f.saw(a, &proc_(7));
        f.fence(a, []);
        assert!(f.refuses(a, Some(&proc_(7))), "the process last seen");
        assert!(!f.refuses(a, Some(&proc_(8))), "its restart");
        assert!(!f.refuses(b, Some(&proc_(7))), "not fenced there");
        f.fence(b, [([2; 16], &proc_(9))]);
        assert_eq!(f.of_session(&[2; 16]), Some(b));
        assert_eq!(f.of_session(&[3; 16]), None);
        assert_eq!((f.addrs(), f.len()), (vec![a, b], 2));
        assert!(f.unfence(a) && !f.unfence(a));
        assert!(!f.refuses(a, None));
    }
}

//! Liveness of remote engines and the memory of recently ended requests, shared by both sides.

use crate::msg::Message;
use crate::types::{IdMap, Nanos, PeerId, RequestId, MS};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// What one side knows about one remote engine.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) last_heard: Nanos,
    pub(crate) incarnation: Option<u64>,
    pub(crate) up: bool,
    /// Live requests that fail if this peer dies (ordered for deterministic failure order).
    pub(crate) reqs: BTreeSet<RequestId>,
}

/// Outcome of hearing from a peer.
pub(crate) enum Heard {
    /// Nothing special.
    Alive,
    /// The peer restarted: its old requests are lost.
    Restarted(Vec<RequestId>),
}

#[derive(Debug, Default)]
pub(crate) struct Peers {
    pub(crate) map: BTreeMap<PeerId, Peer>,
    pub(crate) hb_seq: u64,
}

impl Peers {
    /// The next heartbeat of this engine (`incarnation`: its life).
    fn heartbeat(&mut self, incarnation: u64) -> Message {
        self.hb_seq += 1;
        Message::Heartbeat {
            incarnation,
            seq: self.hb_seq,
        }
    }

    /// Registers `peer` if new. A new peer first hears who we are, before anything else, so
    /// that a restart is visible before any request message of the new life: the heartbeat to
    /// send it is returned.
    pub(crate) fn first_contact(
        &mut self,
        peer: PeerId,
        now: Nanos,
        incarnation: u64,
    ) -> Option<Message> {
        self.ensure(peer, now).then(|| self.heartbeat(incarnation))
    }

    /// One heartbeat to every known peer (they share a sequence number).
    pub(crate) fn heartbeats(&mut self, incarnation: u64) -> Vec<(PeerId, Message)> {
        let msg = self.heartbeat(incarnation);
        self.map.keys().map(|p| (*p, msg.clone())).collect()
    }

    /// Registers `peer` if new; returns true when it was new.
    pub(crate) fn ensure(&mut self, peer: PeerId, now: Nanos) -> bool {
        if self.map.contains_key(&peer) {
            return false;
        }
        self.map.insert(
            peer,
            Peer {
                last_heard: now,
                incarnation: None,
                up: true,
                reqs: BTreeSet::new(),
            },
        );
        true
    }

    pub(crate) fn is_up(&self, peer: PeerId) -> bool {
        self.map.get(&peer).is_some_and(|p| p.up)
    }

    pub(crate) fn attach(&mut self, peer: PeerId, req: RequestId) {
        if let Some(p) = self.map.get_mut(&peer) {
            p.reqs.insert(req);
        }
    }

    pub(crate) fn detach(&mut self, peer: PeerId, req: RequestId) {
        if let Some(p) = self.map.get_mut(&peer) {
            p.reqs.remove(&req);
        }
    }

    /// Records traffic from `peer`; `incarnation` when the traffic was a heartbeat.
    pub(crate) fn heard(&mut self, peer: PeerId, incarnation: Option<u64>, now: Nanos) -> Heard {
        self.ensure(peer, now);
        let Some(p) = self.map.get_mut(&peer) else {
            return Heard::Alive;
        };
        p.last_heard = now;
        p.up = true;
        if let Some(inc) = incarnation {
            match p.incarnation {
                Some(old) if old != inc => {
                    p.incarnation = Some(inc);
                    return Heard::Restarted(std::mem::take(&mut p.reqs).into_iter().collect());
                }
                _ => p.incarnation = Some(inc),
            }
        }
        Heard::Alive
    }

    /// The live requests of `peer`, silent for `for_ns`, that `fail` selects (in order), logged
    /// once as failing for that silence when there are any; `who` names the peer's role.
    pub(crate) fn failing_for_silence(
        &self,
        peer: PeerId,
        for_ns: Nanos,
        who: &'static str,
        fail: impl Fn(RequestId) -> bool,
    ) -> Vec<RequestId> {
        let reqs: Vec<RequestId> = self.map.get(&peer).map_or_else(Vec::new, |p| {
            p.reqs.iter().copied().filter(|&r| fail(r)).collect()
        });
        if !reqs.is_empty() {
            tracing::warn!(
                target: "kvwire_connector",
                peer = peer.0,
                role = who,
                silent_ms = for_ns / MS,
                requests = reqs.len(),
                "peer silent, its requests fail"
            );
        }
        reqs
    }

    /// Marks `peer` down; returns its live requests (to fail), or `None` if it was already down.
    pub(crate) fn down(&mut self, peer: PeerId) -> Option<Vec<RequestId>> {
        let p = self.map.get_mut(&peer)?;
        if !p.up {
            return None;
        }
        p.up = false;
        Some(std::mem::take(&mut p.reqs).into_iter().collect())
    }

    /// Peers silent for `timeout` or longer that are still marked up, with how long each was.
    pub(crate) fn silent(&self, now: Nanos, timeout: Nanos) -> Vec<(PeerId, Nanos)> {
        self.map
            .iter()
            .filter_map(|(id, p)| {
                let quiet = now.saturating_sub(p.last_heard);
                (p.up && quiet >= timeout).then_some((*id, quiet))
            })
            .collect()
    }
}

/// Recently ended requests, so that late or duplicate messages are recognised and ignored
/// instead of resurrecting them. Expiry is FIFO (constant TTL), O(1) amortised. Each entry says
/// whether the request was given up before it started on this side (the peer aborted it, or it
/// stayed an orphan and the peer was told to abort): a late local start of it then fails at
/// once rather than being refused.
#[derive(Debug, Default)]
pub(crate) struct Tombstones {
    set: IdMap<RequestId, bool>,
    fifo: VecDeque<(Nanos, RequestId)>,
}

impl Tombstones {
    /// Remembers `req` until `expires`; `peer_aborted`: the peer gave it up before we had it.
    pub(crate) fn bury(&mut self, req: RequestId, expires: Nanos, peer_aborted: bool) {
        if self.set.insert(req, peer_aborted).is_none() {
            self.fifo.push_back((expires, req));
        }
    }

    pub(crate) fn contains(&self, req: RequestId) -> bool {
        self.set.contains_key(&req)
    }

    /// Whether `req` is remembered as aborted by the peer before it started here.
    pub(crate) fn peer_aborted(&self, req: RequestId) -> bool {
        self.set.get(&req).copied().unwrap_or(false)
    }

    pub(crate) fn expire(&mut self, now: Nanos) {
        while let Some(&(at, req)) = self.fifo.front() {
            if at > now {
                break;
            }
            self.fifo.pop_front();
            self.set.remove(&req);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.set.len()
    }
}

/// A fixed-size set of layer indices.
#[derive(Clone, Debug, Default)]
pub(crate) struct LayerSet {
    words: Vec<u64>,
    layers: u16,
    count: u16,
}

impl LayerSet {
    pub(crate) fn new(layers: u16) -> Self {
        LayerSet {
            words: vec![0; usize::from(layers).div_ceil(64)],
            layers,
            count: 0,
        }
    }

    /// Inserts `layer`; returns true when it was not there. Out-of-range layers are refused
    /// (false) — callers check the range first.
    pub(crate) fn insert(&mut self, layer: u16) -> bool {
        if layer >= self.layers {
            return false;
        }
        let (w, b) = (usize::from(layer) / 64, layer % 64);
        match self.words.get_mut(w) {
            Some(word) if *word & (1 << b) == 0 => {
                *word |= 1 << b;
                self.count += 1;
                true
            }
            _ => false,
        }
    }

    pub(crate) fn contains(&self, layer: u16) -> bool {
        let (w, b) = (usize::from(layer) / 64, layer % 64);
        self.words.get(w).is_some_and(|word| word & (1 << b) != 0)
    }

    pub(crate) fn count(&self) -> u16 {
        self.count
    }

    /// The layers in the set, in increasing order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        self.words.iter().enumerate().flat_map(|(w, &word)| {
            (0..64u16)
                .filter(move |b| word & (1 << b) != 0)
                .map(move |b| w as u16 * 64 + b)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::LayerSet;

    #[test]
    fn layer_set_iterates_across_words_in_order() {
        let mut s = LayerSet::new(130);
        for l in [129, 3, 64, 63, 3, 130] {
            s.insert(l);
        }
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![3, 63, 64, 129]);
        assert_eq!(s.count(), 4);
    }
}

//! Deadlines: the heartbeat tick, silent peers, and each request's own deadline.

use super::*;

impl DSide {
    pub(super) fn tick(&mut self, now: Nanos) {
        for (p, hb) in self.peers.heartbeats(self.cfg.incarnation) {
            self.send(p, hb);
        }
        for (p, for_ns) in self.peers.silent(now, self.cfg.peer_timeout) {
            self.peer_silent(p, for_ns, now);
        }
        self.timers
            .arm(now.saturating_add(self.cfg.heartbeat_interval), Timer::Tick);
    }

    /// Fails the requests of a P silent for `for_ns` (see the module's docs): not given up,
    /// so a stalled P that comes back keeps its data path. Those whose block ids it has drain:
    /// their blocks wait for its confirming `Abort` or the drain deadline, and only that
    /// deadline gives it up ([`DownCause::DrainTimeout`]). A request younger than `peer_timeout`
    /// waits: silence is judged over a request's own life (the peer may be heard again as soon
    /// as a connection that broke while it stalled is made again).
    pub(super) fn peer_silent(&mut self, peer: PeerId, for_ns: Nanos, now: Nanos) {
        let timeout = self.cfg.peer_timeout;
        let reqs = self.peers.failing_for_silence(peer, for_ns, "P", |r| {
            self.reqs.get(&r).is_some_and(|r| {
                r.state != DState::Draining && now.saturating_sub(r.created) >= timeout
            })
        });
        if reqs.is_empty() {
            return;
        }
        self.stats.silences += 1;
        for req in reqs {
            self.fail(req, FailReason::Timeout, true, now);
        }
    }

    pub(super) fn deadline(&self, r: &DReq) -> Option<Nanos> {
        let c = &self.cfg;
        match r.state {
            DState::Early => Some(r.created.saturating_add(c.orphan_timeout)),
            DState::Waiting | DState::Reserved => {
                let mut d = r.created.saturating_add(c.request_timeout);
                if !r.p_started && !r.p_acked {
                    d = d.min(r.created.saturating_add(c.wait_for_p_timeout));
                }
                Some(d)
            }
            DState::Draining => Some(
                (r.drain_since.saturating_add(c.drain_timeout))
                    .min(r.abort_sent.saturating_add(c.heartbeat_interval)),
            ),
            DState::Landed | DState::Complete | DState::Reported | DState::Promoted => None,
        }
    }

    pub(super) fn arm(&mut self, req: RequestId, _now: Nanos) {
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        let Some(at) = self.deadline(r) else {
            return;
        };
        let gen = r.gen.wrapping_add(1);
        if let Some(r) = self.reqs.get_mut(&req) {
            r.gen = gen;
        }
        self.timers.arm(at, Timer::Req(req, gen));
    }

    pub(super) fn req_deadline(&mut self, req: RequestId, gen: u32, now: Nanos) {
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        if r.gen != gen {
            return;
        }
        let Some(at) = self.deadline(r) else {
            return;
        };
        if at > now {
            // The deadline moved later (e.g. P started): wait for the new one.
            self.timers.arm(at, Timer::Req(req, gen));
            return;
        }
        match r.state {
            DState::Early => {
                let peer = r.peer;
                let up = self.peers.is_up(peer);
                self.stats.orphans += 1;
                // P is told to give it up; an arrival after this fails at once.
                self.drop_early(req, now, true);
                if up {
                    self.send(
                        peer,
                        Message::Abort {
                            req,
                            reason: FailReason::Timeout,
                        },
                    );
                }
            }
            DState::Draining => {
                let peer = r.peer;
                let reason = r.fail.unwrap_or(FailReason::Timeout);
                if now < r.drain_since.saturating_add(self.cfg.drain_timeout) {
                    // No confirmation yet: the Abort (or its answer) may have been lost.
                    if let Some(r) = self.reqs.get_mut(&req) {
                        r.abort_sent = now;
                    }
                    self.send(peer, Message::Abort { req, reason });
                    self.arm(req, now);
                    return;
                }
                // P is alive but never confirmed: only tearing its connection down guarantees
                // that no write lands in the blocks once they are released.
                self.stats.drain_timeouts += 1;
                self.peer_down(peer, FailReason::PeerDown, DownCause::DrainTimeout, now);
                self.release_failed(req, now);
            }
            _ => self.fail(req, FailReason::Timeout, true, now),
        }
    }
}

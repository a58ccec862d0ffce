//! Deadlines: the heartbeat tick, silent peers, and each request's own deadline.

use super::*;

impl PSide {
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

    /// Fails the requests of a D silent for `for_ns` (see the module's docs), telling it: not
    /// given up, so a stalled D that comes back frees their blocks at once. A request younger
    /// than `peer_timeout` waits: silence is judged over a request's own life (after this
    /// engine stalled itself, D is heard again only once its connections are made again).
    pub(super) fn peer_silent(&mut self, peer: PeerId, for_ns: Nanos, now: Nanos) {
        let timeout = self.cfg.peer_timeout;
        let reqs = self.peers.failing_for_silence(peer, for_ns, "D", |r| {
            self.reqs.get(&r).is_some_and(|r| {
                r.state != PState::Draining && now.saturating_sub(r.created) >= timeout
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

    pub(super) fn deadline(&self, r: &PReq) -> Nanos {
        let c = &self.cfg;
        match r.state {
            PState::Early => r.created.saturating_add(c.orphan_timeout),
            PState::Draining => r.drain_since.saturating_add(c.drain_timeout),
            PState::Active => {
                let mut d = r.created.saturating_add(c.request_timeout);
                if r.prefill_done && r.dst.is_none() {
                    d = d.min(r.prefill_done_at.saturating_add(c.block_ids_timeout));
                }
                if r.inflight > 0 {
                    d = d.min(r.last_progress.saturating_add(c.transfer_timeout));
                }
                d
            }
        }
    }

    pub(super) fn arm(&mut self, req: RequestId) {
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        let at = self.deadline(r);
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
        let at = self.deadline(r);
        if at > now {
            self.timers.arm(at, Timer::Req(req, gen));
            return;
        }
        match r.state {
            PState::Early => {
                let peer = r.peer;
                self.stats.orphans += 1;
                // D is told to give it up; a `Scheduled` after this fails at once.
                self.drop_early(req, now, true);
                self.ack_abort(peer, req);
            }
            PState::Draining => {
                // Transfers never settled: only tearing the connection down guarantees they
                // stop reading our blocks (and writing D's) before the blocks are released.
                self.stats.drain_timeouts += 1;
                let peer = r.peer;
                self.peer_down(peer, FailReason::PeerDown, DownCause::DrainTimeout, now);
                self.finish_fail(req, now);
            }
            PState::Active => self.fail(req, FailReason::Timeout, true, now),
        }
    }
}

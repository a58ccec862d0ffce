//! Each request's own deadline. The requests of a P silent for `peer_timeout` fail (see the
//! module's docs, and [`book::run_timers`]): not given up, so a stalled P that comes back keeps
//! its data path. Those whose block ids it has drain: their blocks wait for its confirming
//! `Abort` or the drain deadline, and only that deadline gives it up
//! ([`DownCause::DrainTimeout`]).

use super::*;

impl DSide {
    pub(super) fn arm(&mut self, req: RequestId) {
        let cfg = &self.cfg;
        self.book.arm(req, |r| deadline(cfg, r));
    }

    pub(super) fn deadline_passed(&mut self, req: RequestId, gen: u32, now: Nanos) {
        let cfg = &self.cfg;
        let Some(r) = self.book.due(req, gen, now, |r| deadline(cfg, r)) else {
            return;
        };
        match r.state {
            DState::Early => {
                let peer = r.peer;
                let up = self.book.peers.is_up(peer);
                self.stats.orphans += 1;
                // P is told to give it up; an arrival after this fails at once.
                self.book.drop_early(req, now, true);
                if up {
                    self.book.send(
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
                    if let Some(r) = self.book.reqs.get_mut(&req) {
                        r.abort_sent = now;
                    }
                    self.book.send(peer, Message::Abort { req, reason });
                    self.arm(req);
                    return;
                }
                // P is alive but never confirmed: only tearing its connection down guarantees
                // that no write lands in the blocks once they are released.
                self.stats.drain_timeouts += 1;
                book::drain_timed_out(self, peer, now);
                self.release_failed(req, now);
            }
            _ => self.fail(req, FailReason::Timeout, true, now),
        }
    }
}

fn deadline(c: &DConfig, r: &DReq) -> Option<Nanos> {
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

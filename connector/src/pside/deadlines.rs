//! Each request's own deadline. The requests of a D silent for `peer_timeout` fail (see the
//! module's docs, and [`book::run_timers`]), telling it: not given up, so a stalled D that comes
//! back frees their blocks at once.

use super::*;

impl PSide {
    pub(super) fn arm(&mut self, req: RequestId) {
        let cfg = &self.cfg;
        self.book.arm(req, |r| Some(deadline(cfg, r)));
    }

    pub(super) fn deadline_passed(&mut self, req: RequestId, gen: u32, now: Nanos) {
        let cfg = &self.cfg;
        let Some(r) = self.book.due(req, gen, now, |r| Some(deadline(cfg, r))) else {
            return;
        };
        match r.state {
            PState::Early => {
                let peer = r.peer;
                self.stats.orphans += 1;
                // D is told to give it up; a `Scheduled` after this fails at once.
                self.book.drop_early(req, now, true);
                self.ack_abort(peer, req);
            }
            PState::Draining => {
                // Transfers never settled: only tearing the connection down guarantees they
                // stop reading our blocks (and writing D's) before the blocks are released.
                self.stats.drain_timeouts += 1;
                let peer = r.peer;
                book::drain_timed_out(self, peer, now);
                self.finish_fail(req, now);
            }
            PState::Active => self.fail(req, FailReason::Timeout, true, now),
        }
    }
}

fn deadline(c: &PConfig, r: &PReq) -> Nanos {
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

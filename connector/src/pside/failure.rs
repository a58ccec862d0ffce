//! Failure paths: a request failed, its transfers settled or drained, a D down.

use super::*;

impl PSide {
    /// Fails `req`; `notify`: send D an `Abort` once nothing is in flight.
    pub(super) fn fail(&mut self, req: RequestId, reason: FailReason, notify: bool, now: Nanos) {
        let Some(r) = self.book.reqs.get_mut(&req) else {
            return;
        };
        match r.state {
            PState::Early => {
                let peer = r.peer;
                self.book.drop_early(req, now, false);
                if notify {
                    self.ack_abort(peer, req);
                }
            }
            PState::Draining => {}
            PState::Active => {
                r.fail = Some(reason);
                r.rec.outcome = Outcome::Failed;
                r.rec.fail_reason = Some(reason);
                if !notify {
                    // The peer is gone: no Abort to send.
                    r.silent = true;
                }
                if r.inflight > 0 {
                    r.state = PState::Draining;
                    r.drain_since = now;
                    self.book
                        .actions
                        .push_back(PAction::CancelTransfers { req });
                    self.arm(req);
                } else {
                    self.finish_fail(req, now);
                }
            }
        }
    }

    /// Fails `req` because its D is gone or restarted: no `Abort` to send it.
    pub(super) fn fail_for_d(&mut self, req: RequestId, reason: FailReason, now: Nanos) {
        self.fail(req, reason, false, now);
    }

    /// Releases P's blocks of a failed request, tells D (if it should) and ends it.
    pub(super) fn finish_fail(&mut self, req: RequestId, now: Nanos) {
        let Some(r) = self.book.reqs.get_mut(&req) else {
            return;
        };
        let reason = r.fail.unwrap_or(FailReason::LocalAbort);
        let blocks = r.src.to_vec();
        let peer = r.peer;
        let notify = !r.silent;
        self.metrics.failed[reason_index(reason)] += 1;
        self.metrics.releases += 1;
        self.metrics.released_blocks += blocks.len() as u64;
        tracing::debug!(
            target: "kvwire_connector",
            req = req.0,
            peer = peer.0,
            blocks = blocks.len(),
            reason = fail_reason_name(reason),
            "p released blocks"
        );
        self.book
            .actions
            .push_back(PAction::ReleaseBlocks { req, blocks });
        self.book
            .actions
            .push_back(PAction::ReportFailed { req, reason });
        if notify && self.book.peers.is_up(peer) {
            self.book.send(peer, Message::Abort { req, reason });
        }
        self.stats.failed += 1;
        self.book.end(req, now);
    }
}

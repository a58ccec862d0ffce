//! Failure paths: a request failed, its blocks drained or released, a P down.

use super::*;

impl DSide {
    /// Fails `req`. `notify`: tell P with an `Abort` (false when P told us, or P is gone).
    pub(super) fn fail(&mut self, req: RequestId, reason: FailReason, notify: bool, now: Nanos) {
        let Some(r) = self.book.reqs.get_mut(&req) else {
            return;
        };
        let peer = r.peer;
        let state = r.state;
        let blocks_sent = r.blocks_sent;
        let peer_up = self.book.peers.is_up(peer);
        match state {
            DState::Early => self.book.drop_early(req, now, false),
            DState::Draining | DState::Promoted => {}
            DState::Waiting | DState::Landed | DState::Complete | DState::Reported => {
                r.fail = Some(reason);
                if notify && peer_up && state == DState::Waiting {
                    self.book.send(peer, Message::Abort { req, reason });
                }
                self.release_failed(req, now);
            }
            DState::Reserved => {
                r.fail = Some(reason);
                let p_may_write = blocks_sent
                    && peer_up
                    && !matches!(reason, FailReason::RemoteAbort | FailReason::PeerDown);
                if p_may_write {
                    // P has our block ids and may have writes in flight: keep the blocks until
                    // P confirms with its Abort, P dies, or the drain deadline passes.
                    r.state = DState::Draining;
                    r.drain_since = now;
                    r.abort_sent = now;
                    self.book.send(peer, Message::Abort { req, reason });
                    self.arm(req);
                } else {
                    if notify && peer_up {
                        self.book.send(peer, Message::Abort { req, reason });
                    }
                    self.release_failed(req, now);
                }
            }
        }
    }

    /// Releases a failed request's blocks (if any), reports it failed and ends it.
    pub(super) fn release_failed(&mut self, req: RequestId, now: Nanos) {
        let Some(r) = self.book.reqs.get_mut(&req) else {
            return;
        };
        let reason = r.fail.unwrap_or(FailReason::LocalAbort);
        let mut blocks = std::mem::take(&mut r.blocks);
        if r.landing {
            r.landing = false;
            let slots = std::mem::take(&mut blocks);
            self.book
                .actions
                .push_back(DAction::ReleaseLanding { req, slots });
        }
        r.rec.outcome = Outcome::Failed;
        r.rec.fail_reason = Some(reason);
        self.metrics.failed[reason_index(reason)] += 1;
        if !blocks.is_empty() {
            r.rec.d_released = Some(now);
            self.metrics.releases += 1;
            self.metrics.released_blocks += blocks.len() as u64;
            self.metrics.block_ns_waiting += held_ns(blocks.len(), r.rec.d_reserved, now);
            tracing::debug!(
                target: "kvwire_connector",
                req = req.0,
                peer = r.peer.0,
                blocks = blocks.len(),
                reason = crate::metrics::fail_reason_name(reason),
                "d released blocks"
            );
            self.book.actions.push_back(DAction::ReleaseBlocks {
                req,
                blocks: blocks.clone(),
            });
        }
        self.book.actions.push_back(DAction::ReportFailed {
            req,
            blocks,
            reason,
        });
        self.stats.failed += 1;
        self.book.end(req, now);
    }

    /// Fails a request because its P is gone: nothing more can land, so a draining
    /// reservation is released at once.
    ///
    /// A restart is different: the connection is up and the message that revealed the new
    /// incarnation may have been overtaken by requests of the new life (a lost heartbeat), so a
    /// request whose block ids went out still drains through an `Abort` round trip (the new
    /// life confirms unknown requests at once).
    pub(super) fn fail_for_p(&mut self, req: RequestId, reason: FailReason, now: Nanos) {
        match (self.book.reqs.get(&req).map(|r| r.state), reason) {
            (Some(DState::Draining), FailReason::PeerDown) => self.release_failed(req, now),
            (Some(DState::Draining), _) => {}
            (Some(_), FailReason::PeerRestarted) => self.fail(req, reason, true, now),
            (Some(_), _) => self.fail(req, reason, false, now),
            (None, _) => {}
        }
    }
}

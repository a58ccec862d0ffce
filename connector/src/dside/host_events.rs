//! The host's events about one request: it arrived (decode_sent), blocks were reserved for it,
//! a landing slot was granted.

use super::*;

impl DSide {
    pub(super) fn on_arrived(
        &mut self,
        req: RequestId,
        peer: PeerId,
        tokens: u32,
        blocks: u32,
        now: Nanos,
    ) -> Result<(), DError> {
        if blocks == 0 {
            return Err(DError::NoBlocks(req));
        }
        let peer_aborted = self.book.tombs.peer_aborted(req);
        if self.book.tombs.contains(req) && !peer_aborted {
            return Err(DError::DuplicateRequest(req));
        }
        let mut rec = TimelineRecord::new(req, Side::D, &self.cfg.transport);
        rec.policy = Some(self.cfg.policy);
        rec.layers = self.cfg.layers;
        rec.blocks = blocks;
        rec.tokens = tokens;
        rec.decode_sent = Some(now);
        let (p_started, p_done, p_acked, p_layers) = match self.book.reqs.get(&req) {
            Some(r) if r.state == DState::Early && r.peer == peer => {
                rec.p_scheduled = r.rec.p_scheduled;
                rec.p_last_layer_ready = r.rec.p_last_layer_ready;
                (r.p_started, r.p_done, r.p_acked, r.p_layers)
            }
            Some(_) => return Err(DError::DuplicateRequest(req)),
            None => (false, false, false, None),
        };
        if self.book.reqs.contains_key(&req) {
            self.book.early -= 1;
        }
        self.book.touch_peer(peer, now);
        self.book.reqs.insert(
            req,
            DReq {
                blocks_needed: blocks,
                p_layers,
                p_started,
                p_done,
                p_acked,
                landed: LayerSet::new(self.cfg.layers),
                ..DReq::new(peer, DState::Waiting, self.cfg.policy, now, rec)
            },
        );
        self.book.peers.attach(peer, req);
        self.metrics.arrived += 1;
        if peer_aborted {
            // P already gave this request up: it fails here at once (no blocks held).
            if let Some(r) = self.book.reqs.get_mut(&req) {
                r.fail = Some(FailReason::RemoteAbort);
            }
            self.release_failed(req, now);
            return Ok(());
        }
        self.book.send(
            peer,
            Message::Announce {
                req,
                tokens,
                blocks,
            },
        );
        if !self.check_p_shape(req, now) {
            return Ok(());
        }
        self.arm(req);
        self.signal_if_reservable(req);
        Ok(())
    }

    pub(super) fn on_reserved(
        &mut self,
        req: RequestId,
        blocks: Vec<BlockId>,
        now: Nanos,
    ) -> Result<(), DError> {
        let policy = self.cfg.policy;
        let Some(r) = self.book.reqs.get_mut(&req) else {
            // The request ended while the host was reserving: hand the blocks straight back.
            self.stats.stale_reservations += 1;
            self.metrics.releases += 1;
            self.metrics.released_blocks += blocks.len() as u64;
            tracing::debug!(
                target: "kvwire_connector",
                req = req.0,
                blocks = blocks.len(),
                reason = "stale",
                "d released blocks"
            );
            self.book
                .actions
                .push_back(DAction::ReleaseBlocks { req, blocks });
            return Ok(());
        };
        match r.state {
            DState::Waiting => {}
            DState::Landed => {
                // `land`: the KV is complete in the landing pool; these are its KV blocks.
                r.check_count(req, blocks.len())?;
                r.state = DState::Complete;
                r.rec.d_reserved = Some(now);
                r.landing = false;
                r.blocks = blocks;
                self.metrics.reservations += 1;
                self.metrics.reserved_blocks += r.blocks.len() as u64;
                self.book.actions.push_back(DAction::ReportFinished { req });
                return Ok(());
            }
            DState::Early => return Err(DError::UnknownRequest(req)),
            DState::Reserved | DState::Draining => return Err(DError::AlreadyReserved(req)),
            s => return Err(invalid(req, "reserved", s)),
        }
        if r.policy == Policy::Land || !allowed(r.policy, r) {
            return Err(DError::NotReservable(req));
        }
        r.check_count(req, blocks.len())?;
        r.rec.d_reserved = Some(now);
        let n = blocks.len();
        let (peer, msg) = r.reserve(req, blocks, false, now);
        self.metrics.reservations += 1;
        self.metrics.reserved_blocks += n as u64;
        tracing::debug!(
            target: "kvwire_connector",
            req = req.0,
            peer = peer.0,
            blocks = n,
            policy = policy.name(),
            "d reserved blocks"
        );
        self.book.send(peer, msg);
        Ok(())
    }

    pub(super) fn on_landing(
        &mut self,
        req: RequestId,
        slots: Vec<BlockId>,
        now: Nanos,
    ) -> Result<(), DError> {
        let Some(r) = self.book.reqs.get_mut(&req) else {
            // Ended while the host took the slots: hand them straight back.
            self.stats.stale_reservations += 1;
            self.book
                .actions
                .push_back(DAction::ReleaseLanding { req, slots });
            return Ok(());
        };
        if r.state != DState::Waiting || r.policy != Policy::Land || !r.signalled {
            return Err(invalid(req, "landing", r.state));
        }
        r.check_count(req, slots.len())?;
        let (peer, msg) = r.reserve(req, slots, true, now);
        self.metrics.landings += 1;
        self.book.send(peer, msg);
        Ok(())
    }
}

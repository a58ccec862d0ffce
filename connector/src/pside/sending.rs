//! Sending: a request scheduled, its layers ready, D's destination known, transfers issued
//! and settled, the request complete.

use super::*;

impl PSide {
    pub(super) fn on_scheduled(
        &mut self,
        req: RequestId,
        peer: PeerId,
        tokens: u32,
        blocks: Vec<BlockId>,
        now: Nanos,
    ) -> Result<(), PError> {
        if blocks.is_empty() {
            return Err(PError::NoBlocks(req));
        }
        let peer_aborted = self.book.tombs.peer_aborted(req);
        if self.book.tombs.contains(req) && !peer_aborted {
            return Err(PError::DuplicateRequest(req));
        }
        let early_dst = match self.book.reqs.get(&req) {
            Some(r) if r.state == PState::Early && r.peer == peer => r.dst.clone(),
            Some(_) => return Err(PError::DuplicateRequest(req)),
            None => None,
        };
        if self.book.reqs.contains_key(&req) {
            self.book.early -= 1;
        }
        let n = blocks.len();
        let mut rec = TimelineRecord::new(req, Side::P, &self.cfg.transport);
        rec.send_mode = Some(self.cfg.send_mode);
        rec.layers = self.cfg.layers;
        rec.blocks = n as u32;
        rec.tokens = tokens;
        rec.p_scheduled = Some(now);
        self.book.touch_peer(peer, now);
        let layers = self.cfg.layers;
        self.book.reqs.insert(
            req,
            PReq::new(
                peer,
                PState::Active,
                blocks.into(),
                LayerSet::new(layers),
                now,
                rec,
            ),
        );
        self.book.peers.attach(peer, req);
        self.metrics.scheduled += 1;
        if peer_aborted {
            // D already gave this request up: release P's blocks at once.
            self.fail(req, FailReason::RemoteAbort, false, now);
            return Ok(());
        }
        self.book.send(
            peer,
            Message::Started {
                req,
                layers,
                blocks: n as u32,
            },
        );
        self.arm(req);
        if let Some(dst) = early_dst {
            self.set_destination(req, dst, now);
        }
        Ok(())
    }

    pub(super) fn layer_ready(&mut self, req: RequestId, layer: u16, now: Nanos) {
        let layers = self.cfg.layers;
        let mode = self.cfg.send_mode;
        let Some(r) = self.book.reqs.get_mut(&req) else {
            return;
        };
        if !r.ready.insert(layer) {
            return;
        }
        if r.rec.p_first_layer_ready.is_none() {
            r.rec.p_first_layer_ready = Some(now);
        }
        let all = r.ready.count() == layers;
        let has_dst = r.dst.is_some();
        if all {
            r.prefill_done = true;
            r.prefill_done_at = now;
            r.rec.p_last_layer_ready = Some(now);
            let peer = r.peer;
            self.book.send(peer, Message::PrefillDone { req });
            if !has_dst {
                // Waiting for D's block ids now has its own, shorter deadline.
                self.arm(req);
            }
        }
        if !has_dst {
            return;
        }
        match mode {
            SendMode::Layerwise => self.issue(req, layer, now),
            SendMode::Whole if all => self.issue_all_ready(req, now),
            SendMode::Whole => {}
        }
    }

    pub(super) fn set_destination(&mut self, req: RequestId, dst: Dst, now: Nanos) {
        let announce = self.cfg.announce_destination;
        let Some(r) = self.book.reqs.get_mut(&req) else {
            return;
        };
        if let Some(have) = &r.dst {
            if *have == dst {
                self.stats.duplicate_messages += 1;
            } else {
                self.fail(req, FailReason::Protocol, true, now);
            }
            return;
        }
        let first = dst.first as usize;
        if first >= r.src.len() || dst.blocks.len() != r.src.len() - first {
            self.fail(req, FailReason::Protocol, true, now);
            return;
        }
        if first > 0 {
            r.src = Arc::from(&r.src[first..]);
        }
        if announce {
            self.book.actions.push_back(PAction::Destination {
                req,
                peer: r.peer,
                first: dst.first,
                src: r.src.clone(),
                dst: dst.blocks.clone(),
                landing: dst.landing,
            });
        }
        r.dst = Some(dst);
        let go = match self.cfg.send_mode {
            SendMode::Layerwise => true,
            SendMode::Whole => r.prefill_done,
        };
        if go {
            self.issue_all_ready(req, now);
        }
    }

    pub(super) fn issue_all_ready(&mut self, req: RequestId, now: Nanos) {
        for l in 0..self.cfg.layers {
            let ready = self
                .book
                .reqs
                .get(&req)
                .is_some_and(|r| r.ready.contains(l) && !r.issued.contains(l));
            if ready {
                self.issue(req, l, now);
            }
        }
    }

    pub(super) fn issue(&mut self, req: RequestId, layer: u16, now: Nanos) {
        let Some(r) = self.book.reqs.get_mut(&req) else {
            return;
        };
        let Some(Dst {
            blocks: dst,
            landing,
            ..
        }) = r.dst.clone()
        else {
            return;
        };
        if r.state != PState::Active || !r.issued.insert(layer) {
            return;
        }
        r.inflight += 1;
        r.last_progress = now;
        if r.rec.first_byte.is_none() {
            r.rec.first_byte = Some(now);
        }
        let first_inflight = r.inflight == 1;
        self.metrics.transfers += 1;
        self.book.actions.push_back(PAction::Transfer {
            req,
            peer: r.peer,
            layer,
            src: r.src.clone(),
            dst,
            landing,
        });
        if first_inflight {
            self.arm(req);
        }
    }

    pub(super) fn transfer_settled(
        &mut self,
        req: RequestId,
        layer: u16,
        bytes: Option<u64>,
        now: Nanos,
    ) -> Result<(), PError> {
        let layers = self.cfg.layers;
        let Some(r) = self.book.reqs.get_mut(&req) else {
            if self.book.tombs.contains(req) {
                self.stats.late += 1;
                return Ok(());
            }
            return Err(PError::UnknownRequest(req));
        };
        if r.state == PState::Early || !r.issued.contains(layer) || r.done.contains(layer) {
            return Err(PError::NoTransfer { req, layer });
        }
        r.inflight -= 1;
        r.last_progress = now;
        // Mark it settled so a second report is refused.
        r.done.insert(layer);
        let peer = r.peer;
        let state = r.state;
        let inflight = r.inflight;
        match bytes {
            Some(b) => {
                self.metrics.transfers_done += 1;
                self.metrics.bytes_sent = self.metrics.bytes_sent.saturating_add(b);
            }
            None => self.metrics.transfers_failed += 1,
        }
        match (state, bytes) {
            (PState::Draining, _) => {
                if inflight == 0 {
                    self.finish_fail(req, now);
                }
            }
            (_, None) => self.fail(req, FailReason::TransferError, true, now),
            (_, Some(b)) => {
                r.rec.bytes = r.rec.bytes.saturating_add(b);
                let complete = r.done.count() == layers;
                self.book.send(
                    peer,
                    Message::LayerSent {
                        req,
                        layer,
                        bytes: b,
                    },
                );
                if complete {
                    self.complete(req, now);
                }
            }
        }
        Ok(())
    }

    /// Every layer was written: tell D, release P's blocks, end the request.
    pub(super) fn complete(&mut self, req: RequestId, now: Nanos) {
        let layers = self.cfg.layers;
        let Some(r) = self.book.reqs.get_mut(&req) else {
            return;
        };
        r.rec.last_byte = Some(now);
        let total = r.rec.bytes;
        let blocks = r.src.to_vec();
        let peer = r.peer;
        self.metrics.completed += 1;
        self.metrics.releases += 1;
        self.metrics.released_blocks += blocks.len() as u64;
        if let Some(at) = r.rec.p_scheduled {
            self.metrics.send_latency.observe(now.saturating_sub(at));
        }
        tracing::debug!(
            target: "kvwire_connector",
            req = req.0,
            peer = peer.0,
            blocks = blocks.len(),
            reason = "sent",
            "p released blocks"
        );
        self.book.send(
            peer,
            Message::AllSent {
                req,
                layers,
                bytes: total,
            },
        );
        self.book
            .actions
            .push_back(PAction::ReleaseBlocks { req, blocks });
        self.book.actions.push_back(PAction::ReportFinished { req });
        self.stats.finished += 1;
        self.book.end(req, now);
    }
}

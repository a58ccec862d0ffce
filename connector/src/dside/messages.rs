//! P's messages: acknowledgements, layers landed, aborts and heartbeats.

use super::*;

impl DSide {
    pub(super) fn on_message(&mut self, from: PeerId, msg: Message, now: Nanos) {
        let Some(req) = book::inbound(self, from, &msg, now) else {
            return;
        };
        if !self.book.reqs.contains_key(&req) && self.book.tombs.contains(req) {
            self.stats.late_messages += 1;
            return;
        }
        match msg {
            Message::Started { layers, blocks, .. } => {
                let Some(r) = self.early_or_get(req, from, now) else {
                    return;
                };
                if r.p_started {
                    self.stats.duplicate_messages += 1;
                    return;
                }
                r.p_started = true;
                r.p_layers = Some((layers, blocks));
                r.rec.p_scheduled = Some(now);
                if self.check_p_shape(req, now) {
                    self.signal_if_reservable(req);
                }
            }
            Message::Queued { .. } => {
                let Some(r) = self.early_or_get(req, from, now) else {
                    return;
                };
                if r.p_acked {
                    self.stats.duplicate_messages += 1;
                    return;
                }
                // The waiting deadline moves to `request_timeout` (re-armed when it fires).
                r.p_acked = true;
            }
            Message::PrefillDone { .. } => {
                let Some(r) = self.early_or_get(req, from, now) else {
                    return;
                };
                if r.p_done {
                    self.stats.duplicate_messages += 1;
                    return;
                }
                r.p_started = true;
                r.p_done = true;
                r.rec.p_last_layer_ready = Some(now);
                if r.rec.p_scheduled.is_none() {
                    r.rec.p_scheduled = Some(now);
                }
                self.signal_if_reservable(req);
            }
            Message::LayerSent { layer, bytes, .. } => {
                self.on_data_msg(req, Some(layer), bytes, now);
            }
            Message::AllSent { layers, bytes, .. } => {
                if layers != self.cfg.layers {
                    if self.book.reqs.contains_key(&req) {
                        self.fail(req, FailReason::Protocol, true, now);
                    }
                    return;
                }
                self.on_data_msg(req, None, bytes, now);
            }
            Message::Abort { .. } => match self.book.reqs.get(&req).map(|r| r.state) {
                Some(DState::Early) => self.book.drop_early(req, now, true),
                Some(DState::Waiting) | Some(DState::Reserved) => {
                    self.fail(req, FailReason::RemoteAbort, false, now)
                }
                Some(DState::Draining) => self.release_failed(req, now),
                Some(_) => self.stats.late_messages += 1,
                None => {
                    // P gave up a request D has not seen yet: remember, fail it on arrival.
                    self.book.bury(req, now, true);
                }
            },
            Message::Announce { .. } | Message::BlockIds { .. } | Message::Heartbeat { .. } => {
                self.stats.unexpected_messages += 1;
            }
        }
    }

    pub(super) fn on_data_msg(
        &mut self,
        req: RequestId,
        layer: Option<u16>,
        bytes: u64,
        now: Nanos,
    ) {
        let Some(state) = self.book.reqs.get(&req).map(|r| (r.state, r.blocks_sent)) else {
            self.stats.unexpected_messages += 1;
            return;
        };
        match state {
            (DState::Reserved, true) => {
                if layer.is_some_and(|l| l >= self.cfg.layers) {
                    self.fail(req, FailReason::Protocol, true, now);
                } else {
                    self.land(req, layer, bytes, now);
                }
            }
            // P cannot have written anything before it had our block ids.
            (DState::Early, _) | (DState::Waiting, _) | (DState::Reserved, false) => {
                if self
                    .book
                    .reqs
                    .get(&req)
                    .is_some_and(|r| r.state == DState::Early)
                {
                    self.book.drop_early(req, now, false);
                } else {
                    self.fail(req, FailReason::Protocol, true, now);
                }
            }
            _ => self.stats.duplicate_messages += 1,
        }
    }

    /// One layer (or, with `None`, every layer) has landed.
    pub(super) fn land(&mut self, req: RequestId, layer: Option<u16>, bytes: u64, now: Nanos) {
        let layers = self.cfg.layers;
        let Some(r) = self.book.reqs.get_mut(&req) else {
            return;
        };
        let fresh = match layer {
            Some(l) => r.landed.insert(l),
            None => {
                let mut any = false;
                for l in 0..layers {
                    any |= r.landed.insert(l);
                }
                any
            }
        };
        if !fresh {
            self.stats.duplicate_messages += 1;
            return;
        }
        let before = r.rec.bytes;
        match layer {
            Some(_) => r.rec.bytes = r.rec.bytes.saturating_add(bytes),
            None => r.rec.bytes = r.rec.bytes.max(bytes),
        }
        // Saturating: the byte counts come from P's messages.
        self.metrics.bytes_received = self
            .metrics
            .bytes_received
            .saturating_add(r.rec.bytes.saturating_sub(before));
        if r.rec.first_byte.is_none() {
            r.rec.first_byte = Some(now);
        }
        if r.landed.count() == layers {
            r.rec.last_byte = Some(now);
            r.gen += 1;
            let peer = r.peer;
            self.metrics.completed += 1;
            // Everything is here: the peer's death no longer affects this request.
            self.book.peers.detach(peer, req);
            if r.landing {
                // `land`: now (and only now) the request needs KV blocks.
                r.state = DState::Landed;
                let blocks = r.blocks_needed - r.first;
                self.book
                    .actions
                    .push_back(DAction::MayReserve { req, blocks });
            } else {
                r.state = DState::Complete;
                self.book.actions.push_back(DAction::ReportFinished { req });
            }
        }
    }
}

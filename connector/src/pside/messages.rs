//! D's messages: destinations, aborts and heartbeats.

use super::*;

impl PSide {
    pub(super) fn on_message(&mut self, from: PeerId, msg: Message, now: Nanos) {
        let Some(req) = book::inbound(self, from, &msg, now) else {
            return;
        };
        match msg {
            Message::BlockIds {
                blocks,
                first,
                landing,
                ..
            } => {
                let dst = Dst {
                    first,
                    landing,
                    blocks: blocks.into(),
                };
                if self.book.tombs.contains(req) {
                    self.stats.late += 1;
                    return;
                }
                match self.book.reqs.get(&req).map(|r| r.state) {
                    Some(PState::Active) => self.set_destination(req, dst, now),
                    Some(PState::Draining) => self.stats.late += 1,
                    Some(PState::Early) | None => {
                        if let Some(r) = self.early_entry(req, from, now) {
                            if r.dst.is_some() {
                                self.stats.duplicate_messages += 1;
                            } else {
                                r.dst = Some(dst);
                            }
                        }
                    }
                }
            }
            Message::Announce { .. } => {
                if self.book.tombs.contains(req) {
                    self.stats.late += 1;
                    return;
                }
                if !self.book.reqs.contains_key(&req) {
                    let _ = self.early_entry(req, from, now);
                }
            }
            Message::Abort { .. } => match self.book.reqs.get(&req).map(|r| r.state) {
                Some(PState::Active) => self.fail(req, FailReason::RemoteAbort, true, now),
                Some(PState::Draining) => {}
                Some(PState::Early) => {
                    self.book.drop_early(req, now, true);
                    self.ack_abort(from, req);
                }
                // Nothing of ours can be in flight: confirm so D can release at once.
                None => {
                    if !self.book.tombs.contains(req) {
                        self.book.bury(req, now, true);
                    }
                    self.ack_abort(from, req);
                }
            },
            Message::Started { .. }
            | Message::Queued { .. }
            | Message::PrefillDone { .. }
            | Message::LayerSent { .. }
            | Message::AllSent { .. }
            | Message::Heartbeat { .. } => self.stats.unexpected_messages += 1,
        }
    }

    pub(super) fn ack_abort(&mut self, to: PeerId, req: RequestId) {
        if self.book.peers.is_up(to) {
            self.book.send(
                to,
                Message::Abort {
                    req,
                    reason: FailReason::RemoteAbort,
                },
            );
        }
    }
}

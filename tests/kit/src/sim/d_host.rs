//! The D engine: its step loop (promotion, reservation, decode), its actions and its messages
//! to the P engines.

use kvwire_connector::{DAction, DEvent, Message, PeerId, RequestId};

use super::check::{Role, Violation};
use super::config::HostBug;
use super::events::Ev;
use super::world::{DPhase, Sim};

impl Sim {
    pub(super) fn on_d_recv(&mut self, req: u64) {
        self.arrived += 1;
        let spec = &mut self.reqs[req as usize];
        spec.d_phase = DPhase::Live;
        let ev = DEvent::Arrived {
            req: RequestId(req),
            peer: PeerId(spec.p as u32),
            tokens: spec.tokens,
            blocks: spec.blocks,
        };
        self.check.begin(Role::D, RequestId(req));
        let r = self.d.core.handle(ev, self.now);
        self.host_result(r.map_err(|e| e.to_string()));
        self.drain_d();
    }

    pub(super) fn kick_d(&mut self) {
        if !self.d.stepping {
            self.d.stepping = true;
            // An idle engine notices new work at its next idle-loop tick.
            let grid = self.cfg.d_idle_poll.max(1);
            let at = (self.now / grid + 1) * grid;
            self.at(at, Ev::DStep);
        }
    }

    pub(super) fn on_d_step(&mut self) {
        self.d_steps += 1;
        let now = self.now;
        // Promote what was reported at the end of the previous step (one step later with async
        // scheduling: the output of step N is processed after step N+1 was scheduled).
        let mut later = Vec::new();
        for (req, wait) in std::mem::take(&mut self.d.to_promote) {
            if wait > 0 {
                later.push((req, wait - 1));
                continue;
            }
            let r = self.d.core.handle(DEvent::Promoted { req }, now);
            self.host_result_at("promoted", r.map_err(|e| e.to_string()));
            let spec = &mut self.reqs[req.0 as usize];
            spec.d_phase = DPhase::Promoted;
            let blocks = spec.d_blocks.clone();
            let toks = spec.decode_tokens;
            self.check.promote(0, req, &blocks);
            self.d.running.push((req, toks));
            self.d.promoted_now.push(req);
        }
        self.d.to_promote = later;
        // Reserve for requests the core allows, in order, while the pool has room.
        while let Some(&req) = self.d.reservable.front() {
            if !self.d.core.may_reserve(req) {
                self.d.reservable.pop_front();
                continue;
            }
            let n = self.reqs[req.0 as usize].blocks as usize;
            let Some(blocks) = self.d.pool.alloc(n) else {
                break;
            };
            self.d.reservable.pop_front();
            self.check.reserve(0, req, &blocks);
            self.reqs[req.0 as usize].d_blocks = blocks.clone();
            let r = self.d.core.handle(DEvent::Reserved { req, blocks }, now);
            self.host_result(r.map_err(|e| e.to_string()));
        }
        self.drain_d();
        let dur = if self.d.running.is_empty() {
            self.cfg.d_idle_poll
        } else {
            self.cfg.d_step_base + self.cfg.d_step_per_running * self.d.running.len() as u64
        };
        self.at(now + dur, Ev::DStepEnd);
    }

    pub(super) fn on_d_step_end(&mut self) {
        let now = self.now;
        for req in std::mem::take(&mut self.d.promoted_now) {
            let r = self.d.core.handle(DEvent::FirstToken { req }, now);
            self.host_result_at("first_token", r.map_err(|e| e.to_string()));
        }
        let mut still = Vec::with_capacity(self.d.running.len());
        for (req, left) in std::mem::take(&mut self.d.running) {
            if left <= 1 {
                let spec = &mut self.reqs[req.0 as usize];
                let blocks = std::mem::take(&mut spec.d_blocks);
                self.check.host_free(0, req, &blocks);
                self.d.pool.release(&blocks);
            } else {
                still.push((req, left - 1));
            }
        }
        self.d.running = still;
        // get_finished at the end of the step: what completed during it is reported now.
        for req in std::mem::take(&mut self.d.to_report) {
            if self.reqs[req.0 as usize].d_phase == DPhase::Ended {
                // Aborted by the host after the core said finished: nothing to report.
                continue;
            }
            let r = self.d.core.handle(DEvent::Reported { req }, now);
            self.host_result_at("reported", r.map_err(|e| e.to_string()));
            self.reqs[req.0 as usize].d_phase = DPhase::Reported;
            let wait = u8::from(self.cfg.d_async_scheduling);
            self.d.to_promote.push((req, wait));
        }
        self.drain_d();
        let head_fits = self
            .d
            .reservable
            .front()
            .is_some_and(|r| self.reqs[r.0 as usize].blocks as usize <= self.d.pool.free());
        if !self.d.running.is_empty() || !self.d.to_promote.is_empty() || head_fits {
            self.at(now, Ev::DStep);
        } else {
            self.d.stepping = false;
        }
    }

    pub(super) fn drain_d(&mut self) {
        let now = self.now;
        let mut kick = false;
        while let Some(a) = self.d.core.poll_action() {
            if self.cfg.trace.is_some() {
                let about = match &a {
                    DAction::Send { msg, .. } => msg.request() == self.cfg.trace,
                    DAction::MayReserve { req, .. }
                    | DAction::MayLand { req, .. }
                    | DAction::ReleaseLanding { req, .. }
                    | DAction::ReleaseBlocks { req, .. }
                    | DAction::ReportFinished { req }
                    | DAction::ReportFailed { req, .. } => self.traced(req.0),
                    DAction::DisconnectPeer { .. } => true,
                };
                if about {
                    eprintln!("t={}   D action {a:?}", self.now);
                }
            }
            match a {
                DAction::Send { to, msg } => {
                    if let (Some(HostBug::FreeOnAbortSent), Message::Abort { req, .. }) =
                        (self.cfg.host_bug, &msg)
                    {
                        let blocks = std::mem::take(&mut self.reqs[req.0 as usize].d_blocks);
                        if !blocks.is_empty() {
                            self.check.release(0, *req, &blocks);
                            self.d.pool.release(&blocks);
                            self.bug_freed.insert(*req, ());
                        }
                    }
                    self.send_to_p(to.0 as usize, &msg)
                }
                DAction::MayReserve { req, .. } => {
                    self.d.reservable.push_back(req);
                    kick = true;
                }
                DAction::MayLand { req, blocks } => {
                    // The landing pool is host memory apart from the KV cache: taken at once,
                    // or the request falls back to lazy.
                    let ev = match self.d.land_pool.alloc(blocks as usize) {
                        Some(slots) => {
                            let pool = self.land_pool_index();
                            self.check.reserve(pool, req, &slots);
                            self.reqs[req.0 as usize].d_landing = slots.clone();
                            DEvent::Landing { req, slots }
                        }
                        None => DEvent::LandFallback { req },
                    };
                    let r = self.d.core.handle(ev, now);
                    self.host_result(r.map_err(|e| e.to_string()));
                }
                DAction::ReleaseLanding { req, slots } => {
                    let spec = &mut self.reqs[req.0 as usize];
                    if std::mem::take(&mut spec.d_landing) != slots {
                        self.check.report(Violation::Host(format!(
                            "D release of landing slots not taken for {req:?}"
                        )));
                    }
                    let pool = self.land_pool_index();
                    self.check.release(pool, req, &slots);
                    self.d.land_pool.release(&slots);
                }
                DAction::ReleaseBlocks { req, blocks } => {
                    if self.bug_freed.remove(&req).is_some() {
                        // Already (wrongly) freed by the injected bug.
                        continue;
                    }
                    let spec = &mut self.reqs[req.0 as usize];
                    if std::mem::take(&mut spec.d_blocks) != blocks {
                        self.check.report(Violation::Host(format!(
                            "D release of blocks not reserved for {req:?}"
                        )));
                    }
                    self.check.release(0, req, &blocks);
                    self.d.pool.release(&blocks);
                    kick = true;
                }
                DAction::ReportFinished { req } => {
                    self.check.report_finished(req, self.cfg.layers);
                    // `land`: the host copies the landing slots into the reserved blocks (at
                    // once here) and frees them.
                    let slots = std::mem::take(&mut self.reqs[req.0 as usize].d_landing);
                    if !slots.is_empty() {
                        let pool = self.land_pool_index();
                        self.check.release(pool, req, &slots);
                        self.d.land_pool.release(&slots);
                    }
                    self.d.to_report.push(req);
                    kick = true;
                }
                DAction::ReportFailed { req, blocks, .. } => {
                    if self.cfg.host_bug == Some(HostBug::DoubleFreeOnFailure) && !blocks.is_empty()
                    {
                        self.check.release(0, req, &blocks);
                    }
                }
                DAction::DisconnectPeer { peer, .. } => {
                    // D gave this P up: tear the link down so nothing in flight lands; P sees
                    // its end of the connection drop and gives up its requests to D.
                    let p = peer.0 as usize;
                    if p < self.ps.len() {
                        self.cut_link(p);
                        let life = self.ps[p].life;
                        self.at(now + self.cfg.net.latency, Ev::PLinkDown { p, life });
                    }
                }
            }
        }
        while let Some(rec) = self.d.core.poll_timeline() {
            self.check.end(Role::D, rec.req);
            self.d_ended += 1;
            if let Some(s) = self.reqs.get_mut(rec.req.0 as usize) {
                s.d_phase = DPhase::Ended;
            }
            self.d_records.push(rec);
        }
        if let Some(t) = self.d.core.poll_timeout() {
            if self.d.wake_at.is_none_or(|w| t < w) {
                self.d.wake_at = Some(t);
                self.at(t.max(now), Ev::DWake { at: t });
            }
        }
        if kick {
            self.kick_d();
        }
    }

    pub(super) fn send_to_p(&mut self, p: usize, msg: &Message) {
        if p >= self.ps.len() || self.rng_net.chance(self.cfg.net.loss) {
            return;
        }
        let Ok(bytes) = msg.encode() else {
            self.check.report(Violation::Host("encode failed".into()));
            return;
        };
        let jitter = self.rng_net.range(0, self.cfg.net.jitter);
        let at = (self.now + self.cfg.net.latency + jitter).max(self.d.last_msg_to_p[p]);
        self.d.last_msg_to_p[p] = at;
        let life = self.ps[p].life;
        self.at(at, Ev::MsgToP { p, life, bytes });
    }
}

//! The P engines: prefill steps, transfers over the data link, crashes and restarts.

use std::sync::Arc;

use kvwire_connector::{BlockId, DEvent, Message, Nanos, PAction, PEvent, PSide, RequestId};

use super::check::{Role, Violation};
use super::config::D_PEER;
use super::events::{Ev, Landing};
use super::report::add_p_stats;
use super::world::Sim;
use crate::pool::BlockPool;

impl Sim {
    pub(super) fn p_try_step(&mut self, p: usize) {
        let now = self.now;
        let e = &mut self.ps[p];
        if !e.up || e.busy {
            return;
        }
        let mut batch = Vec::new();
        let mut tokens = 0u64;
        while let Some(&req) = e.queue.front() {
            let spec = &self.reqs[req as usize];
            if !batch.is_empty()
                && tokens + u64::from(spec.uncached) > u64::from(self.cfg.p_token_budget)
            {
                break;
            }
            let Some(blocks) = e.pool.alloc(spec.blocks as usize) else {
                break;
            };
            e.queue.pop_front();
            tokens += u64::from(spec.uncached);
            self.check.reserve(p + 1, RequestId(req), &blocks);
            self.check.begin(Role::P, RequestId(req));
            e.blocks_of.insert(req, blocks.clone());
            let r = e.core.handle(
                PEvent::Scheduled {
                    req: RequestId(req),
                    peer: D_PEER,
                    tokens: spec.tokens,
                    blocks,
                },
                now,
            );
            if let Err(err) = r {
                self.check.report(Violation::Host(err.to_string()));
            }
            batch.push(req);
        }
        if batch.is_empty() {
            self.drain_p(p);
            return;
        }
        let dur = self.cfg.p_step_overhead + self.cfg.p_ns_per_token * tokens;
        let layers = u64::from(self.cfg.layers);
        let life = self.ps[p].life;
        for &req in &batch {
            for l in 0..self.cfg.layers {
                let t = now + dur * (u64::from(l) + 1) / layers;
                self.at(
                    t,
                    Ev::PLayerReady {
                        p,
                        life,
                        req,
                        layer: l,
                    },
                );
            }
        }
        self.ps[p].busy = true;
        self.ps[p].batch = batch;
        self.at(now + dur, Ev::PStepEnd { p, life });
        self.drain_p(p);
    }

    pub(super) fn on_p_step_end(&mut self, p: usize) {
        let batch = std::mem::take(&mut self.ps[p].batch);
        for req in batch {
            let r = self.ps[p].core.handle(
                PEvent::PrefillDone {
                    req: RequestId(req),
                },
                self.now,
            );
            self.host_result(r.map_err(|e| e.to_string()));
        }
        self.ps[p].busy = false;
        self.drain_p(p);
        self.p_try_step(p);
    }

    pub(super) fn drain_p(&mut self, p: usize) {
        let now = self.now;
        let mut freed = false;
        while let Some(a) = self.ps[p].core.poll_action() {
            if self.cfg.trace.is_some() {
                let about = match &a {
                    PAction::Send { msg, .. } => msg.request() == self.cfg.trace,
                    PAction::Transfer { req, .. }
                    | PAction::Destination { req, .. }
                    | PAction::CancelTransfers { req }
                    | PAction::ReleaseBlocks { req, .. }
                    | PAction::ReportFinished { req }
                    | PAction::ReportFailed { req, .. } => self.traced(req.0),
                    PAction::DisconnectPeer { .. } => true,
                };
                if about {
                    eprintln!("t={}   P{p} action {a:?}", self.now);
                }
            }
            match a {
                PAction::Send { msg, .. } => self.send_to_d(p, &msg),
                PAction::Transfer {
                    req,
                    layer,
                    src,
                    dst,
                    landing,
                    ..
                } => self.start_transfer(p, req.0, layer, src, dst, landing),
                PAction::CancelTransfers { .. } | PAction::Destination { .. } => {}
                PAction::ReleaseBlocks { req, blocks } => {
                    let e = &mut self.ps[p];
                    match e.blocks_of.remove(&req.0) {
                        Some(b) if b == blocks => {}
                        _ => self.check.report(Violation::Host(format!(
                            "P{p} release of blocks it did not give for {req:?}"
                        ))),
                    }
                    self.check.release(p + 1, req, &blocks);
                    self.ps[p].pool.release(&blocks);
                    freed = true;
                }
                PAction::ReportFinished { .. } | PAction::ReportFailed { .. } => {}
                PAction::DisconnectPeer { .. } => {
                    // P gave D up: writes in flight fail, the link is re-established, and D
                    // sees its end of the connection drop.
                    self.cut_link(p);
                    self.at(now + self.cfg.net.latency, Ev::DLinkDown { p });
                }
            }
        }
        while let Some(rec) = self.ps[p].core.poll_timeline() {
            self.check.end(Role::P, rec.req);
            self.p_records.insert(rec.req, rec);
        }
        if let Some(t) = self.ps[p].core.poll_timeout() {
            if self.ps[p].wake_at.is_none_or(|w| t < w) {
                self.ps[p].wake_at = Some(t);
                let life = self.ps[p].life;
                self.at(t.max(now), Ev::PWake { p, life, at: t });
            }
        }
        if freed && !self.ps[p].busy && !self.ps[p].queue.is_empty() {
            self.p_try_step(p);
        }
    }

    pub(super) fn send_to_d(&mut self, p: usize, msg: &Message) {
        if self.rng_net.chance(self.cfg.net.loss) {
            return;
        }
        let Ok(bytes) = msg.encode() else {
            self.check.report(Violation::Host("encode failed".into()));
            return;
        };
        let jitter = self.rng_net.range(0, self.cfg.net.jitter);
        let at = (self.now + self.cfg.net.latency + jitter).max(self.ps[p].last_msg_to_d);
        self.ps[p].last_msg_to_d = at;
        let life = self.ps[p].life;
        self.at(at, Ev::MsgToD { p, life, bytes });
    }

    pub(super) fn start_transfer(
        &mut self,
        p: usize,
        req: u64,
        layer: u16,
        src: Arc<[BlockId]>,
        dst: Arc<[BlockId]>,
        landing: bool,
    ) {
        let now = self.now;
        let spec = &self.reqs[req as usize];
        let bytes =
            u64::from(spec.tokens) * self.cfg.kv_bytes_per_token / u64::from(self.cfg.layers);
        let life = self.ps[p].life;
        let epoch = self.ps[p].epoch;
        self.pending_transfers += 1;
        let f = &self.cfg.faults;
        let (err, hang) = (f.transfer_error, f.transfer_hang);
        let failed_at = if self.rng_fault.chance(err) || now < self.ps[p].link_down_until {
            Some(now + self.cfg.net.latency)
        } else if self.rng_fault.chance(hang) {
            Some(now + self.cfg.faults.transfer_deadline)
        } else {
            None
        };
        let settle = |ok| Ev::Settle {
            p,
            life,
            epoch,
            req,
            layer,
            bytes,
            ok,
        };
        if let Some(at) = failed_at {
            self.at(at, settle(false));
            return;
        }
        let start = now.max(self.ps[p].link_free);
        let dur = (u128::from(bytes) * 1_000_000_000 / u128::from(self.cfg.net.bandwidth.max(1)))
            as Nanos;
        let end = start + dur;
        self.ps[p].link_free = end;
        let land = end + self.cfg.net.latency;
        self.at(
            land,
            Ev::DataLand(Box::new(Landing {
                p,
                life,
                epoch,
                req,
                layer,
                bytes,
                src,
                dst,
                landing,
            })),
        );
        self.at(land + self.cfg.net.latency, settle(true));
    }

    /// The checker's pool index of D's landing pool (after D's and every P's).
    pub(super) fn land_pool_index(&self) -> usize {
        self.cfg.n_p + 1
    }

    pub(super) fn cut_link(&mut self, p: usize) {
        let e = &mut self.ps[p];
        e.epoch += 1;
        e.link_down_until = self.now + self.cfg.net.latency;
    }

    pub(super) fn on_landing(&mut self, l: Landing) {
        let e = &self.ps[l.p];
        if e.life != l.life || e.epoch != l.epoch {
            // The sender died or the connection was torn down: nothing lands.
            return;
        }
        let req = RequestId(l.req);
        // The NIC has read P's blocks and written D's: both must still be held for `req`.
        self.check
            .touch(l.p + 1, req, l.layer, self.cfg.layers, &l.src, false);
        let pool = if l.landing { self.land_pool_index() } else { 0 };
        self.check
            .touch(pool, req, l.layer, self.cfg.layers, &l.dst, true);
        let r = self.d.core.handle(
            DEvent::LayerLanded {
                req,
                layer: l.layer,
                bytes: l.bytes,
            },
            self.now,
        );
        self.host_result(r.map_err(|e| e.to_string()));
        self.drain_d();
    }

    pub(super) fn on_p_crash(&mut self, p: usize) {
        if !self.ps[p].up {
            return;
        }
        self.p_crashes += 1;
        let e = &mut self.ps[p];
        e.up = false;
        e.life += 1;
        e.busy = false;
        e.batch.clear();
        e.queue.clear();
        e.wake_at = None;
        // Its requests die with it: they will not end on P.
        let lost: Vec<u64> = e.blocks_of.keys().copied().collect();
        e.blocks_of.clear();
        for req in lost {
            self.check.forget(Role::P, RequestId(req));
        }
        self.check.reset_pool(p + 1);
        let old_life = self.ps[p].life - 1;
        if self.rng_fault.chance(self.cfg.faults.peer_down_notify) {
            self.at(
                self.now + self.cfg.net.latency,
                Ev::DPeerDown { p, life: old_life },
            );
        }
        self.at(
            self.now + self.cfg.faults.p_restart_after,
            Ev::PRestart { p },
        );
    }

    pub(super) fn on_p_restart(&mut self, p: usize) {
        let mut cfg = self.cfg.p_cfg.clone();
        let life = self.ps[p].life;
        cfg.incarnation = u64::from(life);
        add_p_stats(&mut self.p_stats, self.ps[p].core.stats());
        let e = &mut self.ps[p];
        e.core = PSide::new(cfg);
        e.pool = BlockPool::new(self.cfg.p_pool_blocks);
        e.up = true;
        e.epoch = 0;
        e.link_free = self.now;
        e.last_msg_to_d = self.now;
        let _ = e.core.handle(PEvent::PeerUp { peer: D_PEER }, self.now);
        self.drain_p(p);
        self.schedule_crash(p);
    }
}

//! The simulation's state, its event loop and the workload generator.

use std::collections::VecDeque;

use kvwire_connector::types::IdMap;
use kvwire_connector::{
    BlockId, DEvent, DSide, PEvent, PSide, PStats, PeerId, RequestId, TimelineRecord, MS, SEC,
};

use super::check::{Checker, Violation};
use super::config::{SimConfig, Workload, D_PEER};
use super::events::Ev;
use super::report::SimReport;
use crate::pool::BlockPool;
use crate::queue::EventQueue;
use crate::rng::Rng;
use kvwire_connector::Nanos;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DPhase {
    NotYet,
    Live,
    Reported,
    Promoted,
    Ended,
}

pub(super) struct ReqSpec {
    pub(super) tokens: u32,
    pub(super) uncached: u32,
    pub(super) blocks: u32,
    pub(super) p: usize,
    pub(super) decode_tokens: u32,
    pub(super) d_phase: DPhase,
    pub(super) d_blocks: Vec<BlockId>,
    /// Landing-pool slots held (`land`).
    pub(super) d_landing: Vec<BlockId>,
}

pub(super) struct PEngine {
    pub(super) core: PSide,
    pub(super) life: u32,
    pub(super) up: bool,
    pub(super) queue: VecDeque<u64>,
    pub(super) pool: BlockPool,
    pub(super) busy: bool,
    pub(super) batch: Vec<u64>,
    pub(super) link_free: Nanos,
    pub(super) last_msg_to_d: Nanos,
    pub(super) wake_at: Option<Nanos>,
    pub(super) epoch: u32,
    /// The data link is being re-established until then: transfers posted before fail.
    pub(super) link_down_until: Nanos,
    pub(super) blocks_of: IdMap<u64, Vec<BlockId>>,
}

pub(super) struct DEngine {
    pub(super) core: DSide,
    pub(super) pool: BlockPool,
    pub(super) land_pool: BlockPool,
    pub(super) reservable: VecDeque<RequestId>,
    pub(super) to_report: Vec<RequestId>,
    /// Reported requests and the steps they still wait before promotion.
    pub(super) to_promote: Vec<(RequestId, u8)>,
    pub(super) promoted_now: Vec<RequestId>,
    pub(super) running: Vec<(RequestId, u32)>,
    pub(super) stepping: bool,
    pub(super) wake_at: Option<Nanos>,
    pub(super) last_msg_to_p: Vec<Nanos>,
}

pub(super) struct Session {
    pub(super) ctx: u32,
}

pub(super) struct Sim {
    pub(super) cfg: SimConfig,
    /// Arrivals and prompt lengths (independent of the policy under test).
    pub(super) rng: Rng,
    /// Message jitter and loss.
    pub(super) rng_net: Rng,
    /// Injected failures.
    pub(super) rng_fault: Rng,
    pub(super) now: Nanos,
    pub(super) queue: EventQueue<Ev>,
    pub(super) reqs: Vec<ReqSpec>,
    pub(super) sessions: Vec<Session>,
    pub(super) ps: Vec<PEngine>,
    pub(super) d: DEngine,
    pub(super) check: Checker,
    pub(super) d_records: Vec<TimelineRecord>,
    pub(super) p_records: IdMap<RequestId, TimelineRecord>,
    pub(super) p_stats: PStats,
    pub(super) arrived: usize,
    pub(super) d_ended: usize,
    pub(super) events: u64,
    pub(super) d_steps: u64,
    pub(super) p_crashes: u64,
    pub(super) pending_transfers: usize,
    pub(super) bug_freed: IdMap<RequestId, ()>,
}

/// Runs one simulation to completion (every request ended, every pool drained, or
/// `max_sim_time` reached) and returns its report.
pub fn run(cfg: SimConfig) -> SimReport {
    let mut sim = Sim::new(cfg);
    sim.run();
    sim.report()
}

impl Sim {
    pub(super) fn new(mut cfg: SimConfig) -> Self {
        cfg.d_cfg.policy = cfg.policy;
        cfg.d_cfg.layers = cfg.layers;
        cfg.p_cfg.send_mode = cfg.send_mode;
        cfg.p_cfg.layers = cfg.layers;
        let mut rng = Rng::new(cfg.seed);
        let sessions = match &cfg.workload {
            Workload::Fixed { .. } => Vec::new(),
            Workload::Agentic {
                sessions,
                min_tokens,
                max_tokens,
                ..
            } => (0..*sessions)
                .map(|_| Session {
                    ctx: rng.range(u64::from(*min_tokens), u64::from(*max_tokens) / 4) as u32,
                })
                .collect(),
        };
        let mut pool_sizes = vec![cfg.d_pool_blocks];
        pool_sizes.extend(std::iter::repeat_n(cfg.p_pool_blocks, cfg.n_p));
        // The landing pool is the checker's last pool.
        pool_sizes.push(cfg.land_pool_blocks);
        let ps = (0..cfg.n_p)
            .map(|_| PEngine {
                core: PSide::new(cfg.p_cfg.clone()),
                life: 1,
                up: true,
                queue: VecDeque::new(),
                pool: BlockPool::new(cfg.p_pool_blocks),
                busy: false,
                batch: Vec::new(),
                link_free: 0,
                last_msg_to_d: 0,
                wake_at: None,
                epoch: 0,
                link_down_until: 0,
                blocks_of: IdMap::default(),
            })
            .collect();
        let d = DEngine {
            core: DSide::new(cfg.d_cfg.clone()),
            pool: BlockPool::new(cfg.d_pool_blocks),
            land_pool: BlockPool::new(cfg.land_pool_blocks),
            reservable: VecDeque::new(),
            to_report: Vec::new(),
            to_promote: Vec::new(),
            promoted_now: Vec::new(),
            running: Vec::new(),
            stepping: false,
            wake_at: None,
            last_msg_to_p: vec![0; cfg.n_p],
        };
        Sim {
            check: Checker::new(&pool_sizes),
            rng_net: Rng::new(cfg.seed ^ 0x6e65_7477_6f72_6b00),
            rng_fault: Rng::new(cfg.seed ^ 0x6661_756c_7473_0000),
            cfg,
            rng,
            now: 0,
            queue: EventQueue::new(),
            reqs: Vec::new(),
            sessions,
            ps,
            d,
            d_records: Vec::new(),
            p_records: IdMap::default(),
            p_stats: PStats::default(),
            arrived: 0,
            d_ended: 0,
            events: 0,
            d_steps: 0,
            p_crashes: 0,
            pending_transfers: 0,
            bug_freed: IdMap::default(),
        }
    }

    pub(super) fn at(&mut self, at: Nanos, ev: Ev) {
        self.queue.push(at, ev);
    }

    pub(super) fn run(&mut self) {
        // Connect everyone.
        for p in 0..self.cfg.n_p {
            let _ = self.d.core.handle(
                DEvent::PeerUp {
                    peer: PeerId(p as u32),
                },
                0,
            );
            let _ = self.ps[p].core.handle(PEvent::PeerUp { peer: D_PEER }, 0);
            self.drain_p(p);
            self.schedule_crash(p);
        }
        self.drain_d();
        self.at(0, Ev::Arrival);
        while let Some((at, ev)) = self.queue.pop() {
            self.now = at;
            self.events += 1;
            self.dispatch(ev);
            if self.cfg.strict {
                self.step_check();
                if !self.check.violations().is_empty() {
                    return;
                }
            }
            if self.drained() {
                break;
            }
            if self.now > self.cfg.max_sim_time {
                self.check.report(Violation::Host(
                    "run did not drain before max_sim_time".into(),
                ));
                return;
            }
        }
        // Decodes still running hold host-owned blocks; finish them before the leak check.
        self.check.drain_check();
    }

    /// O(1) per-event consistency: every pool's free list and the checker's count of held
    /// blocks add up to the pool size.
    pub(super) fn step_check(&mut self) {
        let d_ok = self.check.held(0) + self.d.pool.free() == self.cfg.d_pool_blocks as usize;
        if !d_ok {
            self.check.report(Violation::Host(format!(
                "t={} D pool: {} held + {} free != {}",
                self.now,
                self.check.held(0),
                self.d.pool.free(),
                self.cfg.d_pool_blocks
            )));
        }
        let land = self.land_pool_index();
        if self.check.held(land) + self.d.land_pool.free() != self.cfg.land_pool_blocks as usize {
            self.check.report(Violation::Host(format!(
                "t={} D landing pool count mismatch",
                self.now
            )));
        }
        for p in 0..self.ps.len() {
            if self.ps[p].up
                && self.check.held(p + 1) + self.ps[p].pool.free()
                    != self.cfg.p_pool_blocks as usize
            {
                self.check.report(Violation::Host(format!(
                    "t={} P{p} pool count mismatch",
                    self.now
                )));
            }
        }
    }

    pub(super) fn drained(&self) -> bool {
        self.arrived == self.cfg.requests
            && self.d_ended == self.cfg.requests
            && self.d.running.is_empty()
            && self.d.core.live_requests() == 0
            && self.pending_transfers == 0
            && self
                .ps
                .iter()
                .all(|p| !p.up || (p.core.live_requests() == 0 && p.queue.is_empty() && !p.busy))
    }

    // ----- workload -----

    pub(super) fn on_arrival(&mut self) {
        if self.reqs.len() >= self.cfg.requests {
            return;
        }
        let id = self.reqs.len() as u64;
        let (tokens, uncached) = match self.cfg.workload.clone() {
            Workload::Fixed { tokens } => (tokens, tokens),
            Workload::Agentic {
                min_tokens,
                max_tokens,
                step,
                reuse,
                ..
            } => {
                let i = self.rng.range(0, self.sessions.len() as u64 - 1) as usize;
                let add = self.rng.range(u64::from(step.0), u64::from(step.1)) as u32;
                let prev = self.sessions[i].ctx;
                let mut ctx = prev + add;
                let mut uncached = if self.rng.chance(reuse) { add } else { ctx };
                if ctx > max_tokens {
                    // Session over: a new one starts from scratch.
                    ctx = self
                        .rng
                        .range(u64::from(min_tokens), u64::from(min_tokens) * 8)
                        as u32;
                    uncached = ctx;
                }
                self.sessions[i].ctx = ctx;
                (ctx, uncached)
            }
        };
        let blocks = tokens.div_ceil(self.cfg.block_tokens);
        let live: Vec<usize> = (0..self.cfg.n_p).filter(|&p| self.ps[p].up).collect();
        let p = if live.is_empty() {
            0
        } else {
            live[self.rng.range(0, live.len() as u64 - 1) as usize]
        };
        let decode_tokens = self.rng.range(
            u64::from(self.cfg.decode_tokens.0),
            u64::from(self.cfg.decode_tokens.1),
        ) as u32;
        self.reqs.push(ReqSpec {
            tokens,
            uncached,
            blocks,
            p,
            decode_tokens,
            d_phase: DPhase::NotYet,
            d_blocks: Vec::new(),
            d_landing: Vec::new(),
        });
        // The proxy dispatches to P and D concurrently.
        let life = self.ps[p].life;
        let dp = self.rng.range(0, 2 * MS);
        let dd = self.rng.range(0, 2 * MS);
        self.at(self.now + dp, Ev::PRecv { p, life, req: id });
        self.at(self.now + dd, Ev::DRecv { req: id });
        if self.rng_fault.chance(self.cfg.faults.d_abort) {
            let after = self.rng_fault.range(0, 2 * SEC);
            self.at(self.now + dd + after, Ev::DAbort { req: id });
        }
        let gap = (self.rng.exp(1.0 / self.cfg.arrival_rate) * 1e9) as Nanos;
        self.at(self.now + gap.max(1), Ev::Arrival);
    }

    pub(super) fn schedule_crash(&mut self, p: usize) {
        let rate = self.cfg.faults.p_crash_per_s;
        if rate > 0.0 {
            let gap = (self.rng_fault.exp(1.0 / rate) * 1e9) as Nanos;
            self.at(self.now + gap.max(1), Ev::PCrash { p });
        }
    }
}

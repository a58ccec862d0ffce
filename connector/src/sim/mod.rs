//! A deterministic discrete-event simulator of P and D engines around the connector cores.
//!
//! P engines are step loops (batches of prefills under a token budget, layers becoming ready
//! through the step) with block pools; one D engine is a step loop that reserves when the core
//! allows, reports finished at the end of a step, promotes at the next, and decodes. Between
//! them a simulated network: control messages (encoded with the real codec, FIFO per link, with
//! delay, jitter and loss) and a data link per P with a bandwidth (per-layer transfer time) and
//! latency. Failures are injected: P crashes (and restarts with a new incarnation), D aborts,
//! transfer errors and hung transfers, lost messages, and the timeouts that follow.
//!
//! Every block operation and request end goes through a [`check::Checker`]; with
//! [`SimConfig::strict`] the run stops at the first violation. Same seed, same run.

pub mod check;
pub mod queue;
pub mod rng;

use crate::dside::{DAction, DConfig, DEvent, DSide, DStats};
use crate::msg::Message;
use crate::pside::{PAction, PConfig, PEvent, PSide, PStats};
use crate::timeline::{Outcome, TimelineRecord};
use crate::types::{BlockId, IdMap, Nanos, PeerId, Policy, RequestId, SendMode, MS, SEC};
use check::{Checker, Role, Violation};
use queue::EventQueue;
use rng::Rng;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// The D engine's peer id as P cores see it.
pub const D_PEER: PeerId = PeerId(0);

/// Prompt-length mix.
#[derive(Clone, Debug)]
pub enum Workload {
    /// Every prompt has `tokens` tokens and nothing is cached on P.
    Fixed {
        /// Prompt tokens.
        tokens: u32,
    },
    /// Agentic sessions: a context that grows turn by turn from `min_tokens` toward
    /// `max_tokens`; P has the previous turn cached with probability `reuse`, so it prefills
    /// only the new tokens, while the whole context is transferred.
    Agentic {
        /// Sessions active at once (each arrival picks one).
        sessions: usize,
        /// Shortest initial context.
        min_tokens: u32,
        /// Longest context.
        max_tokens: u32,
        /// Tokens added per turn (uniform in `[step.0, step.1]`).
        step: (u32, u32),
        /// Probability that P has the previous context cached.
        reuse: f64,
    },
}

/// Network model.
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// One-way latency of messages and data.
    pub latency: Nanos,
    /// Extra uniform jitter on messages (FIFO order is kept).
    pub jitter: Nanos,
    /// Data link bandwidth per P, bytes per second.
    pub bandwidth: u64,
    /// Probability a control message is lost.
    pub loss: f64,
}

/// Injected failures.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Crashes per P engine per simulated second.
    pub p_crash_per_s: f64,
    /// Downtime before a crashed P restarts.
    pub p_restart_after: Nanos,
    /// Probability the transport tells D at once that a crashed P is gone.
    pub peer_down_notify: f64,
    /// Fraction of requests the D host aborts at a random time after arrival.
    pub d_abort: f64,
    /// Probability a layer transfer fails.
    pub transfer_error: f64,
    /// Probability a layer transfer hangs until the engine's deadline.
    pub transfer_hang: f64,
    /// The transfer engine's per-transfer deadline (a hung transfer fails then).
    pub transfer_deadline: Nanos,
}

/// Everything a run depends on.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// PRNG seed.
    pub seed: u64,
    /// Requests to generate.
    pub requests: usize,
    /// D's reservation policy.
    pub policy: Policy,
    /// P's send mode.
    pub send_mode: SendMode,
    /// Prompt mix.
    pub workload: Workload,
    /// Poisson arrival rate, requests per second.
    pub arrival_rate: f64,
    /// Number of P engines.
    pub n_p: usize,
    /// Model layers.
    pub layers: u16,
    /// Tokens per block.
    pub block_tokens: u32,
    /// KV bytes per token over all layers.
    pub kv_bytes_per_token: u64,
    /// Blocks in each P pool.
    pub p_pool_blocks: u32,
    /// Blocks in the D pool.
    pub d_pool_blocks: u32,
    /// Slots in D's landing pool (policy `land`).
    pub land_pool_blocks: u32,
    /// Fixed cost of a P step.
    pub p_step_overhead: Nanos,
    /// P prefill cost per uncached token.
    pub p_ns_per_token: Nanos,
    /// Most uncached tokens per P step (a longer prompt runs alone).
    pub p_token_budget: u32,
    /// Fixed cost of a D step with requests running.
    pub d_step_base: Nanos,
    /// Extra D step cost per running request.
    pub d_step_per_running: Nanos,
    /// Idle D loop period (vLLM sleeps 1 ms between empty steps).
    pub d_idle_poll: Nanos,
    /// vLLM async scheduling: a request reported finished at the end of step N is promoted at
    /// step N+2 instead of N+1.
    pub d_async_scheduling: bool,
    /// Output tokens per request, uniform in the range.
    pub decode_tokens: (u32, u32),
    /// Network.
    pub net: NetConfig,
    /// Failures.
    pub faults: Faults,
    /// D core configuration (`policy` and `layers` are overwritten from this config).
    pub d_cfg: DConfig,
    /// P core configuration (`send_mode` and `layers` are overwritten).
    pub p_cfg: PConfig,
    /// Stop at the first invariant violation (checked after every event).
    pub strict: bool,
    /// Simulated time after which a run that has not drained stops with a violation.
    pub max_sim_time: Nanos,
    /// A deliberate host bug, to show that the invariant checks catch it.
    pub host_bug: Option<HostBug>,
    /// Print to stderr every event and action about this request (debugging aid).
    pub trace: Option<RequestId>,
}

/// Deliberately wrong host behaviour (for tests proving the checks can fail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostBug {
    /// D frees a failed request's blocks as soon as it sends P an `Abort`, without waiting for
    /// P's confirmation (what a connector with only a timeout would do). Writes still in flight
    /// then land in freed blocks.
    FreeOnAbortSent,
    /// D frees the blocks of `ReportFailed` although `ReleaseBlocks` already freed them.
    DoubleFreeOnFailure,
}

impl SimConfig {
    /// A mixed agentic workload with every kind of failure injected.
    pub fn faulty(seed: u64, policy: Policy, send_mode: SendMode, requests: usize) -> Self {
        let mut d_cfg = DConfig::new(policy, 8);
        d_cfg.transport = "sim".into();
        d_cfg.heartbeat_interval = 250 * MS;
        d_cfg.peer_timeout = 2 * SEC;
        d_cfg.wait_for_p_timeout = 20 * SEC;
        d_cfg.request_timeout = 40 * SEC;
        d_cfg.drain_timeout = 10 * SEC;
        d_cfg.orphan_timeout = 5 * SEC;
        d_cfg.tombstone_ttl = 60 * SEC;
        let mut p_cfg = PConfig::new(send_mode, 8);
        p_cfg.transport = "sim".into();
        p_cfg.heartbeat_interval = 250 * MS;
        p_cfg.peer_timeout = 2 * SEC;
        p_cfg.request_timeout = 40 * SEC;
        p_cfg.block_ids_timeout = 10 * SEC;
        p_cfg.transfer_timeout = 3 * SEC;
        p_cfg.drain_timeout = 10 * SEC;
        p_cfg.orphan_timeout = 20 * SEC;
        SimConfig {
            seed,
            requests,
            policy,
            send_mode,
            workload: Workload::Agentic {
                sessions: 64,
                min_tokens: 1_000,
                max_tokens: 50_000,
                step: (500, 4_000),
                reuse: 0.9,
            },
            arrival_rate: 12.0,
            n_p: 2,
            layers: 8,
            block_tokens: 128,
            kv_bytes_per_token: 96 * 1024,
            p_pool_blocks: 4_096,
            d_pool_blocks: 8_192,
            land_pool_blocks: 4_096,
            p_step_overhead: 5 * MS,
            p_ns_per_token: 20_000,
            p_token_budget: 16_384,
            d_step_base: 10 * MS,
            d_step_per_running: 50_000,
            d_idle_poll: MS,
            d_async_scheduling: true,
            decode_tokens: (8, 32),
            net: NetConfig {
                latency: 50_000,
                jitter: 20_000,
                bandwidth: 25_000_000_000,
                loss: 0.0005,
            },
            faults: Faults {
                p_crash_per_s: 1.0 / 200.0,
                p_restart_after: 2 * SEC,
                peer_down_notify: 0.5,
                d_abort: 0.02,
                transfer_error: 0.003,
                transfer_hang: 0.001,
                transfer_deadline: 2 * SEC,
            },
            d_cfg,
            p_cfg,
            strict: true,
            max_sim_time: 100_000 * SEC,
            host_bug: None,
            trace: None,
        }
    }

    /// No failures, fixed 8k-token prompts, one P loaded to about 95%: P queues, which is
    /// where the reservation policies differ.
    pub fn queueing(seed: u64, policy: Policy, send_mode: SendMode, requests: usize) -> Self {
        let mut c = Self::faulty(seed, policy, send_mode, requests);
        c.faults = Faults {
            transfer_deadline: 2 * SEC,
            ..Faults::default()
        };
        c.net.loss = 0.0;
        c.n_p = 1;
        c.workload = Workload::Fixed { tokens: 8_192 };
        // One prefill of 8k tokens: 5 ms + 8192 × 20 µs ≈ 169 ms → capacity ≈ 5.9 req/s.
        c.p_token_budget = 8_192;
        c.arrival_rate = 5.6;
        c.d_pool_blocks = 32_768;
        c.p_pool_blocks = 32_768;
        c.d_cfg.wait_for_p_timeout = 600 * SEC;
        c.d_cfg.request_timeout = 600 * SEC;
        c.p_cfg.request_timeout = 600 * SEC;
        c.p_cfg.orphan_timeout = 600 * SEC;
        c
    }
}

/// Aggregates of a run.
#[derive(Clone, Debug, Default)]
pub struct SimReport {
    /// Merged timeline records (D's, with P's timestamps), sorted by request id.
    pub records: Vec<TimelineRecord>,
    /// FNV-1a hash of the records' JSON lines.
    pub timeline_hash: u64,
    /// Requests that reached their first token.
    pub finished: usize,
    /// Requests that failed on D.
    pub failed: usize,
    /// Failures by reason (merged records: the root cause where P failed first).
    pub fail_reasons: BTreeMap<String, usize>,
    /// Failures on P by reason (from P's own records).
    pub p_fail_reasons: BTreeMap<String, usize>,
    /// Invariant violations (empty on a correct run).
    pub violations: Vec<Violation>,
    /// Sum over requests of D blocks × seconds reserved before promotion or release.
    pub d_block_seconds_waiting: f64,
    /// Events processed.
    pub events: u64,
    /// D steps run.
    pub d_steps: u64,
    /// Simulated time at the end.
    pub sim_end: Nanos,
    /// P crashes injected.
    pub p_crashes: u64,
    /// D core counters at the end.
    pub d_stats: DStats,
    /// P core counters summed over engines and lives.
    pub p_stats: PStats,
    /// `land` requests that took landing slots.
    pub d_landings: u64,
    /// `land` requests that fell back to `lazy` (landing pool full).
    pub d_land_fallbacks: u64,
}

impl SimReport {
    /// Timeline as JSON lines.
    pub fn json_lines(&self) -> String {
        let mut s = String::new();
        for r in &self.records {
            s.push_str(&r.to_json_line());
            s.push('\n');
        }
        s
    }

    /// Mean of a decomposition segment over finished requests, in milliseconds.
    pub fn mean_ms(&self, f: impl Fn(&crate::timeline::Decomposition) -> Nanos) -> f64 {
        let v: Vec<f64> = self
            .records
            .iter()
            .filter_map(|r| r.decompose())
            .map(|d| f(&d) as f64 / 1e6)
            .collect();
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    }

    /// Quantile `q` of `decode_sent → first_token` over finished requests, in milliseconds.
    pub fn ttft_quantile_ms(&self, q: f64) -> f64 {
        let mut v: Vec<Nanos> = self
            .records
            .iter()
            .filter_map(|r| r.decompose())
            .map(|d| d.total())
            .collect();
        if v.is_empty() {
            return 0.0;
        }
        v.sort_unstable();
        let i = ((v.len() - 1) as f64 * q).round() as usize;
        v[i.min(v.len() - 1)] as f64 / 1e6
    }
}

// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
enum Ev {
    Arrival,
    PRecv {
        p: usize,
        life: u32,
        req: u64,
    },
    DRecv {
        req: u64,
    },
    PStepEnd {
        p: usize,
        life: u32,
    },
    PLayerReady {
        p: usize,
        life: u32,
        req: u64,
        layer: u16,
    },
    DStep,
    DStepEnd,
    MsgToD {
        p: usize,
        life: u32,
        bytes: Vec<u8>,
    },
    MsgToP {
        p: usize,
        life: u32,
        bytes: Vec<u8>,
    },
    DataLand(Box<Landing>),
    Settle {
        p: usize,
        life: u32,
        epoch: u32,
        req: u64,
        layer: u16,
        bytes: u64,
        ok: bool,
    },
    DWake {
        at: Nanos,
    },
    PWake {
        p: usize,
        life: u32,
        at: Nanos,
    },
    PCrash {
        p: usize,
    },
    PRestart {
        p: usize,
    },
    DPeerDown {
        p: usize,
        life: u32,
    },
    /// The connection P→D was torn down by one end; the other end notices.
    DLinkDown {
        p: usize,
    },
    PLinkDown {
        p: usize,
        life: u32,
    },
    DAbort {
        req: u64,
    },
}

#[derive(Debug)]
struct Landing {
    p: usize,
    life: u32,
    epoch: u32,
    req: u64,
    layer: u16,
    bytes: u64,
    src: Arc<[BlockId]>,
    dst: Arc<[BlockId]>,
    /// `dst` are landing-pool slots.
    landing: bool,
}

struct Pool {
    free: Vec<BlockId>,
}
impl Pool {
    fn new(size: u32) -> Self {
        Pool {
            free: (0..size).rev().collect(),
        }
    }
    fn alloc(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if self.free.len() < n {
            return None;
        }
        let at = self.free.len() - n;
        Some(self.free.split_off(at))
    }
    fn release(&mut self, blocks: &[BlockId]) {
        self.free.extend_from_slice(blocks);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DPhase {
    NotYet,
    Live,
    Reported,
    Promoted,
    Ended,
}

struct ReqSpec {
    tokens: u32,
    uncached: u32,
    blocks: u32,
    p: usize,
    decode_tokens: u32,
    d_phase: DPhase,
    d_blocks: Vec<BlockId>,
    /// Landing-pool slots held (`land`).
    d_landing: Vec<BlockId>,
}

struct PEngine {
    core: PSide,
    life: u32,
    up: bool,
    queue: VecDeque<u64>,
    pool: Pool,
    busy: bool,
    batch: Vec<u64>,
    link_free: Nanos,
    last_msg_to_d: Nanos,
    wake_at: Option<Nanos>,
    epoch: u32,
    /// The data link is being re-established until then: transfers posted before fail.
    link_down_until: Nanos,
    blocks_of: IdMap<u64, Vec<BlockId>>,
}

struct DEngine {
    core: DSide,
    pool: Pool,
    land_pool: Pool,
    reservable: VecDeque<RequestId>,
    to_report: Vec<RequestId>,
    /// Reported requests and the steps they still wait before promotion.
    to_promote: Vec<(RequestId, u8)>,
    promoted_now: Vec<RequestId>,
    running: Vec<(RequestId, u32)>,
    stepping: bool,
    wake_at: Option<Nanos>,
    last_msg_to_p: Vec<Nanos>,
}

struct Session {
    ctx: u32,
}

struct Sim {
    cfg: SimConfig,
    /// Arrivals and prompt lengths (independent of the policy under test).
    rng: Rng,
    /// Message jitter and loss.
    rng_net: Rng,
    /// Injected failures.
    rng_fault: Rng,
    now: Nanos,
    queue: EventQueue<Ev>,
    reqs: Vec<ReqSpec>,
    sessions: Vec<Session>,
    ps: Vec<PEngine>,
    d: DEngine,
    check: Checker,
    d_records: Vec<TimelineRecord>,
    p_records: IdMap<RequestId, TimelineRecord>,
    p_stats: PStats,
    arrived: usize,
    d_ended: usize,
    events: u64,
    d_steps: u64,
    p_crashes: u64,
    pending_transfers: usize,
    bug_freed: IdMap<RequestId, ()>,
}

/// Runs one simulation to completion (every request ended, every pool drained, or
/// `max_sim_time` reached) and returns its report.
pub fn run(cfg: SimConfig) -> SimReport {
    let mut sim = Sim::new(cfg);
    sim.run();
    sim.report()
}

fn fnv1a(data: &[u8], mut h: u64) -> u64 {
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl Sim {
    fn new(mut cfg: SimConfig) -> Self {
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
                pool: Pool::new(cfg.p_pool_blocks),
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
            pool: Pool::new(cfg.d_pool_blocks),
            land_pool: Pool::new(cfg.land_pool_blocks),
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

    fn at(&mut self, at: Nanos, ev: Ev) {
        self.queue.push(at, ev);
    }

    fn run(&mut self) {
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
    fn step_check(&mut self) {
        let d_ok = self.check.held(0) + self.d.pool.free.len() == self.cfg.d_pool_blocks as usize;
        if !d_ok {
            self.check.report(Violation::Host(format!(
                "t={} D pool: {} held + {} free != {}",
                self.now,
                self.check.held(0),
                self.d.pool.free.len(),
                self.cfg.d_pool_blocks
            )));
        }
        let land = self.land_pool_index();
        if self.check.held(land) + self.d.land_pool.free.len() != self.cfg.land_pool_blocks as usize
        {
            self.check.report(Violation::Host(format!(
                "t={} D landing pool count mismatch",
                self.now
            )));
        }
        for p in 0..self.ps.len() {
            if self.ps[p].up
                && self.check.held(p + 1) + self.ps[p].pool.free.len()
                    != self.cfg.p_pool_blocks as usize
            {
                self.check.report(Violation::Host(format!(
                    "t={} P{p} pool count mismatch",
                    self.now
                )));
            }
        }
    }

    fn drained(&self) -> bool {
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

    fn traced(&self, req: u64) -> bool {
        self.cfg.trace == Some(RequestId(req))
    }

    fn dispatch(&mut self, ev: Ev) {
        if let Some(t) = self.cfg.trace {
            let about = match &ev {
                Ev::PRecv { req, .. }
                | Ev::DRecv { req }
                | Ev::PLayerReady { req, .. }
                | Ev::Settle { req, .. }
                | Ev::DAbort { req } => *req == t.0,
                Ev::DataLand(l) => l.req == t.0,
                Ev::MsgToD { bytes, .. } | Ev::MsgToP { bytes, .. } => {
                    Message::decode(bytes).ok().and_then(|m| m.request()) == Some(t)
                }
                Ev::PCrash { .. } | Ev::PRestart { .. } | Ev::DPeerDown { .. } => true,
                _ => false,
            };
            if about {
                match &ev {
                    Ev::MsgToD { p, life, bytes } => eprintln!(
                        "t={} MsgToD p{p} life{life} {:?}",
                        self.now,
                        Message::decode(bytes)
                    ),
                    Ev::MsgToP { p, life, bytes } => eprintln!(
                        "t={} MsgToP p{p} life{life} {:?}",
                        self.now,
                        Message::decode(bytes)
                    ),
                    Ev::DataLand(l) => eprintln!(
                        "t={} DataLand p{} life{} epoch{} layer{}",
                        self.now, l.p, l.life, l.epoch, l.layer
                    ),
                    other => eprintln!("t={} {other:?}", self.now),
                }
            }
        }
        match ev {
            Ev::Arrival => self.on_arrival(),
            Ev::PRecv { p, life, req } => {
                let e = &mut self.ps[p];
                if e.up && e.life == life {
                    e.queue.push_back(req);
                    self.p_try_step(p);
                }
            }
            Ev::DRecv { req } => self.on_d_recv(req),
            Ev::PStepEnd { p, life } => {
                if self.ps[p].life == life {
                    self.on_p_step_end(p);
                }
            }
            Ev::PLayerReady {
                p,
                life,
                req,
                layer,
            } => {
                if self.ps[p].life == life {
                    let r = self.ps[p].core.handle(
                        PEvent::LayerReady {
                            req: RequestId(req),
                            layer,
                        },
                        self.now,
                    );
                    self.host_result(r.map_err(|e| e.to_string()));
                    self.drain_p(p);
                }
            }
            Ev::DStep => self.on_d_step(),
            Ev::DStepEnd => self.on_d_step_end(),
            Ev::MsgToD { p, life, bytes } => {
                if self.ps[p].life == life {
                    let r = self.d.core.handle_bytes(PeerId(p as u32), &bytes, self.now);
                    self.host_result(r.map_err(|e| e.to_string()));
                    self.drain_d();
                }
            }
            Ev::MsgToP { p, life, bytes } => {
                if self.ps[p].up && self.ps[p].life == life {
                    let r = self.ps[p].core.handle_bytes(D_PEER, &bytes, self.now);
                    self.host_result(r.map_err(|e| e.to_string()));
                    self.drain_p(p);
                }
            }
            Ev::DataLand(l) => self.on_landing(*l),
            Ev::Settle {
                p,
                life,
                epoch,
                req,
                layer,
                bytes,
                ok,
            } => {
                self.pending_transfers -= 1;
                if self.ps[p].life == life {
                    let ev = if ok && self.ps[p].epoch == epoch {
                        PEvent::TransferDone {
                            req: RequestId(req),
                            layer,
                            bytes,
                        }
                    } else {
                        PEvent::TransferFailed {
                            req: RequestId(req),
                            layer,
                        }
                    };
                    let r = self.ps[p].core.handle(ev, self.now);
                    self.host_result(r.map_err(|e| e.to_string()));
                    self.drain_p(p);
                }
            }
            Ev::DWake { at } => {
                if self.d.wake_at == Some(at) {
                    self.d.wake_at = None;
                    self.d.core.handle_timeout(self.now);
                    self.drain_d();
                }
            }
            Ev::PWake { p, life, at } => {
                if self.ps[p].life == life && self.ps[p].wake_at == Some(at) {
                    self.ps[p].wake_at = None;
                    self.ps[p].core.handle_timeout(self.now);
                    self.drain_p(p);
                }
            }
            Ev::PCrash { p } => self.on_p_crash(p),
            Ev::PRestart { p } => self.on_p_restart(p),
            Ev::DPeerDown { p, life } => {
                // The transport noticed the crash of that life (not of a later one).
                if self.ps[p].life == life + 1 || !self.ps[p].up {
                    let _ = self.d.core.handle(
                        DEvent::PeerDown {
                            peer: PeerId(p as u32),
                        },
                        self.now,
                    );
                    self.drain_d();
                }
            }
            Ev::DLinkDown { p } => {
                let _ = self.d.core.handle(
                    DEvent::PeerDown {
                        peer: PeerId(p as u32),
                    },
                    self.now,
                );
                self.drain_d();
            }
            Ev::PLinkDown { p, life } => {
                if self.ps[p].up && self.ps[p].life == life {
                    let _ = self.ps[p]
                        .core
                        .handle(PEvent::PeerDown { peer: D_PEER }, self.now);
                    self.drain_p(p);
                }
            }
            Ev::DAbort { req } => {
                let phase = self.reqs[req as usize].d_phase;
                if phase == DPhase::Live {
                    let r = self.d.core.handle(
                        DEvent::Abort {
                            req: RequestId(req),
                        },
                        self.now,
                    );
                    self.host_result(r.map_err(|e| e.to_string()));
                    self.drain_d();
                }
            }
        }
    }

    fn host_result(&mut self, r: Result<(), String>) {
        if let Err(e) = r {
            self.check
                .report(Violation::Host(format!("t={} {e}", self.now)));
        }
    }

    fn host_result_at(&mut self, what: &str, r: Result<(), String>) {
        if let Err(e) = r {
            self.check
                .report(Violation::Host(format!("t={} {what}: {e}", self.now)));
        }
    }

    // ----- workload -----

    fn on_arrival(&mut self) {
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

    fn schedule_crash(&mut self, p: usize) {
        let rate = self.cfg.faults.p_crash_per_s;
        if rate > 0.0 {
            let gap = (self.rng_fault.exp(1.0 / rate) * 1e9) as Nanos;
            self.at(self.now + gap.max(1), Ev::PCrash { p });
        }
    }

    // ----- P engine -----

    fn p_try_step(&mut self, p: usize) {
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

    fn on_p_step_end(&mut self, p: usize) {
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

    fn drain_p(&mut self, p: usize) {
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

    fn send_to_d(&mut self, p: usize, msg: &Message) {
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

    fn start_transfer(
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
        if self.rng_fault.chance(err) || now < self.ps[p].link_down_until {
            let at = now + self.cfg.net.latency;
            self.at(
                at,
                Ev::Settle {
                    p,
                    life,
                    epoch,
                    req,
                    layer,
                    bytes,
                    ok: false,
                },
            );
            return;
        }
        if self.rng_fault.chance(hang) {
            let at = now + self.cfg.faults.transfer_deadline;
            self.at(
                at,
                Ev::Settle {
                    p,
                    life,
                    epoch,
                    req,
                    layer,
                    bytes,
                    ok: false,
                },
            );
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
        self.at(
            land + self.cfg.net.latency,
            Ev::Settle {
                p,
                life,
                epoch,
                req,
                layer,
                bytes,
                ok: true,
            },
        );
    }

    /// The checker's pool index of D's landing pool (after D's and every P's).
    fn land_pool_index(&self) -> usize {
        self.cfg.n_p + 1
    }

    fn cut_link(&mut self, p: usize) {
        let e = &mut self.ps[p];
        e.epoch += 1;
        e.link_down_until = self.now + self.cfg.net.latency;
    }

    fn on_landing(&mut self, l: Landing) {
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

    fn on_p_crash(&mut self, p: usize) {
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

    fn on_p_restart(&mut self, p: usize) {
        let mut cfg = self.cfg.p_cfg.clone();
        let life = self.ps[p].life;
        cfg.incarnation = u64::from(life);
        add_p_stats(&mut self.p_stats, self.ps[p].core.stats());
        let e = &mut self.ps[p];
        e.core = PSide::new(cfg);
        e.pool = Pool::new(self.cfg.p_pool_blocks);
        e.up = true;
        e.epoch = 0;
        e.link_free = self.now;
        e.last_msg_to_d = self.now;
        let _ = e.core.handle(PEvent::PeerUp { peer: D_PEER }, self.now);
        self.drain_p(p);
        self.schedule_crash(p);
    }

    // ----- D engine -----

    fn on_d_recv(&mut self, req: u64) {
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

    fn kick_d(&mut self) {
        if !self.d.stepping {
            self.d.stepping = true;
            // An idle engine notices new work at its next idle-loop tick.
            let grid = self.cfg.d_idle_poll.max(1);
            let at = (self.now / grid + 1) * grid;
            self.at(at, Ev::DStep);
        }
    }

    fn on_d_step(&mut self) {
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

    fn on_d_step_end(&mut self) {
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
            .is_some_and(|r| self.reqs[r.0 as usize].blocks as usize <= self.d.pool.free.len());
        if !self.d.running.is_empty() || !self.d.to_promote.is_empty() || head_fits {
            self.at(now, Ev::DStep);
        } else {
            self.d.stepping = false;
        }
    }

    fn drain_d(&mut self) {
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
                DAction::DisconnectPeer { peer } => {
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

    fn send_to_p(&mut self, p: usize, msg: &Message) {
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

    // ----- report -----

    fn report(mut self) -> SimReport {
        for e in &self.ps {
            add_p_stats(&mut self.p_stats, e.core.stats());
        }
        let mut records: Vec<TimelineRecord> = self
            .d_records
            .iter()
            .map(|d| match self.p_records.get(&d.req) {
                Some(p) => TimelineRecord::merge(d, p),
                None => d.clone(),
            })
            .collect();
        records.sort_by_key(|r| r.req);
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut finished = 0;
        let mut failed = 0;
        let mut reasons = BTreeMap::new();
        let mut block_ns = 0u128;
        for r in &records {
            h = fnv1a(r.to_json_line().as_bytes(), h);
            h = fnv1a(b"\n", h);
            block_ns += r.d_block_ns_waiting();
            match r.outcome {
                Outcome::Finished => finished += 1,
                Outcome::Failed => {
                    failed += 1;
                    let k = r
                        .fail_reason
                        .map_or("unknown".to_string(), |f| format!("{f:?}"));
                    *reasons.entry(k).or_insert(0) += 1;
                }
            }
        }
        let mut p_reasons = BTreeMap::new();
        let mut p_recs: Vec<&TimelineRecord> = self.p_records.values().collect();
        p_recs.sort_by_key(|r| r.req);
        for r in p_recs {
            if r.outcome == Outcome::Failed {
                let k = r
                    .fail_reason
                    .map_or("unknown".to_string(), |f| format!("{f:?}"));
                *p_reasons.entry(k).or_insert(0) += 1;
            }
        }
        SimReport {
            p_fail_reasons: p_reasons,
            records,
            timeline_hash: h,
            finished,
            failed,
            fail_reasons: reasons,
            violations: self.check.violations().to_vec(),
            d_block_seconds_waiting: block_ns as f64 / 1e9,
            events: self.events,
            d_steps: self.d_steps,
            sim_end: self.now,
            p_crashes: self.p_crashes,
            d_stats: self.d.core.stats().clone(),
            p_stats: self.p_stats,
            d_landings: self.d.core.metrics().landings,
            d_land_fallbacks: self.d.core.metrics().land_fallbacks,
        }
    }
}

fn add_p_stats(a: &mut PStats, b: &PStats) {
    a.late += b.late;
    a.duplicate_messages += b.duplicate_messages;
    a.unexpected_messages += b.unexpected_messages;
    a.early_overflow += b.early_overflow;
    a.orphans += b.orphans;
    a.finished += b.finished;
    a.failed += b.failed;
    a.drain_timeouts += b.drain_timeouts;
}

//! One cell of the matrix: P and D step loops on a virtual clock around the connector cores,
//! with every layer moved through the real [`DataPath`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_connector::{
    DAction, DConfig, DEvent, DSide, Message, Nanos, PAction, PConfig, PEvent, PSide, PeerId,
    Policy, RequestId, SendMode, TimelineRecord, SEC,
};
use kvwire_testkit::queue::EventQueue;

use super::datapath::DataPath;
use super::workload::RequestSpec;
use super::{ClockConfig, ClockError, LinkSpeed, Scenario};

const D_PEER: PeerId = PeerId(0);
const P_PEER: PeerId = PeerId(1);

/// What one cell produced.
#[derive(Clone, Debug)]
pub struct CellRun {
    /// D's reservation policy.
    pub policy: Policy,
    /// P's send mode.
    pub send_mode: SendMode,
    /// Merged (D + P) timeline records, by request id.
    pub records: Vec<TimelineRecord>,
    /// Per request (same order as `records`): D's waiting and running counts at arrival.
    pub load_at_arrival: Vec<(u32, u32)>,
    /// Per request (same order as `records`): what a router knows of the source (P) at
    /// `decode_sent`.
    pub src_at_arrival: Vec<SrcLoad>,
    /// Blocks held by kv_both on P (prefill done → blocks released after the send) and on D
    /// (reserved → promoted), over the cell's virtual time.
    pub pool: PoolHeld,
    /// Requests whose every layer was checked on D against the pattern.
    pub verified_requests: usize,
    /// Layers whose bytes on D did not match.
    pub corrupt_layers: usize,
    /// Bytes checked on D.
    pub bytes_verified: u64,
    /// Layer batches posted.
    pub batches: usize,
    /// Writes after coalescing, summed over requests.
    pub writes: u64,
    /// Ops submitted (one per block per layer).
    pub ops: u64,
    /// Wall time spent in transfers (post → D's notification), summed.
    pub transfer_wall: Duration,
    /// Wire bytes moved.
    pub wire_bytes: u64,
    /// Measured wall time of every layer batch, µs (post → D's notification).
    pub layer_wall_us: Vec<f64>,
    /// D steps run.
    pub d_steps: u64,
    /// D steps in which a request allowed to reserve could not for lack of free blocks.
    pub admission_stalls: u64,
    /// Virtual time at the end.
    pub virtual_end: Nanos,
    /// Wall time of the cell.
    pub wall: Duration,
}

/// What a router knows of the prefill (source) engine when it sends a request to D: the
/// requests queued on P ahead of this one and the step P is running, and the request's own
/// prefill work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SrcLoad {
    /// Requests queued on P, not yet scheduled, ahead of this one.
    pub waiting: u32,
    /// Their uncached (to be prefilled) tokens.
    pub queued_tokens: u64,
    /// Requests in the step P is running (other than this one).
    pub running: u32,
    /// Uncached tokens of that step not computed yet, as P's layer-ready events tell:
    /// `tokens × (layers − layers ready) / layers`.
    pub running_tokens: u64,
    /// Modelled KV bytes P will send before this request's: what is not yet landed of the
    /// requests whose prefill is done, plus all of those in the running step and queued ahead.
    pub pending_bytes: u64,
    /// This request's tokens P must still prefill (0 when its prefill is done: migration).
    pub prefill_tokens: u32,
    /// This request's tokens P has cached.
    pub cached_tokens: u32,
}

/// A time-weighted record of how many blocks of one pool are held: a step function of virtual
/// time from 0 to the end of the cell.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HeldBlocks {
    /// Blocks in the pool.
    pub capacity: u32,
    level: u64,
    since: Nanos,
    /// Nanoseconds spent at each level (level → duration).
    time_at: std::collections::BTreeMap<u64, u128>,
}

impl HeldBlocks {
    /// An empty record for a pool of `capacity` blocks.
    pub fn new(capacity: u32) -> Self {
        HeldBlocks {
            capacity,
            ..Default::default()
        }
    }

    fn settle(&mut self, now: Nanos) {
        let dt = now.saturating_sub(self.since);
        if dt > 0 {
            *self.time_at.entry(self.level).or_default() += u128::from(dt);
        }
        self.since = self.since.max(now);
    }

    /// `blocks` more held from `now` on.
    pub fn hold(&mut self, now: Nanos, blocks: u64) {
        self.settle(now);
        self.level += blocks;
    }

    /// `blocks` fewer held from `now` on.
    pub fn release(&mut self, now: Nanos, blocks: u64) {
        self.settle(now);
        self.level = self.level.saturating_sub(blocks);
    }

    /// Closes the record at `end` (the end of the cell).
    pub fn close(&mut self, end: Nanos) {
        self.settle(end);
    }

    /// Time-weighted mean of the blocks held over `[0, end]` (0 for an empty interval).
    pub fn mean(&self) -> f64 {
        let total: u128 = self.time_at.values().sum();
        if total == 0 {
            return 0.0;
        }
        let area: u128 = self.time_at.iter().map(|(&l, &t)| u128::from(l) * t).sum();
        area as f64 / total as f64
    }

    /// Time-weighted `q` quantile (0..=1): the fewest blocks that were held no more than that
    /// for at least a `q` fraction of the time.
    pub fn quantile(&self, q: f64) -> u64 {
        let total: u128 = self.time_at.values().sum();
        if total == 0 {
            return 0;
        }
        let mut acc = 0u128;
        for (&l, &t) in &self.time_at {
            acc += t;
            if acc as f64 >= q * total as f64 {
                return l;
            }
        }
        self.time_at.keys().next_back().copied().unwrap_or(0)
    }
}

/// Blocks held by kv_both in each pool of a cell.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolHeld {
    /// P: blocks of requests whose prefill is done and whose KV is not yet sent (a prefill
    /// engine without a connector would free them at the end of prefill).
    pub p: HeldBlocks,
    /// D: blocks reserved for requests not yet running (a decode engine without a connector
    /// allocates them when the request starts running).
    pub d: HeldBlocks,
}

enum Ev {
    PRecv(u64),
    DRecv(u64),
    PStepEnd,
    PLayerReady(u64, u16),
    DStep,
    DStepEnd,
    MsgToD(Vec<u8>),
    MsgToP(Vec<u8>),
    Land(u64, u16, u64),
    Settle(u64, u16, u64),
    DWake(Nanos),
    PWake(Nanos),
}

/// A block pool: a free list; allocation takes the tail (runs of adjacent ids come out
/// together, as in a fresh vLLM pool).
struct Pool {
    free: Vec<u32>,
}
impl Pool {
    fn new(n: u32) -> Pool {
        Pool {
            free: (0..n).rev().collect(),
        }
    }
    fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let at = self.free.len() - n;
        let mut v = self.free.split_off(at);
        v.reverse();
        Some(v)
    }
    fn release(&mut self, b: &[u32]) {
        self.free.extend(b.iter().rev());
    }
}

#[derive(Default)]
struct ReqState {
    p_blocks: Vec<u32>,
    d_blocks: Vec<u32>,
    crcs: Vec<u32>,
    layers_ok: u16,
    layers_landed: u16,
    load: (u32, u32),
    src: SrcLoad,
    d_live: bool,
    p_held: bool,
    d_held: bool,
}

struct Cell<'a> {
    cfg: &'a ClockConfig,
    specs: &'a [RequestSpec],
    dp: &'a mut DataPath,
    fixed: Duration,
    now: Nanos,
    queue: EventQueue<Ev>,
    st: Vec<ReqState>,
    // P engine
    p: PSide,
    p_pool: Pool,
    p_queue: VecDeque<u64>,
    p_busy: bool,
    p_batch: Vec<u64>,
    p_step: (Nanos, Nanos),
    p_wake: Option<Nanos>,
    link_free: Nanos,
    last_to_d: Nanos,
    // D engine
    d: DSide,
    d_pool: Pool,
    reservable: VecDeque<RequestId>,
    to_report: Vec<RequestId>,
    to_promote: Vec<(RequestId, u8)>,
    promoted_now: Vec<RequestId>,
    running: Vec<(RequestId, u32)>,
    d_waiting: u32,
    d_stepping: bool,
    d_wake: Option<Nanos>,
    last_to_p: Nanos,
    // results
    d_records: Vec<TimelineRecord>,
    p_records: Vec<Option<TimelineRecord>>,
    out: CellRun,
    landings: u64,
}

/// Runs one cell: every request of `specs` through P, D and the data path under `policy` ×
/// `send_mode`. `fixed` is the engine's fixed cost of a batch (not stretched by the transfer
/// scale, see [`DataPath::probe_fixed_cost`]).
pub fn run_cell(
    cfg: &ClockConfig,
    specs: &[RequestSpec],
    dp: &mut DataPath,
    fixed: Duration,
    policy: Policy,
    send_mode: SendMode,
) -> Result<CellRun, ClockError> {
    let long = 3_600 * SEC;
    let mut dc = DConfig::new(policy, cfg.layers);
    dc.transport = dp.transport().to_string();
    dc.wait_for_p_timeout = long;
    dc.request_timeout = long;
    dc.orphan_timeout = long;
    dc.tombstone_ttl = long;
    let mut pc = PConfig::new(send_mode, cfg.layers);
    pc.transport = dp.transport().to_string();
    pc.request_timeout = long;
    pc.block_ids_timeout = long;
    pc.transfer_timeout = long;
    pc.orphan_timeout = long;
    pc.tombstone_ttl = long;
    let n = specs.len();
    let mut c = Cell {
        cfg,
        specs,
        dp,
        fixed,
        now: 0,
        queue: EventQueue::new(),
        st: (0..n).map(|_| ReqState::default()).collect(),
        p: PSide::new(pc),
        p_pool: Pool::new(cfg.p_pool_blocks),
        p_queue: VecDeque::new(),
        p_busy: false,
        p_batch: Vec::new(),
        p_step: (0, 1),
        p_wake: None,
        link_free: 0,
        last_to_d: 0,
        d: DSide::new(dc),
        d_pool: Pool::new(cfg.d_pool_blocks),
        reservable: VecDeque::new(),
        to_report: Vec::new(),
        to_promote: Vec::new(),
        promoted_now: Vec::new(),
        running: Vec::new(),
        d_waiting: 0,
        d_stepping: false,
        d_wake: None,
        last_to_p: 0,
        d_records: Vec::new(),
        p_records: vec![None; n],
        out: CellRun {
            policy,
            send_mode,
            records: Vec::new(),
            load_at_arrival: Vec::new(),
            src_at_arrival: Vec::new(),
            pool: PoolHeld {
                p: HeldBlocks::new(cfg.p_pool_blocks),
                d: HeldBlocks::new(cfg.d_pool_blocks),
            },
            verified_requests: 0,
            corrupt_layers: 0,
            bytes_verified: 0,
            batches: 0,
            writes: 0,
            ops: 0,
            transfer_wall: Duration::ZERO,
            wire_bytes: 0,
            layer_wall_us: Vec::new(),
            d_steps: 0,
            admission_stalls: 0,
            virtual_end: 0,
            wall: Duration::ZERO,
        },
        landings: 0,
    };
    let t0 = Instant::now();
    c.run(t0)?;
    c.out.wall = t0.elapsed();
    Ok(c.finish())
}

impl Cell<'_> {
    fn at(&mut self, at: Nanos, ev: Ev) {
        self.queue.push(at, ev);
    }

    fn blocks_of(&self, req: u64) -> u32 {
        self.specs[req as usize]
            .prompt_tokens
            .div_ceil(self.cfg.block_tokens)
            .max(1)
    }

    fn run(&mut self, t0: Instant) -> Result<(), ClockError> {
        self.d
            .handle(DEvent::PeerUp { peer: P_PEER }, 0)
            .map_err(d_err)?;
        self.p
            .handle(PEvent::PeerUp { peer: D_PEER }, 0)
            .map_err(p_err)?;
        for (i, s) in self.specs.iter().enumerate() {
            let blocks = s.prompt_tokens.div_ceil(self.cfg.block_tokens).max(1);
            if blocks > self.cfg.d_pool_blocks || blocks > self.cfg.p_pool_blocks {
                return Err(ClockError::Config(format!(
                    "request {i} needs {blocks} blocks; pools hold P {} / D {}",
                    self.cfg.p_pool_blocks, self.cfg.d_pool_blocks
                )));
            }
            // The router dispatches to P and D together (pd), or to P first (migration: D
            // gets the request once P's prefill is done).
            let i = i as u64;
            let jitter = |k: u64| (mix(i ^ k) % 1_000_000) as Nanos;
            self.at(s.arrival + jitter(0x50), Ev::PRecv(i));
            if self.cfg.scenario == Scenario::Pd {
                self.at(s.arrival + jitter(0xd0), Ev::DRecv(i));
            }
        }
        self.drain_p()?;
        self.drain_d()?;
        let mut ended = 0usize;
        while let Some((at, ev)) = self.queue.pop() {
            self.now = at;
            self.dispatch(ev)?;
            ended = self.d_records.len();
            if ended == self.specs.len() && self.running.is_empty() && self.p.live_requests() == 0 {
                break;
            }
            if self.now > self.cfg.max_virtual {
                return Err(ClockError::Stuck(format!(
                    "virtual time passed {} s with {ended} of {} requests ended",
                    self.cfg.max_virtual / SEC,
                    self.specs.len()
                )));
            }
            if t0.elapsed() > self.cfg.max_wall {
                return Err(ClockError::Stuck(format!(
                    "wall time passed {:?} with {ended} of {} requests ended",
                    self.cfg.max_wall,
                    self.specs.len()
                )));
            }
        }
        if ended != self.specs.len() {
            return Err(ClockError::Stuck(format!(
                "event queue ran dry with {ended} of {} requests ended",
                self.specs.len()
            )));
        }
        self.out.virtual_end = self.now;
        self.out.pool.p.close(self.now);
        self.out.pool.d.close(self.now);
        Ok(())
    }

    fn dispatch(&mut self, ev: Ev) -> Result<(), ClockError> {
        match ev {
            Ev::PRecv(req) => {
                self.p_queue.push_back(req);
                self.p_try_step()?;
            }
            Ev::DRecv(req) => self.d_arrive(req)?,
            Ev::PStepEnd => {
                for req in std::mem::take(&mut self.p_batch) {
                    let st = &mut self.st[req as usize];
                    if !st.p_blocks.is_empty() {
                        st.p_held = true;
                        self.out.pool.p.hold(self.now, st.p_blocks.len() as u64);
                    }
                    self.p
                        .handle(
                            PEvent::PrefillDone {
                                req: RequestId(req),
                            },
                            self.now,
                        )
                        .map_err(p_err)?;
                    if self.cfg.scenario == Scenario::Migration {
                        // PD-sep migration: the decode request is sent once prefill is done.
                        let at = self.now + self.cfg.msg_latency;
                        self.at(at, Ev::DRecv(req));
                    }
                }
                self.p_busy = false;
                self.drain_p()?;
                self.p_try_step()?;
            }
            Ev::PLayerReady(req, layer) => {
                self.p
                    .handle(
                        PEvent::LayerReady {
                            req: RequestId(req),
                            layer,
                        },
                        self.now,
                    )
                    .map_err(p_err)?;
                self.drain_p()?;
            }
            Ev::DStep => self.d_step()?,
            Ev::DStepEnd => self.d_step_end()?,
            Ev::MsgToD(bytes) => {
                self.d
                    .handle_bytes(P_PEER, &bytes, self.now)
                    .map_err(d_err)?;
                self.drain_d()?;
            }
            Ev::MsgToP(bytes) => {
                self.p
                    .handle_bytes(D_PEER, &bytes, self.now)
                    .map_err(p_err)?;
                self.drain_p()?;
            }
            Ev::Land(req, layer, bytes) => self.land(req, layer, bytes)?,
            Ev::Settle(req, layer, bytes) => {
                self.p
                    .handle(
                        PEvent::TransferDone {
                            req: RequestId(req),
                            layer,
                            bytes,
                        },
                        self.now,
                    )
                    .map_err(p_err)?;
                self.drain_p()?;
            }
            Ev::DWake(at) => {
                if self.d_wake == Some(at) {
                    self.d_wake = None;
                    self.d.handle_timeout(self.now);
                    self.drain_d()?;
                }
            }
            Ev::PWake(at) => {
                if self.p_wake == Some(at) {
                    self.p_wake = None;
                    self.p.handle_timeout(self.now);
                    self.drain_p()?;
                }
            }
        }
        Ok(())
    }

    // ----- P engine -----

    fn p_try_step(&mut self) -> Result<(), ClockError> {
        if self.p_busy {
            return Ok(());
        }
        let mut batch = Vec::new();
        let mut tokens = 0u64;
        while let Some(&req) = self.p_queue.front() {
            let spec = &self.specs[req as usize];
            let uncached = if self.cfg.scenario == Scenario::Migration {
                // The KV is already cached on the source: nothing to compute.
                0
            } else {
                u64::from(spec.uncached())
            };
            if !batch.is_empty() && tokens + uncached > u64::from(self.cfg.p_token_budget) {
                break;
            }
            let n = self.blocks_of(req) as usize;
            let Some(blocks) = self.p_pool.alloc(n) else {
                break;
            };
            self.p_queue.pop_front();
            tokens += uncached;
            let crcs = self.dp.stage(req, self.cfg.layers, &blocks)?;
            let st = &mut self.st[req as usize];
            st.crcs = crcs;
            st.p_blocks = blocks.clone();
            self.p
                .handle(
                    PEvent::Scheduled {
                        req: RequestId(req),
                        peer: D_PEER,
                        tokens: spec.prompt_tokens,
                        blocks,
                    },
                    self.now,
                )
                .map_err(p_err)?;
            batch.push(req);
        }
        if batch.is_empty() {
            return self.drain_p();
        }
        let dur = self.cfg.p_step_base + self.cfg.p_step_per_token * tokens;
        let layers = u64::from(self.cfg.layers);
        for &req in &batch {
            for l in 0..self.cfg.layers {
                let t = self.now + dur * (u64::from(l) + 1) / layers;
                self.at(t, Ev::PLayerReady(req, l));
            }
        }
        self.p_busy = true;
        self.p_batch = batch;
        self.p_step = (self.now, dur.max(1));
        self.at(self.now + dur, Ev::PStepEnd);
        self.drain_p()
    }

    fn drain_p(&mut self) -> Result<(), ClockError> {
        let mut freed = false;
        while let Some(a) = self.p.poll_action() {
            match a {
                PAction::Send { msg, .. } => self.send(true, &msg)?,
                PAction::Transfer {
                    req,
                    layer,
                    src,
                    dst,
                    ..
                } => self.transfer(req.0, layer, src, dst)?,
                PAction::Destination { .. } => {}
                PAction::ReleaseBlocks { req, blocks } => {
                    let st = &mut self.st[req.0 as usize];
                    if st.p_blocks != blocks {
                        return Err(ClockError::Protocol(format!(
                            "P released blocks it did not give for {req:?}"
                        )));
                    }
                    st.p_blocks.clear();
                    if std::mem::take(&mut st.p_held) {
                        self.out.pool.p.release(self.now, blocks.len() as u64);
                    }
                    self.p_pool.release(&blocks);
                    freed = true;
                }
                PAction::ReportFinished { .. } => {}
                PAction::CancelTransfers { req } | PAction::ReportFailed { req, .. } => {
                    return Err(ClockError::Protocol(format!(
                        "request {req:?} failed on P (no failures are injected)"
                    )))
                }
                PAction::DisconnectPeer { .. } => {
                    return Err(ClockError::Protocol("P disconnected D".into()))
                }
            }
        }
        while let Some(rec) = self.p.poll_timeline() {
            if let Some(slot) = self.p_records.get_mut(rec.req.0 as usize) {
                *slot = Some(rec);
            }
        }
        if let Some(t) = self.p.poll_timeout() {
            if self.p_wake.is_none_or(|w| t < w) {
                self.p_wake = Some(t);
                self.at(t.max(self.now), Ev::PWake(t));
            }
        }
        if freed && !self.p_busy && !self.p_queue.is_empty() {
            self.p_try_step()?;
        }
        Ok(())
    }

    /// A control message over a simulated link: fixed latency, FIFO per direction.
    fn send(&mut self, to_d: bool, msg: &Message) -> Result<(), ClockError> {
        let bytes = msg
            .encode()
            .map_err(|e| ClockError::Protocol(format!("encoding {msg:?}: {e}")))?;
        let last = if to_d {
            &mut self.last_to_d
        } else {
            &mut self.last_to_p
        };
        let at = (self.now + self.cfg.msg_latency).max(*last);
        *last = at;
        let ev = if to_d {
            Ev::MsgToD(bytes)
        } else {
            Ev::MsgToP(bytes)
        };
        self.at(at, ev);
        Ok(())
    }

    /// Moves the layer through the real engines now; its virtual duration is the measured
    /// wall time times `transfer_scale`, serialized on the one P→D link.
    fn transfer(
        &mut self,
        req: u64,
        layer: u16,
        src: Arc<[u32]>,
        dst: Arc<[u32]>,
    ) -> Result<(), ClockError> {
        let crc = self.st[req as usize]
            .crcs
            .get(layer as usize)
            .copied()
            .ok_or_else(|| ClockError::Protocol(format!("no pattern for {req}/{layer}")))?;
        let t = self.dp.transfer(req, layer, &src, &dst, crc)?;
        self.out.batches += 1;
        self.out.writes += t.writes as u64;
        self.out.ops += src.len() as u64;
        self.out.transfer_wall += t.wall;
        self.out.wire_bytes += t.bytes;
        // The fixed cost of a batch is not stretched; the part that grows with bytes is, at
        // the speed measured on this layer (raw) or the median over recent layers.
        let fixed = self.fixed.min(t.wall);
        let variable = t.wall - fixed;
        // Frozen: nothing measured on this layer may reach the virtual clock (a layer faster
        // than the probed fixed cost would otherwise shorten it), so every run of the same
        // workload gets the same timeline whatever the host's load.
        let fixed = match self.cfg.link_speed {
            LinkSpeed::Frozen => self.fixed,
            LinkSpeed::Raw | LinkSpeed::Window => fixed,
        };
        let typical = self.dp.typical_ns_per_byte(variable, t.bytes);
        let var_ns = match self.cfg.link_speed {
            LinkSpeed::Raw => variable.as_nanos() as f64,
            LinkSpeed::Window | LinkSpeed::Frozen => typical * t.bytes as f64,
        };
        self.out.layer_wall_us.push(t.wall.as_secs_f64() * 1e6);
        let virt = fixed.as_nanos() as Nanos + (var_ns * self.cfg.transfer_scale) as Nanos;
        let start = self.now.max(self.link_free);
        let end = start + virt.max(1);
        self.link_free = end;
        let model_bytes = (t.bytes as f64 * self.cfg.transfer_scale) as u64;
        self.at(end, Ev::Land(req, layer, model_bytes));
        self.at(
            end + self.cfg.msg_latency,
            Ev::Settle(req, layer, model_bytes),
        );
        Ok(())
    }

    // ----- D engine -----

    fn d_arrive(&mut self, req: u64) -> Result<(), ClockError> {
        let src = self.src_load(req);
        let st = &mut self.st[req as usize];
        st.load = (self.d_waiting, self.running.len() as u32);
        st.src = src;
        st.d_live = true;
        self.d_waiting += 1;
        let blocks = self.blocks_of(req);
        self.d
            .handle(
                DEvent::Arrived {
                    req: RequestId(req),
                    peer: P_PEER,
                    tokens: self.specs[req as usize].prompt_tokens,
                    blocks,
                },
                self.now,
            )
            .map_err(d_err)?;
        self.drain_d()
    }

    /// What a router knows of P when `req` reaches D: the requests queued on P ahead of it
    /// (all of P's queue when P has not received it yet), the step P is running, and the
    /// request's own prefill work.
    fn src_load(&self, req: u64) -> SrcLoad {
        let migration = self.cfg.scenario == Scenario::Migration;
        let uncached = |r: u64| {
            if migration {
                0
            } else {
                u64::from(self.specs[r as usize].uncached())
            }
        };
        let layers = u64::from(self.cfg.layers.max(1));
        let model_bytes = |r: u64| {
            u64::from(self.blocks_of(r))
                * u64::from(self.cfg.block_tokens)
                * self.cfg.model_bytes_per_token
        };
        let mut s = SrcLoad::default();
        // Once P runs the request, everything still queued on P is behind it.
        let started = self.p_busy && self.p_batch.contains(&req);
        let ahead = if started { 0 } else { self.p_queue.len() };
        for &r in self.p_queue.iter().take(ahead).take_while(|&&r| r != req) {
            s.waiting += 1;
            s.queued_tokens += uncached(r);
            s.pending_bytes += model_bytes(r);
        }
        if self.p_busy {
            let (start, dur) = self.p_step;
            let ready = (u128::from(self.now.saturating_sub(start)) * u128::from(layers)
                / u128::from(dur))
            .min(u128::from(layers)) as u64;
            for &r in self.p_batch.iter().filter(|&&r| r != req) {
                s.running += 1;
                s.running_tokens += uncached(r) * (layers - ready) / layers;
                s.pending_bytes += model_bytes(r);
            }
        }
        // Prefilled, blocks still held on P: the layers not landed yet are still to go.
        for (r, st) in self.st.iter().enumerate() {
            if st.p_held && r as u64 != req {
                let left = layers.saturating_sub(u64::from(st.layers_landed));
                s.pending_bytes += model_bytes(r as u64) * left / layers;
            }
        }
        let spec = &self.specs[req as usize];
        s.prefill_tokens = uncached(req) as u32;
        s.cached_tokens = if migration {
            spec.prompt_tokens
        } else {
            spec.cached_tokens.min(spec.prompt_tokens)
        };
        s
    }

    fn land(&mut self, req: u64, layer: u16, model_bytes: u64) -> Result<(), ClockError> {
        self.landings += 1;
        let (dst, want) = {
            let st = &self.st[req as usize];
            (st.d_blocks.clone(), st.crcs.get(layer as usize).copied())
        };
        if self.cfg.fault_corrupt_landing == Some(self.landings) {
            if let Some(&b) = dst.first() {
                self.dp.corrupt_d(b, layer)?;
            }
        }
        let got = self.dp.landed_crc(&dst, layer)?;
        let st = &mut self.st[req as usize];
        st.layers_landed += 1;
        if Some(got) == want {
            st.layers_ok += 1;
            self.out.bytes_verified += dst.len() as u64 * self.dp.layer_block_bytes();
        } else {
            self.out.corrupt_layers += 1;
        }
        self.d
            .handle(
                DEvent::LayerLanded {
                    req: RequestId(req),
                    layer,
                    bytes: model_bytes,
                },
                self.now,
            )
            .map_err(d_err)?;
        self.drain_d()
    }

    fn kick_d(&mut self) {
        if !self.d_stepping {
            self.d_stepping = true;
            let grid = self.cfg.d_idle_poll.max(1);
            let at = (self.now / grid + 1) * grid;
            self.at(at, Ev::DStep);
        }
    }

    fn d_step(&mut self) -> Result<(), ClockError> {
        self.out.d_steps += 1;
        let now = self.now;
        let mut later = Vec::new();
        for (req, wait) in std::mem::take(&mut self.to_promote) {
            if wait > 0 {
                later.push((req, wait - 1));
                continue;
            }
            self.d
                .handle(DEvent::Promoted { req }, now)
                .map_err(d_err)?;
            let st = &mut self.st[req.0 as usize];
            if std::mem::take(&mut st.d_held) {
                self.out.pool.d.release(now, st.d_blocks.len() as u64);
            }
            self.d_waiting = self.d_waiting.saturating_sub(1);
            let out = self.specs[req.0 as usize].output_tokens.max(1);
            self.running.push((req, out));
            self.promoted_now.push(req);
        }
        self.to_promote = later;
        let mut stalled = false;
        while let Some(&req) = self.reservable.front() {
            if !self.d.may_reserve(req) {
                self.reservable.pop_front();
                continue;
            }
            let n = self.blocks_of(req.0) as usize;
            let Some(blocks) = self.d_pool.alloc(n) else {
                stalled = true;
                break;
            };
            self.reservable.pop_front();
            self.out.pool.d.hold(now, blocks.len() as u64);
            let st = &mut self.st[req.0 as usize];
            st.d_blocks = blocks.clone();
            st.d_held = true;
            self.d
                .handle(DEvent::Reserved { req, blocks }, now)
                .map_err(d_err)?;
        }
        if stalled {
            self.out.admission_stalls += 1;
        }
        self.drain_d()?;
        let dur = if self.running.is_empty() {
            self.cfg.d_idle_poll
        } else {
            self.cfg.d_step_base + self.cfg.d_step_per_running * self.running.len() as u64
        };
        self.at(now + dur, Ev::DStepEnd);
        Ok(())
    }

    fn d_step_end(&mut self) -> Result<(), ClockError> {
        let now = self.now;
        for req in std::mem::take(&mut self.promoted_now) {
            self.d
                .handle(DEvent::FirstToken { req }, now)
                .map_err(d_err)?;
        }
        let mut still = Vec::with_capacity(self.running.len());
        for (req, left) in std::mem::take(&mut self.running) {
            if left <= 1 {
                let blocks = std::mem::take(&mut self.st[req.0 as usize].d_blocks);
                self.d_pool.release(&blocks);
            } else {
                still.push((req, left - 1));
            }
        }
        self.running = still;
        // get_finished at the end of the step: what completed during it is reported now,
        // promoted at the step after next (async scheduling).
        for req in std::mem::take(&mut self.to_report) {
            self.d
                .handle(DEvent::Reported { req }, now)
                .map_err(d_err)?;
            self.to_promote.push((req, 1));
        }
        self.drain_d()?;
        let head_fits = self
            .reservable
            .front()
            .is_some_and(|r| self.blocks_of(r.0) as usize <= self.d_pool.free.len());
        if !self.running.is_empty() || !self.to_promote.is_empty() || head_fits {
            self.at(now, Ev::DStep);
        } else {
            self.d_stepping = false;
        }
        Ok(())
    }

    fn drain_d(&mut self) -> Result<(), ClockError> {
        let mut kick = false;
        while let Some(a) = self.d.poll_action() {
            match a {
                DAction::Send { msg, .. } => self.send(false, &msg)?,
                DAction::MayReserve { req, .. } => {
                    self.reservable.push_back(req);
                    kick = true;
                }
                // No landing pool in the clock's data path yet: `land` runs as its fallback.
                DAction::MayLand { req, .. } => {
                    self.d
                        .handle(DEvent::LandFallback { req }, self.now)
                        .map_err(d_err)?;
                }
                DAction::ReleaseLanding { req, .. } => {
                    return Err(ClockError::Protocol(format!(
                        "request {req:?}: landing slots released, none were given"
                    )))
                }
                DAction::ReportFinished { req } => {
                    self.to_report.push(req);
                    kick = true;
                }
                DAction::ReleaseBlocks { req, .. } | DAction::ReportFailed { req, .. } => {
                    return Err(ClockError::Protocol(format!(
                        "request {req:?} failed on D (no failures are injected)"
                    )))
                }
                DAction::DisconnectPeer { .. } => {
                    return Err(ClockError::Protocol("D disconnected P".into()))
                }
            }
        }
        while let Some(rec) = self.d.poll_timeline() {
            self.d_records.push(rec);
        }
        if let Some(t) = self.d.poll_timeout() {
            if self.d_wake.is_none_or(|w| t < w) {
                self.d_wake = Some(t);
                self.at(t.max(self.now), Ev::DWake(t));
            }
        }
        if kick {
            self.kick_d();
        }
        Ok(())
    }

    fn finish(mut self) -> CellRun {
        let mut recs: Vec<TimelineRecord> = std::mem::take(&mut self.d_records)
            .into_iter()
            .map(|d| match self.p_records.get(d.req.0 as usize) {
                Some(Some(p)) => TimelineRecord::merge(&d, p),
                _ => d,
            })
            .collect();
        recs.sort_by_key(|r| r.req);
        let layers = self.cfg.layers;
        self.out.verified_requests = self
            .st
            .iter()
            .filter(|s| s.layers_ok == layers && s.layers_landed == layers && s.d_live)
            .count();
        self.out.load_at_arrival = recs
            .iter()
            .map(|r| self.st.get(r.req.0 as usize).map_or((0, 0), |s| s.load))
            .collect();
        self.out.src_at_arrival = recs
            .iter()
            .map(|r| {
                self.st
                    .get(r.req.0 as usize)
                    .map_or_else(SrcLoad::default, |s| s.src)
            })
            .collect();
        self.out.records = recs;
        self.out
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn d_err(e: kvwire_connector::DError) -> ClockError {
    ClockError::Protocol(format!("D core refused an event: {e}"))
}

fn p_err(e: kvwire_connector::PError) -> ClockError {
    ClockError::Protocol(format!("P core refused an event: {e}"))
}

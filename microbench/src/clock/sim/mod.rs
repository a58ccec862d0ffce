//! One cell of the matrix: P and D step loops on a virtual clock around the connector cores,
//! with every layer moved through the real [`DataPath`].
//!
//! * `p_engine`: P's step loop (whole prompts, or chunked prefill with each chunk's blocks
//!   streamed layer by layer), P's connector actions, what a router knows of P.
//! * `d_engine`: D as vLLM's scheduler runs it: a decode batch whose KV grows one block per
//!   `block_tokens` generated tokens, local requests prefilled on D, admission in arrival
//!   order, recompute preemption of the newest running request under block pressure, and the
//!   prefix cache (`kv::KvPool`).
//! * `d_host`: D's connector actions (reservation, landing slots, the local copy of a `land`
//!   request, reports), layers landing on D and their checks.
//! * `link`: control messages and the data path's transfers on the virtual clock.

mod d_engine;
mod d_host;
mod held;
mod kv;
mod link;
mod p_engine;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_connector::{
    DConfig, DEvent, DSide, Nanos, PConfig, PEvent, PSide, PeerId, Policy, RequestId, SendMode,
    TimelineRecord, SEC,
};
use kvwire_testkit::queue::EventQueue;

use super::datapath::{DataPath, StagedCrcs};
use super::workload::RequestSpec;
use super::{ClockConfig, ClockError, Scenario};

pub use held::{HeldBlocks, PoolHeld};

const D_PEER: PeerId = PeerId(0);
const P_PEER: PeerId = PeerId(1);

/// What one cell produced.
#[derive(Clone, Debug)]
pub struct CellRun {
    /// D's reservation policy.
    pub policy: Policy,
    /// P's send mode.
    pub send_mode: SendMode,
    /// Merged (D + P) timeline records of the P/D requests, by request id.
    pub records: Vec<TimelineRecord>,
    /// Per P/D request (same order as `records`): what the hosts saw of it.
    pub host: Vec<HostRecord>,
    /// Every request D served (local and P/D), by request id.
    pub served: Vec<ServedRecord>,
    /// Per request (same order as `records`): D's waiting and running counts at arrival.
    pub load_at_arrival: Vec<(u32, u32)>,
    /// Per request (same order as `records`): what a router knows of the source (P) at
    /// `decode_sent`.
    pub src_at_arrival: Vec<SrcLoad>,
    /// Blocks held by kv_both on P (prefill done → blocks released after the send), on D
    /// (reserved → promoted) and in D's landing pool, over the cell's virtual time.
    pub pool: PoolHeld,
    /// Requests whose every layer was checked on D against the pattern (a `land` request:
    /// in its landing slots and again in its KV blocks after the copy).
    pub verified_requests: usize,
    /// Layers whose bytes on D did not match.
    pub corrupt_layers: usize,
    /// Bytes checked on D as they landed.
    pub bytes_verified: u64,
    /// Bytes checked again in D's KV blocks after a `land` request's local copy.
    pub copy_bytes_verified: u64,
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
    /// D steps in which the request at the head of D's waiting queue could not get blocks.
    pub admission_stalls: u64,
    /// Running requests preempted (recompute) for lack of blocks.
    pub preemptions: u64,
    /// Tokens D recomputed for preempted requests.
    pub recompute_tokens: u64,
    /// Prefix-cache lookups and hits on D, in tokens.
    pub apc: ApcCounts,
    /// Cached blocks D evicted.
    pub evicted_blocks: u64,
    /// `land` requests that got landing slots.
    pub landings: u64,
    /// `land` requests that fell back to `lazy` (landing pool full).
    pub land_fallbacks: u64,
    /// Virtual time at the end.
    pub virtual_end: Nanos,
    /// Wall time of the cell.
    pub wall: Duration,
}

/// Prefix-cache lookups on D at a request's first admission, in tokens (vLLM's APC hit rate
/// is `hit / query`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ApcCounts {
    /// Prompt tokens of local requests looked up.
    pub local_query: u64,
    /// Of them, found in the cache.
    pub local_hit: u64,
    /// Prompt tokens of P/D requests looked up (with [`ClockConfig::d_prefix_cache`]).
    pub pd_query: u64,
    /// Of them, found in the cache (not transferred).
    pub pd_hit: u64,
}

/// What the hosts saw of one P/D request, beyond the connector's timeline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostRecord {
    /// Wire bytes moved for it.
    pub wire_bytes: u64,
    /// Wire bytes its whole context would have been (every block, every layer).
    pub context_wire_bytes: u64,
    /// P steps (chunks) of its prefill.
    pub chunks: u32,
    /// Batches posted for it.
    pub batches: u32,
    /// When the first batch carrying layer 0 landed on D (chunked layerwise: chunk 0's).
    pub first_layer0_landed: Option<Nanos>,
    /// Virtual duration of the last batch of the last layer (the last chunk's last layer).
    pub last_batch_ns: Nanos,
    /// When the KV was complete in D's KV blocks (`land`: after the local copy).
    pub kv_ready: Option<Nanos>,
    /// `land`: it used landing slots (did not fall back).
    pub landed: bool,
    /// `land`: virtual duration of the local copy.
    pub copy_ns: Nanos,
    /// Tokens D had in its prefix cache (not transferred).
    pub prefix_tokens: u32,
}

/// A request D served (local or P/D): its own TTFT and TPOT.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServedRecord {
    /// The request.
    pub req: u64,
    /// A local request (D computed its prompt).
    pub local: bool,
    /// Arrival on D (`decode_sent` for a P/D request).
    pub arrival: Nanos,
    /// First output token.
    pub first_token: Option<Nanos>,
    /// Last output token.
    pub finished: Option<Nanos>,
    /// Output tokens.
    pub output_tokens: u32,
    /// Times it was preempted.
    pub preemptions: u32,
    /// Prompt tokens looked up in D's prefix cache at its first admission (0: no lookup).
    pub lookup_tokens: u32,
    /// Of them, found.
    pub hit_tokens: u32,
}

impl ServedRecord {
    /// Time to first token.
    pub fn ttft(&self) -> Option<Nanos> {
        self.first_token.map(|t| t.saturating_sub(self.arrival))
    }

    /// Time per output token after the first (`None` for a single-token output).
    pub fn tpot(&self) -> Option<Nanos> {
        match (self.first_token, self.finished) {
            (Some(a), Some(b)) if self.output_tokens > 1 => {
                Some(b.saturating_sub(a) / u64::from(self.output_tokens - 1))
            }
            _ => None,
        }
    }
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
    /// `tokens × (layers − layers ready) / layers`, plus the chunks still to come of requests
    /// in the middle of a chunked prefill.
    pub running_tokens: u64,
    /// Modelled KV bytes P will send before this request's: what is not yet landed of the
    /// requests whose prefill is done, plus all of those in the running step and queued ahead.
    pub pending_bytes: u64,
    /// This request's tokens P must still prefill (0 when its prefill is done: migration).
    pub prefill_tokens: u32,
    /// This request's tokens P has cached.
    pub cached_tokens: u32,
}

enum Ev {
    PRecv(u64),
    DRecv(u64),
    LocalArrive(u64),
    PStepEnd,
    PLayerReady(u64, u16),
    /// Chunked prefill: the step's chunk of `req` passed `layer`; `upto` request blocks are
    /// complete; `last`: the request's last chunk.
    PChunkLayer {
        req: u64,
        layer: u16,
        upto: u32,
        last: bool,
    },
    DStep,
    DStepEnd,
    MsgToD(Vec<u8>),
    MsgToP(Vec<u8>),
    Land(u64, u16, u64),
    Settle(u64, u16, u64),
    /// A run of `blocks` blocks of a layer (chunked streaming) landed on D.
    Piece {
        req: u64,
        layer: u16,
        blocks: u32,
        bytes: u64,
    },
    CopyDone(u64),
    DWake(Nanos),
    PWake(Nanos),
}

/// Where D wants a streamed request's KV (from [`kvwire_connector::PAction::Destination`]).
#[derive(Clone)]
struct Dest {
    first: u32,
    dst: Arc<[u32]>,
    landing: bool,
}

#[derive(Default)]
struct ReqState {
    // P
    p_blocks: Vec<u32>,
    crcs: StagedCrcs,
    p_done_tokens: u32,
    ready_upto: Vec<u32>,
    sent_upto: Vec<u32>,
    dest: Option<Dest>,
    core_issued: Vec<bool>,
    layer_bytes: Vec<u64>,
    // D
    d_blocks: Vec<u32>,
    d_prefix: Vec<u32>,
    prefix_set: bool,
    apc_counted: bool,
    slots: Vec<u32>,
    landed_blocks: Vec<u32>,
    layers_ok: u16,
    layers_landed: u16,
    copy_ok: bool,
    load: (u32, u32),
    src: SrcLoad,
    d_live: bool,
    p_held: bool,
    d_held: bool,
    land_held: bool,
    d_generated: u32,
    host: HostRecord,
    served: ServedRecord,
}

/// A request in D's running batch.
struct Running {
    req: u64,
    /// Tokens to compute before decoding (prompt, plus the output so far after a preemption).
    target: u32,
    computed: u32,
    blocks: Vec<u32>,
    step_tokens: u32,
    step_prefill: bool,
}

/// An entry of D's waiting queue, in arrival order (a preempted request goes to the front).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wait {
    /// A P/D request the core allows to reserve its KV blocks.
    Reserve(RequestId),
    /// A request D computes itself: a local one, or a preempted one to recompute.
    Run(u64),
}

struct Cell<'a> {
    cfg: &'a ClockConfig,
    specs: &'a [RequestSpec],
    dp: &'a mut DataPath,
    fixed: Duration,
    now: Nanos,
    queue: EventQueue<Ev>,
    st: Vec<ReqState>,
    streaming: bool,
    // P engine
    p: PSide,
    p_pool: kv::Slots,
    p_queue: VecDeque<u64>,
    p_partial: VecDeque<u64>,
    p_busy: bool,
    p_batch: Vec<(u64, u32, bool)>,
    p_step: (Nanos, Nanos),
    p_wake: Option<Nanos>,
    link_free: Nanos,
    last_to_d: Nanos,
    // D engine
    d: DSide,
    d_pool: kv::KvPool,
    land_pool: kv::Slots,
    waiting: VecDeque<Wait>,
    to_report: Vec<RequestId>,
    to_promote: Vec<(RequestId, u8)>,
    promoted_now: Vec<RequestId>,
    running: Vec<Running>,
    d_waiting: u32,
    d_stepping: bool,
    d_wake: Option<Nanos>,
    last_to_p: Nanos,
    // results
    d_records: Vec<TimelineRecord>,
    p_records: Vec<Option<TimelineRecord>>,
    pd_total: usize,
    local_total: usize,
    local_done: usize,
    /// Closed-loop sessions: the request sent when this one ends, and after how long.
    next_turn: Vec<Option<(u64, Nanos)>>,
    /// Sent by [`Cell::turn_done`] of the previous turn, not at its `arrival`.
    chained: Vec<bool>,
    out: CellRun,
    landings: u64,
}

/// Runs one cell: every request of `specs` through P, D and the data path under `policy` ×
/// `send_mode` (local requests through D alone). `fixed` is the engine's fixed cost of a
/// batch (not stretched by the transfer scale, see [`DataPath::probe_fixed_cost`]).
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
    // Chunked layerwise: the host streams each chunk's blocks itself, as vLLM's worker will.
    let streaming = cfg.chunk_tokens > 0 && send_mode == SendMode::Layerwise;
    pc.announce_destination = streaming;
    let n = specs.len();
    let local_total = specs.iter().filter(|s| s.local).count();
    let mut c = Cell {
        cfg,
        specs,
        dp,
        fixed,
        now: 0,
        queue: EventQueue::new(),
        st: (0..n).map(|_| ReqState::default()).collect(),
        streaming,
        p: PSide::new(pc),
        p_pool: kv::Slots::new(cfg.p_pool_blocks),
        p_queue: VecDeque::new(),
        p_partial: VecDeque::new(),
        p_busy: false,
        p_batch: Vec::new(),
        p_step: (0, 1),
        p_wake: None,
        link_free: 0,
        last_to_d: 0,
        d: DSide::new(dc),
        d_pool: kv::KvPool::new(cfg.d_pool_blocks),
        land_pool: kv::Slots::new(cfg.land_pool_blocks),
        waiting: VecDeque::new(),
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
        pd_total: n - local_total,
        local_total,
        local_done: 0,
        next_turn: next_turns(specs),
        chained: Vec::new(),
        out: CellRun {
            policy,
            send_mode,
            records: Vec::new(),
            host: Vec::new(),
            served: Vec::new(),
            load_at_arrival: Vec::new(),
            src_at_arrival: Vec::new(),
            pool: PoolHeld {
                p: HeldBlocks::new(cfg.p_pool_blocks),
                d: HeldBlocks::new(cfg.d_pool_blocks),
                land: HeldBlocks::new(cfg.land_pool_blocks),
            },
            verified_requests: 0,
            corrupt_layers: 0,
            bytes_verified: 0,
            copy_bytes_verified: 0,
            batches: 0,
            writes: 0,
            ops: 0,
            transfer_wall: Duration::ZERO,
            wire_bytes: 0,
            layer_wall_us: Vec::new(),
            d_steps: 0,
            admission_stalls: 0,
            preemptions: 0,
            recompute_tokens: 0,
            apc: ApcCounts::default(),
            evicted_blocks: 0,
            landings: 0,
            land_fallbacks: 0,
            virtual_end: 0,
            wall: Duration::ZERO,
        },
        landings: 0,
    };
    c.chained = vec![false; n];
    for &(next, _) in c.next_turn.iter().flatten() {
        c.chained[next as usize] = true;
    }
    let t0 = Instant::now();
    c.run(t0)?;
    c.out.wall = t0.elapsed();
    Ok(c.finish())
}

impl Cell<'_> {
    fn at(&mut self, at: Nanos, ev: Ev) {
        self.queue.push(at, ev);
    }

    /// Blocks of the request's prompt.
    fn blocks_of(&self, req: u64) -> u32 {
        self.cfg
            .blocks_for(u64::from(self.specs[req as usize].prompt_tokens))
    }

    fn run(&mut self, t0: Instant) -> Result<(), ClockError> {
        self.d
            .handle(DEvent::PeerUp { peer: P_PEER }, 0)
            .map_err(d_err)?;
        self.p
            .handle(PEvent::PeerUp { peer: D_PEER }, 0)
            .map_err(p_err)?;
        for (i, s) in self.specs.iter().enumerate() {
            let blocks = self.cfg.blocks_for(u64::from(s.prompt_tokens));
            let most = self
                .cfg
                .blocks_for(u64::from(s.prompt_tokens) + u64::from(s.output_tokens));
            if most > self.cfg.d_pool_blocks || (!s.local && blocks > self.cfg.p_pool_blocks) {
                return Err(ClockError::Config(format!(
                    "request {i} needs {blocks} blocks ({most} with its output); pools hold P {} / D {}",
                    self.cfg.p_pool_blocks, self.cfg.d_pool_blocks
                )));
            }
            if !self.chained[i] {
                self.send_request(i as u64, s.arrival);
            }
        }
        self.drain_p()?;
        self.drain_d()?;
        let mut ended = 0usize;
        while let Some((at, ev)) = self.queue.pop() {
            self.now = at;
            self.dispatch(ev)?;
            ended = self.d_records.len();
            if ended == self.pd_total
                && self.local_done == self.local_total
                && self.running.is_empty()
                && self.p.live_requests() == 0
            {
                break;
            }
            if self.now > self.cfg.max_virtual {
                return Err(ClockError::Stuck(format!(
                    "virtual time passed {} s with {ended} of {} requests ended",
                    self.cfg.max_virtual / SEC,
                    self.pd_total
                )));
            }
            if t0.elapsed() > self.cfg.max_wall {
                return Err(ClockError::Stuck(format!(
                    "wall time passed {:?} with {ended} of {} requests ended",
                    self.cfg.max_wall, self.pd_total
                )));
            }
        }
        if ended != self.pd_total || self.local_done != self.local_total {
            return Err(ClockError::Stuck(format!(
                "event queue ran dry with {ended} of {} P/D and {} of {} local requests ended",
                self.pd_total, self.local_done, self.local_total
            )));
        }
        self.out.virtual_end = self.now;
        self.out.pool.p.close(self.now);
        self.out.pool.d.close(self.now);
        self.out.pool.land.close(self.now);
        self.out.evicted_blocks = self.d_pool.evicted;
        Ok(())
    }

    /// The router sends request `i` at `at`: to D alone (local), to P and D together (pd), or
    /// to P first (migration: D gets the request once P's prefill is done).
    fn send_request(&mut self, i: u64, at: Nanos) {
        if self.specs[i as usize].local {
            self.at(at, Ev::LocalArrive(i));
            return;
        }
        let jitter = |k: u64| (mix(i ^ k) % 1_000_000) as Nanos;
        self.at(at + jitter(0x50), Ev::PRecv(i));
        if self.cfg.scenario == Scenario::Pd {
            self.at(at + jitter(0xd0), Ev::DRecv(i));
        }
    }

    /// Request `req` got its last token on D: its session's next turn is sent after its think
    /// time.
    fn turn_done(&mut self, req: u64) {
        if let Some((next, think)) = self.next_turn[req as usize] {
            self.send_request(next, self.now + think);
        }
    }

    fn dispatch(&mut self, ev: Ev) -> Result<(), ClockError> {
        match ev {
            Ev::PRecv(req) => {
                self.p_queue.push_back(req);
                self.p_try_step()?;
            }
            Ev::DRecv(req) => self.d_arrive(req)?,
            Ev::LocalArrive(req) => self.local_arrive(req),
            Ev::PStepEnd => self.p_step_end()?,
            Ev::PLayerReady(req, layer) => self.p_layer_ready(req, layer)?,
            Ev::PChunkLayer {
                req,
                layer,
                upto,
                last,
            } => self.p_chunk_layer(req, layer, upto, last)?,
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
                let req = RequestId(req);
                self.p_handle(PEvent::TransferDone { req, layer, bytes })?;
            }
            Ev::Piece {
                req,
                layer,
                blocks,
                bytes,
            } => self.piece_landed(req, layer, blocks, bytes)?,
            Ev::CopyDone(req) => self.copy_done(req),
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
            .filter(|s| {
                s.layers_ok == layers
                    && s.layers_landed == layers
                    && s.d_live
                    && (!s.host.landed || s.copy_ok)
            })
            .count();
        let at = |r: &TimelineRecord| self.st.get(r.req.0 as usize);
        self.out.load_at_arrival = recs
            .iter()
            .map(|r| at(r).map_or((0, 0), |s| s.load))
            .collect();
        self.out.src_at_arrival = recs
            .iter()
            .map(|r| at(r).map_or_else(SrcLoad::default, |s| s.src))
            .collect();
        self.out.host = recs
            .iter()
            .map(|r| at(r).map_or_else(HostRecord::default, |s| s.host))
            .collect();
        self.out.served = self
            .st
            .iter()
            .filter(|s| s.served.first_token.is_some() || s.served.finished.is_some())
            .map(|s| s.served)
            .collect();
        self.out.records = recs;
        self.out
    }
}

/// For each request, the next request of its session sent closed loop (with its think time).
fn next_turns(specs: &[RequestSpec]) -> Vec<Option<(u64, Nanos)>> {
    let mut next = vec![None; specs.len()];
    let mut last: kvwire_connector::types::IdMap<u64, usize> = Default::default();
    for (i, s) in specs.iter().enumerate() {
        let Some(session) = s.session else {
            continue;
        };
        if let (Some(think), Some(&prev)) = (s.think, last.get(&session)) {
            next[prev] = Some((i as u64, think));
        }
        last.insert(session, i);
    }
    next
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

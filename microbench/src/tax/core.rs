//! Connector core per-step cost (Rust level, runs anywhere): what the glue does once per engine
//! step for one side — feed the events of the requests that changed, run due timers, drain the
//! actions and timeline records — with 1k and 1M cached blocks in the host's pool and 10 and
//! 1,000 live requests, 4 of them changing state per step. Each step is timed on its own with
//! `Instant` (in-process; no harness), after a warm-up.
//!
//! The core never sees the block pool, so the cached-block count enters only through the host's
//! free list; the figure shows whether anything in the per-step path depends on it.

use std::hint::black_box;
use std::time::Instant;

use kvwire_connector::msg::Message;
use kvwire_connector::{
    BlockId, DConfig, DEvent, DSide, Nanos, PConfig, PEvent, PSide, PeerId, Policy, RequestId,
    SendMode, MS,
};
use serde::Serialize;

const LAYERS: u16 = 32;
const BLOCKS_PER_REQ: usize = 64;
const CHANGING: usize = 4;
const STEP_NS: Nanos = 2 * MS;
const P: PeerId = PeerId(1);
const D: PeerId = PeerId(0);

/// A host block pool: a free list holding every cached block.
struct HostPool {
    free: Vec<BlockId>,
}

impl HostPool {
    fn new(cached: usize, live: usize) -> Self {
        let n = u32::try_from(cached + live * BLOCKS_PER_REQ).unwrap_or(u32::MAX);
        HostPool {
            free: (0..n).collect(),
        }
    }
    fn take(&mut self) -> Vec<BlockId> {
        let at = self.free.len().saturating_sub(BLOCKS_PER_REQ);
        self.free.split_off(at)
    }
    fn give(&mut self, b: &[BlockId]) {
        self.free.extend_from_slice(b);
    }
}

type Slot = (RequestId, u32, Vec<BlockId>);

struct DBench {
    d: DSide,
    pool: HostPool,
    slots: Vec<Slot>,
    next_id: u64,
    cursor: usize,
    now: Nanos,
}

impl DBench {
    fn new(cached: usize, live: usize) -> Self {
        let mut b = DBench {
            d: DSide::new(DConfig::new(Policy::Lazy, LAYERS)),
            pool: HostPool::new(cached, live),
            slots: Vec::new(),
            next_id: 0,
            cursor: 0,
            now: 0,
        };
        for i in 0..live {
            let req = b.arrive();
            b.slots.push((req, 0, Vec::new()));
            // Spread the live requests over the whole life cycle.
            for _ in 0..(i * 7) % (LAYERS as usize + 5) {
                b.advance(i);
            }
        }
        while b.d.poll_action().is_some() {}
        while b.d.poll_timeline().is_some() {}
        b
    }

    fn arrive(&mut self) -> RequestId {
        let req = RequestId(self.next_id);
        self.next_id += 1;
        let _ = self.d.handle(
            DEvent::Arrived {
                req,
                peer: P,
                tokens: (BLOCKS_PER_REQ * 16) as u32,
                blocks: BLOCKS_PER_REQ as u32,
            },
            self.now,
        );
        req
    }

    fn advance(&mut self, slot: usize) {
        let now = self.now;
        let (req, stage) = (self.slots[slot].0, self.slots[slot].1);
        let l = u32::from(LAYERS);
        match stage {
            0 => {
                let msg = Message::Started {
                    req,
                    layers: LAYERS,
                    blocks: BLOCKS_PER_REQ as u32,
                };
                let _ = self.d.handle(DEvent::Message { from: P, msg }, now);
            }
            1 => {
                if self.d.may_reserve(req) {
                    let blocks = self.pool.take();
                    self.slots[slot].2 = blocks.clone();
                    let _ = self.d.handle(DEvent::Reserved { req, blocks }, now);
                }
            }
            s if s < 2 + l => {
                let layer = u16::try_from(s - 2).unwrap_or(0);
                let ev = DEvent::LayerLanded {
                    req,
                    layer,
                    bytes: 1 << 20,
                };
                let _ = self.d.handle(ev, now);
            }
            s if s == 2 + l => {
                let _ = self.d.handle(DEvent::Reported { req }, now);
            }
            s if s == 3 + l => {
                let _ = self.d.handle(DEvent::Promoted { req }, now);
            }
            _ => {
                let _ = self.d.handle(DEvent::FirstToken { req }, now);
                let blocks = std::mem::take(&mut self.slots[slot].2);
                self.pool.give(&blocks);
                let new = self.arrive();
                self.slots[slot] = (new, 0, Vec::new());
                return;
            }
        }
        self.slots[slot].1 += 1;
    }

    fn step(&mut self) -> usize {
        self.now += STEP_NS;
        for _ in 0..CHANGING {
            let s = self.cursor % self.slots.len();
            self.cursor += 1;
            self.advance(s);
        }
        let hb = Message::Heartbeat {
            incarnation: 1,
            seq: self.now,
        };
        let _ = self
            .d
            .handle(DEvent::Message { from: P, msg: hb }, self.now);
        if self.d.poll_timeout().is_some_and(|t| t <= self.now) {
            self.d.handle_timeout(self.now);
        }
        let mut n = 0;
        while let Some(a) = self.d.poll_action() {
            n += 1;
            black_box(a);
        }
        while let Some(r) = self.d.poll_timeline() {
            black_box(r);
        }
        n
    }
}

struct PBench {
    p: PSide,
    pool: HostPool,
    slots: Vec<Slot>,
    next_id: u64,
    cursor: usize,
    now: Nanos,
}

impl PBench {
    fn new(cached: usize, live: usize) -> Self {
        let mut b = PBench {
            p: PSide::new(PConfig::new(SendMode::Layerwise, LAYERS)),
            pool: HostPool::new(cached, live),
            slots: Vec::new(),
            next_id: 0,
            cursor: 0,
            now: 0,
        };
        for i in 0..live {
            let (req, blocks) = b.schedule();
            b.slots.push((req, 0, blocks));
            for _ in 0..(i * 7) % (2 * LAYERS as usize + 1) {
                b.advance(i);
            }
        }
        while b.p.poll_action().is_some() {}
        while b.p.poll_timeline().is_some() {}
        b
    }

    fn schedule(&mut self) -> (RequestId, Vec<BlockId>) {
        let req = RequestId(self.next_id);
        self.next_id += 1;
        let blocks = self.pool.take();
        let _ = self.p.handle(
            PEvent::Scheduled {
                req,
                peer: D,
                tokens: (BLOCKS_PER_REQ * 16) as u32,
                blocks: blocks.clone(),
            },
            self.now,
        );
        (req, blocks)
    }

    fn advance(&mut self, slot: usize) {
        let now = self.now;
        let (req, stage) = (self.slots[slot].0, self.slots[slot].1);
        let l = u32::from(LAYERS);
        match stage {
            0 => {
                let blocks: Vec<BlockId> = (0..BLOCKS_PER_REQ as u32).collect();
                let msg = Message::BlockIds { req, blocks };
                let _ = self.p.handle(PEvent::Message { from: D, msg }, now);
            }
            s if s <= 2 * l => {
                let layer = u16::try_from((s - 1) / 2).unwrap_or(0);
                let ev = if s % 2 == 1 {
                    PEvent::LayerReady { req, layer }
                } else {
                    PEvent::TransferDone {
                        req,
                        layer,
                        bytes: 1 << 20,
                    }
                };
                let _ = self.p.handle(ev, now);
            }
            _ => {}
        }
        self.slots[slot].1 += 1;
        if self.slots[slot].1 > 2 * l {
            let blocks = std::mem::take(&mut self.slots[slot].2);
            self.pool.give(&blocks);
            let (new, nb) = self.schedule();
            self.slots[slot] = (new, 0, nb);
        }
    }

    fn step(&mut self) -> usize {
        self.now += STEP_NS;
        for _ in 0..CHANGING {
            let s = self.cursor % self.slots.len();
            self.cursor += 1;
            self.advance(s);
        }
        let hb = Message::Heartbeat {
            incarnation: 1,
            seq: self.now,
        };
        let _ = self
            .p
            .handle(PEvent::Message { from: D, msg: hb }, self.now);
        if self.p.poll_timeout().is_some_and(|t| t <= self.now) {
            self.p.handle_timeout(self.now);
        }
        let mut n = 0;
        while let Some(a) = self.p.poll_action() {
            n += 1;
            black_box(a);
        }
        while let Some(r) = self.p.poll_timeline() {
            black_box(r);
        }
        n
    }
}

/// One configuration's per-step cost.
#[derive(Clone, Debug, Serialize)]
pub struct CoreStep {
    /// `"d"` or `"p"`.
    pub side: &'static str,
    /// Blocks cached in the host pool besides the live requests' blocks.
    pub cached_blocks: usize,
    /// Live requests.
    pub live: usize,
    /// Timed steps.
    pub steps: usize,
    /// Median ns per step.
    pub median_ns: f64,
    /// 99th percentile ns per step.
    pub p99_ns: f64,
    /// Mean ns per step.
    pub mean_ns: f64,
    /// Live requests at the end (must equal `live`: the bench keeps its live set).
    pub live_end: usize,
}

fn summarize(
    side: &'static str,
    cached: usize,
    live: usize,
    mut t: Vec<u64>,
    end: usize,
) -> CoreStep {
    t.sort_unstable();
    let q = |p: f64| t[((t.len() - 1) as f64 * p).round() as usize] as f64;
    CoreStep {
        side,
        cached_blocks: cached,
        live,
        steps: t.len(),
        median_ns: q(0.5),
        p99_ns: q(0.99),
        mean_ns: t.iter().sum::<u64>() as f64 / t.len() as f64,
        live_end: end,
    }
}

fn time_steps(steps: usize, mut f: impl FnMut() -> usize) -> Vec<u64> {
    let mut t = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t0 = Instant::now();
        black_box(f());
        t.push(t0.elapsed().as_nanos() as u64);
    }
    t
}

/// Runs D and P at every (cached, live) pair; `steps` timed steps each after `steps / 5`
/// warm-up steps.
pub fn run(cached: &[usize], live: &[usize], steps: usize) -> Vec<CoreStep> {
    let steps = steps.max(10);
    let mut out = Vec::new();
    for &c in cached {
        for &l in live {
            let mut d = DBench::new(c, l);
            let _ = time_steps(steps / 5, || d.step());
            let t = time_steps(steps, || d.step());
            out.push(summarize("d", c, l, t, d.d.live_requests()));
            drop(d);
            let mut p = PBench::new(c, l);
            let _ = time_steps(steps / 5, || p.step());
            let t = time_steps(steps, || p.step());
            out.push(summarize("p", c, l, t, p.p.live_requests()));
        }
    }
    out
}

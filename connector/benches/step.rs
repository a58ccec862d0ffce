//! Cost of one D step and one P step of the connector core, with 1k vs 1M cached blocks in the
//! host's pool and 10 vs 1,000 live requests, 4 of them changing state per step.
//!
//! A "step" is what the glue does once per engine step: feed the events of the requests that
//! changed (an arrival, P's messages, a reservation, layers landing or ready, transfer
//! completions, promotion...), run due timers, drain the actions, ask for the next deadline.
//!
//! `cargo bench -p kvwire-connector --bench step -- --warm-up-time 1 --measurement-time 3`

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use kvwire_connector::msg::Message;
use kvwire_connector::*;

const LAYERS: u16 = 32;
const BLOCKS_PER_REQ: usize = 64;
const CHANGING: usize = 4;
const STEP_NS: Nanos = 2 * MS;

/// A host block pool: a free list. Only `BLOCKS_PER_REQ` ids move per reservation, whatever
/// its size; the core never sees the pool at all.
struct HostPool {
    free: Vec<BlockId>,
}

impl HostPool {
    fn new(cached: usize, live: usize) -> Self {
        HostPool {
            free: (0..(cached + live * BLOCKS_PER_REQ) as u32).collect(),
        }
    }
    fn take(&mut self) -> Vec<BlockId> {
        let at = self.free.len() - BLOCKS_PER_REQ;
        self.free.split_off(at)
    }
    fn give(&mut self, b: &[BlockId]) {
        self.free.extend_from_slice(b);
    }
}

struct DBench {
    d: DSide,
    pool: HostPool,
    slots: Vec<(RequestId, u32, Vec<BlockId>)>,
    next_id: u64,
    cursor: usize,
    now: Nanos,
}

const P: PeerId = PeerId(1);
const D: PeerId = PeerId(0);

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
            let stages = (i * 7) % (LAYERS as usize + 5);
            for _ in 0..stages {
                b.advance(i);
            }
        }
        while b.d.poll_action().is_some() {}
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

    /// Moves request in `slot` one stage on.
    fn advance(&mut self, slot: usize) {
        let now = self.now;
        let (req, stage, _) = self.slots[slot].clone();
        let l = LAYERS as u32;
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
                let _ = self.d.handle(
                    DEvent::LayerLanded {
                        req,
                        layer: (s - 2) as u16,
                        bytes: 1 << 20,
                    },
                    now,
                );
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
        // Keep P alive for the liveness check.
        let _ = self.d.handle(
            DEvent::Message {
                from: P,
                msg: Message::Heartbeat {
                    incarnation: 1,
                    seq: self.now,
                },
            },
            self.now,
        );
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
    slots: Vec<(RequestId, u32, Vec<BlockId>)>,
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
            let stages = (i * 7) % (2 * LAYERS as usize + 1);
            for _ in 0..stages {
                b.advance(i);
            }
        }
        while b.p.poll_action().is_some() {}
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

    /// Stages: D's block ids, then per layer: ready, transfer done.
    fn advance(&mut self, slot: usize) {
        let now = self.now;
        let (req, stage, _) = self.slots[slot].clone();
        let l = LAYERS as u32;
        match stage {
            0 => {
                let blocks: Vec<BlockId> = (0..BLOCKS_PER_REQ as u32).collect();
                let msg = Message::BlockIds { req, blocks };
                let _ = self.p.handle(PEvent::Message { from: D, msg }, now);
            }
            s if s <= 2 * l => {
                let layer = ((s - 1) / 2) as u16;
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
        let _ = self.p.handle(
            PEvent::Message {
                from: D,
                msg: Message::Heartbeat {
                    incarnation: 1,
                    seq: self.now,
                },
            },
            self.now,
        );
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

fn steps(c: &mut Criterion) {
    let mut g = c.benchmark_group("connector_step");
    for cached in [1_000usize, 1_000_000] {
        for live in [10usize, 1_000] {
            let id = format!("cached={cached}/live={live}");
            let mut d = DBench::new(cached, live);
            g.bench_function(BenchmarkId::new("d_step", &id), |b| b.iter(|| d.step()));
            assert_eq!(d.d.live_requests(), live, "the D bench keeps its live set");
            let mut p = PBench::new(cached, live);
            g.bench_function(BenchmarkId::new("p_step", &id), |b| b.iter(|| p.step()));
            assert_eq!(p.p.live_requests(), live, "the P bench keeps its live set");
        }
    }
    g.finish();
}

criterion_group!(benches, steps);
criterion_main!(benches);

//! A deterministic per-step workload for the connector cores, shared by the criterion bench
//! (`benches/step.rs`) and `kvwire-bench tax`: what the glue does once per engine step for one
//! side — feed the events of the requests that changed (an arrival, P's messages, a reservation,
//! layers landing or ready, transfer completions, promotion...), run due timers, drain the
//! actions and timeline records — with a host block pool of any size and any number of live
//! requests, 4 of them changing state per step.
//!
//! The core never sees the block pool: the cached-block count enters only through the host's
//! free list, so a step's cost shows whether anything in the per-step path depends on it.

use std::hint::black_box;

use crate::msg::Message;
use crate::{
    BlockId, DConfig, DEvent, DSide, Nanos, PConfig, PEvent, PSide, PeerId, Policy, RequestId,
    SendMode, MS,
};

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
    /// `cached` blocks in the host pool besides the live requests' blocks; `live` requests.
    pub fn new(cached: usize, live: usize) -> Self {
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

/// The D side of the step workload: a lazy-policy core with `live` requests spread over
/// their life cycle.
pub struct DStepLoop {
    /// The core under test.
    pub d: DSide,
    pool: HostPool,
    slots: Vec<Slot>,
    next_id: u64,
    cursor: usize,
    now: Nanos,
}

impl DStepLoop {
    /// `cached` blocks in the host pool besides the live requests' blocks; `live` requests.
    pub fn new(cached: usize, live: usize) -> Self {
        let mut b = DStepLoop {
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

    /// One engine step: 4 requests change state, a heartbeat, due timers, actions and timeline
    /// drained. Returns the number of actions.
    pub fn step(&mut self) -> usize {
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

/// The P side of the step workload: a layerwise core with `live` requests spread over their
/// life cycle.
pub struct PStepLoop {
    /// The core under test.
    pub p: PSide,
    pool: HostPool,
    slots: Vec<Slot>,
    next_id: u64,
    cursor: usize,
    now: Nanos,
}

impl PStepLoop {
    /// `cached` blocks in the host pool besides the live requests' blocks; `live` requests.
    pub fn new(cached: usize, live: usize) -> Self {
        let mut b = PStepLoop {
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
                let msg = Message::BlockIds {
                    req,
                    first: 0,
                    landing: false,
                    blocks,
                };
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

    /// One engine step: 4 requests change state, a heartbeat, due timers, actions and timeline
    /// drained. Returns the number of actions.
    pub fn step(&mut self) -> usize {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_loops_keep_their_live_set_and_produce_actions() {
        let mut d = DStepLoop::new(1_000, 10);
        let mut p = PStepLoop::new(1_000, 10);
        let (mut da, mut pa) = (0, 0);
        for _ in 0..500 {
            da += d.step();
            pa += p.step();
        }
        assert_eq!(d.d.live_requests(), 10);
        assert_eq!(p.p.live_requests(), 10);
        assert!(
            da > 0 && pa > 0,
            "the workload drives the cores: {da} / {pa}"
        );
    }
}

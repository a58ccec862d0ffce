//! A deterministic per-step workload for the connector cores, shared by the criterion bench
//! (`connector/benches/step.rs`) and `kvwire-bench tax`: what the glue does once per engine
//! step for one side — feed the events of the requests that changed (an arrival, P's messages,
//! a reservation, layers landing or ready, transfer completions, promotion...), run due timers,
//! drain the actions and timeline records — with a host block pool of any size and any number
//! of live requests, 4 of them changing state per step.
//!
//! The core never sees the block pool: the cached-block count enters only through the host's
//! free list, so a step's cost shows whether anything in the per-step path depends on it.

use std::hint::black_box;

use kvwire_connector::{
    BlockId, DConfig, DEvent, DSide, Message, Nanos, PConfig, PEvent, PSide, PeerId, Policy,
    RequestId, SendMode, MS,
};

use crate::pool::BlockPool;

const LAYERS: u16 = 32;
const BLOCKS_PER_REQ: usize = 64;
const CHANGING: usize = 4;
const STEP_NS: Nanos = 2 * MS;
const P: PeerId = PeerId(1);
const D: PeerId = PeerId(0);

/// One live request: its id, how far it got, the host blocks it holds.
type Slot = (RequestId, u32, Vec<BlockId>);

/// What a step loop needs of a core besides its own events.
trait Core {
    /// Feeds a message from the peer.
    fn message(&mut self, msg: Message, now: Nanos);
    /// Runs the timers due at `now`.
    fn timers(&mut self, now: Nanos);
    /// Drains actions and timeline records; returns the number of actions.
    fn drain(&mut self) -> usize;
}

macro_rules! core_impl {
    ($core:ty, $event:ident, $peer:expr) => {
        impl Core for $core {
            fn message(&mut self, msg: Message, now: Nanos) {
                let _ = self.handle($event::Message { from: $peer, msg }, now);
            }
            fn timers(&mut self, now: Nanos) {
                if self.poll_timeout().is_some_and(|t| t <= now) {
                    self.handle_timeout(now);
                }
            }
            fn drain(&mut self) -> usize {
                let mut n = 0;
                while let Some(a) = self.poll_action() {
                    n += 1;
                    black_box(a);
                }
                while let Some(r) = self.poll_timeline() {
                    black_box(r);
                }
                n
            }
        }
    };
}

core_impl!(DSide, DEvent, P);
core_impl!(PSide, PEvent, D);

/// The host side of a step loop: block pool, live requests, virtual clock.
struct Host {
    pool: BlockPool,
    slots: Vec<Slot>,
    next_id: u64,
    cursor: usize,
    now: Nanos,
}

impl Host {
    /// `cached` blocks in the host pool besides the blocks of `live` requests.
    fn new(cached: usize, live: usize) -> Self {
        Host {
            pool: BlockPool::new(u32::try_from(cached + live * BLOCKS_PER_REQ).unwrap_or(u32::MAX)),
            slots: Vec::new(),
            next_id: 0,
            cursor: 0,
            now: 0,
        }
    }

    fn next_req(&mut self) -> RequestId {
        self.next_id += 1;
        RequestId(self.next_id - 1)
    }

    fn take_blocks(&mut self) -> Vec<BlockId> {
        self.pool.alloc(BLOCKS_PER_REQ).unwrap_or_default()
    }

    /// One engine step: 4 requests change state (`advance`), a heartbeat, due timers, actions
    /// and timeline drained. Returns the number of actions.
    fn step<C: Core>(&mut self, core: &mut C, advance: fn(&mut Self, &mut C, usize)) -> usize {
        self.now += STEP_NS;
        for _ in 0..CHANGING {
            let s = self.cursor % self.slots.len();
            self.cursor += 1;
            advance(self, core, s);
        }
        let hb = Message::Heartbeat {
            incarnation: 1,
            seq: self.now,
        };
        core.message(hb, self.now);
        core.timers(self.now);
        core.drain()
    }
}

/// The D side of the step workload: a lazy-policy core with `live` requests spread over
/// their life cycle.
pub struct DStepLoop {
    /// The core under test.
    pub d: DSide,
    host: Host,
}

impl DStepLoop {
    /// `cached` blocks in the host pool besides the live requests' blocks; `live` requests.
    pub fn new(cached: usize, live: usize) -> Self {
        let mut host = Host::new(cached, live);
        let mut d = DSide::new(DConfig::new(Policy::Lazy, LAYERS));
        for i in 0..live {
            let req = arrive(&mut host, &mut d);
            host.slots.push((req, 0, Vec::new()));
            // Spread the live requests over the whole life cycle.
            for _ in 0..(i * 7) % (LAYERS as usize + 5) {
                advance_d(&mut host, &mut d, i);
            }
        }
        d.drain();
        DStepLoop { d, host }
    }

    /// One engine step: 4 requests change state, a heartbeat, due timers, actions and timeline
    /// drained. Returns the number of actions.
    pub fn step(&mut self) -> usize {
        self.host.step(&mut self.d, advance_d)
    }
}

fn arrive(host: &mut Host, d: &mut DSide) -> RequestId {
    let req = host.next_req();
    let _ = d.handle(
        DEvent::Arrived {
            req,
            peer: P,
            tokens: (BLOCKS_PER_REQ * 16) as u32,
            blocks: BLOCKS_PER_REQ as u32,
        },
        host.now,
    );
    req
}

fn advance_d(host: &mut Host, d: &mut DSide, slot: usize) {
    let now = host.now;
    let (req, stage) = (host.slots[slot].0, host.slots[slot].1);
    let l = u32::from(LAYERS);
    match stage {
        0 => {
            let msg = Message::Started {
                req,
                layers: LAYERS,
                blocks: BLOCKS_PER_REQ as u32,
            };
            d.message(msg, now);
        }
        1 => {
            if d.may_reserve(req) {
                let blocks = host.take_blocks();
                host.slots[slot].2 = blocks.clone();
                let _ = d.handle(DEvent::Reserved { req, blocks }, now);
            }
        }
        s if s < 2 + l => {
            let layer = u16::try_from(s - 2).unwrap_or(0);
            let ev = DEvent::LayerLanded {
                req,
                layer,
                bytes: 1 << 20,
            };
            let _ = d.handle(ev, now);
        }
        s if s == 2 + l => {
            let _ = d.handle(DEvent::Reported { req }, now);
        }
        s if s == 3 + l => {
            let _ = d.handle(DEvent::Promoted { req }, now);
        }
        _ => {
            let _ = d.handle(DEvent::FirstToken { req }, now);
            let blocks = std::mem::take(&mut host.slots[slot].2);
            host.pool.release(&blocks);
            let new = arrive(host, d);
            host.slots[slot] = (new, 0, Vec::new());
            return;
        }
    }
    host.slots[slot].1 += 1;
}

/// The P side of the step workload: a layerwise core with `live` requests spread over their
/// life cycle.
pub struct PStepLoop {
    /// The core under test.
    pub p: PSide,
    host: Host,
}

impl PStepLoop {
    /// `cached` blocks in the host pool besides the live requests' blocks; `live` requests.
    pub fn new(cached: usize, live: usize) -> Self {
        let mut host = Host::new(cached, live);
        let mut p = PSide::new(PConfig::new(SendMode::Layerwise, LAYERS));
        for i in 0..live {
            let (req, blocks) = schedule(&mut host, &mut p);
            host.slots.push((req, 0, blocks));
            for _ in 0..(i * 7) % (2 * LAYERS as usize + 1) {
                advance_p(&mut host, &mut p, i);
            }
        }
        p.drain();
        PStepLoop { p, host }
    }

    /// One engine step: 4 requests change state, a heartbeat, due timers, actions and timeline
    /// drained. Returns the number of actions.
    pub fn step(&mut self) -> usize {
        self.host.step(&mut self.p, advance_p)
    }
}

fn schedule(host: &mut Host, p: &mut PSide) -> (RequestId, Vec<BlockId>) {
    let req = host.next_req();
    let blocks = host.take_blocks();
    let _ = p.handle(
        PEvent::Scheduled {
            req,
            peer: D,
            tokens: (BLOCKS_PER_REQ * 16) as u32,
            blocks: blocks.clone(),
        },
        host.now,
    );
    (req, blocks)
}

fn advance_p(host: &mut Host, p: &mut PSide, slot: usize) {
    let now = host.now;
    let (req, stage) = (host.slots[slot].0, host.slots[slot].1);
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
            p.message(msg, now);
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
            let _ = p.handle(ev, now);
        }
        _ => {}
    }
    host.slots[slot].1 += 1;
    if host.slots[slot].1 > 2 * l {
        let blocks = std::mem::take(&mut host.slots[slot].2);
        host.pool.release(&blocks);
        let (new, nb) = schedule(host, p);
        host.slots[slot] = (new, 0, nb);
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

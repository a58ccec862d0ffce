//! Invariant checker for the simulator: fed every block operation and every request end as it
//! happens, it records each violation (O(1) per block touched, nothing per step beyond that).

use kvwire_connector::types::IdMap;
use kvwire_connector::{BlockId, RequestId};
use std::fmt;

/// What a block of a checked pool is used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockUse {
    /// Free.
    Free,
    /// Held by the connector for a request (D: reservation; P: KV waiting to be sent).
    Reserved(RequestId),
    /// Owned by a running request (D, after promotion).
    Running(RequestId),
}

/// Which side's bookkeeping a check is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// The decode side.
    D,
    /// The prefill side.
    P,
}

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Violation {
    /// A block was reserved while not free.
    DoubleReserve {
        /// Pool index.
        pool: usize,
        /// The block.
        block: BlockId,
        /// The request reserving it.
        req: RequestId,
        /// What the block was.
        was: BlockUse,
    },
    /// A block was released that the request did not hold.
    BadRelease {
        /// Pool index.
        pool: usize,
        /// The block.
        block: BlockId,
        /// The request releasing it.
        req: RequestId,
        /// What the block was.
        was: BlockUse,
    },
    /// A layer was written into (or read from) a block the request does not hold.
    WriteToUnheld {
        /// Pool index.
        pool: usize,
        /// The block.
        block: BlockId,
        /// The writing request.
        req: RequestId,
        /// What the block was.
        was: BlockUse,
    },
    /// Finished was reported before every layer landed.
    FinishedEarly {
        /// The request.
        req: RequestId,
        /// Layers landed.
        landed: u16,
        /// Layers needed.
        layers: u16,
    },
    /// A request ended twice on one side.
    EndedTwice {
        /// The side.
        role: Role,
        /// The request.
        req: RequestId,
    },
    /// A request never ended on a side that had it.
    NeverEnded {
        /// The side.
        role: Role,
        /// The request.
        req: RequestId,
    },
    /// Blocks still held when the run drained.
    Leaked {
        /// Pool index.
        pool: usize,
        /// Blocks not free.
        blocks: usize,
    },
    /// The host refused an event the simulator considered valid, or another host-level error.
    Host(String),
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

const RUNNING: u64 = 1 << 63;

fn encode(u: BlockUse) -> u64 {
    match u {
        BlockUse::Free => 0,
        BlockUse::Reserved(r) => r.0.wrapping_add(1) & !RUNNING,
        BlockUse::Running(r) => (r.0.wrapping_add(1) & !RUNNING) | RUNNING,
    }
}

fn decode(v: u64) -> BlockUse {
    if v == 0 {
        BlockUse::Free
    } else if v & RUNNING != 0 {
        BlockUse::Running(RequestId((v & !RUNNING) - 1))
    } else {
        BlockUse::Reserved(RequestId(v - 1))
    }
}

/// The layers of one request that landed on D.
#[derive(Debug)]
struct Landed {
    seen: Vec<bool>,
    count: u16,
}

impl Landed {
    fn new(layers: u16) -> Self {
        Landed {
            seen: vec![false; usize::from(layers)],
            count: 0,
        }
    }

    /// Counts `layer` once (an out-of-range layer is not counted).
    fn insert(&mut self, layer: u16) {
        if let Some(s) = self.seen.get_mut(usize::from(layer)) {
            if !*s {
                *s = true;
                self.count += 1;
            }
        }
    }
}

/// The checker. Pools are numbered by the caller (the simulator uses 0 for D, 1.. for P's).
/// Block states are kept as plain integers so the per-block checks stay cheap in debug builds.
#[derive(Debug, Default)]
pub struct Checker {
    pools: Vec<Vec<u64>>,
    held: Vec<usize>,
    landed: IdMap<RequestId, Landed>,
    started: IdMap<(Role, RequestId), bool>,
    violations: Vec<Violation>,
}

impl Checker {
    /// A checker for pools of the given sizes, every block free.
    pub fn new(pool_sizes: &[u32]) -> Self {
        Checker {
            pools: pool_sizes.iter().map(|&n| vec![0; n as usize]).collect(),
            held: vec![0; pool_sizes.len()],
            ..Default::default()
        }
    }

    /// Violations found so far.
    pub fn violations(&self) -> &[Violation] {
        &self.violations
    }

    /// Records a violation found by the caller.
    pub fn report(&mut self, v: Violation) {
        self.violations.push(v);
    }

    /// Blocks not free in `pool` (kept as a counter: O(1)).
    pub fn held(&self, pool: usize) -> usize {
        self.held.get(pool).copied().unwrap_or(0)
    }

    /// What `block` of `pool` is used for (`None`: no such block).
    pub fn block(&self, pool: usize, block: BlockId) -> Option<BlockUse> {
        self.pools
            .get(pool)
            .and_then(|p| p.get(block as usize))
            .map(|&v| decode(v))
    }

    /// `req` reserves `blocks`: each must be free.
    pub fn reserve(&mut self, pool: usize, req: RequestId, blocks: &[BlockId]) {
        self.transition(pool, req, blocks, BlockUse::Free, BlockUse::Reserved(req));
    }

    /// The connector releases `req`'s reservation: each block must be reserved by `req`.
    pub fn release(&mut self, pool: usize, req: RequestId, blocks: &[BlockId]) {
        self.transition(pool, req, blocks, BlockUse::Reserved(req), BlockUse::Free);
    }

    /// The reservation becomes a running request.
    pub fn promote(&mut self, pool: usize, req: RequestId, blocks: &[BlockId]) {
        self.transition(
            pool,
            req,
            blocks,
            BlockUse::Reserved(req),
            BlockUse::Running(req),
        );
    }

    /// The running request finished and the host freed its blocks.
    pub fn host_free(&mut self, pool: usize, req: RequestId, blocks: &[BlockId]) {
        self.transition(pool, req, blocks, BlockUse::Running(req), BlockUse::Free);
    }

    fn transition(
        &mut self,
        pool: usize,
        req: RequestId,
        blocks: &[BlockId],
        from: BlockUse,
        to: BlockUse,
    ) {
        let (f, t) = (encode(from), encode(to));
        let Some(p) = self.pools.get_mut(pool) else {
            return;
        };
        let mut bad = Vec::new();
        let mut moved = 0usize;
        for &b in blocks {
            match p.get_mut(b as usize) {
                Some(v) if *v == f => {
                    *v = t;
                    moved += 1;
                }
                other => bad.push((b, other.map(|v| decode(*v)))),
            }
        }
        if from == BlockUse::Free {
            self.held[pool] += moved;
        } else if to == BlockUse::Free {
            self.held[pool] -= moved;
        }
        for (block, was) in bad {
            let was = was.unwrap_or(BlockUse::Free);
            self.violations.push(if from == BlockUse::Free {
                Violation::DoubleReserve {
                    pool,
                    block,
                    req,
                    was,
                }
            } else {
                Violation::BadRelease {
                    pool,
                    block,
                    req,
                    was,
                }
            });
        }
    }

    /// Layer `layer` of `req` touched `blocks` (a write on D, a read on P): each must be
    /// reserved by `req`. On D (`count_layer`), the layer counts as landed.
    pub fn touch(
        &mut self,
        pool: usize,
        req: RequestId,
        layer: u16,
        layers: u16,
        blocks: &[BlockId],
        count_layer: bool,
    ) {
        let want = encode(BlockUse::Reserved(req));
        let empty = Vec::new();
        let p = self.pools.get(pool).unwrap_or(&empty);
        let mut bad = None;
        for &b in blocks {
            let i = b as usize;
            if i >= p.len() || p[i] != want {
                bad = Some((b, p.get(i).map(|&v| decode(v))));
                break;
            }
        }
        if let Some((block, was)) = bad {
            self.violations.push(Violation::WriteToUnheld {
                pool,
                block,
                req,
                was: was.unwrap_or(BlockUse::Free),
            });
            return;
        }
        if count_layer {
            self.landed
                .entry(req)
                .or_insert_with(|| Landed::new(layers))
                .insert(layer);
        }
    }

    /// D reported `req` finished: every layer must have landed.
    pub fn report_finished(&mut self, req: RequestId, layers: u16) {
        let landed = self.landed.get(&req).map_or(0, |s| s.count);
        if landed != layers {
            self.violations.push(Violation::FinishedEarly {
                req,
                landed,
                layers,
            });
        }
    }

    /// `req` began on `role` (it must end exactly once there).
    pub fn begin(&mut self, role: Role, req: RequestId) {
        self.started.insert((role, req), false);
    }

    /// `req` will never end on `role` (its process died).
    pub fn forget(&mut self, role: Role, req: RequestId) {
        self.started.remove(&(role, req));
    }

    /// `req` ended on `role`.
    pub fn end(&mut self, role: Role, req: RequestId) {
        match self.started.get_mut(&(role, req)) {
            Some(ended) if !*ended => *ended = true,
            _ => self.violations.push(Violation::EndedTwice { role, req }),
        }
        // What landed on D is D's to forget (P may end first: a `land` request is reported
        // finished only once D reserved its KV blocks).
        if role == Role::D {
            self.landed.remove(&req);
        }
    }

    /// Marks every block of `pool` free without checks (the process owning it died).
    pub fn reset_pool(&mut self, pool: usize) {
        if let Some(p) = self.pools.get_mut(pool) {
            p.iter_mut().for_each(|b| *b = 0);
            self.held[pool] = 0;
        }
    }

    /// Checks at the end of a run: no block held in any pool, every begun request ended.
    pub fn drain_check(&mut self) {
        for pool in 0..self.pools.len() {
            if self.held[pool] != 0 {
                self.violations.push(Violation::Leaked {
                    pool,
                    blocks: self.held[pool],
                });
            }
        }
        let mut never: Vec<(Role, RequestId)> = self
            .started
            .iter()
            .filter(|(_, ended)| !**ended)
            .map(|(k, _)| *k)
            .collect();
        never.sort();
        for (role, req) in never {
            self.violations.push(Violation::NeverEnded { role, req });
        }
    }
}

//! Block pools of the simulated engines: a plain free list (P's KV pool, D's landing pool) and
//! D's KV pool with its prefix cache.

use std::collections::BTreeSet;

use kvwire_connector::types::IdMap;

/// A block pool: a free list; allocation takes the tail (runs of adjacent ids come out
/// together, as in a fresh vLLM pool).
pub(super) struct Slots {
    pub(super) free: Vec<u32>,
}

impl Slots {
    pub(super) fn new(n: u32) -> Slots {
        Slots {
            free: (0..n).rev().collect(),
        }
    }

    pub(super) fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let at = self.free.len() - n;
        let mut v = self.free.split_off(at);
        v.reverse();
        Some(v)
    }

    pub(super) fn release(&mut self, b: &[u32]) {
        self.free.extend(b.iter().rev());
    }
}

/// One context's cached blocks, in prompt order.
struct Entry {
    blocks: Vec<u32>,
    last_use: u64,
}

/// D's KV pool as vLLM's block manager keeps it: blocks are free, held by requests
/// (reference-counted: a prefix-cache hit shares them), or cached and unreferenced —
/// evictable, still counted as free for allocation. The cache keeps, per context, the full
/// blocks of its latest request (prompt and output); an allocation that finds too few free
/// blocks evicts the least recently used context's blocks from its tail (a shorter prefix
/// stays usable), as vLLM's free queue does with the blocks of a freed request.
pub(super) struct KvPool {
    free: Vec<u32>,
    refs: Vec<u32>,
    cached: Vec<bool>,
    entries: IdMap<u64, Entry>,
    lru: BTreeSet<(u64, u64)>,
    tick: u64,
    evictable: usize,
    /// Cached blocks evicted so far.
    pub(super) evicted: u64,
}

impl KvPool {
    pub(super) fn new(n: u32) -> KvPool {
        KvPool {
            free: (0..n).rev().collect(),
            refs: vec![0; n as usize],
            cached: vec![false; n as usize],
            entries: IdMap::default(),
            lru: BTreeSet::new(),
            tick: 0,
            evictable: 0,
            evicted: 0,
        }
    }

    /// Blocks an allocation can get now (free and evictable).
    pub(super) fn available(&self) -> usize {
        self.free.len() + self.evictable
    }

    /// `n` blocks for a request (evicting cached blocks if needed), or `None` with nothing
    /// changed when the pool cannot give them.
    pub(super) fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.available() < n {
            return None;
        }
        while self.free.len() < n {
            if !self.evict_one() {
                return None;
            }
        }
        let at = self.free.len() - n;
        let mut v = self.free.split_off(at);
        v.reverse();
        for &b in &v {
            self.refs[b as usize] = 1;
        }
        Some(v)
    }

    /// Drops the requests' references to `blocks` (in reverse, as vLLM frees a request):
    /// an unreferenced block goes back to the free list, or becomes evictable if cached.
    pub(super) fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let r = &mut self.refs[b as usize];
            *r = r.saturating_sub(1);
            if *r == 0 {
                if self.cached[b as usize] {
                    self.evictable += 1;
                } else {
                    self.free.push(b);
                }
            }
        }
    }

    /// How many of `ctx`'s cached blocks a prompt of `tokens` tokens can use (at least one
    /// token must be computed, so at most `(tokens − 1) / block_tokens`).
    pub(super) fn hit(&self, ctx: u64, tokens: u32, block_tokens: u32) -> usize {
        let most = (tokens.saturating_sub(1) / block_tokens.max(1)) as usize;
        self.entries
            .get(&ctx)
            .map_or(0, |e| e.blocks.len().min(most))
    }

    /// Of the first `n` cached blocks of `ctx`, those no request references (pinning them
    /// takes them out of the evictable ones).
    pub(super) fn pin_cost(&self, ctx: u64, n: usize) -> usize {
        self.entries.get(&ctx).map_or(0, |e| {
            e.blocks[..n.min(e.blocks.len())]
                .iter()
                .filter(|&&b| self.refs[b as usize] == 0)
                .count()
        })
    }

    /// Takes a reference to the first `n` cached blocks of `ctx` (a prefix-cache hit).
    pub(super) fn pin(&mut self, ctx: u64, n: usize) -> Vec<u32> {
        let Some(e) = self.entries.get_mut(&ctx) else {
            return Vec::new();
        };
        let v: Vec<u32> = e.blocks[..n.min(e.blocks.len())].to_vec();
        self.lru.remove(&(e.last_use, ctx));
        self.tick += 1;
        e.last_use = self.tick;
        self.lru.insert((self.tick, ctx));
        for &b in &v {
            let r = &mut self.refs[b as usize];
            if *r == 0 {
                self.evictable -= 1;
            }
            *r += 1;
        }
        v
    }

    /// Caches `blocks` (full blocks held by a request, in prompt order) as `ctx`'s entry,
    /// replacing the previous one; the request releases its references afterwards.
    pub(super) fn store(&mut self, ctx: u64, blocks: &[u32]) {
        if let Some(old) = self.entries.remove(&ctx) {
            self.lru.remove(&(old.last_use, ctx));
            for b in old.blocks {
                self.uncache(b);
            }
        }
        if blocks.is_empty() {
            return;
        }
        for &b in blocks {
            // Every block is referenced by the storing request: none is evictable yet.
            self.cached[b as usize] = true;
        }
        self.tick += 1;
        self.entries.insert(
            ctx,
            Entry {
                blocks: blocks.to_vec(),
                last_use: self.tick,
            },
        );
        self.lru.insert((self.tick, ctx));
    }

    fn uncache(&mut self, b: u32) {
        let i = b as usize;
        if !self.cached[i] {
            return;
        }
        self.cached[i] = false;
        if self.refs[i] == 0 {
            self.evictable -= 1;
            self.free.push(b);
        }
    }

    /// Evicts the tail block of the least recently used context that has an unreferenced
    /// tail. False when nothing is evictable.
    fn evict_one(&mut self) -> bool {
        let mut victim = None;
        for &(t, ctx) in &self.lru {
            let e = &self.entries[&ctx];
            if e.blocks.last().is_some_and(|&b| self.refs[b as usize] == 0) {
                victim = Some((t, ctx));
                break;
            }
        }
        let Some((t, ctx)) = victim else {
            return false;
        };
        let (b, empty) = {
            let e = self.entries.get_mut(&ctx).expect("entry in the lru");
            let b = e.blocks.pop().expect("a tail block");
            (b, e.blocks.is_empty())
        };
        if empty {
            self.entries.remove(&ctx);
            self.lru.remove(&(t, ctx));
        }
        self.uncache(b);
        self.evicted += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_prefix_is_shared_and_evicted_from_its_tail_lru_first() {
        let mut p = KvPool::new(8);
        let a = p.alloc(4).unwrap();
        p.store(1, &a[..3]);
        p.release(&a);
        // One block free again (the partial one), three cached and evictable.
        assert_eq!((p.free.len(), p.available()), (5, 8));
        assert_eq!(p.hit(1, 10_000, 16), 3);
        assert_eq!(p.hit(1, 33, 16), 2, "at least one token is computed");
        let h = p.pin(1, 2);
        assert_eq!(h, a[..2].to_vec());
        assert_eq!(p.available(), 6);
        // Another context, older use first: 1 was just used, so 2's tail goes first.
        let b = p.alloc(2).unwrap();
        p.store(2, &b);
        p.release(&b);
        p.pin(1, 0);
        let c = p.alloc(6).unwrap();
        assert_eq!(c.len(), 6);
        assert_eq!(p.hit(2, 10_000, 16), 0, "context 2 evicted");
        assert_eq!(p.hit(1, 10_000, 16), 2, "the pinned prefix of 1 stays");
        assert_eq!(p.available(), 0);
        assert!(p.alloc(1).is_none());
        p.release(&c);
        p.release(&h);
        assert_eq!(p.available(), 8);
    }
}

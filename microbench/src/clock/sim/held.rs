//! Time-weighted records of the blocks held in a pool.

use kvwire_connector::Nanos;

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
    /// allocates them when the request starts running; `land`: from the KV reservation).
    pub d: HeldBlocks,
    /// D's landing pool (`land`): slots from the landing to the end of the local copy.
    pub land: HeldBlocks,
}

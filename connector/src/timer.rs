//! Deadline queue with lazy deletion: arming is O(log n); a cancelled or re-armed deadline is
//! left in the heap and skipped when it surfaces (its generation no longer matches).

use crate::types::Nanos;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A min-heap of `(deadline, key)`; ties broken by insertion order for determinism.
#[derive(Debug)]
pub(crate) struct Deadlines<K: Ord> {
    heap: BinaryHeap<Reverse<(Nanos, u64, K)>>,
    seq: u64,
}

impl<K: Ord + Copy> Deadlines<K> {
    pub(crate) fn new() -> Self {
        Deadlines {
            heap: BinaryHeap::new(),
            seq: 0,
        }
    }

    pub(crate) fn arm(&mut self, at: Nanos, key: K) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, key)));
    }

    /// Earliest armed deadline (possibly stale).
    pub(crate) fn next(&self) -> Option<Nanos> {
        self.heap.peek().map(|Reverse((at, _, _))| *at)
    }

    /// Pops one deadline due at or before `now`.
    pub(crate) fn pop_due(&mut self, now: Nanos) -> Option<(Nanos, K)> {
        match self.heap.peek() {
            Some(Reverse((at, _, _))) if *at <= now => {
                self.heap.pop().map(|Reverse((at, _, k))| (at, k))
            }
            _ => None,
        }
    }

    /// Every deadline due at `now`, taken out. Only what is due on entry: a deadline re-armed
    /// at or before `now` while these are handled (a clock at the end of its range) waits for
    /// the next call instead of spinning there.
    pub(crate) fn take_due(&mut self, now: Nanos) -> Vec<K> {
        let mut due = Vec::new();
        while let Some((_, k)) = self.pop_due(now) {
            due.push(k);
        }
        due
    }

    /// Entries in the heap, stale ones included.
    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }
}

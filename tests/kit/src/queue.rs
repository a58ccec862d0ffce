//! A time-ordered event queue for discrete-event step loops (the simulator, the clock
//! microbench): the earliest event pops first; events due at the same time pop in the order
//! they were pushed, so a run is reproducible.

use kvwire_connector::Nanos;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

struct Queued<E> {
    at: Nanos,
    seq: u64,
    ev: E,
}

impl<E> PartialEq for Queued<E> {
    fn eq(&self, o: &Self) -> bool {
        self.at == o.at && self.seq == o.seq
    }
}
impl<E> Eq for Queued<E> {}
impl<E> PartialOrd for Queued<E> {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl<E> Ord for Queued<E> {
    fn cmp(&self, o: &Self) -> Ordering {
        // BinaryHeap is a max-heap: reverse so the earliest (then first pushed) is on top.
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

/// Events of type `E` keyed by the virtual time they are due.
pub struct EventQueue<E> {
    heap: BinaryHeap<Queued<E>>,
    seq: u64,
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> EventQueue<E> {
    /// An empty queue.
    pub fn new() -> Self {
        EventQueue {
            heap: BinaryHeap::new(),
            seq: 0,
        }
    }

    /// Schedules `ev` at `at`.
    pub fn push(&mut self, at: Nanos, ev: E) {
        self.seq += 1;
        self.heap.push(Queued {
            at,
            seq: self.seq,
            ev,
        });
    }

    /// The earliest event and its time.
    pub fn pop(&mut self) -> Option<(Nanos, E)> {
        self.heap.pop().map(|q| (q.at, q.ev))
    }

    /// Events still queued.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::EventQueue;

    #[test]
    fn earliest_first_then_push_order() {
        let mut q = EventQueue::new();
        q.push(5, "c");
        q.push(1, "a");
        q.push(5, "d");
        q.push(1, "b");
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(order, vec![(1, "a"), (1, "b"), (5, "c"), (5, "d")]);
        assert!(q.is_empty());
    }
}

//! Copy marks: what each TCP lane thread of a peer is copying now (see [`CopyMarks`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::types::RegionId;

/// [`CopyMarks`] value of a lane copying several regions at once (a gathered send).
pub(crate) const MARK_ANY: u64 = u64::MAX;

/// What each TCP lane thread of one peer is copying into or out of region memory now: the
/// packed region id (0 = nothing). Written around every copy (a relaxed store, nothing else on
/// the data path) and read only by `unregister` when a copy into caller memory did not end
/// within the deadline: the peers whose lanes are inside such a copy (a peer stalled in the
/// middle of a frame) are disconnected, which ends the copy.
#[derive(Default)]
pub(crate) struct CopyMarks {
    lanes: Mutex<Vec<Weak<AtomicU64>>>,
}

impl CopyMarks {
    /// The mark of a new lane thread (lanes already gone are forgotten here).
    pub fn lane(&self) -> Arc<AtomicU64> {
        let m = Arc::new(AtomicU64::new(0));
        let mut l = self.lanes.lock();
        l.retain(|w| w.strong_count() > 0);
        l.push(Arc::downgrade(&m));
        m
    }

    /// Whether a lane of this peer is inside a copy of region `id` now.
    pub fn holds(&self, id: RegionId) -> bool {
        let want = mark_of(id);
        self.lanes.lock().iter().filter_map(Weak::upgrade).any(|m| {
            let v = m.load(Ordering::Relaxed);
            v == want || v == MARK_ANY
        })
    }
}

/// The [`CopyMarks`] value of a region (never 0: generations start at 1).
pub(crate) fn mark_of(id: RegionId) -> u64 {
    (u64::from(id.index) << 32) | u64::from(id.generation)
}

/// A copy marked on a lane (see [`CopyMarks`]) for as long as it lives.
pub(crate) struct Marked<'a>(&'a AtomicU64);

impl<'a> Marked<'a> {
    pub fn new(mark: &'a AtomicU64, value: u64) -> Marked<'a> {
        mark.store(value, Ordering::Relaxed);
        Marked(mark)
    }
}

impl Drop for Marked<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

//! Region withdrawals awaiting the answers of same-host peers (see `Core::withdraw`).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;

use parking_lot::Mutex;

use crate::types::PeerId;

/// Region withdrawals (unregister of caller memory) awaiting each same-host peer's answer.
#[derive(Default)]
pub(super) struct RegionFences {
    pub(super) next: AtomicU64,
    /// Fence number -> its state.
    pub(super) m: Mutex<HashMap<u64, Fence>>,
    pub(super) cv: parking_lot::Condvar,
}

#[derive(Default)]
pub(super) struct Fence {
    /// Peers that have not answered yet.
    pub(super) waiting: std::collections::HashSet<PeerId>,
    /// Processes of peers disconnected before answering.
    pub(super) lost: Vec<u32>,
}

impl RegionFences {
    pub(super) fn acked(&self, seq: u64, peer: PeerId) {
        if let Some(f) = self.m.lock().get_mut(&seq) {
            f.waiting.remove(&peer);
        }
        self.cv.notify_all();
    }

    /// A peer was disconnected: it cannot answer any more.
    pub(super) fn peer_gone(&self, peer: PeerId, pid: u32) {
        for f in self.m.lock().values_mut() {
            if f.waiting.remove(&peer) {
                f.lost.push(pid);
            }
        }
        self.cv.notify_all();
    }
}

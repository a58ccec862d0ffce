//! Regions: memory registered with the engine, named by generation-checked handles.
//!
//! A peer never sees a pointer: it sees a [`RegionId`] (slot index + generation), the length and
//! the access it is granted. Unregistering a region bumps the slot's generation, so every
//! handle or id minted before is refused as [`Error::StaleRegion`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex, RwLock};

use crate::error::Error;
use crate::mem::RegionMem;
use crate::types::{Access, RegionHandle, RegionId, RemoteRegion};

/// Checks `offset .. offset+len` against a region of `region_len` bytes, without overflow.
pub(crate) fn check_bounds(
    region: RegionId,
    offset: u64,
    len: u64,
    region_len: u64,
) -> Result<(), Error> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(Error::OutOfBounds {
            region,
            offset,
            len,
            region_len,
        }),
    }
}

/// One registered region.
#[derive(Debug)]
pub(crate) struct RegionEntry {
    pub id: RegionId,
    pub access: Access,
    pub mem: Arc<RegionMem>,
    /// Copies by engine threads into or out of `mem` running now (see [`RegionGate`]).
    pub gate: RegionGate,
}

impl RegionEntry {
    /// Marks a copy into or out of this region's memory as running, for as long as the guard
    /// lives; refused with [`Error::StaleRegion`] once the region was unregistered.
    pub fn enter(&self) -> Result<GateGuard<'_>, Error> {
        self.gate.enter().ok_or(Error::StaleRegion(self.id))
    }
}

/// Set in [`RegionGate::state`] once the region is withdrawn.
const CLOSED: usize = 1 << (usize::BITS - 1);

/// Counts the copies engine threads (tcp lanes, the shm copy path, `local_write`/`local_read`)
/// are making into or out of a region's memory, separately from the lifetime of the `Arc`s
/// that name the region (a batch keeps those until its handle drops). `unregister` closes the
/// gate, so later copies are refused, and waits until the running ones ended: then no engine
/// thread touches caller memory any more.
///
/// Entering and leaving are one atomic add each (no lock); only a leave that ends the last copy
/// of a closed gate takes the mutex, to wake the waiter.
#[derive(Debug, Default)]
pub(crate) struct RegionGate {
    /// Running copies, plus [`CLOSED`].
    state: AtomicUsize,
    m: Mutex<()>,
    cv: Condvar,
}

/// A running copy (see [`RegionGate`]); ends when dropped.
#[must_use = "the copy is only covered while the guard lives"]
pub(crate) struct GateGuard<'a> {
    gate: &'a RegionGate,
}

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        self.gate.leave();
    }
}

impl RegionGate {
    /// Starts a copy; `None` once the gate is closed.
    pub fn enter(&self) -> Option<GateGuard<'_>> {
        // Acquire: pairs with nothing the copy needs, but keeps the copy after the check.
        let prev = self.state.fetch_add(1, Ordering::Acquire);
        if prev & CLOSED != 0 {
            self.leave();
            return None;
        }
        Some(GateGuard { gate: self })
    }

    fn leave(&self) {
        // Release: the copy's accesses happen before the waiter sees the count drop.
        let prev = self.state.fetch_sub(1, Ordering::Release);
        if prev == CLOSED | 1 {
            // The last copy of a closed gate: wake the waiter (under the mutex, so a waiter
            // that saw the old count is already parked and gets the signal).
            let _g = self.m.lock();
            self.cv.notify_all();
        }
    }

    /// Refuses every later [`RegionGate::enter`].
    pub fn close(&self) {
        self.state.fetch_or(CLOSED, Ordering::AcqRel);
    }

    /// Copies running now.
    pub fn running(&self) -> usize {
        self.state.load(Ordering::Acquire) & !CLOSED
    }

    /// Waits until no copy runs any more (after [`RegionGate::close`]) or `until` passed;
    /// returns whether it is idle.
    pub fn wait_idle(&self, until: Instant) -> bool {
        let mut g = self.m.lock();
        while self.running() != 0 {
            if self.cv.wait_until(&mut g, until).timed_out() {
                return self.running() == 0;
            }
        }
        true
    }
}

struct Slot {
    generation: u32,
    entry: Option<Arc<RegionEntry>>,
}

/// The engine's table of regions: a slab of generation-checked slots.
#[derive(Default)]
pub(crate) struct RegionTable {
    inner: RwLock<TableInner>,
}

#[derive(Default)]
struct TableInner {
    slots: Vec<Slot>,
    free: Vec<u32>,
}

/// Maximum number of regions one engine holds (bounds the table).
pub(crate) const MAX_REGIONS: usize = 1 << 20;

impl RegionTable {
    pub fn insert(&self, mem: Arc<RegionMem>, access: Access) -> Result<RegionHandle, Error> {
        let mut t = self.inner.write();
        let index = match t.free.pop() {
            Some(i) => i,
            None => {
                if t.slots.len() >= MAX_REGIONS {
                    return Err(Error::InvalidArgument(format!(
                        "too many regions (max {MAX_REGIONS})"
                    )));
                }
                t.slots.push(Slot {
                    generation: 1,
                    entry: None,
                });
                (t.slots.len() - 1) as u32
            }
        };
        let slot = &mut t.slots[index as usize];
        let id = RegionId {
            index,
            generation: slot.generation,
        };
        slot.entry = Some(Arc::new(RegionEntry {
            id,
            access,
            mem,
            gate: RegionGate::default(),
        }));
        Ok(RegionHandle {
            index,
            generation: id.generation,
        })
    }

    pub fn remove(&self, h: RegionHandle) -> Result<Arc<RegionEntry>, Error> {
        let mut t = self.inner.write();
        let id = h.id();
        let slot = t
            .slots
            .get_mut(h.index as usize)
            .ok_or(Error::UnknownRegion(id))?;
        if slot.generation != h.generation || slot.entry.is_none() {
            return Err(Error::StaleRegion(id));
        }
        let e = slot.entry.take().ok_or(Error::StaleRegion(id))?;
        slot.generation = slot.generation.wrapping_add(1).max(1);
        t.free.push(h.index);
        Ok(e)
    }

    pub fn get(&self, id: RegionId) -> Result<Arc<RegionEntry>, Error> {
        let t = self.inner.read();
        let slot = t
            .slots
            .get(id.index as usize)
            .ok_or(Error::UnknownRegion(id))?;
        match &slot.entry {
            Some(e) if slot.generation == id.generation => Ok(e.clone()),
            _ if id.generation < slot.generation => Err(Error::StaleRegion(id)),
            _ => Err(Error::UnknownRegion(id)),
        }
    }

    /// Lookup for a remote access: the region must exist, be current and be offered.
    /// A region with [`Access::Local`] is reported as unknown (it is not offered at all).
    pub fn get_remote(&self, id: RegionId, write: bool) -> Result<Arc<RegionEntry>, Error> {
        let e = self.get(id)?;
        if !e.access.offered() {
            return Err(Error::AccessDenied(id));
        }
        let ok = if write {
            e.access.remote_write()
        } else {
            e.access.remote_read()
        };
        if !ok {
            return Err(Error::AccessDenied(id));
        }
        Ok(e)
    }

    /// The regions offered to peers.
    pub fn offered(&self) -> Vec<RemoteRegion> {
        let t = self.inner.read();
        t.slots
            .iter()
            .filter_map(|s| s.entry.as_ref())
            .filter(|e| e.access.offered())
            .map(|e| RemoteRegion {
                id: e.id,
                len: e.mem.len() as u64,
                access: e.access,
            })
            .collect()
    }

    pub fn all(&self) -> Vec<Arc<RegionEntry>> {
        let t = self.inner.read();
        t.slots.iter().filter_map(|s| s.entry.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn gate_refuses_after_close_and_waits_for_running_copies() {
        let g = Arc::new(RegionGate::default());
        let a = g.enter().expect("open gate");
        let b = g.enter().expect("open gate");
        assert_eq!(g.running(), 2);
        drop(b);
        g.close();
        assert!(g.enter().is_none(), "closed gate admits no copy");
        assert_eq!(g.running(), 1, "a refused entry leaves no count behind");
        // A copy still runs: not idle (an expired deadline returns at once).
        assert!(!g.wait_idle(Instant::now()));
        // The waiter returns once the running copy ended on another thread.
        let (tx, rx) = std::sync::mpsc::channel();
        let w = {
            let g = g.clone();
            std::thread::spawn(move || {
                let idle = g.wait_idle(Instant::now() + Duration::from_secs(60));
                let _ = tx.send(());
                idle
            })
        };
        // Nothing wakes the waiter before the copy ends (bounded look).
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
        drop(a);
        assert!(w.join().expect("waiter"));
        assert_eq!(g.running(), 0);
        assert!(g.wait_idle(Instant::now()));
    }

    #[test]
    fn entry_enter_names_the_region_when_refused() {
        let t = RegionTable::default();
        let mem = Arc::new(RegionMem::alloc_memfd(4096).expect("memfd"));
        let h = t.insert(mem, Access::ReadWrite).expect("insert");
        let e = t.remove(h).expect("remove");
        assert!(e.enter().is_ok());
        e.gate.close();
        assert!(matches!(e.enter(), Err(Error::StaleRegion(id)) if id == h.id()));
    }
}

//! Regions: memory registered with the engine, named by generation-checked handles.
//!
//! A peer never sees a pointer: it sees a [`RegionId`] (slot index + generation), the length and
//! the access it is granted. Unregistering a region bumps the slot's generation, so every
//! handle or id minted before is refused as [`Error::StaleRegion`].

use std::sync::Arc;

use parking_lot::RwLock;

use crate::error::Error;
use crate::mem::RegionMem;

/// A local handle to a registered region (slot index + generation). Cheap to copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionHandle {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

impl RegionHandle {
    /// The id under which peers see this region.
    pub fn id(&self) -> RegionId {
        RegionId {
            index: self.index,
            generation: self.generation,
        }
    }
}

/// The name of a region as peers see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionId {
    /// Slot index in the owner's region table.
    pub index: u32,
    /// Generation of the slot when the region was registered.
    pub generation: u32,
}

/// What remote peers may do with a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Remote peers may write and read.
    ReadWrite,
    /// Remote peers may write only.
    WriteOnly,
    /// Remote peers may read only.
    ReadOnly,
    /// Not offered to peers at all (local source/destination buffers).
    Local,
}

impl Access {
    /// Whether a remote peer may write into a region with this access.
    pub fn remote_write(self) -> bool {
        matches!(self, Access::ReadWrite | Access::WriteOnly)
    }
    /// Whether a remote peer may read from a region with this access.
    pub fn remote_read(self) -> bool {
        matches!(self, Access::ReadWrite | Access::ReadOnly)
    }
    /// Whether the region is offered to peers at all.
    pub fn offered(self) -> bool {
        !matches!(self, Access::Local)
    }
    pub(crate) fn to_wire(self) -> u8 {
        match self {
            Access::ReadWrite => 0,
            Access::WriteOnly => 1,
            Access::ReadOnly => 2,
            Access::Local => 3,
        }
    }
    pub(crate) fn from_wire(b: u8) -> Option<Access> {
        Some(match b {
            0 => Access::ReadWrite,
            1 => Access::WriteOnly,
            2 => Access::ReadOnly,
            3 => Access::Local,
            _ => return None,
        })
    }
}

/// A region a remote peer offers to us.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// The region's id on the remote engine.
    pub id: RegionId,
    /// Its length in bytes.
    pub len: u64,
    /// What we may do with it.
    pub access: Access,
}

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
        slot.entry = Some(Arc::new(RegionEntry { id, access, mem }));
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

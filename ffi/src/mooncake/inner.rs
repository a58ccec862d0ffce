//! The engine behind a drop-in `TransferEngine`: our registered buffers and the address map
//! that publishes them.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicI64;
use std::sync::Arc;
use std::time::Duration;

use kvwire_transfer::{Access, Batch, Engine, Error, RegionHandle};
use parking_lot::Mutex;

use super::addrmap::{encode_entries, header, MapEntry, HEADER, MAX_ENTRIES};
use super::segments::Remote;
use crate::rawmem::{self, ManagedBuffer};

/// Why a drop-in call failed (turned into a negative return code and a log line).
#[derive(Debug)]
pub(super) enum MError {
    NotInitialized,
    Engine(Error),
    Other(String),
}

impl std::fmt::Display for MError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MError::NotInitialized => write!(f, "engine not initialized (call initialize first)"),
            MError::Engine(e) => write!(f, "{e}"),
            MError::Other(s) => write!(f, "{s}"),
        }
    }
}

impl From<Error> for MError {
    fn from(e: Error) -> Self {
        MError::Engine(e)
    }
}

/// Our registered buffers.
#[derive(Default)]
pub(super) struct Local {
    /// base address → (handle, length).
    pub(super) regions: BTreeMap<u64, (RegionHandle, u64)>,
    pub(super) managed: HashMap<u64, ManagedBuffer>,
    pub(super) seq: u64,
}

/// What an initialized drop-in engine holds.
pub(super) struct Inner {
    pub(super) engine: Engine,
    pub(super) hostname: String,
    pub(super) meta: RegionHandle,
    pub(super) local: Mutex<Local>,
    pub(super) remotes: Mutex<HashMap<String, Arc<Remote>>>,
    /// Serialises address-map reads (they share one scratch region).
    pub(super) scratch: Mutex<Option<RegionHandle>>,
    pub(super) batches: Mutex<HashMap<i64, Vec<Batch>>>,
    pub(super) next_batch: AtomicI64,
    pub(super) timeout: Duration,
}

impl Inner {
    /// Rewrites our address map (call with `local` locked).
    pub(super) fn publish(&self, local: &mut Local) -> Result<(), MError> {
        let entries: Vec<MapEntry> = local
            .regions
            .iter()
            .map(|(&base, &(h, len))| MapEntry {
                base,
                len,
                id: h.id(),
            })
            .collect();
        if entries.len() > MAX_ENTRIES {
            return Err(MError::Other(format!(
                "more than {MAX_ENTRIES} registered buffers"
            )));
        }
        local.seq += 1; // odd: being rewritten
        self.engine
            .local_write(self.meta, 0, &header(local.seq, 0))?;
        self.engine
            .local_write(self.meta, HEADER as u64, &encode_entries(&entries))?;
        local.seq += 1; // even: stable
        self.engine
            .local_write(self.meta, 0, &header(local.seq, entries.len() as u32))?;
        Ok(())
    }

    pub(super) fn register(
        &self,
        addr: u64,
        len: u64,
        managed: Option<ManagedBuffer>,
    ) -> Result<(), MError> {
        let mut local = self.local.lock();
        let end = addr
            .checked_add(len)
            .ok_or_else(|| MError::Other(format!("{addr:#x} + {len} overflows")))?;
        if let Some((&b, &(_, l))) = local.regions.range(..end).next_back() {
            if b + l > addr {
                return Err(MError::Other(format!(
                    "buffer {addr:#x}+{len} overlaps the registered buffer {b:#x}+{l}"
                )));
            }
        }
        let h = match rawmem::check_mapped(addr, len) {
            Ok(()) => rawmem::register(&self.engine, addr, len, Access::ReadWrite, false)?,
            // CUDA device memory (Mooncake registers GPU KV caches): a device region, which
            // same-host peers reach with the cuda_ipc transport
            Err(host) => match crate::cuda::device_of(addr) {
                Some(dev) => {
                    crate::cuda::register_device(&self.engine, addr, len, Access::ReadWrite, dev)
                        .map_err(|e| MError::Other(format!("registering CUDA memory: {e}")))?
                }
                None => return Err(MError::Engine(Error::InvalidArgument(host))),
            },
        };
        local.regions.insert(addr, (h, len));
        if let Some(m) = managed {
            local.managed.insert(addr, m);
        }
        if let Err(e) = self.publish(&mut local) {
            local.regions.remove(&addr);
            let _ = self.engine.unregister(h);
            return Err(e);
        }
        Ok(())
    }

    pub(super) fn unregister(&self, addr: u64) -> Result<(), MError> {
        let mut local = self.local.lock();
        let (h, _) = local
            .regions
            .remove(&addr)
            .ok_or_else(|| MError::Other(format!("no buffer registered at {addr:#x}")))?;
        self.engine.unregister(h)?;
        local.managed.remove(&addr);
        self.publish(&mut local)
    }

    pub(super) fn local_op(&self, addr: u64, len: u64) -> Result<(RegionHandle, u64), MError> {
        let local = self.local.lock();
        if let Some((&b, &(h, l))) = local.regions.range(..=addr).next_back() {
            let off = addr - b;
            if off.checked_add(len).is_some_and(|e| e <= l) {
                return Ok((h, off));
            }
        }
        Err(MError::Engine(Error::InvalidArgument(format!(
            "local buffer {addr:#x}+{len} is not inside a registered buffer"
        ))))
    }
}

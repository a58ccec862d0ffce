//! Regions: registration and unregistration (withdrawal from peers, fences, waiting for
//! copies), local copies in and out, and how a region is described to a peer.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::core::{Core, Engine};
use super::fence::Fence;
use crate::error::Error;
use crate::mem::RegionMem;
use crate::region::{check_bounds, RegionEntry};
use crate::types::{Access, PeerId, RegionHandle, RegionId};
use crate::wire::fence::{EngineMsg, FenceKind};
use crate::wire::{CtrlMsg, MrChunks, WireRegion};

/// `e` as described to a peer (`shm`: on this host); `keys`: its RDMA keys (0: none), see
/// `Core::rdma_keys`.
pub(super) fn wire_region(e: &RegionEntry, shm: bool, keys: (u32, Option<MrChunks>)) -> WireRegion {
    let (rkey, chunks) = keys;
    let device = e.mem.device_ipc();
    let (addr, fd, ino) = if device.is_some() {
        // No host mapping to share: CUDA IPC reaches it by its handle, RDMA (where a NIC
        // registered it: GPUDirect) by its device address.
        (if rkey != 0 { e.mem.addr() } else { 0 }, -1, 0)
    } else if shm {
        (
            e.mem.addr(),
            e.mem.memfd().map(|f| f.as_raw_fd()).unwrap_or(-1),
            e.mem.memfd_ino(),
        )
    } else if rkey != 0 {
        (e.mem.addr(), -1, 0)
    } else {
        (0, -1, 0)
    };
    WireRegion {
        id: e.id,
        len: e.mem.len() as u64,
        access: e.access,
        addr,
        fd,
        ino,
        rkey,
        chunks: chunks.filter(|_| rkey != 0),
        ipc: device.filter(|_| shm).map(|(_, ipc)| ipc),
    }
}

impl Engine {
    /// Allocates an engine-owned region: zeroed, page aligned, backed by a memfd (so same-host
    /// peers can map it).
    pub fn alloc_region(&self, len: usize, access: Access) -> Result<RegionHandle, Error> {
        let mem = RegionMem::alloc_memfd(len).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidInput => Error::InvalidArgument(e.to_string()),
            _ => Error::Io(e),
        })?;
        self.core().add_region(Arc::new(mem), access)
    }

    /// Registers caller-owned memory (counted as `host` memory in the metrics).
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid for reads and writes until [`Engine::unregister`] of the
    /// region returned `Ok` (after an error it must stay valid, see there), and, over RDMA,
    /// until every batch that used the region has completed; the caller must not hold Rust
    /// references into it while peers may write (remote writes land at any time).
    #[allow(unsafe_code)] // the caller's contract, forwarded to `RegionMem::from_raw`
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<RegionHandle, Error> {
        // SAFETY: forwarded contract of this function.
        unsafe { self.register_caller(ptr, len, access, false) }
    }

    /// [`Engine::register_raw`] for host memory the caller pinned with the CUDA driver
    /// (`cudaHostAlloc`, `cudaHostRegister`): the same, counted as `pinned` in the metrics.
    /// The caller says so because the driver cannot: where pageable memory is accessible to the
    /// GPU (HMM), it reports pageable and pinned host memory alike.
    ///
    /// # Safety
    /// As [`Engine::register_raw`].
    #[allow(unsafe_code)] // the caller's contract, forwarded to `RegionMem::from_raw`
    pub unsafe fn register_raw_pinned(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<RegionHandle, Error> {
        // SAFETY: forwarded contract of this function.
        unsafe { self.register_caller(ptr, len, access, true) }
    }

    #[allow(unsafe_code)] // the callers' contract, forwarded to `RegionMem::from_raw`
    unsafe fn register_caller(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
        pinned: bool,
    ) -> Result<RegionHandle, Error> {
        // SAFETY: forwarded contract of the two public callers.
        let mem = unsafe { RegionMem::from_raw(ptr, len) }
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        self.core()
            .add_region(Arc::new(mem.with_pinned(pinned)), access)
    }

    /// Registers memory the crate prepared (device memory, from `cuda`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn register_mem(
        &self,
        mem: RegionMem,
        access: Access,
    ) -> Result<RegionHandle, Error> {
        self.core().add_region(Arc::new(mem), access)
    }

    /// Unregisters a region; its handle and id become stale everywhere.
    ///
    /// From the moment this begins, this engine's threads refuse every copy into or out of the
    /// region's memory with [`Error::StaleRegion`]: TCP slices a peer writes into it or reads
    /// from it (the peer's batch fails with `StaleRegion`), data of our TCP reads landing in it,
    /// payload of our TCP writes sent from it, our shm copies from or into it, `local_write` and
    /// `local_read`. A batch already submitted that still needed the region fails with
    /// `StaleRegion`, and a notification it carries is not delivered. (RDMA work requests
    /// already posted are the NIC's and complete.)
    ///
    /// For caller memory ([`Engine::register_raw`]) this also waits until every such copy that
    /// was already running ended: once it returns `Ok`, neither this engine nor any peer reads
    /// or writes the memory any more (RDMA work requests aside), and the caller may reuse or
    /// free it. A TCP copy still running after `EngineConfig::default_deadline` (a peer stalled
    /// in the middle of a frame) is aborted by disconnecting that peer, after which this
    /// returns `Ok` as well; if even then it does not end within another `default_deadline`,
    /// this returns [`Error::Timeout`] and the memory must not be reused.
    ///
    /// Offered caller memory is also written directly by same-host peers (shm), so this waits
    /// until every such peer confirmed that it withdrew the region and that none of its copies
    /// into it is still running; copies it has not started fail with [`Error::StaleRegion`]. A
    /// peer that does not confirm within `EngineConfig::default_deadline` is disconnected and
    /// this returns [`Error::Timeout`]; one disconnected before answering while its process
    /// lives gives [`Error::PeerDead`]. In both cases the region is withdrawn, but a copy that
    /// peer had already begun may still land, so the memory must not be reused then.
    pub fn unregister(&self, r: RegionHandle) -> Result<(), Error> {
        let core = self.core();
        let (e, fence) = {
            let _g = core.reg_lock.lock();
            let e = core.regions.remove(r)?;
            e.gate.close();
            for t in &core.transports {
                t.region_removed(e.id);
            }
            core.metrics.unregistrations.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(region = ?e.id, "region unregistered");
            let fence = if e.access.offered() {
                core.withdraw(e.id, e.mem.memfd().is_none())
            } else {
                None
            };
            (e, fence)
        };
        let fenced = match fence {
            Some(seq) => core.await_fence(seq),
            None => Ok(()),
        };
        // Engine-allocated memory lives as long as the copies that hold it; caller memory must
        // be left alone once this returns.
        let copies = if e.mem.memfd().is_none() {
            core.await_copies(&e)
        } else {
            Ok(())
        };
        fenced.and(copies)
    }

    /// Copies `data` into a local region.
    pub fn local_write(&self, r: RegionHandle, offset: u64, data: &[u8]) -> Result<(), Error> {
        let e = self.core().regions.get(r.id())?;
        check_bounds(r.id(), offset, data.len() as u64, e.mem.len() as u64)?;
        let _g = e.enter()?;
        e.mem.copy_in(offset, data)?;
        Ok(())
    }

    /// Copies bytes out of a local region.
    pub fn local_read(&self, r: RegionHandle, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        let e = self.core().regions.get(r.id())?;
        check_bounds(r.id(), offset, out.len() as u64, e.mem.len() as u64)?;
        let _g = e.enter()?;
        e.mem.copy_out(offset, out)?;
        Ok(())
    }

    /// The id under which peers see a region.
    pub fn region_id(&self, r: RegionHandle) -> RegionId {
        r.id()
    }

    /// Length of a local region.
    pub fn region_len(&self, r: RegionHandle) -> Result<u64, Error> {
        Ok(self.core().regions.get(r.id())?.mem.len() as u64)
    }
}

impl Core {
    pub(super) fn add_region(
        &self,
        mem: Arc<RegionMem>,
        access: Access,
    ) -> Result<RegionHandle, Error> {
        let t0 = Instant::now();
        let len = mem.len() as u64;
        let h = self.add_region_inner(mem, access)?;
        let ns = t0.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        let m = &self.metrics;
        m.registrations.fetch_add(1, Ordering::Relaxed);
        m.registered_bytes.fetch_add(len, Ordering::Relaxed);
        m.registration_ns.fetch_add(ns, Ordering::Relaxed);
        tracing::debug!(region = ?h.id(), bytes = len, duration_us = ns / 1000, "region registered");
        Ok(h)
    }

    pub(super) fn add_region_inner(
        &self,
        mem: Arc<RegionMem>,
        access: Access,
    ) -> Result<RegionHandle, Error> {
        self.check_open()?;
        let _g = self.reg_lock.lock();
        let h = self.regions.insert(mem, access)?;
        let e = self.regions.get(h.id())?;
        for (i, t) in self.transports.iter().enumerate() {
            if let Err(err) = t.region_added(&e) {
                for t in &self.transports[..i] {
                    t.region_removed(e.id);
                }
                let _ = self.regions.remove(h);
                return Err(err);
            }
        }
        if access.offered() {
            let keys = self.rdma_keys(e.id);
            self.broadcast(|p| {
                CtrlMsg::RegionsAdded(vec![wire_region(&e, p.same_host, keys.clone())])
            });
        }
        Ok(h)
    }

    /// Tells every peer that region `id` is gone (callers hold `reg_lock`). For caller memory,
    /// same-host peers (which may be copying into it) also get a fence; returns its number.
    pub(super) fn withdraw(&self, id: RegionId, raw: bool) -> Option<u64> {
        let peers: Vec<_> = self.peers.lock().values().cloned().collect();
        let seq = self.fences.next.fetch_add(1, Ordering::Relaxed);
        let fenced: Vec<(PeerId, u32)> = peers
            .iter()
            .filter(|p| raw && p.same_host)
            .map(|p| (p.id, p.remote_host.pid))
            .collect();
        if !fenced.is_empty() {
            // Registered before anything is sent: an answer may come back at once.
            self.fences.m.lock().insert(
                seq,
                Fence {
                    waiting: fenced.iter().map(|f| f.0).collect(),
                    lost: Vec::new(),
                },
            );
        }
        for p in peers {
            let mut buf = CtrlMsg::RegionsRemoved(vec![id]).encode();
            let fence = raw && p.same_host;
            if fence {
                buf.extend_from_slice(
                    &EngineMsg::Fence(FenceKind::Regions, seq).to_ctrl().encode(),
                );
            }
            let sent = p.ctrl.write_encoded(&buf);
            if let Err(e) = sent {
                tracing::debug!(peer = ?p.id, error = %e, "region withdrawal not sent");
                if fence {
                    // It cannot answer (counted as lost by `kill_peer`).
                    self.kill_peer(p.id, &format!("region withdrawal not sent: {e}"), false);
                }
            }
        }
        // Peers disconnected since the snapshot will never answer.
        for (peer, pid) in &fenced {
            if !self.peers.lock().contains_key(peer) {
                self.fences.peer_gone(*peer, *pid);
            }
        }
        (!fenced.is_empty()).then_some(seq)
    }

    /// Waits until every peer of fence `seq` confirmed it or went away (bounded by
    /// `default_deadline`; peers still silent then are disconnected, `Error::Timeout`).
    pub(super) fn await_fence(&self, seq: u64) -> Result<(), Error> {
        let until = Instant::now() + self.cfg.default_deadline;
        let mut m = self.fences.m.lock();
        loop {
            let left = m.get(&seq).map_or(0, |f| f.waiting.len());
            if left == 0 {
                let f = m.remove(&seq).unwrap_or_default();
                drop(m);
                // A peer that went away without answering is harmless only if its process is
                // gone too (a live one may still be inside a copy it began).
                let alive: Vec<u32> = f
                    .lost
                    .into_iter()
                    .filter(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
                    .collect();
                if alive.is_empty() {
                    return Ok(());
                }
                return Err(Error::PeerDead(format!(
                    "same-host peer process(es) {alive:?} disconnected before confirming the \
                     region withdrawal; a copy already begun may still land"
                )));
            }
            if self.fences.cv.wait_until(&mut m, until).timed_out() {
                let silent = m.remove(&seq).map(|f| f.waiting).unwrap_or_default();
                drop(m);
                if silent.is_empty() {
                    return Ok(());
                }
                for id in silent {
                    self.kill_peer(
                        id,
                        "did not confirm a region withdrawal before the deadline",
                        false,
                    );
                }
                return Err(Error::Timeout);
            }
        }
    }

    /// Waits until no engine thread copies into or out of withdrawn region `e` any more (its
    /// gate is closed). A copy still running after `default_deadline` is stuck on a stalled
    /// peer (a TCP lane inside a frame): the peers whose lanes are inside a copy of the region
    /// are disconnected, which ends it; `Error::Timeout` if it still did not end within a
    /// second `default_deadline`.
    pub(super) fn await_copies(&self, e: &RegionEntry) -> Result<(), Error> {
        if e.gate.wait_idle(Instant::now() + self.cfg.default_deadline) {
            return Ok(());
        }
        let until = Instant::now() + self.cfg.default_deadline;
        loop {
            let stuck: Vec<PeerId> = self
                .peers
                .lock()
                .values()
                .filter(|p| p.marks.holds(e.id))
                .map(|p| p.id)
                .collect();
            for id in stuck {
                tracing::warn!(peer = id.0, region = ?e.id, "peer stalled inside a copy of an unregistered region");
                self.kill_peer(
                    id,
                    "stalled inside a copy of a region being unregistered",
                    false,
                );
            }
            // Re-checked now and then: a lane may mark its copy just after the scan.
            let next = (Instant::now() + Duration::from_millis(50)).min(until);
            if e.gate.wait_idle(next) {
                return Ok(());
            }
            if Instant::now() >= until {
                tracing::warn!(region = ?e.id, running = e.gate.running(), "copies of an unregistered region did not end");
                return Err(Error::Timeout);
            }
        }
    }

    pub(super) fn offered_wire(&self, shm: bool) -> Vec<WireRegion> {
        self.regions
            .all()
            .iter()
            .filter(|e| e.access.offered())
            .map(|e| wire_region(e, shm, self.rdma_keys(e.id)))
            .collect()
    }
}

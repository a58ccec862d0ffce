//! Staging: memory the engine cannot send from (CUDA device memory on tcp/shm) is copied
//! layer by layer into a pool of registered host buffers, and sent from there.
//!
//! A [`StagingPool`] holds a fixed set of equally sized buffers, each an engine region. A
//! stream leases a buffer ([`Lease`]) per chunk of a layer, has the [`Stager`] fill it, writes
//! it to the peer, and returns it when the write completes — so with two or more buffers the
//! copy of one chunk overlaps the send of the previous one. Leases return themselves on drop;
//! [`StagingPool::in_use`] counts what is out, so leaks are visible.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::engine::Engine;
use crate::error::Error;
use crate::layer::layout::SrcSpace;
use crate::types::{Access, RegionHandle};

/// One staging buffer: an engine region of `len` bytes (and its host address when known).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingBuffer {
    /// The engine region writes are sent from.
    pub region: RegionHandle,
    /// Bytes.
    pub len: u64,
    /// Host address of the buffer (for device-to-host copies); 0 when not needed.
    pub host_addr: usize,
}

type Waiter = Box<dyn FnOnce() + Send>;
type Release = Box<dyn FnOnce(Vec<StagingBuffer>) + Send + Sync>;

struct PoolState {
    free: Vec<usize>,
    waiters: Vec<Waiter>,
}

/// A fixed pool of staging buffers.
pub struct StagingPool {
    bufs: Vec<StagingBuffer>,
    buffer_len: u64,
    st: Mutex<PoolState>,
    in_use: AtomicUsize,
    leased_total: AtomicUsize,
    release: Mutex<Option<Release>>,
}

impl std::fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingPool")
            .field("buffers", &self.bufs.len())
            .field("buffer_len", &self.buffer_len)
            .field("in_use", &self.in_use())
            .finish()
    }
}

impl StagingPool {
    /// A pool over `bufs` (all the same length, at least one). `release` runs once when the
    /// pool and every lease are gone (unregister and free the memory there).
    pub fn new(bufs: Vec<StagingBuffer>, release: Option<Release>) -> Result<Arc<Self>, Error> {
        let Some(first) = bufs.first() else {
            return Err(Error::InvalidArgument(
                "staging pool needs at least one buffer".into(),
            ));
        };
        let buffer_len = first.len;
        if buffer_len == 0 || bufs.iter().any(|b| b.len != buffer_len) {
            return Err(Error::InvalidArgument(
                "staging buffers must be non-empty and of equal length".into(),
            ));
        }
        Ok(Arc::new(StagingPool {
            buffer_len,
            st: Mutex::new(PoolState {
                free: (0..bufs.len()).rev().collect(),
                waiters: Vec::new(),
            }),
            bufs,
            in_use: AtomicUsize::new(0),
            leased_total: AtomicUsize::new(0),
            release: Mutex::new(release),
        }))
    }

    /// `count` host buffers of `len` bytes allocated by the engine (memfd regions, not offered
    /// to peers); unregistered when the pool is gone.
    pub fn host(engine: &Engine, count: usize, len: usize) -> Result<Arc<Self>, Error> {
        let mut bufs = Vec::with_capacity(count);
        for _ in 0..count {
            match engine.alloc_region(len, Access::Local) {
                Ok(region) => bufs.push(StagingBuffer {
                    region,
                    len: len as u64,
                    host_addr: 0,
                }),
                Err(e) => {
                    for b in bufs {
                        let _ = engine.unregister(b.region);
                    }
                    return Err(e);
                }
            }
        }
        let eng = engine.clone();
        StagingPool::new(
            bufs,
            Some(Box::new(move |bufs: Vec<StagingBuffer>| {
                for b in bufs {
                    let _ = eng.unregister(b.region);
                }
            })),
        )
    }

    /// Takes a free buffer, if any.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Lease> {
        let idx = self.st.lock().free.pop()?;
        self.in_use.fetch_add(1, Ordering::AcqRel);
        self.leased_total.fetch_add(1, Ordering::Relaxed);
        Some(Lease {
            pool: self.clone(),
            idx,
        })
    }

    /// Calls `f` once, when a buffer is free (now, if one is).
    pub fn when_free(&self, f: impl FnOnce() + Send + 'static) {
        let mut g = self.st.lock();
        if g.free.is_empty() {
            g.waiters.push(Box::new(f));
        } else {
            drop(g);
            f();
        }
    }

    fn give_back(&self, idx: usize) {
        let waiters = {
            let mut g = self.st.lock();
            g.free.push(idx);
            std::mem::take(&mut g.waiters)
        };
        self.in_use.fetch_sub(1, Ordering::AcqRel);
        for w in waiters {
            w();
        }
    }

    /// Buffers leased right now.
    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Acquire)
    }

    /// Buffers in the pool.
    pub fn capacity(&self) -> usize {
        self.bufs.len()
    }

    /// Bytes per buffer.
    pub fn buffer_len(&self) -> u64 {
        self.buffer_len
    }

    /// Leases handed out since the pool was made.
    pub fn leased_total(&self) -> usize {
        self.leased_total.load(Ordering::Relaxed)
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        if let Some(r) = self.release.lock().take() {
            r(std::mem::take(&mut self.bufs));
        }
    }
}

/// A leased staging buffer; returns to its pool when dropped.
pub struct Lease {
    pool: Arc<StagingPool>,
    idx: usize,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("buffer", &self.buffer())
            .finish()
    }
}

impl Lease {
    /// The buffer.
    pub fn buffer(&self) -> StagingBuffer {
        self.pool.bufs[self.idx]
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pool.give_back(self.idx);
    }
}

/// One copy into a staging buffer: `len` bytes from `(src, src_offset)` to `buf_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageCopy {
    /// Source memory.
    pub src: SrcSpace,
    /// Offset in the source memory.
    pub src_offset: u64,
    /// Offset in the staging buffer.
    pub buf_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Called once by a [`Stager`] when a chunk's bytes are in the buffer (`Ok`) or cannot be.
pub type StageDone = Box<dyn FnOnce(Lease, Result<(), String>) + Send>;

/// Copies layer chunks into staging buffers.
pub trait Stager: Send + Sync + 'static {
    /// The pool buffers come from.
    fn pool(&self) -> &Arc<StagingPool>;

    /// Whether [`Stager::stage`] can order its copies after a CUDA event on the device (then a
    /// layer with a CUDA event is staged at once, without a host-side wait).
    fn orders_after_events(&self) -> bool {
        false
    }

    /// Copies `copies` into `lease`'s buffer, after `after_event` (a raw `CUevent`) when
    /// given, and calls `done` once with the lease when the bytes are there (from any thread;
    /// possibly before returning). The lease must stay alive until the copy has finished.
    fn stage(
        &self,
        after_event: Option<u64>,
        copies: Vec<StageCopy>,
        lease: Lease,
        done: StageDone,
    );

    /// Whether the stager can read this source memory.
    fn can_read(&self, src: SrcSpace) -> bool;
}

/// Stages from host memory registered with the engine (a CPU stand-in for device memory:
/// tests and benches exercise the staging pipeline with it). Copies on the calling thread.
pub struct HostStager {
    engine: Engine,
    pool: Arc<StagingPool>,
}

impl HostStager {
    /// A stager copying with `engine.local_read`/`local_write` into `pool`'s buffers.
    pub fn new(engine: Engine, pool: Arc<StagingPool>) -> Self {
        HostStager { engine, pool }
    }

    fn copy_all(&self, copies: &[StageCopy], buf: RegionHandle) -> Result<(), Error> {
        let mut tmp = Vec::new();
        for c in copies {
            let SrcSpace::Region(src) = c.src else {
                return Err(Error::InvalidArgument(
                    "host stager cannot read device memory".into(),
                ));
            };
            let len = usize::try_from(c.len)
                .map_err(|_| Error::InvalidArgument("copy too large".into()))?;
            tmp.resize(len, 0);
            self.engine.local_read(src, c.src_offset, &mut tmp)?;
            self.engine.local_write(buf, c.buf_offset, &tmp)?;
        }
        Ok(())
    }
}

impl Stager for HostStager {
    fn pool(&self) -> &Arc<StagingPool> {
        &self.pool
    }

    fn stage(
        &self,
        _after_event: Option<u64>,
        copies: Vec<StageCopy>,
        lease: Lease,
        done: StageDone,
    ) {
        let r = self
            .copy_all(&copies, lease.buffer().region)
            .map_err(|e| e.to_string());
        done(lease, r);
    }

    fn can_read(&self, src: SrcSpace) -> bool {
        matches!(src, SrcSpace::Region(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn pool_counts_leases_and_wakes_waiters() {
        let e = Engine::new(crate::config::EngineConfig::default()).unwrap();
        let pool = StagingPool::host(&e, 2, 4096).unwrap();
        assert_eq!(
            (pool.capacity(), pool.in_use(), pool.buffer_len()),
            (2, 0, 4096)
        );
        let a = pool.try_acquire().unwrap();
        let b = pool.try_acquire().unwrap();
        assert_ne!(a.buffer().region, b.buffer().region);
        assert!(pool.try_acquire().is_none());
        assert_eq!(pool.in_use(), 2);
        let woke = Arc::new(AtomicBool::new(false));
        let w = woke.clone();
        pool.when_free(move || w.store(true, Ordering::SeqCst));
        assert!(!woke.load(Ordering::SeqCst));
        drop(a);
        assert!(woke.load(Ordering::SeqCst));
        assert_eq!(pool.in_use(), 1);
        drop(b);
        assert_eq!((pool.in_use(), pool.leased_total()), (0, 2));
        assert!(StagingPool::new(Vec::new(), None).is_err());
    }

    #[test]
    fn pool_release_runs_after_the_last_lease() {
        let e = Engine::new(crate::config::EngineConfig::default()).unwrap();
        let pool = StagingPool::host(&e, 1, 4096).unwrap();
        let region = pool.try_acquire().map(|l| l.buffer().region).unwrap();
        let lease = pool.try_acquire().unwrap();
        drop(pool);
        // the lease keeps the pool (and its region) alive
        e.local_write(region, 0, b"x").unwrap();
        drop(lease);
        assert!(
            e.local_write(region, 0, b"x").is_err(),
            "region not unregistered"
        );
    }
}

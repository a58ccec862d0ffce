//! CUDA device memory, through `cudarc`'s driver API loaded at run time (`dynamic-loading`: no
//! toolkit to build, no link-time dependency on `libcuda`).
//!
//! Files, bottom up: `driver.rs` (the driver, devices, [`CudaError`]) and `ipc.rs` (CUDA IPC and
//! device copies), which the `cuda_ipc` transport uses below the engine; `region.rs` (device
//! memory as an engine region, [`register_device_region`]) and this file (layer-stream sources
//! and staging), which use the engine.
//!
//! Every entry point first checks that `libcuda` can be loaded ([`driver_present`], a cached
//! `is_culib_present()`), so a machine without a driver gets [`CudaError::NoDriver`] instead
//! of cudarc's panic.
//!
//! - [`EventReadiness`]: a layer is ready when a `CUevent` fires (raw handle from PyTorch's
//!   `torch.cuda.Event.cuda_event`, or recorded here on a foreign raw `CUstream`). Host-side
//!   waits happen on an [`EventWaiter`] thread blocked in `cuEventSynchronize`.
//! - [`CudaStager`]: stages device memory through a pool of pinned host buffers
//!   (`cuMemHostAlloc` with flags 0: cached, not write-combined, so the send path reads them at
//!   full speed), registered with the engine. Per chunk: `cuStreamWaitEvent(side, layer
//!   event)` — the copy is ordered after the layer on the device, the host never waits for
//!   the layer itself — then `cuMemcpyDtoHAsync` of each extent on a side stream, then an event
//!   the waiter thread synchronizes before the chunk is written. With two or more buffers, the
//!   copy of one chunk overlaps the send of the previous one.
//!
//! # GPUDirect RDMA
//!
//! tcp and shm always stage (the `cuda_ipc` transport, towards device regions of a same-host
//! peer, does not: it copies device to device). A device region ([`register_device_region`])
//! is also registered with the engine's RDMA devices where they take device memory: the
//! driver's dma-buf of it ([`export_dmabuf`]) through
//! `ibv_reg_dmabuf_mr` first, its device address (`ibv_reg_mr`, nvidia-peermem) second; then
//! RDMA work requests read and write it in place, and a layer stream can name it as
//! [`SrcSpace::Region`] with [`EventReadiness`] as the layer's readiness and no stager.
//! [`gpudirect_rdma_supported`] says whether the device claims support.
//!
//! [`ipc`]: device memory shared with another process of this host (CUDA IPC) and copies
//! into it on the device.
//!
//! All `unsafe` for CUDA lives in this module.

mod driver;
pub mod ipc;
mod region;

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};
use parking_lot::Mutex;

use crate::engine::Engine;
use crate::error::Error;
use crate::layer::{
    Lease, Readiness, ReadySignal, SrcSpace, StageCopy, StageDone, Stager, StagingBuffer,
    StagingPool,
};
use crate::types::Access;

pub(crate) use driver::create_blocking_event;
pub use driver::{
    context, device_count, device_ordinal, driver_present, export_dmabuf, gpudirect_rdma_supported,
    CudaError,
};
pub use region::register_device_region;

type WaitJob = (u64, Box<dyn FnOnce(Result<(), String>) + Send>);

/// A thread that waits for CUDA events (`cuEventSynchronize`, blocking) in the order they
/// are handed to it and runs a callback for each. Exits when the last handle is dropped.
pub struct EventWaiter {
    tx: Mutex<Option<crossbeam_channel::Sender<WaitJob>>>,
}

impl std::fmt::Debug for EventWaiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventWaiter")
    }
}

impl EventWaiter {
    /// Starts the waiter thread with `ctx` bound.
    pub fn new(ctx: Arc<CudaContext>) -> Result<Arc<Self>, CudaError> {
        let (tx, rx) = crossbeam_channel::unbounded::<WaitJob>();
        std::thread::Builder::new()
            .name("kvwire-cuda-wait".into())
            .spawn(move || {
                let bound = ctx.bind_to_thread().map_err(|e| format!("{e:?}"));
                for (ev, then) in rx.iter() {
                    let r = match &bound {
                        Err(e) => Err(e.clone()),
                        // SAFETY: whoever queued the event keeps it alive until `then` runs
                        // (EventReadiness moves itself into the callback; the stager
                        // destroys its own event inside the callback).
                        Ok(()) => unsafe { sys::cuEventSynchronize(ev as usize as sys::CUevent) }
                            .result()
                            .map_err(|e| format!("cuEventSynchronize: {e:?}")),
                    };
                    then(r);
                }
            })
            .map_err(|e| CudaError::Engine(Error::Io(e)))?;
        Ok(Arc::new(EventWaiter {
            tx: Mutex::new(Some(tx)),
        }))
    }

    /// Waits for `event` on the waiter thread, then calls `then`. The event must stay valid
    /// until `then` runs.
    fn push(&self, event: u64, then: Box<dyn FnOnce(Result<(), String>) + Send>) {
        let g = self.tx.lock();
        match g.as_ref() {
            Some(tx) => {
                if let Err(crossbeam_channel::SendError((_, then))) = tx.send((event, then)) {
                    then(Err("CUDA event waiter is gone".into()));
                }
            }
            None => then(Err("CUDA event waiter is gone".into())),
        }
    }
}

/// A layer is ready when a CUDA event fires.
pub struct EventReadiness {
    event: u64,
    owned: bool,
    ctx: Arc<CudaContext>,
    waiter: Arc<EventWaiter>,
}

// SAFETY: a CUevent handle is an opaque driver object usable from any thread that has its
// context bound (we bind before every call); the struct holds no thread-affine state.
unsafe impl Send for EventReadiness {}

impl std::fmt::Debug for EventReadiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventReadiness")
            .field("event", &format_args!("{:#x}", self.event))
            .field("owned", &self.owned)
            .finish()
    }
}

impl EventReadiness {
    /// An event owned elsewhere (e.g. `torch.cuda.Event().cuda_event`).
    ///
    /// # Safety
    /// `event` must be a valid `CUevent` of `ctx`'s context, already recorded (or recorded
    /// before the stream needs it), and must stay valid until the layer completes.
    pub unsafe fn borrowed(ctx: Arc<CudaContext>, waiter: Arc<EventWaiter>, event: u64) -> Self {
        EventReadiness {
            event,
            owned: false,
            ctx,
            waiter,
        }
    }

    /// Records a new event on a stream owned elsewhere (e.g. PyTorch's current stream, raw
    /// `CUstream` as an integer); the event is destroyed when the layer is done.
    ///
    /// # Safety
    /// `stream` must be a valid `CUstream` of `ctx`'s context (0 = the legacy default stream).
    pub unsafe fn record_on(
        ctx: Arc<CudaContext>,
        waiter: Arc<EventWaiter>,
        stream: u64,
    ) -> Result<Self, CudaError> {
        ctx.bind_to_thread()?;
        let ev = create_blocking_event()?;
        // SAFETY: `ev` was just created in this context; the caller guarantees `stream`.
        if let Err(e) = unsafe { result::event::record(ev, stream as usize as sys::CUstream) } {
            // SAFETY: `ev` is ours and unused.
            let _ = unsafe { result::event::destroy(ev) };
            return Err(e.into());
        }
        Ok(EventReadiness {
            event: ev as usize as u64,
            owned: true,
            ctx,
            waiter,
        })
    }
}

impl EventReadiness {
    /// Safe form of [`EventReadiness::record_on`] for a cudarc stream: records a new event on
    /// `stream`, which must belong to `ctx` (checked).
    pub fn record_on_stream(
        ctx: Arc<CudaContext>,
        waiter: Arc<EventWaiter>,
        stream: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<Self, CudaError> {
        if !Arc::ptr_eq(stream.context(), &ctx) {
            return Err(CudaError::InvalidArgument(
                "the stream belongs to another context".into(),
            ));
        }
        let raw = stream.cu_stream() as usize as u64;
        // SAFETY: `raw` is the live `CUstream` of `stream`, a stream of `ctx` (checked above),
        // borrowed for the duration of this call; the event is recorded before we return.
        unsafe { Self::record_on(ctx, waiter, raw) }
    }
}

impl Drop for EventReadiness {
    fn drop(&mut self) {
        if self.owned && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: we created the event; everything that used it (waits, stream waits) was
            // enqueued before this drop, and CUDA defers the release of an event with pending
            // work until that work completes.
            let _ = unsafe { result::event::destroy(self.event as usize as sys::CUevent) };
        }
    }
}

impl Readiness for EventReadiness {
    fn notify(self: Box<Self>, signal: ReadySignal) {
        let waiter = self.waiter.clone();
        let ev = self.event;
        waiter.push(
            ev,
            Box::new(move |r| {
                drop(self); // the event outlives the wait
                signal.fire(r);
            }),
        );
    }

    fn cuda_event(&self) -> Option<u64> {
        Some(self.event)
    }
}

struct SideStream(sys::CUstream);
// SAFETY: a CUstream handle may be used from any thread with its context bound (done before
// each use); the driver serializes work submitted to one stream.
unsafe impl Send for SideStream {}
// SAFETY: as above; we only pass the handle by value to driver calls.
unsafe impl Sync for SideStream {}

struct PinnedPtr(usize);
// SAFETY: the address of pinned host memory, freed once by the pool's release closure.
unsafe impl Send for PinnedPtr {}

/// Stages CUDA device memory through pinned host buffers (see the module docs).
pub struct CudaStager {
    ctx: Arc<CudaContext>,
    side: SideStream,
    pool: Arc<StagingPool>,
    waiter: Arc<EventWaiter>,
    /// Device memory sources: (device pointer, length), indexed by `SrcSpace::Device` id.
    devices: Mutex<Vec<(u64, u64)>>,
    /// Device allocations handed over with [`CudaStager::register_owned`], kept alive as long
    /// as the stager.
    owned: Mutex<Vec<cudarc::driver::CudaSlice<u8>>>,
}

impl std::fmt::Debug for CudaStager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStager")
            .field("pool", &self.pool)
            .finish()
    }
}

impl CudaStager {
    /// A stager on device `ctx` with `buffers` pinned host buffers of `buffer_len` bytes each
    /// (registered with `engine`; freed when the pool and all leases are gone) and its own
    /// non-blocking side stream.
    pub fn new(
        engine: &Engine,
        ctx: Arc<CudaContext>,
        buffers: usize,
        buffer_len: usize,
    ) -> Result<Arc<Self>, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        if buffers == 0 || buffer_len == 0 {
            return Err(CudaError::InvalidArgument(
                "need at least one non-empty staging buffer".into(),
            ));
        }
        ctx.bind_to_thread()?;
        let side = result::stream::create(result::stream::StreamKind::NonBlocking)?;
        let mut bufs: Vec<StagingBuffer> = Vec::with_capacity(buffers);
        let mut ptrs: Vec<PinnedPtr> = Vec::with_capacity(buffers);
        let cleanup = |bufs: &[StagingBuffer], ptrs: &[PinnedPtr]| {
            for b in bufs {
                let _ = engine.unregister(b.region);
            }
            for p in ptrs {
                // SAFETY: allocated below with cuMemHostAlloc and not yet handed out.
                let _ = unsafe { result::free_host(p.0 as *mut std::ffi::c_void) };
            }
            // SAFETY: the side stream was created above and has no work.
            let _ = unsafe { result::stream::destroy(side) };
        };
        for _ in 0..buffers {
            // SAFETY: cuMemHostAlloc with flags 0 (portable=no, write-combined=no) returns
            // page-locked, cached host memory of `buffer_len` bytes or an error.
            let p = match unsafe { result::malloc_host(buffer_len, 0) } {
                Ok(p) => p as *mut u8,
                Err(e) => {
                    cleanup(&bufs, &ptrs);
                    return Err(e.into());
                }
            };
            ptrs.push(PinnedPtr(p as usize));
            // SAFETY: `p` is `buffer_len` bytes of host memory we own; it stays allocated
            // until the pool's release closure unregisters the region and then frees it.
            match unsafe { engine.register_raw_pinned(p, buffer_len, Access::Local) } {
                Ok(region) => bufs.push(StagingBuffer {
                    region,
                    len: buffer_len as u64,
                    host_addr: p as usize,
                }),
                Err(e) => {
                    cleanup(&bufs, &ptrs);
                    return Err(e.into());
                }
            }
        }
        let eng = engine.clone();
        let rctx = ctx.clone();
        let release = Box::new(move |bufs: Vec<StagingBuffer>| {
            for b in &bufs {
                let _ = eng.unregister(b.region);
            }
            if rctx.bind_to_thread().is_ok() {
                for p in &ptrs {
                    // SAFETY: every lease is gone (the pool is being dropped) and the regions
                    // were just unregistered, so nothing references the memory any more.
                    let _ = unsafe { result::free_host(p.0 as *mut std::ffi::c_void) };
                }
            }
        });
        let pool = StagingPool::new(bufs, Some(release))?;
        let waiter = EventWaiter::new(ctx.clone())?;
        Ok(Arc::new(CudaStager {
            ctx,
            side: SideStream(side),
            pool,
            waiter,
            devices: Mutex::new(Vec::new()),
            owned: Mutex::new(Vec::new()),
        }))
    }

    /// The waiter thread (to build [`EventReadiness`] values that share it).
    pub fn waiter(&self) -> Arc<EventWaiter> {
        self.waiter.clone()
    }

    /// The context.
    pub fn context(&self) -> Arc<CudaContext> {
        self.ctx.clone()
    }

    /// Makes `len` bytes of device memory at `dptr` a staging source; the layout names it as
    /// `SrcSpace::Device(id)` with offsets relative to `dptr`.
    ///
    /// # Safety
    /// `dptr..dptr+len` must be device memory of this stager's context that stays allocated
    /// as long as streams may stage from it.
    pub unsafe fn register_device(&self, dptr: u64, len: u64) -> Result<SrcSpace, CudaError> {
        if dptr.checked_add(len).is_none() {
            return Err(CudaError::InvalidArgument("device range overflows".into()));
        }
        let mut d = self.devices.lock();
        let id = u32::try_from(d.len())
            .map_err(|_| CudaError::InvalidArgument("too many device ranges".into()))?;
        d.push((dptr, len));
        Ok(SrcSpace::Device(id))
    }

    /// Safe form of [`CudaStager::register_device`] for memory allocated with cudarc: the
    /// stager takes the allocation and keeps it alive as long as itself, so the range stays
    /// valid for every stream that stages from it. `stream` orders the pointer lookup.
    pub fn register_owned(
        &self,
        mem: cudarc::driver::CudaSlice<u8>,
        stream: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<SrcSpace, CudaError> {
        if !Arc::ptr_eq(stream.context(), &self.ctx) {
            return Err(CudaError::InvalidArgument(
                "the allocation's stream belongs to another context".into(),
            ));
        }
        let ptr = device_ptr(&mem, stream);
        let len = mem.len() as u64;
        // SAFETY: `mem` is a live allocation of this stager's context (checked above) of `len`
        // bytes at `ptr`; it is moved into `self.owned` below and so stays allocated as long as
        // the stager, which outlives every stream staging from it.
        let space = unsafe { self.register_device(ptr, len) }?;
        self.owned.lock().push(mem);
        Ok(space)
    }

    fn resolve(
        &self,
        c: &StageCopy,
        buf: &StagingBuffer,
    ) -> Result<(sys::CUdeviceptr, *mut u8), String> {
        let SrcSpace::Device(id) = c.src else {
            return Err("CUDA stager reads device memory only".into());
        };
        let (base, len) = *self
            .devices
            .lock()
            .get(id as usize)
            .ok_or_else(|| format!("unknown device memory {id}"))?;
        if c.src_offset.checked_add(c.len).is_none_or(|e| e > len) {
            return Err(format!(
                "copy {}+{} outside device memory of {len} bytes",
                c.src_offset, c.len
            ));
        }
        if c.buf_offset.checked_add(c.len).is_none_or(|e| e > buf.len) || buf.host_addr == 0 {
            return Err("copy outside the staging buffer".into());
        }
        Ok((
            base + c.src_offset,
            (buf.host_addr + c.buf_offset as usize) as *mut u8,
        ))
    }

    fn enqueue(
        &self,
        after_event: Option<u64>,
        copies: &[StageCopy],
        buf: &StagingBuffer,
    ) -> Result<sys::CUevent, String> {
        self.ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        if let Some(ev) = after_event {
            // SAFETY: the side stream is ours; the stream keeps the layer's readiness (and so
            // its event) alive until the layer completes, after this copy.
            unsafe {
                result::stream::wait_event(
                    self.side.0,
                    ev as usize as sys::CUevent,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(|e| format!("cuStreamWaitEvent: {e:?}"))?;
        }
        for c in copies {
            let (src, dst) = self.resolve(c, buf)?;
            // SAFETY: `dst..dst+len` lies in a pinned buffer we leased (checked above) and the
            // lease is held until the done event completed; `src..src+len` lies in device
            // memory registered with `register_device` (checked above).
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst as *mut std::ffi::c_void,
                    src,
                    c.len as usize,
                    self.side.0,
                )
            }
            .result()
            .map_err(|e| format!("cuMemcpyDtoHAsync: {e:?}"))?;
        }
        let done = create_blocking_event().map_err(|e| e.to_string())?;
        // SAFETY: `done` was just created in this context; the side stream is ours.
        if let Err(e) = unsafe { result::event::record(done, self.side.0) } {
            // SAFETY: `done` is ours and unused.
            let _ = unsafe { result::event::destroy(done) };
            return Err(format!("cuEventRecord: {e:?}"));
        }
        Ok(done)
    }
}

impl Drop for CudaStager {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the side stream is ours; pending copies finish before it is released
            // (cuStreamDestroy returns at once and the driver releases it when idle).
            let _ = unsafe { result::stream::destroy(self.side.0) };
        }
    }
}

impl Stager for CudaStager {
    fn pool(&self) -> &Arc<StagingPool> {
        &self.pool
    }

    fn orders_after_events(&self) -> bool {
        true
    }

    fn can_read(&self, src: SrcSpace) -> bool {
        matches!(src, SrcSpace::Device(id) if (id as usize) < self.devices.lock().len())
    }

    fn stage(
        &self,
        after_event: Option<u64>,
        copies: Vec<StageCopy>,
        lease: Lease,
        done: StageDone,
    ) {
        let buf = lease.buffer();
        match self.enqueue(after_event, &copies, &buf) {
            Ok(ev) => {
                let ctx = self.ctx.clone();
                let raw = ev as usize as u64;
                self.waiter.push(
                    raw,
                    Box::new(move |r| {
                        if ctx.bind_to_thread().is_ok() {
                            // SAFETY: the wait on the event has returned; nothing else uses it.
                            let _ = unsafe { result::event::destroy(raw as usize as sys::CUevent) };
                        }
                        done(lease, r);
                    }),
                );
            }
            Err(e) => {
                // Some copies may be queued: let them finish before the buffer goes back.
                // SAFETY: the side stream is ours.
                let _ = unsafe { result::stream::synchronize(self.side.0) };
                done(lease, Err(e));
            }
        }
    }
}

/// The raw device pointer of a cudarc slice (for [`CudaStager::register_device`]).
pub fn device_ptr<T>(
    s: &cudarc::driver::CudaSlice<T>,
    stream: &Arc<cudarc::driver::CudaStream>,
) -> u64 {
    use cudarc::driver::DevicePtr;
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// Re-export of the cudarc driver API for callers that allocate device memory themselves.
pub use cudarc::driver as driver_api;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        if driver_present() {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: a CUDA driver is present; this test covers machines without one"
            );
            return;
        }
        assert!(matches!(device_count(), Err(CudaError::NoDriver)));
        assert!(matches!(context(0), Err(CudaError::NoDriver)));
    }
}

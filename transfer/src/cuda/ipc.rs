//! Device memory shared between processes of one host (CUDA IPC), and device-side copies into
//! it: the copy engines move the bytes (NVLink or PCIe peer-to-peer), no host memory on the
//! way.
//!
//! - [`DeviceBuffer`]: device memory from `cuMemAlloc` (exportable; stream-ordered pool memory,
//!   which cudarc's own allocations may use, is not).
//! - [`DeviceBuffer::export`]: the owner names its allocation with a 64-byte IPC handle (an
//!   allocation from `cuMemAlloc`/`cudaMalloc`, as PyTorch's caching allocator makes without
//!   expandable segments); the handle names the whole allocation, so the range exported
//!   travels as (handle, offset, length).
//! - [`IpcMapping`]: the other process opens the handle once (`cuIpcOpenMemHandle`, peer access
//!   enabled lazily) and closes it when dropped; [`IpcMapping::range`] is the only way to an
//!   address inside it, bounds-checked against the range exported.
//! - [`DeviceCopier`]: bounds-checked copies into a mapping (or, as the baseline, into a buffer
//!   of this process) on its own non-blocking stream; [`DeviceCopier::finish`] records an event
//!   after them and waits for it, so a caller notifies a peer only after the bytes are there.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, CudaContext};

use super::driver::{create_blocking_event, driver_present, CudaError};
use crate::mem::RegionMem;

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_LEN: usize = 64;

/// Whether `n` bytes at `off` lie inside `len` bytes (no overflow).
fn within(len: u64, off: u64, n: u64) -> bool {
    off.checked_add(n).is_some_and(|end| end <= len)
}

/// A range of device memory exported for another process on this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpcExport {
    /// The allocation's IPC handle.
    pub handle: [u8; IPC_HANDLE_LEN],
    /// Offset of the range from the allocation's base.
    pub offset: u64,
    /// Length of the range.
    pub len: u64,
}

/// Exports `len` bytes of device memory at `dptr` on `ctx`'s device.
///
/// # Safety
/// `dptr..dptr+len` must be device memory of `ctx` that stays allocated while this call runs.
pub(super) unsafe fn export(
    ctx: &CudaContext,
    dptr: u64,
    len: u64,
) -> Result<IpcExport, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    ctx.bind_to_thread()?;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: two valid out-pointers; the driver only looks `dptr` up.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, dptr).result()? };
    let offset = dptr - base;
    if !within(size as u64, offset, len) {
        return Err(CudaError::InvalidArgument(format!(
            "{len} bytes at {dptr:#x} run past their allocation ({size} bytes at {base:#x})"
        )));
    }
    let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
    // SAFETY: a valid out-pointer; `base` is the start of a device allocation (looked up above).
    unsafe { sys::cuIpcGetMemHandle(&mut h, base).result()? };
    Ok(IpcExport {
        handle: h.reserved.map(|c| c as u8),
        offset,
        len,
    })
}

/// Device memory allocated with `cuMemAlloc`, zero-filled, freed when dropped.
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

// SAFETY: a device address; every driver call on it binds the context first.
unsafe impl Send for DeviceBuffer {}
// SAFETY: as above; the copies in and out are synchronous.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// `len` bytes (at least 1) on `ctx`'s device.
    pub fn alloc(ctx: Arc<CudaContext>, len: usize) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        if len == 0 {
            return Err(CudaError::InvalidArgument("an empty device buffer".into()));
        }
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation of `len` bytes, freed once in Drop (or just below).
        let ptr = unsafe { result::malloc_sync(len)? };
        let b = DeviceBuffer { ctx, ptr, len };
        // SAFETY: the `len` bytes just allocated.
        unsafe { result::memset_d8_sync(b.ptr, 0, len)? };
        Ok(b)
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a buffer has at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }

    fn check(&self, off: usize, n: usize) -> Result<(), CudaError> {
        if within(self.len as u64, off as u64, n as u64) {
            return Ok(());
        }
        Err(CudaError::InvalidArgument(format!(
            "{n} bytes at {off} outside a {}-byte device buffer",
            self.len
        )))
    }

    /// Copies `src` to offset `off` (synchronous).
    pub fn upload(&self, off: usize, src: &[u8]) -> Result<(), CudaError> {
        self.check(off, src.len())?;
        self.ctx.bind_to_thread()?;
        // SAFETY: bounds checked above; `src` is a live host slice of that length.
        unsafe { result::memcpy_htod_sync(self.ptr + off as u64, src)? };
        Ok(())
    }

    /// Copies `dst.len()` bytes at offset `off` into `dst` (synchronous).
    pub fn download(&self, off: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        self.check(off, dst.len())?;
        self.ctx.bind_to_thread()?;
        // SAFETY: bounds checked above; `dst` is a live host slice of that length.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + off as u64)? };
        Ok(())
    }

    /// Exports the whole buffer for another process of this host. Keeping the buffer alive
    /// while another process has the handle open, and withdrawing it from that process before
    /// its memory serves other bytes, is the caller's protocol (as for regions offered to
    /// same-host peers): the driver does not stop an importer's copies.
    pub fn export(&self) -> Result<IpcExport, CudaError> {
        // SAFETY: our allocation, of this length, alive while `self` is.
        unsafe { export(&self.ctx, self.ptr, self.len as u64) }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `alloc`, freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Another process's device memory, opened in this one; closed when dropped.
pub struct IpcMapping {
    ctx: Arc<CudaContext>,
    base: sys::CUdeviceptr,
    offset: u64,
    len: u64,
}

// SAFETY: the mapping is a device address; every driver call on it binds the context first.
unsafe impl Send for IpcMapping {}
// SAFETY: as above; `&self` methods only compute addresses.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// The context the mapping was opened in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Opens `exp` (exported by another process of this host) on `ctx`'s device.
    pub fn open(ctx: Arc<CudaContext>, exp: &IpcExport) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        ctx.bind_to_thread()?;
        let h = sys::CUipcMemHandle_st {
            reserved: exp.handle.map(|b| b as std::ffi::c_char),
        };
        let mut base: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: a valid out-pointer and a handle passed by value; the driver checks the
        // handle and fails (it does not fault) on one it does not know.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, h, flags).result()? };
        let m = IpcMapping {
            ctx,
            base,
            offset: exp.offset,
            len: exp.len,
        };
        // The range comes from the other process: it must lie inside what was mapped, or a
        // copy past the allocation would fault on the device (and poison this context).
        let mut start: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: two valid out-pointers; `base` was just mapped.
        unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base).result()? };
        if start != base || !within(size as u64, exp.offset, exp.len) {
            return Err(CudaError::InvalidArgument(format!(
                "the peer's range ({} bytes at offset {}) runs past its allocation ({size} bytes)",
                exp.len, exp.offset
            )));
        }
        Ok(m)
    }

    /// Length of the range exported.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the range exported is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of `n` bytes at `off` in the range exported.
    pub fn range(&self, off: u64, n: u64) -> Result<u64, CudaError> {
        if within(self.len, off, n) {
            return Ok(self.base + self.offset + off);
        }
        Err(CudaError::InvalidArgument(format!(
            "{n} bytes at {off} outside the {} bytes exported",
            self.len
        )))
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `base` came from cuIpcOpenMemHandle and is closed once, here.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        }
    }
}

/// Copies per `cuMemcpyBatchAsync` call (a bound of ours, not the driver's).
pub const BATCH_MAX: usize = 1024;

/// Whether the driver has `cuMemcpyBatchAsync` (CUDA 12.8 and later; checked once).
pub fn batch_copies_supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if !driver_present() {
            return false;
        }
        let mut v: std::ffi::c_int = 0;
        // SAFETY: one valid out-pointer; the call needs no context.
        let r = unsafe { sys::cuDriverGetVersion(&mut v) };
        r == sys::CUresult::CUDA_SUCCESS && v >= 12080
    })
}

/// Copies on a non-blocking stream of its own, finished by an event. It holds every buffer
/// and mapping a queued copy uses until [`DeviceCopier::finish`] (or its drop) has waited for
/// the copies, so none is freed or closed under a copy.
pub struct DeviceCopier {
    ctx: Arc<CudaContext>,
    stream: sys::CUstream,
    done: sys::CUevent,
    held: Vec<Held>,
}

enum Held {
    Buffer(Arc<DeviceBuffer>),
    Mapping(Arc<IpcMapping>),
    Region(Arc<RegionMem>),
}

// SAFETY: the stream and event handles are used with the context bound (done before each
// use); the driver serializes work on one stream. `&mut self` methods keep one user at a time.
unsafe impl Send for DeviceCopier {}

impl DeviceCopier {
    /// A copier on `ctx`'s device.
    pub fn new(ctx: Arc<CudaContext>) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        ctx.bind_to_thread()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)?;
        let done = match create_blocking_event() {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: created just above, destroyed once.
                let _ = unsafe { result::stream::destroy(stream) };
                return Err(e);
            }
        };
        Ok(DeviceCopier {
            ctx,
            stream,
            done,
            held: Vec::new(),
        })
    }

    /// Queues a copy of `n` bytes at `src_off` in `src` to `dst_off` in the exported range
    /// `dst` (another process's memory), after the copies queued before it.
    pub fn to_mapping(
        &mut self,
        dst: &Arc<IpcMapping>,
        dst_off: u64,
        src: &Arc<DeviceBuffer>,
        src_off: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        let to = dst.range(dst_off, n as u64)?;
        src.check(src_off, n)?;
        self.hold(Held::Mapping(dst.clone()));
        self.hold(Held::Buffer(src.clone()));
        // SAFETY: both ranges checked above and held until the copy has completed.
        unsafe { self.queue(to, src.ptr + src_off as u64, n) }
    }

    /// Queues a copy of `n` bytes at `src_off` in `src` to `dst_off` in `dst` (this process's
    /// memory: the device-to-device baseline).
    pub fn to_buffer(
        &mut self,
        dst: &Arc<DeviceBuffer>,
        dst_off: usize,
        src: &Arc<DeviceBuffer>,
        src_off: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        dst.check(dst_off, n)?;
        src.check(src_off, n)?;
        self.hold(Held::Buffer(dst.clone()));
        self.hold(Held::Buffer(src.clone()));
        // SAFETY: both ranges checked above and held until the copy has completed.
        unsafe { self.queue(dst.ptr + dst_off as u64, src.ptr + src_off as u64, n) }
    }

    /// Queues copies `(dst_off, src_off, n)` from `src` into the exported range `dst` as one
    /// batch (`cuMemcpyBatchAsync`, CUDA 12.8 drivers on; one call per [`BATCH_MAX`] copies,
    /// so the launch cost is paid per batch, not per block), or one by one on older drivers.
    /// Every range is checked before any copy is queued.
    pub fn to_mapping_batch(
        &mut self,
        dst: &Arc<IpcMapping>,
        src: &Arc<DeviceBuffer>,
        ops: &[(u64, usize, usize)],
    ) -> Result<(), CudaError> {
        let mut dsts = Vec::with_capacity(ops.len());
        let mut srcs = Vec::with_capacity(ops.len());
        let mut sizes = Vec::with_capacity(ops.len());
        for &(d, so, n) in ops {
            dsts.push(dst.range(d, n as u64)?);
            src.check(so, n)?;
            srcs.push(src.ptr + so as u64);
            sizes.push(n);
        }
        self.hold(Held::Mapping(dst.clone()));
        self.hold(Held::Buffer(src.clone()));
        if !batch_copies_supported() {
            for i in 0..ops.len() {
                // SAFETY: both ranges checked above and held until the copy has completed.
                unsafe { self.queue(dsts[i], srcs[i], sizes[i])? };
            }
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        let dev = sys::CUmemLocation_st {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.ctx.ordinal() as i32,
        };
        let mut attrs = [sys::CUmemcpyAttributes_st {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: dev,
            dstLocHint: dev,
            flags: 0,
        }];
        let mut idx = [0usize];
        let mut at = 0;
        while at < ops.len() {
            let n = (ops.len() - at).min(BATCH_MAX);
            let mut fail = usize::MAX;
            // SAFETY: three arrays of `n` entries from `at` (the ranges checked above and held
            // until the copies have completed), one attribute applying from copy 0, a valid
            // out-pointer for the failed index, and our stream (not the legacy one, which the
            // batch call refuses).
            unsafe {
                sys::cuMemcpyBatchAsync(
                    dsts[at..].as_mut_ptr(),
                    srcs[at..].as_mut_ptr(),
                    sizes[at..].as_mut_ptr(),
                    n,
                    attrs.as_mut_ptr(),
                    idx.as_mut_ptr(),
                    1,
                    &mut fail,
                    self.stream,
                )
                .result()?
            };
            at += n;
        }
        Ok(())
    }

    /// Queues a copy of `n` bytes between `local` at `local_off` (an engine region: device
    /// memory, or host memory the driver reaches through unified addressing) and `remote_off`
    /// in the exported range `remote`: into `remote` when `to_remote`, out of it otherwise.
    /// Both ranges are bounds-checked; `local` is held until [`DeviceCopier::finish`].
    pub(crate) fn region_copy(
        &mut self,
        to_remote: bool,
        local: &Arc<RegionMem>,
        local_off: u64,
        remote: &Arc<IpcMapping>,
        remote_off: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let far = remote.range(remote_off, n as u64)?;
        let near = local
            .raw_addr(local_off, n)
            .map_err(|e| CudaError::InvalidArgument(e.to_string()))?;
        self.hold(Held::Mapping(remote.clone()));
        self.hold(Held::Region(local.clone()));
        let (dst, src) = if to_remote { (far, near) } else { (near, far) };
        // SAFETY: both ranges are checked above; the local one is region memory, valid while
        // its `RegionMem` lives (held until the copy has completed, as is the mapping).
        unsafe { self.queue(dst, src, n) }
    }

    fn hold(&mut self, h: Held) {
        let same = |a: &Held, b: &Held| match (a, b) {
            (Held::Buffer(x), Held::Buffer(y)) => Arc::ptr_eq(x, y),
            (Held::Mapping(x), Held::Mapping(y)) => Arc::ptr_eq(x, y),
            (Held::Region(x), Held::Region(y)) => Arc::ptr_eq(x, y),
            _ => false,
        };
        if !self.held.iter().any(|x| same(x, &h)) {
            self.held.push(h);
        }
    }

    /// # Safety
    /// Both ranges must be memory the driver can address (device memory, or host memory
    /// through unified addressing), valid until the copy has completed.
    unsafe fn queue(&mut self, dst: u64, src: u64, n: usize) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: the caller vouches for both ranges; the stream is ours.
        unsafe { sys::cuMemcpyAsync(dst, src, n, self.stream).result()? };
        Ok(())
    }

    /// Waits until every copy queued so far has completed on the device, then lets go of
    /// the buffers and mappings they used.
    pub fn finish(&mut self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: our event and stream; synchronize blocks until the event has completed.
        unsafe {
            result::event::record(self.done, self.stream)?;
            result::event::synchronize(self.done)?;
        }
        self.held.clear();
        Ok(())
    }
}

impl Drop for DeviceCopier {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ours, destroyed once, after the stream's copies have completed (the
            // buffers they use are released after this).
            unsafe {
                let _ = result::stream::synchronize(self.stream);
                let _ = result::event::destroy(self.done);
                let _ = result::stream::destroy(self.stream);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_past_the_end_or_overflowing_are_outside() {
        assert!(within(4096, 0, 4096));
        assert!(within(4096, 4096, 0));
        assert!(!within(4096, 1, 4096));
        assert!(!within(4096, 4097, 0));
        assert!(!within(u64::MAX, u64::MAX, 1));
    }
}

//! The driver underneath everything CUDA in the engine: whether `libcuda` loads, devices and
//! their primary contexts, [`CudaError`], and blocking events. It uses nothing of the engine
//! (the `cuda_ipc` transport sits on it, below the engine).

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, CudaContext, DriverError};

use crate::error::Error;

/// What can go wrong with CUDA memory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// `libcuda` cannot be loaded on this machine.
    #[error("no CUDA driver (libcuda) on this machine")]
    NoDriver,
    /// The driver loaded but reports no device with this ordinal.
    #[error("no CUDA device {0}")]
    NoDevice(usize),
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// Bad argument (unknown device memory id, copy out of bounds...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Registering staging memory with the engine failed.
    #[error("engine: {0}")]
    Engine(#[from] Error),
}

impl From<DriverError> for CudaError {
    fn from(e: DriverError) -> Self {
        CudaError::Driver(format!("{e:?}"))
    }
}

/// Whether `libcuda` can be loaded (checked once, then cached). Gate for every driver call.
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the library names and drops the handles.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Number of CUDA devices (`cuInit` + `cuDeviceGetCount`).
pub fn device_count() -> Result<usize, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    result::init()?;
    Ok(result::device::get_count()?.max(0) as usize)
}

/// The primary context of device `ordinal` (the one PyTorch uses), after checking the driver
/// and the device exist.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    if device_count()? <= ordinal {
        return Err(CudaError::NoDevice(ordinal));
    }
    Ok(CudaContext::new(ordinal)?)
}

/// Whether the device reports GPUDirect RDMA support (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`).
pub fn gpudirect_rdma_supported(ctx: &CudaContext) -> Result<bool, CudaError> {
    Ok(ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)? != 0)
}

pub(crate) fn create_blocking_event() -> Result<sys::CUevent, CudaError> {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
        | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: cuEventCreate writes one handle into `ev`, a valid out-pointer; the caller has
    // bound a context to this thread.
    unsafe { sys::cuEventCreate(&mut ev, flags).result()? };
    Ok(ev)
}

/// The ordinal of the device whose memory `ptr` is (`cuPointerGetAttribute`); `None` for an
/// address the driver does not know as device memory (host memory, or no allocation). The
/// address is only looked up, never dereferenced.
pub fn device_ordinal(ptr: u64) -> Result<Option<usize>, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    result::init()?;
    let mut kind: u32 = 0;
    // SAFETY: a valid out-pointer of the attribute's size (an unsigned int); the driver only
    // looks the address up.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut kind as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS || kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Ok(None);
    }
    let mut ordinal: i32 = -1;
    // SAFETY: as above (the ordinal is an int).
    unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
        .result()?
    };
    Ok(usize::try_from(ordinal).ok())
}

/// The page-aligned span `(base, size)` around `addr..addr+len` (what
/// `cuMemGetHandleForAddressRange` takes); `None` for an empty range, a page size that is not a
/// power of two, or an end past the address space.
pub(crate) fn page_span(addr: u64, len: u64, page: u64) -> Option<(u64, u64)> {
    if len == 0 || !page.is_power_of_two() {
        return None;
    }
    let base = addr & !(page - 1);
    let end = addr.checked_add(len)?.checked_add(page - 1)? & !(page - 1);
    Some((base, end - base))
}

/// Exports device memory `dptr..dptr+len` of device `ordinal` as a dma-buf
/// (`cuMemGetHandleForAddressRange`, CUDA 11.7 drivers on, a device that supports dma-buf): the
/// file, which covers the page-aligned span around the range, and where `dptr` is in it. What
/// a NIC registers with `ibv_reg_dmabuf_mr` (GPUDirect RDMA without nvidia-peermem).
pub fn export_dmabuf(ordinal: u32, dptr: u64, len: u64) -> Result<(OwnedFd, u64), CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let mut version: std::ffi::c_int = 0;
    // SAFETY: one valid out-pointer; the call needs no context.
    unsafe { sys::cuDriverGetVersion(&mut version).result()? };
    if version < 11070 {
        return Err(CudaError::Driver(format!(
            "driver version {version} has no cuMemGetHandleForAddressRange (11.7 and later)"
        )));
    }
    let ctx = context(ordinal as usize)?;
    ctx.bind_to_thread()?;
    if ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? == 0 {
        return Err(CudaError::Driver(format!(
            "device {ordinal} does not support dma-buf export"
        )));
    }
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let (base, size) = page_span(dptr, len, page).ok_or_else(|| {
        CudaError::InvalidArgument(format!("device range {dptr:#x}+{len} cannot be exported"))
    })?;
    let size = usize::try_from(size)
        .map_err(|_| CudaError::InvalidArgument("device range too large".into()))?;
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: for CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD the handle is an int, and `fd` is a valid
    // out-pointer for one; the driver checks that the span is device memory it allocated and
    // only reads the address range, never the host through it.
    unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut std::ffi::c_int).cast(),
            base,
            size,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
        .result()?
    };
    if fd < 0 {
        return Err(CudaError::Driver(
            "cuMemGetHandleForAddressRange gave no file".into(),
        ));
    }
    // SAFETY: on success the driver returned a new file descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok((fd, dptr - base))
}

#[cfg(test)]
mod span_tests {
    use super::page_span;

    #[test]
    fn the_span_is_page_aligned_around_the_range() {
        assert_eq!(page_span(0x1000, 0x1000, 0x1000), Some((0x1000, 0x1000)));
        assert_eq!(page_span(0x1010, 0x10, 0x1000), Some((0x1000, 0x1000)));
        assert_eq!(page_span(0x1ff0, 0x20, 0x1000), Some((0x1000, 0x2000)));
        assert_eq!(page_span(0x1000, 1, 0x10000), Some((0, 0x10000)));
        assert_eq!(page_span(0x1000, 0, 0x1000), None, "empty");
        assert_eq!(page_span(0x1000, 0x10, 3000), None, "not a power of two");
        assert_eq!(
            page_span(u64::MAX - 0x10, 0x8, 0x1000),
            None,
            "past the end"
        );
    }
}

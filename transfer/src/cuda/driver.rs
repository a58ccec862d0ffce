//! The driver underneath everything CUDA in the engine: whether `libcuda` loads, devices and
//! their primary contexts, [`CudaError`], and blocking events. It uses nothing of the engine
//! (the `cuda_ipc` transport sits on it, below the engine).

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

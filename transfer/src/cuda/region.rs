//! CUDA device memory as an engine region: exported for same-host peers (CUDA IPC), which
//! copy into it and out of it with the `cuda_ipc` transport.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::driver::CudaError;
use super::ipc::export;
use crate::engine::Engine;
use crate::mem::RegionMem;
use crate::types::{Access, DeviceIpc, RegionHandle};

/// Registers `len` bytes of device memory at `dptr` (on `ctx`'s device) with `engine`.
///
/// The range must lie inside one allocation from `cuMemAlloc`/`cudaMalloc` (as PyTorch's
/// caching allocator makes them without expandable segments); its IPC handle and the range's
/// offset in it go to same-host peers with the region, so that a peer with the `cuda_ipc`
/// transport copies into it (writes) or out of it (reads) on its GPU's copy engines. Nothing on
/// the host reads or writes it: tcp and shm batches naming it, `local_write` and `local_read`
/// fail with `Error::Io` (`Unsupported`), RDMA ones with `Error::Unsupported`. It is counted as
/// `device` in the metrics.
///
/// # Safety
/// `dptr..dptr+len` must be device memory of `ctx`'s device that stays allocated until
/// [`Engine::unregister`] of the region returned `Ok`. As with caller memory over shm, that
/// return also means that every same-host peer confirmed it withdrew the region and has no copy
/// into it running.
pub unsafe fn register_device_region(
    engine: &Engine,
    ctx: &Arc<CudaContext>,
    dptr: u64,
    len: usize,
    access: Access,
) -> Result<RegionHandle, CudaError> {
    // SAFETY: forwarded contract: device memory of `ctx`, allocated during this call.
    let exp = unsafe { export(ctx, dptr, len as u64)? };
    let ipc = DeviceIpc {
        handle: exp.handle,
        offset: exp.offset,
    };
    let ordinal = u32::try_from(ctx.ordinal())
        .map_err(|_| CudaError::InvalidArgument("device ordinal too large".into()))?;
    // SAFETY: forwarded contract: the memory outlives the region (unregister returns first).
    let mem = unsafe { RegionMem::device(dptr, len, ordinal, ipc) }
        .map_err(|e| CudaError::InvalidArgument(e.to_string()))?;
    Ok(engine.register_mem(mem, access)?)
}

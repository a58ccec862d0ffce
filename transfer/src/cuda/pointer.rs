//! What the CUDA driver says about a host address.

use cudarc::driver::sys;

use super::driver_present;

/// Whether `addr` lies in host memory the CUDA driver has pinned (`cudaHostAlloc`,
/// `cudaHostRegister`, `cuMemHostAlloc`). False without a driver, and in a process that has not
/// initialized CUDA (the query then fails before looking the address up: nothing of this
/// process can be pinned by CUDA).
pub fn is_pinned(addr: usize) -> bool {
    if !driver_present() {
        return false;
    }
    let mut ty: std::ffi::c_uint = 0;
    // SAFETY: the attribute is a `CUmemorytype` (an unsigned int) written to a valid
    // out-pointer; the driver only looks the address up and fails on one it does not know.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ty as *mut std::ffi::c_uint).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            addr as sys::CUdeviceptr,
        )
    };
    r == sys::CUresult::CUDA_SUCCESS && ty == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32
}

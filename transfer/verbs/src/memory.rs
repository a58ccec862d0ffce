//! Protection domains and memory registration.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::device::{Context, ContextInner};
use crate::error::VerbsError;
use crate::library::ibv_fn;
use crate::sys;

/// Access rights of a memory region (`IBV_ACCESS_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access(u32);

impl Access {
    /// The local NIC may write the region (needed for receives and RDMA READ targets).
    pub const LOCAL_WRITE: Access = Access(sys::IBV_ACCESS_LOCAL_WRITE);
    /// Peers may RDMA WRITE into the region (implies `LOCAL_WRITE` for the provider).
    pub const REMOTE_WRITE: Access = Access(sys::IBV_ACCESS_REMOTE_WRITE);
    /// Peers may RDMA READ the region.
    pub const REMOTE_READ: Access = Access(sys::IBV_ACCESS_REMOTE_READ);

    /// Local write + remote write + remote read: what a KV-cache region offered to peers needs.
    pub fn all_rdma() -> Access {
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ
    }

    /// Raw `ibv_access_flags` bits.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// True when every bit of `other` is set.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

pub(crate) struct PdInner {
    pub(crate) ctx: Arc<ContextInner>,
    pub(crate) pd: NonNull<sys::ibv_pd>,
}

// SAFETY: a PD is an opaque kernel object handle; libibverbs allows using it (registering
// memory, creating QPs) from any thread concurrently.
unsafe impl Send for PdInner {}
// SAFETY: see `Send`.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        if let Ok(dealloc) = &self.ctx.lib.raw.ibv_dealloc_pd {
            // SAFETY: MRs and QPs hold an `Arc<PdInner>`, so none remain; allocated once by
            // `ibv_alloc_pd`, deallocated exactly once here.
            let rc = unsafe { dealloc(self.pd.as_ptr()) };
            if rc != 0 {
                tracing::warn!(rc, "ibv_dealloc_pd failed");
            }
        }
    }
}

/// A protection domain: the scope in which MRs and QPs may be used together.
#[derive(Clone)]
pub struct Pd {
    pub(crate) inner: Arc<PdInner>,
}

impl std::fmt::Debug for Pd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pd")
            .field("device", &self.inner.ctx.info.name)
            .finish()
    }
}

impl Context {
    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<Pd, VerbsError> {
        let alloc = ibv_fn!(self.inner.lib, ibv_alloc_pd);
        // SAFETY: the context is open for as long as `self.inner` lives.
        let raw = unsafe { alloc(self.inner.ctx.as_ptr()) };
        let pd = NonNull::new(raw).ok_or_else(|| VerbsError::last_os("ibv_alloc_pd"))?;
        Ok(Pd {
            inner: Arc::new(PdInner {
                ctx: self.inner.clone(),
                pd,
            }),
        })
    }
}

impl Pd {
    /// Registers `len` bytes at `addr` (host memory, or device memory mapped for the NIC by a
    /// peer-memory driver).
    ///
    /// # Safety
    ///
    /// `addr..addr+len` must stay allocated (not freed, not unmapped) until the returned [`Mr`]
    /// and every work request that names it have completed, and the caller must tolerate the
    /// NIC reading and (with write access) writing those bytes at any time while it is
    /// registered, concurrently with the program.
    pub unsafe fn register_raw(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Mr, VerbsError> {
        if len == 0 {
            return Err(VerbsError::InvalidArgument(
                "cannot register an empty region".to_string(),
            ));
        }
        let limits = &self.inner.ctx.limits;
        if limits.max_mr_size != 0 && len as u64 > limits.max_mr_size {
            return Err(VerbsError::OutOfBounds {
                what: "max MR size",
                offset: 0,
                len: len as u64,
                size: limits.max_mr_size,
            });
        }
        let reg = ibv_fn!(self.inner.ctx.lib, ibv_reg_mr);
        let access_raw = i32::try_from(access.bits())
            .map_err(|_| VerbsError::InvalidArgument("access flags".to_string()))?;
        // SAFETY: the PD is alive (held by `self`); the caller guarantees the memory range is
        // valid for the lifetime of the registration; libibverbs pins it.
        let raw = unsafe { reg(self.inner.pd.as_ptr(), addr.cast(), len, access_raw) };
        let mr = NonNull::new(raw).ok_or_else(|| VerbsError::last_os("ibv_reg_mr"))?;
        // SAFETY: `mr` was just returned by ibv_reg_mr and points to a valid `ibv_mr`.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        Ok(Mr {
            pd: self.inner.clone(),
            mr,
            addr: addr as u64,
            len,
            lkey,
            rkey,
            access,
        })
    }

    /// Registers `len` bytes at `offset` of a dma-buf (e.g. CUDA device memory exported with
    /// `cuMemGetHandleForAddressRange`), addressed by peers as `iova..iova+len` (GPUDirect RDMA
    /// without nvidia-peermem). Needs rdma-core ≥ 34 (`ibv_reg_dmabuf_mr`); an older library
    /// gives [`VerbsError::MissingSymbol`], a provider without support an `Os` error.
    ///
    /// # Safety
    ///
    /// `fd` must be a dma-buf whose memory stays allocated until the returned [`Mr`] and every
    /// work request naming it have completed; the NIC may read and (with write access) write it
    /// at any time while registered.
    pub unsafe fn register_dmabuf(
        &self,
        fd: i32,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<Mr, VerbsError> {
        if len == 0 {
            return Err(VerbsError::InvalidArgument(
                "cannot register an empty region".to_string(),
            ));
        }
        let reg = ibv_fn!(self.inner.ctx.lib, ibv_reg_dmabuf_mr);
        let access_raw = i32::try_from(access.bits())
            .map_err(|_| VerbsError::InvalidArgument("access flags".to_string()))?;
        // SAFETY: the PD is alive (held by `self`); the caller guarantees the dma-buf stays
        // valid for the lifetime of the registration; the kernel validates fd/offset/len.
        let raw = unsafe { reg(self.inner.pd.as_ptr(), offset, len, iova, fd, access_raw) };
        let mr = NonNull::new(raw).ok_or_else(|| VerbsError::last_os("ibv_reg_dmabuf_mr"))?;
        // SAFETY: `mr` was just returned by ibv_reg_dmabuf_mr and points to a valid `ibv_mr`.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        Ok(Mr {
            pd: self.inner.clone(),
            mr,
            addr: iova,
            len,
            lkey,
            rkey,
            access,
        })
    }

    /// Allocates `len` zeroed, page-aligned bytes and registers them.
    pub fn register_buffer(
        &self,
        len: usize,
        access: Access,
    ) -> Result<RegisteredBuffer, VerbsError> {
        let mem = PageBuffer::new(len)?;
        // SAFETY: `mem` is owned by the returned `RegisteredBuffer`, whose field order drops
        // the `Mr` before the memory, so the memory outlives the registration.
        let mr = unsafe { self.register_raw(mem.ptr.as_ptr(), len, access)? };
        Ok(RegisteredBuffer { mr, mem })
    }
}

/// A registered memory region. Deregistered on drop.
pub struct Mr {
    pd: Arc<PdInner>,
    mr: NonNull<sys::ibv_mr>,
    addr: u64,
    len: usize,
    lkey: u32,
    rkey: u32,
    access: Access,
}

// SAFETY: the MR handle is an opaque registration; its keys and bounds are immutable plain
// data, and deregistration happens once, in `Drop`, which requires ownership.
unsafe impl Send for Mr {}
// SAFETY: `&Mr` only reads immutable fields.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        if let Ok(dereg) = &self.pd.ctx.lib.raw.ibv_dereg_mr {
            // SAFETY: registered once by ibv_reg_mr, deregistered exactly once; the PD is kept
            // alive by `self.pd` until after this call.
            let rc = unsafe { dereg(self.mr.as_ptr()) };
            if rc != 0 {
                tracing::warn!(rc, "ibv_dereg_mr failed");
            }
        }
    }
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#x}", self.lkey))
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .finish()
    }
}

impl Mr {
    /// Start address of the region (the remote address base a peer uses).
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Never true (empty regions are refused), provided for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Local key (for SGEs).
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    /// Remote key (given to peers).
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// Access rights it was registered with.
    pub fn access(&self) -> Access {
        self.access
    }

    /// A scatter-gather entry for `len` bytes at `offset`, bounds-checked against the region.
    pub fn sge(&self, offset: usize, len: usize) -> Result<Sge, VerbsError> {
        check_bounds("local memory region", offset, len, self.len)?;
        let length = u32::try_from(len).map_err(|_| VerbsError::OutOfBounds {
            what: "scatter-gather entry (u32 length)",
            offset: offset as u64,
            len: len as u64,
            size: u64::from(u32::MAX),
        })?;
        Ok(Sge {
            addr: self.addr + offset as u64,
            length,
            lkey: self.lkey,
        })
    }

    /// What a peer needs to address `len` bytes at `offset` of this region, bounds-checked.
    pub fn remote(&self, offset: usize, len: usize) -> Result<RemoteSlice, VerbsError> {
        check_bounds("local memory region", offset, len, self.len)?;
        Ok(RemoteSlice {
            addr: self.addr + offset as u64,
            rkey: self.rkey,
        })
    }
}

fn check_bounds(
    what: &'static str,
    offset: usize,
    len: usize,
    size: usize,
) -> Result<(), VerbsError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(VerbsError::OutOfBounds {
            what,
            offset: offset as u64,
            len: len as u64,
            size: size as u64,
        }),
    }
}

/// One scatter-gather entry: `length` bytes at `addr` inside the local region of `lkey`.
///
/// Plain data: the NIC validates it against the region (a wrong one completes with
/// `LocalProtection`), so a stale or forged entry cannot make the program touch memory it does
/// not own. Make them with [`Mr::sge`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Virtual address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the region.
    pub lkey: u32,
}

/// A remote target: address in the peer's registered region and its remote key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSlice {
    /// Remote virtual address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteSlice {
    /// The same region, `delta` bytes further.
    pub fn offset(self, delta: u64) -> RemoteSlice {
        RemoteSlice {
            addr: self.addr.wrapping_add(delta),
            rkey: self.rkey,
        }
    }
}

/// Zeroed page-aligned heap memory.
struct PageBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

const PAGE: usize = 4096;

impl PageBuffer {
    fn new(len: usize) -> Result<PageBuffer, VerbsError> {
        if len == 0 {
            return Err(VerbsError::InvalidArgument("empty buffer".to_string()));
        }
        let layout = Layout::from_size_align(len, PAGE)
            .map_err(|e| VerbsError::InvalidArgument(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: `layout` has non-zero size (checked above).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            VerbsError::InvalidArgument(format!("allocation of {len} bytes failed"))
        })?;
        Ok(PageBuffer { ptr, layout })
    }
}

impl Drop for PageBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this exact layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Heap memory owned together with its registration (the MR is dropped first).
///
/// The NIC may write the bytes at any moment while RDMA operations that target it are in
/// flight, so the contents are never exposed as a Rust slice: they are copied in and out with
/// [`copy_in`](Self::copy_in) / [`copy_out`](Self::copy_out). Read them after the completion
/// (or notification) that says the bytes have landed.
pub struct RegisteredBuffer {
    // Field order matters: `mr` is deregistered before `mem` is freed.
    mr: Mr,
    mem: PageBuffer,
}

// SAFETY: the memory is only reached through raw-pointer copies (never references), which
// are valid from any thread; the MR is `Send + Sync`.
unsafe impl Send for RegisteredBuffer {}
// SAFETY: see `Send`.
unsafe impl Sync for RegisteredBuffer {}

impl std::fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffer")
            .field("mr", &self.mr)
            .finish()
    }
}

impl RegisteredBuffer {
    /// The registration.
    pub fn mr(&self) -> &Mr {
        &self.mr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mr.len
    }

    /// Never true.
    pub fn is_empty(&self) -> bool {
        self.mr.len == 0
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn copy_in(&self, offset: usize, src: &[u8]) -> Result<(), VerbsError> {
        check_bounds("registered buffer", offset, src.len(), self.mr.len)?;
        // SAFETY: bounds checked above; `src` is a distinct Rust allocation, so the ranges do
        // not overlap; no reference to the buffer's bytes exists (only raw-pointer access).
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.mem.ptr.as_ptr().add(offset),
                src.len(),
            )
        };
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` out of the buffer.
    pub fn copy_out(&self, offset: usize, dst: &mut [u8]) -> Result<(), VerbsError> {
        check_bounds("registered buffer", offset, dst.len(), self.mr.len)?;
        // SAFETY: bounds checked above; `dst` is a distinct, exclusively borrowed allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.mem.ptr.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// Fills `len` bytes at `offset` with `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<(), VerbsError> {
        check_bounds("registered buffer", offset, len, self.mr.len)?;
        // SAFETY: bounds checked above; raw write into memory this buffer owns.
        unsafe { std::ptr::write_bytes(self.mem.ptr.as_ptr().add(offset), byte, len) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked_without_overflow() {
        assert!(check_bounds("x", 0, 10, 10).is_ok());
        assert!(check_bounds("x", 10, 0, 10).is_ok());
        assert!(matches!(
            check_bounds("x", 5, 6, 10),
            Err(VerbsError::OutOfBounds {
                offset: 5,
                len: 6,
                size: 10,
                ..
            })
        ));
        assert!(check_bounds("x", usize::MAX, 2, 10).is_err());
    }

    #[test]
    fn access_flags_compose() {
        let a = Access::all_rdma();
        assert!(a.contains(Access::REMOTE_WRITE));
        assert_eq!(a.bits(), 1 | 2 | 4);
        assert!(!Access::LOCAL_WRITE.contains(Access::REMOTE_READ));
    }

    #[test]
    fn page_buffer_is_aligned_and_zeroed() {
        let b = PageBuffer::new(3 * PAGE + 5).expect("alloc");
        assert_eq!(b.ptr.as_ptr() as usize % PAGE, 0);
        assert!(PageBuffer::new(0).is_err());
    }
}

//! Raw memory: the one module of the engine that touches region memory through pointers (the
//! other `unsafe` of the crate is the CUDA driver calls in `cuda`).
//!
//! Everything that reads or writes region memory goes through [`RegionMem`], whose methods
//! check bounds themselves (so they are sound whatever the caller passes) and never hand a
//! `&[u8]`/`&mut [u8]` view of region memory to safe code: region memory may be written at any
//! time by remote peers (sockets, shared mappings, `process_vm_writev`), so safe code only ever
//! sees copies.
//!
//! Kinds of memory:
//! - engine-allocated regions: a memfd mapped `MAP_SHARED`, page aligned and zeroed; the fd can be
//!   passed to a same-host peer (shm transport), which maps it too;
//! - raw regions: memory owned by the caller (`Engine::register_raw`), valid per that function's
//!   safety contract;
//! - mappings of a peer's memfd (shm transport), unmapped on drop;
//! - device regions: CUDA device memory of the caller (`cuda::register_device`). The host
//!   cannot dereference it, so every host-side copy refuses it (`ErrorKind::Unsupported`);
//!   only the CUDA copies of the `cuda_ipc` transport reach it, through [`RegionMem::raw_addr`],
//!   and NICs that registered it (`nic`: GPUDirect RDMA).
//!
//! `nic`: region memory registered with RDMA devices (`RegionMrs`): host memory by address,
//! device memory by dma-buf or, where nvidia-peermem is loaded, by its device address.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use crate::types::DeviceIpc;

mod nic;

pub(crate) use nic::{DmaBuf, RegionMrs};

enum Backing {
    /// A memfd we created and mapped.
    Memfd(OwnedFd),
    /// A mapping of some fd (a peer's memfd), unmapped on drop.
    Mapped,
    /// Memory owned by the caller; `true` when the caller said it is pinned by the CUDA driver.
    Raw(bool),
    /// CUDA device memory owned by the caller, on device `ordinal`, exported as `ipc`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // made only by `cuda` (and tests)
    Device { ordinal: u32, ipc: DeviceIpc },
}

/// What a region's memory is, as the engine's metrics count it ([`RegionMem::kind`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemKind {
    /// Allocated by the engine (a memfd).
    Engine,
    /// The caller's memory, pageable.
    Host,
    /// The caller's memory, pinned by the CUDA driver (`cudaHostAlloc`, `cudaHostRegister`), as
    /// the caller declared at registration.
    Pinned,
    /// A mapping of a peer's memory.
    Mapped,
    /// The caller's CUDA device memory.
    Device,
}

impl MemKind {
    /// The kinds a region of ours can have, in the order the metrics list them.
    pub const REGION_KINDS: [MemKind; 4] = [
        MemKind::Engine,
        MemKind::Host,
        MemKind::Pinned,
        MemKind::Device,
    ];

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            MemKind::Engine => "engine",
            MemKind::Host => "host",
            MemKind::Pinned => "pinned",
            MemKind::Mapped => "mapped",
            MemKind::Device => "device",
        }
    }
}

/// A contiguous range of memory the engine may read and write.
pub struct RegionMem {
    ptr: *mut u8,
    len: usize,
    backing: Backing,
}

impl std::fmt::Debug for RegionMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionMem")
            .field("len", &self.len)
            .field("kind", &self.kind().label())
            .finish()
    }
}

// SAFETY: RegionMem is a pointer + length to memory that stays valid for the lifetime of the
// value (memfd/mapped: unmapped only in Drop; raw: by the register_raw contract). All access goes
// through methods that copy bytes with raw-pointer operations; no references into the memory are
// ever created, so sharing the value across threads does not create aliasing references.
unsafe impl Send for RegionMem {}
// SAFETY: see the Send impl above; concurrent byte copies into the same memory are the nature of
// a transfer target and are never observed through Rust references.
unsafe impl Sync for RegionMem {}

fn range_ok(off: u64, len: usize, total: usize) -> io::Result<usize> {
    let off_us = usize::try_from(off).map_err(|_| oob())?;
    match off_us.checked_add(len) {
        Some(end) if end <= total => Ok(off_us),
        _ => Err(oob()),
    }
}

fn not_host() -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        "device memory: the host cannot copy it (only the cuda_ipc transport can)",
    )
}

fn oob() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "range outside region memory")
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p <= 0 {
        4096
    } else {
        p as usize
    }
}

fn map_shared(fd: RawFd, len: usize) -> io::Result<*mut u8> {
    // SAFETY: a fresh MAP_SHARED mapping chosen by the kernel (addr NULL) of `len` bytes of a
    // valid fd; the result is checked for MAP_FAILED before use.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p as *mut u8)
}

impl RegionMem {
    /// Allocates `len` zeroed bytes backed by a memfd (page aligned, shareable).
    pub fn alloc_memfd(len: usize) -> io::Result<RegionMem> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero-length region",
            ));
        }
        let name = c"kvwire-region";
        // SAFETY: memfd_create with a valid NUL-terminated name; result checked.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just returned by memfd_create and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let ps = page_size();
        let map_len = len.div_ceil(ps) * ps;
        // SAFETY: ftruncate on our own valid fd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), map_len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let ptr = map_shared(fd.as_raw_fd(), map_len)?;
        Ok(RegionMem {
            ptr,
            len,
            backing: Backing::Memfd(fd),
        })
    }

    /// Maps `len` bytes of a peer's memfd.
    pub fn map_fd(fd: BorrowedFd<'_>, len: usize) -> io::Result<RegionMem> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero-length mapping",
            ));
        }
        // The fd came from a peer: make sure it is large enough before touching the mapping
        // (a shorter file would SIGBUS on access).
        // SAFETY: fstat on a valid fd into a zeroed stat struct we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: see above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if (st.st_size as u64) < len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "peer memfd shorter than the region it describes",
            ));
        }
        let ptr = map_shared(fd.as_raw_fd(), len)?;
        Ok(RegionMem {
            ptr,
            len,
            backing: Backing::Mapped,
        })
    }

    /// Wraps caller-owned memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes for as long as the returned value (or
    /// any clone of the `Arc` holding it) lives, and the caller must not hold Rust references to
    /// it while the engine may write into it.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> io::Result<RegionMem> {
        if ptr.is_null() || len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "null or empty raw region",
            ));
        }
        if (ptr as usize).checked_add(len).is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "raw region wraps the address space",
            ));
        }
        Ok(RegionMem {
            ptr,
            len,
            backing: Backing::Raw(false),
        })
    }

    /// Wraps caller-owned CUDA device memory on device `ordinal`, exported as `ipc`. No host
    /// copy ever dereferences it.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be device memory of device `ordinal` that stays allocated for as
    /// long as the returned value (or any clone of the `Arc` holding it) lives, and `ipc` must
    /// name the allocation it lies in.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub unsafe fn device(
        ptr: u64,
        len: usize,
        ordinal: u32,
        ipc: DeviceIpc,
    ) -> io::Result<RegionMem> {
        if ptr == 0 || len == 0 || ptr.checked_add(len as u64).is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "null, empty or wrapping device region",
            ));
        }
        Ok(RegionMem {
            ptr: ptr as *mut u8,
            len,
            backing: Backing::Device { ordinal, ipc },
        })
    }

    /// The device ordinal and IPC export of device memory; `None` for host memory.
    pub fn device_ipc(&self) -> Option<(u32, DeviceIpc)> {
        match self.backing {
            Backing::Device { ordinal, ipc } => Some((ordinal, ipc)),
            _ => None,
        }
    }

    /// The address of `len` bytes at `off` (bounds checked), for a copy the CUDA driver makes
    /// (device memory, or host memory through unified addressing). Only `cuda` uses it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn raw_addr(&self, off: u64, len: usize) -> io::Result<u64> {
        let o = range_ok(off, len, self.len)?;
        Ok(self.ptr as u64 + o as u64)
    }

    fn host(&self) -> io::Result<()> {
        match self.backing {
            Backing::Device { .. } => Err(not_host()),
            _ => Ok(()),
        }
    }

    /// Marks caller memory as pinned (for the metrics; nothing else depends on it).
    pub fn with_pinned(mut self, pinned: bool) -> RegionMem {
        if let Backing::Raw(p) = &mut self.backing {
            *p = pinned;
        }
        self
    }

    /// What this memory is.
    pub fn kind(&self) -> MemKind {
        match self.backing {
            Backing::Memfd(_) => MemKind::Engine,
            Backing::Mapped => MemKind::Mapped,
            Backing::Raw(false) => MemKind::Host,
            Backing::Raw(true) => MemKind::Pinned,
            Backing::Device { .. } => MemKind::Device,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The memfd, when the region is engine-allocated.
    pub fn memfd(&self) -> Option<BorrowedFd<'_>> {
        match &self.backing {
            Backing::Memfd(fd) => Some(fd.as_fd()),
            _ => None,
        }
    }

    /// Inode number of the memfd (lets a peer verify the fd it opened), 0 for other memory.
    pub fn memfd_ino(&self) -> u64 {
        match &self.backing {
            Backing::Memfd(fd) => {
                // SAFETY: fstat on our own valid fd into a zeroed stat struct we own.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: see above.
                if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0 {
                    st.st_ino
                } else {
                    0
                }
            }
            _ => 0,
        }
    }

    /// The virtual address (used only as a `process_vm_*` target for same-host peers).
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Copies `data` into the region at `off`.
    pub fn copy_in(&self, off: u64, data: &[u8]) -> io::Result<()> {
        self.host()?;
        let o = range_ok(off, data.len(), self.len)?;
        // SAFETY: o+data.len() <= self.len (checked above) and the memory is valid (type
        // invariant); `data` is a distinct Rust slice, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(o), data.len()) };
        Ok(())
    }

    /// Copies bytes at `off` out of the region into `out`.
    pub fn copy_out(&self, off: u64, out: &mut [u8]) -> io::Result<()> {
        self.host()?;
        let o = range_ok(off, out.len(), self.len)?;
        // SAFETY: bounds checked above; `out` is an exclusive Rust slice outside region memory.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(o), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `len` bytes from `src` at `src_off` into `dst` at `dst_off` (both bounds checked).
    pub fn copy_between(
        src: &RegionMem,
        src_off: u64,
        dst: &RegionMem,
        dst_off: u64,
        len: usize,
    ) -> io::Result<()> {
        src.host()?;
        dst.host()?;
        let s = range_ok(src_off, len, src.len)?;
        let d = range_ok(dst_off, len, dst.len)?;
        // SAFETY: both ranges are inside valid memory (checked); `copy` (memmove) is used because
        // two mappings of the same memfd could alias.
        unsafe { std::ptr::copy(src.ptr.add(s), dst.ptr.add(d), len) };
        Ok(())
    }

    /// Reads exactly `len` bytes from the stream `fd` straight into the region at `off`.
    pub fn recv_into(&self, fd: BorrowedFd<'_>, off: u64, len: usize) -> io::Result<()> {
        self.host()?;
        let o = range_ok(off, len, self.len)?;
        let mut done = 0usize;
        while done < len {
            // SAFETY: the destination range o+done .. o+len is inside valid region memory
            // (checked above); read writes at most len-done bytes there.
            let n = unsafe {
                libc::read(
                    fd.as_raw_fd(),
                    self.ptr.add(o + done) as *mut libc::c_void,
                    len - done,
                )
            };
            let eof = (
                io::ErrorKind::UnexpectedEof,
                "connection closed mid-payload",
            );
            let Some(n) = progress(n, eof)? else {
                continue;
            };
            done += n;
        }
        Ok(())
    }
}

impl Drop for RegionMem {
    fn drop(&mut self) {
        match self.backing {
            Backing::Memfd(_) | Backing::Mapped => {
                let ps = page_size();
                let map_len = self.len.div_ceil(ps) * ps;
                // SAFETY: ptr/map_len describe exactly the mapping created in alloc_memfd/map_fd
                // (mmap rounds to pages the same way); nothing uses it after drop.
                unsafe { libc::munmap(self.ptr as *mut libc::c_void, map_len) };
            }
            Backing::Raw(_) | Backing::Device { .. } => {}
        }
    }
}

/// One piece of an outgoing gather list: plain bytes or a range of region memory.
pub enum IoPart<'a> {
    /// Bytes owned by the caller (frame headers).
    Bytes(&'a [u8]),
    /// `len` bytes of a region at an offset.
    Region(&'a RegionMem, u64, usize),
}

/// Sends all the parts on the stream `fd` with as few `sendmsg` calls as possible
/// (`MSG_NOSIGNAL`: a dead peer is an error, not a SIGPIPE).
pub fn send_parts(fd: BorrowedFd<'_>, parts: &[IoPart<'_>]) -> io::Result<()> {
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(parts.len());
    for p in parts {
        match p {
            IoPart::Bytes(b) => {
                if !b.is_empty() {
                    iov.push(libc::iovec {
                        iov_base: b.as_ptr() as *mut libc::c_void,
                        iov_len: b.len(),
                    })
                }
            }
            IoPart::Region(m, off, len) => {
                m.host()?;
                let o = range_ok(*off, *len, m.len)?;
                if *len > 0 {
                    iov.push(libc::iovec {
                        // SAFETY: o+len <= m.len (checked), so the pointer stays in the region.
                        iov_base: unsafe { m.ptr.add(o) } as *mut libc::c_void,
                        iov_len: *len,
                    })
                }
            }
        }
    }
    let max_iov = 1024usize;
    let mut start = 0usize;
    while start < iov.len() {
        let end = (start + max_iov).min(iov.len());
        // SAFETY: zeroed msghdr is a valid "no name, no control" header; we point it at our iovec
        // array, which lives across the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov[start..end].as_mut_ptr();
        msg.msg_iovlen = end - start;
        // SAFETY: every iovec points into memory valid for reads (caller slices or checked region
        // ranges); sendmsg only reads from them.
        let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let mut n = n as usize;
        while n > 0 && start < end {
            let l = iov[start].iov_len;
            if n >= l {
                n -= l;
                start += 1;
            } else {
                // SAFETY: advancing within the same iovec by n < iov_len bytes.
                iov[start].iov_base =
                    unsafe { (iov[start].iov_base as *mut u8).add(n) } as *mut libc::c_void;
                iov[start].iov_len -= n;
                n = 0;
            }
        }
        while start < iov.len() && iov[start].iov_len == 0 {
            start += 1;
        }
    }
    Ok(())
}

/// Copies between local region memory and another same-host process's memory with
/// `process_vm_writev` (`write = true`) or `process_vm_readv`. Needs ptrace permission over
/// `pid` (same user, and Yama's ptrace_scope allowing it).
pub fn cma_copy(
    pid: i32,
    local: &RegionMem,
    local_off: u64,
    remote_addr: u64,
    len: usize,
    write: bool,
) -> io::Result<()> {
    local.host()?;
    let o = range_ok(local_off, len, local.len)?;
    let mut done = 0usize;
    while done < len {
        let liov = libc::iovec {
            // SAFETY: o+done < o+len <= local.len (checked above).
            iov_base: unsafe { local.ptr.add(o + done) } as *mut libc::c_void,
            iov_len: len - done,
        };
        let riov = libc::iovec {
            iov_base: (remote_addr + done as u64) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: the local iovec is inside valid region memory; the remote iovec is only
        // dereferenced by the kernel in the other process, which checks it (EFAULT on error).
        let n = unsafe {
            if write {
                libc::process_vm_writev(pid, &liov, 1, &riov, 1, 0)
            } else {
                libc::process_vm_readv(pid, &liov, 1, &riov, 1, 0)
            }
        };
        let stuck = (io::ErrorKind::WriteZero, "process_vm copy made no progress");
        let Some(n) = progress(n, stuck)? else {
            continue;
        };
        done += n;
    }
    Ok(())
}

/// What a system call that moves bytes returned (`n`, with errno set when negative): the
/// bytes it moved; `None` when a signal interrupted it (call it again); `zero` as the error
/// when it moved nothing.
fn progress(n: isize, zero: (io::ErrorKind, &'static str)) -> io::Result<Option<usize>> {
    match n {
        0 => Err(io::Error::new(zero.0, zero.1)),
        n if n < 0 => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                Ok(None)
            } else {
                Err(e)
            }
        }
        n => Ok(Some(n as usize)),
    }
}

/// Reads `out.len()` bytes at `addr` in process `pid` with `process_vm_readv` (used to probe
/// whether same-host memory access to a peer is permitted at all).
pub fn cma_peek(pid: i32, addr: u64, out: &mut [u8]) -> io::Result<()> {
    let liov = libc::iovec {
        iov_base: out.as_mut_ptr() as *mut libc::c_void,
        iov_len: out.len(),
    };
    let riov = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: out.len(),
    };
    // SAFETY: the local iovec is the caller's exclusive slice; the remote one is only
    // dereferenced by the kernel in the other process, which checks it.
    let n = unsafe { libc::process_vm_readv(pid, &liov, 1, &riov, 1, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != out.len() {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "short process_vm_readv",
        ));
    }
    Ok(())
}

#[cfg(test)]
impl RegionMem {
    /// A device region of `len` bytes at an address that is not device memory, for tests that
    /// check every host path refuses it (nothing may dereference it).
    pub(crate) fn unreachable_device(len: usize) -> RegionMem {
        let ipc = DeviceIpc {
            handle: [3; 64],
            offset: 0,
        };
        // SAFETY: the address is never dereferenced: every host copy refuses device memory, and
        // the tests using it have no CUDA copier.
        unsafe { RegionMem::device(0x1000, len, 0, ipc) }.expect("device region")
    }
}

#[cfg(test)]
mod device_tests {
    use super::*;

    #[test]
    fn device_memory_is_refused_by_every_host_copy() {
        let ipc = DeviceIpc {
            handle: [1; 64],
            offset: 0,
        };
        // An address that is not mapped here: any host access through it would fault.
        // SAFETY: the value is never dereferenced (that is what this test checks).
        let dev = unsafe { RegionMem::device(0x10, 4096, 0, ipc) }.expect("device region");
        assert_eq!(dev.kind(), MemKind::Device);
        assert_eq!(dev.device_ipc(), Some((0, ipc)));
        let host = RegionMem::alloc_memfd(4096).expect("memfd");
        let unsupported = |r: io::Result<()>| {
            assert_eq!(r.expect_err("refused").kind(), io::ErrorKind::Unsupported);
        };
        unsupported(dev.copy_in(0, &[1, 2, 3]));
        unsupported(dev.copy_out(0, &mut [0; 3]));
        unsupported(RegionMem::copy_between(&dev, 0, &host, 0, 16));
        unsupported(RegionMem::copy_between(&host, 0, &dev, 0, 16));
        let (a, _b) = std::os::unix::net::UnixStream::pair().expect("pair");
        unsupported(dev.recv_into(a.as_fd(), 0, 16));
        unsupported(send_parts(a.as_fd(), &[IoPart::Region(&dev, 0, 16)]));
        unsupported(cma_copy(
            std::process::id() as i32,
            &dev,
            0,
            0x1000,
            16,
            true,
        ));
        // What the CUDA copies use: bounds-checked, never dereferenced here.
        assert_eq!(dev.raw_addr(4000, 96).expect("inside"), 0x10 + 4000);
        assert!(dev.raw_addr(4000, 97).is_err());
        assert!(host.device_ipc().is_none());
        // Null, empty or wrapping device ranges are refused.
        // SAFETY: refused before anything could use them.
        unsafe {
            assert!(RegionMem::device(0, 16, 0, ipc).is_err());
            assert!(RegionMem::device(0x10, 0, 0, ipc).is_err());
            assert!(RegionMem::device(u64::MAX - 8, 16, 0, ipc).is_err());
        }
    }
}

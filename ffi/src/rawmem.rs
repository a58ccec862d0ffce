//! The one module of this crate that touches raw memory: registering caller memory given as an
//! address (a torch tensor's `data_ptr()`, a numpy buffer, an address from Mooncake's API) and
//! the engine-side "managed buffers" of the Mooncake drop-in.
//!
//! Python hands us integers. Before an address range is registered we check, from
//! `/proc/self/maps`, that every byte of it is mapped readable and writable in this process, so
//! a wrong integer is refused with an error instead of crashing the process on the first
//! transfer. What we cannot check is lifetime: the caller keeps the memory alive until it
//! unregisters it (Mooncake's contract too).

use std::alloc::Layout;

use kvwire_transfer::{Access, Engine, Error, RegionHandle};

/// Page size assumed for managed buffers (alignment only; any power of two works).
const PAGE: usize = 4096;

/// Checks that `[ptr, ptr+len)` is mapped readable and writable in this process.
pub fn check_mapped(ptr: u64, len: u64) -> Result<(), String> {
    if ptr == 0 {
        return Err("address is null".into());
    }
    if len == 0 {
        return Err("length is zero".into());
    }
    let end = ptr
        .checked_add(len)
        .ok_or_else(|| format!("address {ptr:#x} + length {len} overflows"))?;
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| format!("cannot read /proc/self/maps: {e}"))?;
    let mut covered = ptr;
    for line in maps.lines() {
        let mut it = line.split_whitespace();
        let (Some(range), Some(perms)) = (it.next(), it.next()) else {
            continue;
        };
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        if b <= covered || a > covered {
            continue;
        }
        // This mapping contains `covered`.
        if !perms.starts_with("rw") {
            return Err(format!(
                "address {covered:#x} is mapped without read+write permission ({perms})"
            ));
        }
        covered = b;
        if covered >= end {
            return Ok(());
        }
    }
    Err(format!(
        "address range {ptr:#x}..{end:#x} is not mapped in this process (gap at {covered:#x})"
    ))
}

/// Registers caller memory after checking that it is mapped (`pinned`: the caller pinned it
/// with the CUDA driver; only the metrics use it).
pub fn register(
    engine: &Engine,
    ptr: u64,
    len: u64,
    access: Access,
    pinned: bool,
) -> Result<RegionHandle, Error> {
    check_mapped(ptr, len).map_err(Error::InvalidArgument)?;
    let len = usize::try_from(len)
        .map_err(|_| Error::InvalidArgument("length does not fit in usize".into()))?;
    // SAFETY: `check_mapped` verified the whole range is mapped read+write in this process. Its
    // lifetime is the caller's promise (documented on every Python entry point that takes an
    // address): the memory stays valid until it is unregistered. We never create Rust
    // references into it; the engine copies through raw pointers only.
    unsafe {
        if pinned {
            engine.register_raw_pinned(ptr as *mut u8, len, access)
        } else {
            engine.register_raw(ptr as *mut u8, len, access)
        }
    }
}

/// A zeroed, page-aligned heap buffer owned by the Mooncake drop-in (`allocate_managed_buffer`).
/// Its memory is never exposed as a Rust slice: peers write into it at any time.
pub struct ManagedBuffer {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: the buffer is a plain heap allocation addressed only through raw pointers by the
// engine; moving or sharing the owner between threads does not touch the bytes.
unsafe impl Send for ManagedBuffer {}
// SAFETY: as above; `&ManagedBuffer` only exposes the address.
unsafe impl Sync for ManagedBuffer {}

impl ManagedBuffer {
    /// Allocates `len` zeroed bytes, page aligned.
    pub fn new(len: usize) -> Result<ManagedBuffer, String> {
        if len == 0 {
            return Err("length is zero".into());
        }
        let layout = Layout::from_size_align(len, PAGE)
            .map_err(|e| format!("bad buffer size {len}: {e}"))?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(format!("out of memory allocating {len} bytes"));
        }
        Ok(ManagedBuffer { ptr, layout })
    }

    /// The buffer's address.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// The buffer's length.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Never true (zero-length buffers are refused); for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.layout.size() == 0
    }
}

impl Drop for ManagedBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with this same `layout` and is freed only here.
        // Owners unregister the buffer from the engine before dropping it.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_checks() {
        let v = vec![0u8; 10000];
        assert!(check_mapped(v.as_ptr() as u64, v.len() as u64).is_ok());
        assert!(check_mapped(0, 10).is_err());
        assert!(check_mapped(16, 10).is_err());
        assert!(check_mapped(v.as_ptr() as u64, 0).is_err());
        assert!(check_mapped(u64::MAX - 4, 10).is_err());
        // Code pages are mapped but not writable.
        let f = mapped_checks as fn() as usize as u64;
        assert!(check_mapped(f, 8).is_err());
    }

    #[test]
    fn managed_buffer_is_aligned_and_zeroed() {
        let b = ManagedBuffer::new(8192).unwrap();
        assert_eq!(b.addr() % PAGE as u64, 0);
        assert_eq!(b.len(), 8192);
        assert!(check_mapped(b.addr(), 8192).is_ok());
        assert!(ManagedBuffer::new(0).is_err());
    }
}

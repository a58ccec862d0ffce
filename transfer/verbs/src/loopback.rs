//! The controls of `kvwire-verbs-loopback`, the in-process software device that stands in for
//! libibverbs in tests and in `kvwire-bench wr-cost`: where its library is, holding and
//! releasing its execution, and its counters. The device itself is that crate; this is the
//! side that a test or a bench calls (loaded by path, as the engine loads the device, so both
//! reach the same library instance).

use std::path::{Path, PathBuf};

use libloading::Library;

use crate::error::VerbsError;

/// File name of the loopback device's library.
pub const LOOPBACK_LIBRARY: &str = "libkvwire_verbs_loopback.so";

/// The loopback device's library in the build tree of `exe` (a test binary in
/// `target/<profile>/deps/`, or a binary in `target/<profile>/`), if it was built.
pub fn find_loopback(exe: &Path) -> Option<PathBuf> {
    let dir = exe.parent()?;
    [
        dir.to_path_buf(),
        dir.join("deps"),
        dir.parent()?.to_path_buf(),
    ]
    .into_iter()
    .map(|d| d.join(LOOPBACK_LIBRARY))
    .find(|p| p.is_file())
}

/// Controls of a loaded loopback device.
pub struct Loopback {
    hold: unsafe extern "C" fn(i32),
    copy: unsafe extern "C" fn(i32),
    counters: unsafe extern "C" fn(*mut u64, *mut u64),
    _lib: Library,
}

impl Loopback {
    /// Loads the loopback device's library at `path` (the one `KVWIRE_IBVERBS_PATH` names).
    pub fn load(path: &Path) -> Result<Loopback, VerbsError> {
        let na = |reason: String| VerbsError::NotAvailable {
            path: path.display().to_string(),
            reason,
        };
        // SAFETY: loading the loopback device's library runs no initialiser of its own beyond
        // Rust's (it has no constructors); the same file the engine loads.
        let lib = unsafe { Library::new(path) }.map_err(|e| na(e.to_string()))?;
        // SAFETY: both symbols are defined by the loopback crate with exactly these signatures.
        let (hold, copy, counters) = unsafe {
            (
                *lib.get::<unsafe extern "C" fn(i32)>(b"kvwire_loopback_hold\0")
                    .map_err(|e| na(e.to_string()))?,
                *lib.get::<unsafe extern "C" fn(i32)>(b"kvwire_loopback_copy\0")
                    .map_err(|e| na(e.to_string()))?,
                *lib.get::<unsafe extern "C" fn(*mut u64, *mut u64)>(b"kvwire_loopback_counters\0")
                    .map_err(|e| na(e.to_string()))?,
            )
        };
        Ok(Loopback {
            hold,
            copy,
            counters,
            _lib: lib,
        })
    }

    /// Holds the device: work requests posted from now on wait, unexecuted, until
    /// [`Loopback::release`] (a queue pair moved to the error state meanwhile flushes them).
    pub fn hold(&self) {
        // SAFETY: the function takes a plain int; the library stays loaded while `self` lives.
        unsafe { (self.hold)(1) }
    }

    /// Releases the device: waiting work requests execute, in posting order.
    pub fn release(&self) {
        // SAFETY: as in `hold`.
        unsafe { (self.hold)(0) }
    }

    /// Whether work requests move their bytes (`true`, the default) or are only checked.
    pub fn set_copy(&self, on: bool) {
        // SAFETY: as in `hold`.
        unsafe { (self.copy)(i32::from(on)) }
    }

    /// Work requests posted and completions polled since the library was loaded.
    pub fn counters(&self) -> (u64, u64) {
        let (mut posted, mut polled) = (0u64, 0u64);
        // SAFETY: two writable u64s; the library stays loaded while `self` lives.
        unsafe { (self.counters)(&mut posted, &mut polled) };
        (posted, polled)
    }
}

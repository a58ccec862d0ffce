//! [`Verbs`]: loading libibverbs, listing and opening devices.

use crate::device::{Context, DeviceInfo};
use crate::error::VerbsError;
use crate::library::{ibv_fn, Lib};
use crate::sys;
use std::ffi::CStr;
use std::sync::Arc;

/// Soname tried by [`Verbs::load`].
pub const DEFAULT_LIBRARY: &str = "libibverbs.so.1";
/// Environment variable overriding the library path used by [`Verbs::load`].
pub const LIBRARY_ENV: &str = "KVWIRE_IBVERBS_PATH";

/// Entry points kvwire cannot work without; [`Verbs::load`] fails with
/// [`VerbsError::NotAvailable`] when one is missing, so later calls do not.
const REQUIRED_SYMBOLS: &[&str] = &[
    "ibv_get_device_list",
    "ibv_free_device_list",
    "ibv_get_device_name",
    "ibv_get_device_guid",
    "ibv_open_device",
    "ibv_close_device",
    "ibv_query_device",
    "ibv_query_port",
    "ibv_query_gid",
    "ibv_alloc_pd",
    "ibv_dealloc_pd",
    "ibv_reg_mr",
    "ibv_dereg_mr",
    "ibv_create_comp_channel",
    "ibv_destroy_comp_channel",
    "ibv_create_cq",
    "ibv_destroy_cq",
    "ibv_get_cq_event",
    "ibv_ack_cq_events",
    "ibv_create_qp",
    "ibv_modify_qp",
    "ibv_destroy_qp",
];

/// Handle to a loaded libibverbs. Cheap to clone.
#[derive(Clone)]
pub struct Verbs {
    lib: Arc<Lib>,
    path: String,
}

impl std::fmt::Debug for Verbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verbs").field("path", &self.path).finish()
    }
}

impl Verbs {
    /// Loads libibverbs from `$KVWIRE_IBVERBS_PATH` if set, else [`DEFAULT_LIBRARY`].
    ///
    /// Returns [`VerbsError::NotAvailable`] when the library (or one of the entry points
    /// kvwire needs) is missing; never panics.
    pub fn load() -> Result<Verbs, VerbsError> {
        match std::env::var_os(LIBRARY_ENV) {
            Some(p) if !p.is_empty() => Verbs::load_from(&p.to_string_lossy()),
            _ => Verbs::load_from(DEFAULT_LIBRARY),
        }
    }

    /// Loads libibverbs from an explicit path or soname.
    pub fn load_from(path: &str) -> Result<Verbs, VerbsError> {
        // SAFETY: loading libibverbs runs its ELF constructors, which only initialise the
        // library's own state (no global side effects on Rust code). The symbol types are those
        // of rdma-core's public headers, from which `sys` was generated; the libibverbs.so.1
        // ABI is versioned and stable.
        let raw = unsafe { sys::IbvLib::new(path) }.map_err(|e| VerbsError::NotAvailable {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
        let lib = Lib { raw };
        if let Some(missing) = REQUIRED_SYMBOLS.iter().find(|s| !lib.has(s)) {
            return Err(VerbsError::NotAvailable {
                path: path.to_string(),
                reason: format!("symbol {missing} not found"),
            });
        }
        Ok(Verbs {
            lib: Arc::new(lib),
            path: path.to_string(),
        })
    }

    /// The path or soname the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Lists the RDMA devices, with their sysfs locality (NUMA node, PCI address).
    ///
    /// A kernel without RDMA support makes `ibv_get_device_list` return NULL with `ENOSYS`;
    /// that is an empty list here, not an error.
    pub fn devices(&self) -> Result<Vec<DeviceInfo>, VerbsError> {
        self.with_device_list(|list| {
            let mut out = Vec::with_capacity(list.len());
            for &dev in list {
                out.push(self.describe(dev)?);
            }
            Ok(out)
        })
    }

    /// Opens the device called `name` (e.g. `mlx5_0`, `rxe0`).
    pub fn open(&self, name: &str) -> Result<Context, VerbsError> {
        self.with_device_list(|list| {
            for &dev in list {
                let info = self.describe(dev)?;
                if info.name == name {
                    return Context::open(self.lib.clone(), dev, info);
                }
            }
            Err(VerbsError::NoSuchDevice(name.to_string()))
        })
    }

    /// Runs `f` over the device list, freeing the list afterwards.
    fn with_device_list<T>(
        &self,
        f: impl FnOnce(&[*mut sys::ibv_device]) -> Result<T, VerbsError>,
    ) -> Result<T, VerbsError> {
        let get = ibv_fn!(self.lib, ibv_get_device_list);
        let free = ibv_fn!(self.lib, ibv_free_device_list);
        let mut n: std::os::raw::c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the function returns either NULL (errno set) or
        // a NULL-terminated array of `n` device pointers owned by the library until freed.
        let list = unsafe { get(&mut n) };
        if list.is_null() {
            let err = std::io::Error::last_os_error();
            return match err.raw_os_error() {
                // No RDMA subsystem in the kernel (/sys/class/infiniband_verbs missing).
                Some(libc::ENOSYS) => f(&[]),
                _ => Err(VerbsError::Os {
                    op: "ibv_get_device_list",
                    source: err,
                }),
            };
        }
        let count = usize::try_from(n).unwrap_or(0);
        // SAFETY: `list` is non-NULL and points to at least `count` valid device pointers
        // (libibverbs guarantees `n` entries before the NULL terminator).
        let devices = unsafe { std::slice::from_raw_parts(list, count) };
        let result = f(devices);
        // SAFETY: `list` came from ibv_get_device_list and is freed exactly once; opened
        // contexts stay valid after the list is freed (documented by libibverbs).
        unsafe { free(list) };
        result
    }

    fn describe(&self, dev: *mut sys::ibv_device) -> Result<DeviceInfo, VerbsError> {
        let get_name = ibv_fn!(self.lib, ibv_get_device_name);
        let get_guid = ibv_fn!(self.lib, ibv_get_device_guid);
        // SAFETY: `dev` is an element of a live device list; the returned name is a
        // NUL-terminated string inside the device struct, copied out before the list is freed.
        let name = unsafe {
            let p = get_name(dev);
            if p.is_null() {
                return Err(VerbsError::InvalidArgument(
                    "device without a name".to_string(),
                ));
            }
            CStr::from_ptr(p).to_string_lossy().into_owned()
        };
        // SAFETY: `dev` is a live device of the list; the GUID is returned by value
        // (network byte order).
        let guid = u64::from_be(unsafe { get_guid(dev) });
        Ok(DeviceInfo::from_sysfs(name, guid))
    }
}

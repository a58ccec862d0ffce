//! RDMA verbs, loaded at run time.
//!
//! libibverbs is opened with `dlopen` (through [`libloading`]) when [`Verbs::load`] is called,
//! never linked: a machine without it runs kvwire over TCP/shm, and the Python wheel stays
//! manylinux. The raw bindings in `sys` were generated once with bindgen's dynamic-loading mode
//! and committed (see that file's header); the static-inline verbs of `<infiniband/verbs.h>`
//! (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`) are re-implemented
//! in `ops` by calling through the context's ops table, exactly as the inlines do.
//!
//! The safe layer is thin and owns every resource with RAII:
//!
//! ```text
//! Verbs ─ devices() / open(name) ─▶ Context ─┬─ alloc_pd() ─▶ Pd ─┬─ register_*() ─▶ Mr / RegisteredBuffer
//!                                            │                    └─ create_qp(cq, cq) ─▶ Qp (RC)
//!                                            └─ create_cq() ─▶ Cq (+ its own completion channel)
//! ```
//!
//! Children hold an `Arc` of their parents, so a parent is only destroyed after its last child
//! (QP before CQ and PD, MR before PD, CQ before its channel, everything before the device
//! context). All `unsafe` code of kvwire's verbs support is in this module.
//!
//! Memory safety of posting: a work request names local memory only through `(lkey, addr, len)`
//! triples, which the NIC checks against the registered region before it touches a byte (an
//! invalid one completes with [`WcStatus::LocalProtection`]); a region's memory outlives the
//! region by construction ([`RegisteredBuffer`]) or by the contract of the `unsafe`
//! [`Pd::register_raw`]. So posting is a safe operation; remote addresses are checked by the
//! remote NIC against the remote key.

mod cq;
mod device;
mod error;
mod memory;
mod ops;
mod qp;
#[allow(
    dead_code,
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    missing_docs,
    unsafe_op_in_unsafe_fn,
    clippy::all
)]
mod sys;

pub use cq::{Completion, CompletionOp, Cq};
pub use device::{Context, DeviceInfo, Gid, GidKind, GidSelection, LinkLayer, Mtu, PortInfo};
pub use error::{VerbsError, WcError, WcStatus};
pub use memory::{Access, Mr, Pd, RegisteredBuffer, RemoteSlice, Sge};
pub use qp::{ConnectParams, Endpoint, Qp, QpCaps, SendOp, SendRequest};

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

/// The loaded library. Shared (`Arc`) by every resource created from it, so it is unloaded
/// only after the last resource is destroyed.
pub(crate) struct Lib {
    raw: sys::IbvLib,
}

/// Fetches a resolved entry point of [`Lib`], or returns `MissingSymbol` from the caller.
macro_rules! ibv_fn {
    ($lib:expr, $name:ident) => {
        match &$lib.raw.$name {
            Ok(f) => *f,
            Err(_) => return Err($crate::verbs::VerbsError::MissingSymbol(stringify!($name))),
        }
    };
}
pub(crate) use ibv_fn;

impl Lib {
    fn has(&self, name: &str) -> bool {
        let r = &self.raw;
        match name {
            "ibv_get_device_list" => r.ibv_get_device_list.is_ok(),
            "ibv_free_device_list" => r.ibv_free_device_list.is_ok(),
            "ibv_get_device_name" => r.ibv_get_device_name.is_ok(),
            "ibv_get_device_guid" => r.ibv_get_device_guid.is_ok(),
            "ibv_open_device" => r.ibv_open_device.is_ok(),
            "ibv_close_device" => r.ibv_close_device.is_ok(),
            "ibv_query_device" => r.ibv_query_device.is_ok(),
            "ibv_query_port" => r.ibv_query_port.is_ok(),
            "ibv_query_gid" => r.ibv_query_gid.is_ok(),
            "ibv_alloc_pd" => r.ibv_alloc_pd.is_ok(),
            "ibv_dealloc_pd" => r.ibv_dealloc_pd.is_ok(),
            "ibv_reg_mr" => r.ibv_reg_mr.is_ok(),
            "ibv_dereg_mr" => r.ibv_dereg_mr.is_ok(),
            "ibv_create_comp_channel" => r.ibv_create_comp_channel.is_ok(),
            "ibv_destroy_comp_channel" => r.ibv_destroy_comp_channel.is_ok(),
            "ibv_create_cq" => r.ibv_create_cq.is_ok(),
            "ibv_destroy_cq" => r.ibv_destroy_cq.is_ok(),
            "ibv_get_cq_event" => r.ibv_get_cq_event.is_ok(),
            "ibv_ack_cq_events" => r.ibv_ack_cq_events.is_ok(),
            "ibv_create_qp" => r.ibv_create_qp.is_ok(),
            "ibv_modify_qp" => r.ibv_modify_qp.is_ok(),
            "ibv_destroy_qp" => r.ibv_destroy_qp.is_ok(),
            _ => false,
        }
    }
}

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

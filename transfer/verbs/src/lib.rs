//! kvwire-verbs: RDMA verbs, loaded at run time (the only crate of kvwire with verbs `unsafe`).
//!
//! Modules:
//! * `sys`: the generated bindings (bindgen, dynamic loading; committed, see its header);
//!   public (hidden) only for `kvwire-verbs-loopback`, the in-process software device that
//!   implements these entry points for tests and the per-work-request bench;
//! * `library`: the loaded library (`Lib`) and the symbol-fetch macro;
//! * `loader`: [`Verbs`] — load the library, list and open devices;
//! * `device`: [`Context`], ports, GIDs, MTUs, sysfs locality;
//! * `memory`: [`Pd`], memory regions ([`Mr`], [`RegisteredBuffer`]), scatter entries;
//! * `qp`: RC queue pairs ([`Qp`]), endpoints, posting work requests;
//! * `cq`: completion queues ([`Cq`]) with their completion channel;
//! * `ops`: the static-inline verbs written through the context's ops table;
//! * `error`: [`VerbsError`], work-completion statuses;
//! * `loopback`: [`Loopback`], the controls of the in-process software device
//!   (`kvwire-verbs-loopback`) that tests and the per-work-request bench load in place of
//!   libibverbs.
//!
//! libibverbs is opened with `dlopen` (through [`libloading`]) when [`Verbs::load`] (path from
//! `$KVWIRE_IBVERBS_PATH`, else the soname) or [`Verbs::load_from`] (an explicit path, which
//! the transfer engine uses) is called, never linked: a machine without it runs kvwire over
//! TCP/shm, and the Python wheel stays manylinux. The raw bindings in `sys` were generated once
//! with bindgen's dynamic-loading mode and committed (see that file's header); the
//! static-inline verbs of `<infiniband/verbs.h>` (`ibv_post_send`, `ibv_post_recv`,
//! `ibv_poll_cq`, `ibv_req_notify_cq`) are re-implemented in `ops` by calling through the
//! context's ops table, exactly as the inlines do.
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
//! context). All `unsafe` code of kvwire's verbs support is in this crate; the transfer engine
//! sees only the safe types re-exported below (as `kvwire_transfer::verbs`).
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
mod library;
mod loader;
mod loopback;
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
    clippy::all,
    clippy::undocumented_unsafe_blocks
)]
#[doc(hidden)]
pub mod sys;

pub use cq::{Completion, CompletionOp, Cq};
pub use device::{
    contexts_open, contexts_opened, Context, DeviceInfo, Gid, GidKind, GidSelection, LinkLayer,
    Mtu, PortInfo,
};
pub use error::{VerbsError, WcError, WcStatus};
pub use loader::{Verbs, DEFAULT_LIBRARY, LIBRARY_ENV};
pub use loopback::{find_loopback, Loopback, LOOPBACK_LIBRARY};
pub use memory::{Access, Mr, Pd, RegisteredBuffer, RemoteSlice, Sge};
pub use qp::{ConnectParams, Endpoint, Qp, QpCaps, SendOp, SendRequest};

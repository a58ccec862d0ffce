//! kvwire transfer engine.
//!
//! Modules, from the bottom up. Each uses only modules listed before it, except that [`Error`]
//! carries a [`wire::ProtocolError`] while the decoders in `wire` return [`Error`]; the files
//! still form no cycle (`error.rs` uses only `wire/problem.rs`, which uses only `wire/msg.rs`
//! and `types`).
//! * `types`: the plain vocabulary ([`Op`], [`RegionId`], [`Access`], [`TransportKind`], ...);
//! * `limits`: [`Limits`] (what peers may make the engine hold) and [`Resource`];
//! * `config`: [`EngineConfig`], the only reader of the environment;
//! * `auth`: random values, the handshake's key schedule and proofs (X25519, HKDF, HMAC);
//! * `wire`: every byte layout on the wire, and [`wire::ProtocolError`];
//! * `error`: [`Error`];
//! * `host`: this engine's [`HostIdentity`];
//! * `mem`: region memory (memfd or caller memory), copies, RDMA memory registrations;
//! * `region`: the region table and the per-region copy gate;
//! * `coalesce`: merging adjacent ops;
//! * `notify`: [`Notifications`] delivered to a target;
//! * `metrics`: counters, [`MetricsSnapshot`], the Prometheus endpoint;
//! * `batch`: [`Batch`] completion, deadlines, what a transport is handed;
//! * `ctrl`: the serialized writer of a peer's control connection;
//! * `transport`: the transport traits and the `tcp`, `shm`, `rdma` and `cuda_ipc` transports
//!   (`cuda_ipc` uses only the driver layer of `cuda`: `cuda/driver.rs`, `cuda/ipc.rs`);
//! * `engine`: [`Engine`] and [`Peer`] (handshake, control connection, regions, submit);
//! * `layer`: layer streams ([`layer::LayerStream`]);
//! * `cuda`: CUDA device memory (feature `cuda`): the driver and IPC layer under `cuda_ipc`, and,
//!   above the engine, device regions and the staging of layer streams.
//!
//! Register memory as [`RegionHandle`]s, [`Engine::connect`] to peers (handshake with protocol
//! version, mutual shared-secret proof and region descriptors), and move bytes with batches of
//! [`Op`]s: one completion per batch ([`Batch`]: blocking wait with deadline, O(1) poll, or
//! `.await`), and an optional notification delivered to the target only after every byte of its
//! batch landed ([`Engine::notifications`]).
//!
//! Transports: `tcp` (persistent multi-lane connections, pipelined slices, target-side bounds
//! checks before a byte lands), `shm` for peers on one host (the target's memfd regions mapped
//! and copied into; `process_vm_writev` for caller memory) and `rdma` (RC queue pairs over one
//! or several verbs devices per engine, one-sided WRITE/READ striped over the queue pairs,
//! every region registered as a memory region on every device so the NIC enforces its bounds;
//! notifications follow the data over the control connection, with a fence the target answers;
//! offered only when libibverbs loads at run time and a device is usable), and `cuda_ipc` for
//! device regions of peers on one host (copies on the GPU, offered when the CUDA driver loads).
//! [`TransportKind::Auto`] picks cuda_ipc towards a same-host peer when this engine has a
//! device region, else shm when both engines share a host, rdma when both offer it
//! (first, with [`EngineConfig::prefer_rdma`]), tcp otherwise.
//!
//! The `KVWIRE_*` environment variables apply only to configurations built with
//! [`EngineConfig::from_env`]; [`EngineConfig::default`] and [`Engine::new`] read nothing.
//!
//! ```
//! use kvwire_transfer::{Access, Engine, EngineConfig, Op};
//! # fn main() -> Result<(), kvwire_transfer::Error> {
//! let target = Engine::new(EngineConfig::default())?;
//! let dst = target.alloc_region(1 << 20, Access::WriteOnly)?;
//! let init = Engine::new(EngineConfig::default())?;
//! let src = init.alloc_region(1 << 20, Access::Local)?;
//! init.local_write(src, 0, b"hello")?;
//! let peer = init.connect(target.listen_addr())?;
//! let op = Op { local: src, local_offset: 0, remote: target.region_id(dst), remote_offset: 0, len: 5 };
//! init.write(&peer, &[op], Some(b"req-1"), None)?.wait()?;
//! let n = target.notifications().recv_timeout(std::time::Duration::from_secs(1))?;
//! assert_eq!(n.tag, b"req-1");
//! # Ok(()) }
//! ```
//!
//! `unsafe` lives only in the raw-memory module (`mem`: region memory, copies, memory
//! registration with the verbs devices) and in `cuda` (the CUDA driver calls), plus the
//! forwarding call inside the `unsafe fn` [`Engine::register_raw`]; the verbs bindings and
//! their `unsafe` are in the `kvwire-verbs` crate (re-exported as [`verbs`]). Region memory is
//! never exposed as a Rust slice (peers write into it concurrently): use
//! [`Engine::local_write`] and [`Engine::local_read`].
//!

#![deny(unsafe_code)]

// Public for the tests' hand-written peers (the handshake's key schedule); not an API.
#[doc(hidden)]
pub mod auth;
mod batch;
// Public for the tests of coalescing only; callers never need it (`Engine::write` coalesces).
#[doc(hidden)]
pub mod coalesce;
mod config;
mod ctrl;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod cuda;
mod engine;
mod error;
mod gate;
mod host;
pub mod layer;
mod limits;
#[allow(unsafe_code)]
mod mem;
pub mod metrics;
mod net;
mod notify;
mod region;
// Public for the fuzz targets (the handshake's exchanges over bytes); not an API.
#[doc(hidden)]
pub mod session;
mod transport;
mod types;
pub use kvwire_verbs as verbs;
pub mod wire;

pub use auth::new_secret;
pub use batch::Batch;
pub use config::EngineConfig;
pub use engine::{Descriptor, Engine, Peer};
pub use error::Error;
pub use limits::{Limits, Resource};
pub use metrics::MetricsSnapshot;
pub use notify::{Notification, Notifications};
pub use types::{
    Access, BatchStats, DeviceIpc, Op, PeerId, RegionHandle, RegionId, RemoteRegion, TransportKind,
};
pub use wire::HostIdentity;

//! kvwire transfer engine.
//!
//! Register memory as [`RegionHandle`]s, [`Engine::connect`] to peers (handshake with protocol
//! version, mutual shared-secret proof and region descriptors), and move bytes with batches of
//! [`Op`]s: one completion per batch ([`Batch`]: blocking wait with deadline, O(1) poll, or
//! `.await`), and an optional notification delivered to the target only after every byte of its
//! batch landed ([`Engine::notifications`]).
//!
//! Transports: `tcp` (persistent multi-lane connections, pipelined slices, target-side bounds
//! checks before a byte lands), `shm` for peers on one host (the target's memfd regions mapped
//! and copied into; `process_vm_writev` for caller memory) and `rdma` (RC queue pairs on one
//! verbs device per engine, one-sided WRITE/READ striped over `lanes` queue pairs, every region
//! registered as a memory region so the NIC enforces its bounds; offered only when libibverbs
//! loads at run time and a device is usable). [`TransportKind::Auto`] picks shm when both
//! engines share a host, rdma when both offer it (first, with
//! [`EngineConfig::prefer_rdma`]), tcp otherwise.
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
//! `unsafe` lives only in the raw-memory module (`mem`) (plus the forwarding call inside the
//! `unsafe fn` [`Engine::register_raw`]); region memory is never exposed as a
//! Rust slice (peers write into it concurrently): use [`Engine::local_write`] and
//! [`Engine::local_read`].

#![deny(unsafe_code)]

mod auth;
mod batch;
pub mod coalesce;
mod config;
mod ctrl;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod cuda;
mod engine;
mod error;
mod host;
pub mod layer;
#[allow(unsafe_code)]
mod mem;
pub mod metrics;
mod notify;
mod region;
mod transport;
mod types;
pub use kvwire_verbs as verbs;
pub mod wire;

pub use batch::Batch;
pub use config::EngineConfig;
pub use engine::{Descriptor, Engine, Peer};
pub use error::Error;
pub use metrics::MetricsSnapshot;
pub use notify::{Notification, Notifications};
pub use types::{
    Access, BatchStats, Op, PeerId, RegionHandle, RegionId, RemoteRegion, TransportKind,
};
pub use wire::HostIdentity;

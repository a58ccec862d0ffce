//! The transport abstraction: how a validated, coalesced batch reaches a peer.
//!
//! The engine owns everything transport-independent: regions, the handshake (version, secret,
//! region descriptors, host identity), the per-peer control connection (region updates, shm and
//! RDMA notifications, fences), batch ids, deadlines and completion. A transport owns the data
//! path.
//!
//! Lifecycle, and what the RDMA transport puts in each step:
//! 1. **Handshake blobs**: [`Transport::hello_blob`] is carried in `Hello`/`HelloReply`
//!    (`wire::CtrlMsg::*::blobs`, tagged with the transport bit): for RDMA a nonce and, per
//!    device, its port, GID index, MTU, link class and the endpoints (GID, QPN, PSN, LID) of
//!    queue pairs prepared for this handshake (`wire::rdma`).
//! 2. **Per-peer state**: [`Transport::establish`] turns the remote blob (and the remote region
//!    table, whose `WireRegion` entries carry per-transport keys) into a [`PeerTransport`]: for
//!    RDMA the prepared queue pairs, connected to the peer's (the devices' completion threads
//!    run from `Engine::new` on).
//! 3. **Post**: [`PeerTransport::post`] receives a coalesced, bounds-checked
//!    [`Posted`](crate::batch::Posted) batch and creates its
//!    [`BatchState`](crate::batch::BatchState) with the number of completion parts it will
//!    report. RDMA cuts the batch into work requests striped over its queue pairs and reports
//!    one part: when every work request completed, the batch's notification (if any) goes over
//!    the control connection followed by a fence, and the part completes when the target
//!    answers the fence; without a notification, at once.
//! 4. **Completion callback**: the transport calls `BatchState::part_done` per finished part, or
//!    `BatchState::fail` with a typed error; the engine's waiters, pollers and futures see it.
//!    Target-side arrivals go through [`TargetCtx`] (region checks, notification tracking).
//! 5. **Close**: [`PeerTransport::close`] when the peer dies or the engine shuts down; every
//!    in-flight batch is failed by the engine's `Pending` map.
//!
//! The RDMA transport (`rdma`) also uses: per-handshake blobs (fresh QPs keyed by a nonce,
//! claimed in `establish` through [`EstablishCtx::local_blob`]), region hooks
//! ([`Transport::region_added`] registers an MR whose rkey goes into `WireRegion::rkey`),
//! passive attachment ([`Transport::attach_always`]: QPs are connected on both ends even when
//! only one side writes through them) and its own control messages
//! ([`PeerTransport::on_ctrl`], `CtrlMsg::Transport`: QP re-establishment after errors, remote
//! keys on further devices).
//!
//! Modules:
//! * `api`: the [`Transport`] and [`PeerTransport`] traits and what the engine hands them;
//! * `marks`: [`CopyMarks`], what each TCP lane thread is copying now;
//! * `target`: [`TargetCtx`] and [`NotifyTracker`], the target side's checks and notifications;
//! * `tcp`, `shm`, `rdma`: the three transports of every build;
//! * `cuda_ipc` (feature `cuda`): copies into a same-host peer's device regions on the GPU,
//!   shm's per-peer state with a device copier plugged in.

mod api;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_ipc;
mod marks;
pub(crate) mod rdma;
pub(crate) mod shm;
mod target;
pub(crate) mod tcp;

pub(crate) use api::{CopyJob, EstablishCtx, OnDead, PeerTransport, Transport};
pub(crate) use marks::CopyMarks;
pub(crate) use target::{NotifyTracker, TargetCtx};

//! What a transport is to the engine: [`Transport`] (one per kind and engine) and
//! [`PeerTransport`] (its per-peer data path), with what the engine hands them.

use std::net::SocketAddr;
use std::sync::Arc;

use crossbeam_channel::Sender;

use super::marks::CopyMarks;
use crate::auth::LaneCred;
use crate::batch::{BatchState, Pending, Posted};
use crate::config::EngineConfig;
use crate::ctrl::CtrlWriter;
use crate::error::Error;
use crate::net::Threads;
use crate::region::RegionEntry;
use crate::types::{RegionId, TransportKind};
use crate::wire::{HostIdentity, MrChunks, ProtocolError};

/// Called when the peer must be considered dead (lane broke, protocol violation).
pub(crate) type OnDead = Arc<dyn Fn(String) + Send + Sync>;

/// A job for the engine's copy thread.
pub(crate) type CopyJob = Box<dyn FnOnce() + Send>;

/// Per-peer data path.
pub(crate) trait PeerTransport: Send + Sync {
    /// The transport kind (reported in `BatchStats` and `Peer::transport`).
    fn kind(&self) -> TransportKind;
    /// Posts a batch; the returned state is completed by the transport. The transport registers
    /// the state in `pending` before any part can complete.
    fn post(&self, b: Posted, pending: &Arc<Pending>) -> Result<Arc<BatchState>, Error>;
    /// Opens what the data path needs now rather than at the first batch (TCP: the lanes).
    fn warm_up(&self) -> Result<(), Error> {
        Ok(())
    }
    /// The remote withdrew these regions (drop cached mappings/keys).
    fn regions_removed(&self, _ids: &[RegionId]) {}
    /// Work requests posted per lane so far (RDMA queue pairs; empty for other transports).
    fn lane_counters(&self) -> Vec<u64> {
        Vec::new()
    }
    /// Work requests posted so far per local device (RDMA: `(device name, count)` for every
    /// device of the engine); empty for other transports.
    fn device_counters(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
    /// The slice sizes this peer's large batches are cut with now, `[write, read]` (RDMA,
    /// whose sizes adapt: `EngineConfig::rdma_slice_max`); `None` for other transports.
    fn slice_sizes(&self) -> Option<[u64; 2]> {
        None
    }
    /// Work requests re-posted on another lane after a lane failed (RDMA).
    fn reposts(&self) -> u64 {
        0
    }
    /// Lanes re-established after errors so far (RDMA queue pairs replaced).
    fn lanes_reestablished(&self) -> u64 {
        0
    }
    /// A `CtrlMsg::Transport` message for this transport from the peer.
    fn on_ctrl(&self, _data: &[u8]) -> Result<(), Error> {
        Err(ProtocolError::NoTransportMessages { kind: self.kind() }.into())
    }
    /// Tear down (peer dead or engine shutdown).
    fn close(&self);
}

/// Everything a transport may use to set up its per-peer state after the handshake.
pub(crate) struct EstablishCtx<'a> {
    /// The remote's blob for this transport (from `Hello`/`HelloReply`), if it sent one.
    #[allow(dead_code)]
    pub remote_blob: Option<&'a [u8]>,
    /// The blob we sent the remote for this transport in this handshake, if any.
    pub local_blob: Option<&'a [u8]>,
    /// Where the remote runs (pid for same-host transports).
    pub remote_host: &'a HostIdentity,
    /// Where to open data connections to the remote (its listen address).
    pub lane_addr: SocketAddr,
    /// The credentials our lanes join the remote's listener with (derived in the handshake).
    pub lane_cred: LaneCred,
    /// Engine configuration (lanes, slice size, timeouts).
    pub cfg: &'a EngineConfig,
    /// The peer's control connection (notifications for transports without a data-path one).
    pub ctrl: Arc<CtrlWriter>,
    /// The peer's in-flight batches.
    pub pending: Arc<Pending>,
    /// Call when the data path finds the peer dead.
    pub on_dead: OnDead,
    /// The engine's copy thread (for long copies that should not block the submitter).
    pub copy_tx: Sender<CopyJob>,
    /// Where the peer's lane threads mark the region they are copying (TCP).
    pub marks: Arc<CopyMarks>,
    /// The engine's count of running threads (threads the transport starts are counted).
    pub threads: Threads,
}

/// A transport (one instance per kind, per engine).
pub(crate) trait Transport: Send + Sync {
    /// The kind.
    fn kind(&self) -> TransportKind;
    /// The `wire::TRANSPORT_*` bit naming this transport in the handshake.
    fn bit(&self) -> u8;
    /// Transport-specific bytes for our `Hello`/`HelloReply` (`None` = nothing to say).
    fn hello_blob(&self) -> Option<Vec<u8>> {
        None
    }
    /// A blob of ours that no `establish` will claim (the handshake or the peer's setup
    /// failed): release what it names now (RDMA: the prepared queue pairs).
    fn discard_blob(&self, _blob: &[u8]) {}
    /// Whether this transport can reach a peer (host identity, the peer's blob for it).
    fn usable_with(&self, _remote_host: &HostIdentity, _remote_blob: Option<&[u8]>) -> bool {
        true
    }
    /// Whether the per-peer state must be built whenever both sides offered this transport,
    /// even when this side chose another one (the remote may still use it towards us: RDMA
    /// queue pairs must be connected on both ends).
    fn attach_always(&self) -> bool {
        false
    }
    /// A local region was added (RDMA: register its memory).
    fn region_added(&self, _e: &RegionEntry) -> Result<(), Error> {
        Ok(())
    }
    /// A local region was removed (RDMA: deregister it).
    fn region_removed(&self, _id: RegionId) {}
    /// The RDMA keys peers use for a local region: on the first device (0 = none), and the
    /// other chunks' where its registration is cut in chunks.
    fn region_keys(&self, _id: RegionId) -> (u32, Option<MrChunks>) {
        (0, None)
    }
    /// Builds the per-peer state once this side chose this transport towards the peer.
    fn establish(&self, ctx: EstablishCtx<'_>) -> Result<Arc<dyn PeerTransport>, Error>;
}

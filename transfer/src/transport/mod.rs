//! The transport abstraction: how a validated, coalesced batch reaches a peer.
//!
//! The engine owns everything transport-independent: regions, the handshake (version, secret,
//! region descriptors, host identity), the per-peer control connection (region updates, shm
//! notifications), batch ids, deadlines and completion. A transport owns the data path.
//!
//! Lifecycle, with what an RDMA transport would put in each step:
//! 1. **Handshake blobs**: [`Transport::hello_blob`] is carried in `Hello`/`HelloReply`
//!    (`wire::CtrlMsg::*::blobs`, tagged with the transport bit) — for RDMA the GID, QPNs, PSNs
//!    and the rkeys of offered regions.
//! 2. **Per-peer state**: [`Transport::establish`] turns the remote blob (and the remote region
//!    table, whose `WireRegion` entries carry per-transport keys) into a [`PeerTransport`] —
//!    for RDMA the connected RC QPs and a completion channel thread.
//! 3. **Post**: [`PeerTransport::post`] receives a coalesced, bounds-checked [`Posted`] batch and
//!    creates its [`BatchState`] with the number of completion parts it will report — for RDMA one
//!    signalled WR per lane plus the notification (`WRITE_WITH_IMM` or a trailing send).
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
//! ([`PeerTransport::on_ctrl`], `CtrlMsg::Transport`: QP re-establishment after errors).

pub(crate) mod rdma;
pub(crate) mod shm;
pub(crate) mod tcp;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use self::shm::CopyJob;
use self::tcp::OnDead;
use crate::config::EngineConfig;
use crate::engine::CtrlWriter;
use crate::wire::HostIdentity;

use crate::batch::{BatchState, Pending, Timer};
use crate::config::TransportKind;
use crate::engine::PeerId;
use crate::error::Error;
use crate::notify::{Notification, NotifyQueue};
use crate::region::{RegionEntry, RegionId, RegionTable};
use crate::wire::{ProtocolError, WireRegion};

/// Direction of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    /// Local → remote.
    Write,
    /// Remote → local.
    Read,
}

/// One validated transfer (after coalescing).
pub(crate) struct Xfer {
    pub local: Arc<RegionEntry>,
    pub local_offset: u64,
    pub remote: WireRegion,
    pub remote_offset: u64,
    pub len: u64,
}

/// A batch ready to post.
pub(crate) struct Posted {
    pub id: u64,
    pub dir: Dir,
    pub xfers: Vec<Xfer>,
    pub notify: Option<Vec<u8>>,
    pub ops: usize,
    pub bytes: u64,
    pub deadline: Instant,
    pub timer: Arc<Timer>,
    /// When the batch was submitted (metrics: latency).
    pub start: Instant,
}

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
    fn regions_removed(&self, _ids: &[crate::region::RegionId]) {}
    /// Work requests posted per lane so far (RDMA queue pairs; empty for other transports).
    fn lane_counters(&self) -> Vec<u64> {
        Vec::new()
    }
    /// Work requests posted so far per local device (RDMA: `(device name, count)` for every
    /// device of the engine); empty for other transports.
    fn device_counters(&self) -> Vec<(String, u64)> {
        Vec::new()
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
    /// Where to open data connections to the remote (its listen address) and the token to show.
    pub lane_addr: SocketAddr,
    /// Token the remote handed us for joining its data lanes.
    pub remote_token: [u8; 16],
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
}

/// [`CopyMarks`] value of a lane copying several regions at once (a gathered send).
pub(crate) const MARK_ANY: u64 = u64::MAX;

/// What each TCP lane thread of one peer is copying into or out of region memory now: the
/// packed region id (0 = nothing). Written around every copy (a relaxed store, nothing else on
/// the data path) and read only by `unregister` when a copy into caller memory did not end
/// within the deadline: the peers whose lanes are inside such a copy (a peer stalled in the
/// middle of a frame) are disconnected, which ends the copy.
#[derive(Default)]
pub(crate) struct CopyMarks {
    lanes: Mutex<Vec<Weak<AtomicU64>>>,
}

impl CopyMarks {
    /// The mark of a new lane thread (lanes already gone are forgotten here).
    pub fn lane(&self) -> Arc<AtomicU64> {
        let m = Arc::new(AtomicU64::new(0));
        let mut l = self.lanes.lock();
        l.retain(|w| w.strong_count() > 0);
        l.push(Arc::downgrade(&m));
        m
    }

    /// Whether a lane of this peer is inside a copy of region `id` now.
    pub fn holds(&self, id: RegionId) -> bool {
        let want = mark_of(id);
        self.lanes.lock().iter().filter_map(Weak::upgrade).any(|m| {
            let v = m.load(Ordering::Relaxed);
            v == want || v == MARK_ANY
        })
    }
}

/// The [`CopyMarks`] value of a region (never 0: generations start at 1).
pub(crate) fn mark_of(id: RegionId) -> u64 {
    (u64::from(id.index) << 32) | u64::from(id.generation)
}

/// A copy marked on a lane (see [`CopyMarks`]) for as long as it lives.
pub(crate) struct Marked<'a>(&'a AtomicU64);

impl<'a> Marked<'a> {
    pub fn new(mark: &'a AtomicU64, value: u64) -> Marked<'a> {
        mark.store(value, Ordering::Relaxed);
        Marked(mark)
    }
}

impl Drop for Marked<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Relaxed);
    }
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
    fn region_removed(&self, _id: crate::region::RegionId) {}
    /// The RDMA key peers use for a local region (0 = none).
    fn region_rkey(&self, _id: crate::region::RegionId) -> u32 {
        0
    }
    /// Builds the per-peer state once this side chose this transport towards the peer.
    fn establish(&self, ctx: EstablishCtx<'_>) -> Result<Arc<dyn PeerTransport>, Error>;
}

/// The TCP transport (always available).
pub(crate) struct TcpTransport;

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn bit(&self) -> u8 {
        crate::wire::TRANSPORT_TCP
    }
    fn establish(&self, ctx: EstablishCtx<'_>) -> Result<Arc<dyn PeerTransport>, Error> {
        Ok(Arc::new(tcp::TcpPeer::new(
            tcp::LaneTarget {
                addr: ctx.lane_addr,
                token: ctx.remote_token,
                lanes: ctx.cfg.lanes,
                timeout: ctx.cfg.connect_timeout,
            },
            ctx.cfg.slice_size,
            ctx.pending,
            ctx.on_dead,
            ctx.marks,
        )))
    }
}

/// The shared-memory transport (same host only).
///
/// Its handshake blob is the address of 16 random bytes in this process and their value: the
/// peer reads them with `process_vm_readv` to find out whether it may access our memory at all
/// (same user, ptrace policy, container seccomp). When it may not, it uses TCP instead
/// (`TransportKind::Auto`) or refuses (`TransportKind::Shm`).
pub(crate) struct ShmTransport {
    probe: Box<[u8; 16]>,
}

impl ShmTransport {
    pub fn new() -> Self {
        ShmTransport {
            probe: Box::new(crate::auth::random()),
        }
    }
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }
    fn bit(&self) -> u8 {
        crate::wire::TRANSPORT_SHM
    }
    fn hello_blob(&self) -> Option<Vec<u8>> {
        Some(crate::wire::shm::encode_probe(
            self.probe.as_ptr() as u64,
            &self.probe,
        ))
    }
    fn usable_with(&self, remote_host: &HostIdentity, remote_blob: Option<&[u8]>) -> bool {
        let local = crate::engine::host_identity();
        let Some((addr, token)) = remote_blob.and_then(crate::wire::shm::decode_probe) else {
            return false;
        };
        if !local.same_host(remote_host) {
            return false;
        }
        let mut got = [0u8; 16];
        match crate::mem::cma_peek(remote_host.pid as i32, addr, &mut got) {
            Ok(()) => got == token,
            Err(e) => {
                tracing::info!(error = %e, "same host, but the peer's memory is not accessible; not using shm");
                false
            }
        }
    }
    fn establish(&self, ctx: EstablishCtx<'_>) -> Result<Arc<dyn PeerTransport>, Error> {
        Ok(Arc::new(shm::ShmPeer::new(
            ctx.remote_host.pid,
            ctx.ctrl,
            ctx.copy_tx,
        )))
    }
}

/// What a target-side data path needs: region checks, notification tracking and delivery.
#[derive(Clone)]
pub(crate) struct TargetCtx {
    pub regions: Arc<RegionTable>,
    pub notify: Arc<NotifyQueue>,
    pub peer: PeerId,
    pub tracker: Arc<NotifyTracker>,
    /// Where this peer's lane threads mark the region they are copying.
    pub marks: Arc<CopyMarks>,
}

#[derive(Default)]
struct Track {
    landed: u32,
    refused: u32,
    expected: Option<u32>,
    tag: Option<Vec<u8>>,
}

/// Target side: counts the slices of batches that carry a notification and delivers the tag
/// once every slice of the batch (on every lane) landed, whatever the arrival order. A batch
/// with a refused slice never delivers its tag; its entry is dropped once all slices are
/// accounted for.
#[derive(Default)]
pub(crate) struct NotifyTracker {
    m: Mutex<HashMap<u64, Track>>,
}

/// Bound on batches tracked at once per peer.
const MAX_TRACKED: usize = 1 << 16;

impl NotifyTracker {
    fn settle(ctx: &TargetCtx, batch: u64, m: &mut HashMap<u64, Track>) {
        let complete = m.get(&batch).is_some_and(|t| {
            t.expected
                .is_some_and(|e| t.landed.saturating_add(t.refused) >= e)
        });
        if complete {
            if let Some(t) = m.remove(&batch) {
                if t.refused == 0 {
                    ctx.notify.push(Notification {
                        peer: ctx.peer,
                        tag: t.tag.unwrap_or_default(),
                    });
                } else {
                    ctx.notify
                        .suppressed
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
    }

    fn entry(m: &mut HashMap<u64, Track>, batch: u64) -> Result<&mut Track, Error> {
        if !m.contains_key(&batch) && m.len() >= MAX_TRACKED {
            return Err(ProtocolError::TooManyTracked.into());
        }
        Ok(m.entry(batch).or_default())
    }

    /// A tracked slice landed.
    pub fn landed(&self, ctx: &TargetCtx, batch: u64) -> Result<(), Error> {
        let mut m = self.m.lock();
        Self::entry(&mut m, batch)?.landed += 1;
        Self::settle(ctx, batch, &mut m);
        Ok(())
    }

    /// The notification of a batch arrived (with the batch's slice count).
    pub fn notify(
        &self,
        ctx: &TargetCtx,
        batch: u64,
        slices: u32,
        tag: Vec<u8>,
    ) -> Result<(), Error> {
        let mut m = self.m.lock();
        let t = Self::entry(&mut m, batch)?;
        if t.expected.is_some() {
            return Err(ProtocolError::DuplicateNotify { batch }.into());
        }
        t.expected = Some(slices);
        t.tag = Some(tag);
        Self::settle(ctx, batch, &mut m);
        Ok(())
    }

    /// A tracked slice was refused: the batch's notification must never be delivered.
    pub fn refused(&self, ctx: &TargetCtx, batch: u64) {
        let mut m = self.m.lock();
        if let Ok(t) = Self::entry(&mut m, batch) {
            t.refused += 1;
        }
        Self::settle(ctx, batch, &mut m);
    }

    /// Forget everything (peer gone).
    pub fn clear(&self) {
        self.m.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notify::Notifications;

    fn ctx() -> (TargetCtx, Notifications) {
        let q = Arc::new(NotifyQueue::default());
        let ctx = TargetCtx {
            regions: Arc::new(RegionTable::default()),
            notify: q.clone(),
            peer: PeerId(1),
            tracker: Arc::new(NotifyTracker::default()),
            marks: Arc::new(CopyMarks::default()),
        };
        (ctx, Notifications { q })
    }

    #[test]
    fn delivers_only_after_every_slice_in_any_order() {
        let (c, n) = ctx();
        let t = c.tracker.clone();
        t.landed(&c, 7).expect("landed");
        t.notify(&c, 7, 3, b"x".to_vec()).expect("notify");
        assert!(n.try_recv().is_none());
        t.landed(&c, 7).expect("landed");
        assert!(n.try_recv().is_none());
        t.landed(&c, 7).expect("landed");
        assert_eq!(n.try_recv().map(|x| x.tag), Some(b"x".to_vec()));
        // notification first, then slices
        t.notify(&c, 8, 1, b"y".to_vec()).expect("notify");
        assert!(n.try_recv().is_none());
        t.landed(&c, 8).expect("landed");
        assert_eq!(n.try_recv().map(|x| x.tag), Some(b"y".to_vec()));
        // zero slices: at once
        t.notify(&c, 9, 0, b"z".to_vec()).expect("notify");
        assert_eq!(n.try_recv().map(|x| x.tag), Some(b"z".to_vec()));
        assert!(t.m.lock().is_empty());
    }

    #[test]
    fn refused_slice_suppresses_the_notification_and_cleans_up() {
        let (c, n) = ctx();
        let t = c.tracker.clone();
        t.refused(&c, 5);
        t.notify(&c, 5, 3, b"no".to_vec()).expect("notify");
        t.landed(&c, 5).expect("landed");
        assert_eq!(t.m.lock().len(), 1);
        t.landed(&c, 5).expect("landed"); // arrives after the notification, on another lane
        assert!(n.try_recv().is_none());
        assert!(t.m.lock().is_empty());
        assert!(matches!(t.notify(&c, 6, 1, vec![]), Ok(())));
        assert!(matches!(
            t.notify(&c, 6, 1, vec![]),
            Err(Error::Protocol(_))
        ));
    }
}

#[cfg(test)]
mod probe_tests {
    use super::*;

    #[test]
    fn shm_probe_reads_the_peer_token_and_rejects_a_wrong_one() {
        let t = ShmTransport::new();
        let me = crate::engine::host_identity();
        let blob = t.hello_blob().expect("blob");
        assert!(t.usable_with(&me, Some(&blob)));
        let mut wrong = blob.clone();
        wrong[8] ^= 0xff;
        assert!(!t.usable_with(&me, Some(&wrong)));
        assert!(!t.usable_with(&me, None));
        assert!(!t.usable_with(&me, Some(&blob[..10])));
        let mut other = me.clone();
        other.boot_id = "another-host".into();
        assert!(!t.usable_with(&other, Some(&blob)));
        // An address that is not mapped in the peer: the read fails, shm is not used.
        let mut unmapped = blob.clone();
        unmapped[..8].copy_from_slice(&8u64.to_le_bytes());
        assert!(!t.usable_with(&me, Some(&unmapped)));
    }
}

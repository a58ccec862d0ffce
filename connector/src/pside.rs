//! The prefill (P) side: per-request send state machine.
//!
//! Life of a request on P: `scheduled → (D's block ids arrive) → layers sent as they become
//! ready (layerwise) or all after prefill (whole) → all sent → P's blocks released`.
//! Layers ready before D's block ids are known are held and posted when the ids arrive.
//!
//! P's blocks are released exactly once ([`PAction::ReleaseBlocks`]), and only when no transfer
//! of the request is in flight (the NIC may still be reading them): a failure while transfers
//! are in flight first cancels them ([`PAction::CancelTransfers`]) and waits for each to settle
//! ([`PEvent::TransferDone`]/[`PEvent::TransferFailed`]) or for the drain deadline. Only then is
//! D told `Abort`, which promises that P will not write into D's blocks again.
//!
//! A D that falls silent (nothing heard for `peer_timeout`) may be dead or only stalled: its
//! requests fail as above (D is told `Abort` once their transfers settled, so a stalled D that
//! comes back frees its blocks at once), but it is not given up for its silence; only a drain
//! that times out gives it up.

use crate::metrics::{fail_reason_name, reason_index, PMetrics};
use crate::msg::{DecodeError, Message};
use crate::peers::{Heard, LayerSet, Peers, Tombstones};
use crate::timeline::{Outcome, Side, TimelineRecord};
use crate::timer::Deadlines;
use crate::types::{
    BlockId, DownCause, FailReason, IdMap, Nanos, PeerId, RequestId, SendMode, MS, SEC,
};
use std::collections::VecDeque;
use std::sync::Arc;
use thiserror::Error;

/// Configuration of one P instance.
#[derive(Clone, Debug)]
pub struct PConfig {
    /// When layers are sent.
    pub send_mode: SendMode,
    /// Layers of the model (every request has this many).
    pub layers: u16,
    /// Transport label written into timeline records.
    pub transport: String,
    /// Identifies this life of the engine; must change on restart.
    pub incarnation: u64,
    /// Period of heartbeats to each peer and of liveness checks.
    pub heartbeat_interval: Nanos,
    /// A peer silent this long fails its requests.
    pub peer_timeout: Nanos,
    /// Scheduled → every layer sent; past it the request fails.
    pub request_timeout: Nanos,
    /// Prefill finished → D's block ids; past it the request fails (P's blocks are pinned).
    pub block_ids_timeout: Nanos,
    /// Longest time without progress while transfers are in flight.
    pub transfer_timeout: Nanos,
    /// How long a failed request waits for its in-flight transfers to settle. Past it, D's
    /// connection is torn down ([`PAction::DisconnectPeer`]) before P's blocks are released.
    pub drain_timeout: Nanos,
    /// How long D's block ids for a request P has not scheduled yet are kept.
    pub orphan_timeout: Nanos,
    /// How long an ended request is remembered, to drop late messages.
    pub tombstone_ttl: Nanos,
    /// Most requests known only from D's messages.
    pub max_early: usize,
    /// Emit [`PAction::Destination`] as soon as D's block ids are known (for hosts that move
    /// the data themselves, chunk by chunk, and report [`PEvent::TransferDone`] per layer).
    pub announce_destination: bool,
}

impl PConfig {
    /// Defaults: heartbeats every 500 ms, peer down after 3 s, 60 s per request, 10 s for D's
    /// block ids after prefill, 5 s transfer stall, 10 s drain, 30 s orphans, 60 s tombstones.
    pub fn new(send_mode: SendMode, layers: u16) -> Self {
        PConfig {
            send_mode,
            layers,
            transport: "unknown".to_string(),
            incarnation: 1,
            heartbeat_interval: 500 * MS,
            peer_timeout: 3 * SEC,
            request_timeout: 60 * SEC,
            block_ids_timeout: 10 * SEC,
            transfer_timeout: 5 * SEC,
            drain_timeout: 10 * SEC,
            orphan_timeout: 30 * SEC,
            tombstone_ttl: 60 * SEC,
            max_early: 65_536,
            announce_destination: false,
        }
    }
}

/// Something the host tells the P core.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PEvent {
    /// P's scheduler has the request queued for `peer` (not scheduled yet): D is told, so that it
    /// waits for P's start as long as P is alive instead of timing out.
    Queued {
        /// The request.
        req: RequestId,
        /// The D instance that will decode it.
        peer: PeerId,
    },
    /// P scheduled the request's prefill; `blocks` are P's blocks holding its KV (per layer).
    Scheduled {
        /// The request.
        req: RequestId,
        /// The D instance that will decode it.
        peer: PeerId,
        /// Prompt tokens.
        tokens: u32,
        /// P's block ids, in prompt order.
        blocks: Vec<BlockId>,
    },
    /// Layer `layer` of the request is computed (its CUDA event fired).
    LayerReady {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
    },
    /// Prefill finished: every layer is ready.
    PrefillDone {
        /// The request.
        req: RequestId,
    },
    /// The transfer of one layer completed (every byte written on D).
    TransferDone {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
        /// Bytes written.
        bytes: u64,
    },
    /// The transfer of one layer failed or was cancelled. The engine guarantees that nothing of
    /// it lands on D afterwards (it cancels or tears down what is still in flight).
    TransferFailed {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
    },
    /// The host aborts the request.
    Abort {
        /// The request.
        req: RequestId,
    },
    /// A message from D.
    Message {
        /// The sender.
        from: PeerId,
        /// The message.
        msg: Message,
    },
    /// The transport connected to a D instance.
    PeerUp {
        /// The peer.
        peer: PeerId,
    },
    /// The transport lost a D instance.
    PeerDown {
        /// The peer.
        peer: PeerId,
    },
}

/// Something the P core asks the host to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PAction {
    /// Send a message to D.
    Send {
        /// The D instance.
        to: PeerId,
        /// The message.
        msg: Message,
    },
    /// Write layer `layer` of the request from P's blocks `src` into D's blocks `dst`
    /// (block `i` → block `i`), then report [`PEvent::TransferDone`] or
    /// [`PEvent::TransferFailed`]. Every transfer must be reported exactly once. `src` is the
    /// suffix of the request's blocks D asked for (D holds the others from its prefix cache).
    Transfer {
        /// The request.
        req: RequestId,
        /// The D instance.
        peer: PeerId,
        /// The layer.
        layer: u16,
        /// P's source blocks.
        src: Arc<[BlockId]>,
        /// D's destination blocks.
        dst: Arc<[BlockId]>,
        /// `dst` are slots of D's landing pool, not KV-cache blocks.
        landing: bool,
    },
    /// D's block ids for the request are known (only with [`PConfig::announce_destination`]):
    /// P's block `src[i]` goes to D's `dst[i]` in every layer.
    Destination {
        /// The request.
        req: RequestId,
        /// The D instance.
        peer: PeerId,
        /// Index of the request block `src[0]` is (blocks before it are not sent).
        first: u32,
        /// P's source blocks (the suffix D asked for).
        src: Arc<[BlockId]>,
        /// D's destination blocks.
        dst: Arc<[BlockId]>,
        /// `dst` are slots of D's landing pool.
        landing: bool,
    },
    /// Cancel the request's transfers still in flight (each still gets reported).
    CancelTransfers {
        /// The request.
        req: RequestId,
    },
    /// Free P's blocks of the request (vLLM: report it in `finished_sending`).
    ReleaseBlocks {
        /// The request.
        req: RequestId,
        /// The blocks.
        blocks: Vec<BlockId>,
    },
    /// Every layer was sent.
    ReportFinished {
        /// The request.
        req: RequestId,
    },
    /// The request failed on P.
    ReportFailed {
        /// The request.
        req: RequestId,
        /// Why.
        reason: FailReason,
    },
    /// Tear down the connection to this peer.
    DisconnectPeer {
        /// The peer.
        peer: PeerId,
        /// Why it was given up.
        cause: DownCause,
    },
}

/// A host event the P core refused; its state is unchanged.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PError {
    /// The request is not known.
    #[error("unknown request {0:?}")]
    UnknownRequest(RequestId),
    /// `Scheduled` for a request that is live or recently ended.
    #[error("request {0:?} already scheduled")]
    DuplicateRequest(RequestId),
    /// `Scheduled` with no blocks.
    #[error("request {0:?} has no blocks to send")]
    NoBlocks(RequestId),
    /// A layer index at or above the model's layer count.
    #[error("layer {layer} out of range for request {req:?}")]
    LayerOutOfRange {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
    },
    /// A transfer report for a layer that has no transfer in flight.
    #[error("request {req:?}: no transfer of layer {layer} in flight")]
    NoTransfer {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
    },
    /// Bytes from D that do not decode.
    #[error("undecodable message: {0}")]
    Decode(#[from] DecodeError),
}

/// Counters of unusual but handled situations.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PStats {
    /// Messages or host events for requests that ended recently (dropped).
    pub late: u64,
    /// Repeated messages (dropped).
    pub duplicate_messages: u64,
    /// Messages of the wrong direction or from the wrong peer (dropped).
    pub unexpected_messages: u64,
    /// Messages for unknown requests dropped because too many were pending.
    pub early_overflow: u64,
    /// Block ids from D for requests P never scheduled.
    pub orphans: u64,
    /// Requests whose layers were all sent.
    pub finished: u64,
    /// Requests failed.
    pub failed: u64,
    /// Failed requests released at the drain deadline with transfers unsettled (D was
    /// disconnected first).
    pub drain_timeouts: u64,
    /// Times a D with live requests fell silent for `peer_timeout` (they failed).
    pub silences: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PState {
    Early,
    Active,
    Draining,
}

#[derive(Debug)]
struct PReq {
    peer: PeerId,
    state: PState,
    src: Arc<[BlockId]>,
    dst: Option<Dst>,
    ready: LayerSet,
    issued: LayerSet,
    done: LayerSet,
    inflight: u32,
    prefill_done: bool,
    created: Nanos,
    prefill_done_at: Nanos,
    last_progress: Nanos,
    drain_since: Nanos,
    gen: u32,
    fail: Option<FailReason>,
    /// Do not send D an Abort when the failure completes.
    silent: bool,
    rec: TimelineRecord,
}

/// Where D wants the request's KV: the suffix from request block `first`, into `blocks`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Dst {
    first: u32,
    landing: bool,
    blocks: Arc<[BlockId]>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    Tick,
    Req(RequestId, u32),
}

/// The P-side core. See the module documentation.
#[derive(Debug)]
pub struct PSide {
    cfg: PConfig,
    reqs: IdMap<RequestId, PReq>,
    early: usize,
    peers: Peers,
    tombs: Tombstones,
    timers: Deadlines<Timer>,
    tick_armed: bool,
    actions: VecDeque<PAction>,
    timeline: VecDeque<TimelineRecord>,
    stats: PStats,
    metrics: PMetrics,
}

impl PSide {
    /// A P core with no requests.
    pub fn new(cfg: PConfig) -> Self {
        PSide {
            cfg,
            reqs: IdMap::default(),
            early: 0,
            peers: Peers::default(),
            tombs: Tombstones::default(),
            timers: Deadlines::new(),
            tick_armed: false,
            actions: VecDeque::new(),
            timeline: VecDeque::new(),
            stats: PStats::default(),
            metrics: PMetrics::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &PConfig {
        &self.cfg
    }

    /// Counters of unusual situations.
    pub fn stats(&self) -> &PStats {
        &self.stats
    }

    /// Cumulative connector metrics (see [`crate::metrics`]).
    pub fn metrics(&self) -> &PMetrics {
        &self.metrics
    }

    /// Requests the core currently tracks (scheduled and not ended, plus early ones).
    pub fn live_requests(&self) -> usize {
        self.reqs.len()
    }

    /// Whether D's block ids for `req` are known. O(1).
    pub fn has_destination(&self, req: RequestId) -> bool {
        self.reqs.get(&req).is_some_and(|r| r.dst.is_some())
    }

    /// Next action for the host, if any.
    pub fn poll_action(&mut self) -> Option<PAction> {
        self.actions.pop_front()
    }

    /// Next finished timeline record, if any.
    pub fn poll_timeline(&mut self) -> Option<TimelineRecord> {
        self.timeline.pop_front()
    }

    /// When the host must call [`PSide::handle_timeout`] next (may be early; never late).
    pub fn poll_timeout(&self) -> Option<Nanos> {
        self.timers.next()
    }

    /// Entries in the deadline heap (stale ones included); for tests and benches.
    pub fn pending_deadlines(&self) -> usize {
        self.timers.len()
    }

    /// Decodes bytes from D and handles the message. Undecodable bytes change nothing.
    pub fn handle_bytes(&mut self, from: PeerId, bytes: &[u8], now: Nanos) -> Result<(), PError> {
        let msg = Message::decode(bytes)?;
        self.handle(PEvent::Message { from, msg }, now)
    }

    /// Feeds one event at time `now`.
    pub fn handle(&mut self, ev: PEvent, now: Nanos) -> Result<(), PError> {
        self.tombs.expire(now);
        match ev {
            PEvent::Scheduled {
                req,
                peer,
                tokens,
                blocks,
            } => self.on_scheduled(req, peer, tokens, blocks, now),
            PEvent::LayerReady { req, layer } => {
                if layer >= self.cfg.layers {
                    return Err(PError::LayerOutOfRange { req, layer });
                }
                if !self.known_active(req)? {
                    return Ok(());
                }
                self.layer_ready(req, layer, now);
                Ok(())
            }
            PEvent::PrefillDone { req } => {
                if !self.known_active(req)? {
                    return Ok(());
                }
                for l in 0..self.cfg.layers {
                    self.layer_ready(req, l, now);
                }
                Ok(())
            }
            PEvent::TransferDone { req, layer, bytes } => {
                self.transfer_settled(req, layer, Some(bytes), now)
            }
            PEvent::TransferFailed { req, layer } => self.transfer_settled(req, layer, None, now),
            PEvent::Queued { req, peer } => {
                self.touch_peer(peer, now);
                self.send(peer, Message::Queued { req });
                Ok(())
            }
            PEvent::Abort { req } => {
                match self.reqs.get(&req).map(|r| r.state) {
                    Some(PState::Active) => self.fail(req, FailReason::LocalAbort, true, now),
                    Some(PState::Draining) => {}
                    Some(PState::Early) | None => {
                        if !self.tombs.contains(req) {
                            return Err(PError::UnknownRequest(req));
                        }
                    }
                }
                Ok(())
            }
            PEvent::Message { from, msg } => {
                self.on_message(from, msg, now);
                Ok(())
            }
            PEvent::PeerUp { peer } => {
                self.touch_peer(peer, now);
                let _ = self.peers.heard(peer, None, now);
                Ok(())
            }
            PEvent::PeerDown { peer } => {
                self.peer_down(peer, FailReason::PeerDown, DownCause::Reported, now);
                Ok(())
            }
        }
    }

    /// Handles every deadline due at `now`.
    pub fn handle_timeout(&mut self, now: Nanos) {
        self.tombs.expire(now);
        // Only what is due on entry: a deadline re-armed at or before `now` (a clock at the
        // end of its range) waits for the next call instead of spinning here.
        let mut due = Vec::new();
        while let Some((_, t)) = self.timers.pop_due(now) {
            due.push(t);
        }
        for t in due {
            match t {
                Timer::Tick => self.tick(now),
                Timer::Req(req, gen) => self.req_deadline(req, gen, now),
            }
        }
    }

    // ----- events -----

    fn on_scheduled(
        &mut self,
        req: RequestId,
        peer: PeerId,
        tokens: u32,
        blocks: Vec<BlockId>,
        now: Nanos,
    ) -> Result<(), PError> {
        if blocks.is_empty() {
            return Err(PError::NoBlocks(req));
        }
        let peer_aborted = self.tombs.peer_aborted(req);
        if self.tombs.contains(req) && !peer_aborted {
            return Err(PError::DuplicateRequest(req));
        }
        let early_dst = match self.reqs.get(&req) {
            Some(r) if r.state == PState::Early && r.peer == peer => r.dst.clone(),
            Some(_) => return Err(PError::DuplicateRequest(req)),
            None => None,
        };
        if self.reqs.contains_key(&req) {
            self.early -= 1;
        }
        let n = blocks.len();
        let mut rec = TimelineRecord::new(req, Side::P, &self.cfg.transport);
        rec.send_mode = Some(self.cfg.send_mode);
        rec.layers = self.cfg.layers;
        rec.blocks = n as u32;
        rec.tokens = tokens;
        rec.p_scheduled = Some(now);
        self.touch_peer(peer, now);
        let layers = self.cfg.layers;
        self.reqs.insert(
            req,
            PReq {
                peer,
                state: PState::Active,
                src: blocks.into(),
                dst: None,
                ready: LayerSet::new(layers),
                issued: LayerSet::new(layers),
                done: LayerSet::new(layers),
                inflight: 0,
                prefill_done: false,
                created: now,
                prefill_done_at: 0,
                last_progress: now,
                drain_since: 0,
                gen: 0,
                fail: None,
                silent: false,
                rec,
            },
        );
        self.peers.attach(peer, req);
        self.metrics.scheduled += 1;
        if peer_aborted {
            // D already gave this request up: release P's blocks at once.
            self.fail(req, FailReason::RemoteAbort, false, now);
            return Ok(());
        }
        self.send(
            peer,
            Message::Started {
                req,
                layers,
                blocks: n as u32,
            },
        );
        self.arm(req);
        if let Some(dst) = early_dst {
            self.set_destination(req, dst, now);
        }
        Ok(())
    }

    fn layer_ready(&mut self, req: RequestId, layer: u16, now: Nanos) {
        let layers = self.cfg.layers;
        let mode = self.cfg.send_mode;
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        if !r.ready.insert(layer) {
            return;
        }
        if r.rec.p_first_layer_ready.is_none() {
            r.rec.p_first_layer_ready = Some(now);
        }
        let all = r.ready.count() == layers;
        let has_dst = r.dst.is_some();
        if all {
            r.prefill_done = true;
            r.prefill_done_at = now;
            r.rec.p_last_layer_ready = Some(now);
            let peer = r.peer;
            self.send(peer, Message::PrefillDone { req });
            if !has_dst {
                // Waiting for D's block ids now has its own, shorter deadline.
                self.arm(req);
            }
        }
        if !has_dst {
            return;
        }
        match mode {
            SendMode::Layerwise => self.issue(req, layer, now),
            SendMode::Whole if all => self.issue_all_ready(req, now),
            SendMode::Whole => {}
        }
    }

    fn set_destination(&mut self, req: RequestId, dst: Dst, now: Nanos) {
        let announce = self.cfg.announce_destination;
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        if let Some(have) = &r.dst {
            if *have == dst {
                self.stats.duplicate_messages += 1;
            } else {
                self.fail(req, FailReason::Protocol, true, now);
            }
            return;
        }
        let first = dst.first as usize;
        if first >= r.src.len() || dst.blocks.len() != r.src.len() - first {
            self.fail(req, FailReason::Protocol, true, now);
            return;
        }
        if first > 0 {
            r.src = Arc::from(&r.src[first..]);
        }
        if announce {
            self.actions.push_back(PAction::Destination {
                req,
                peer: r.peer,
                first: dst.first,
                src: r.src.clone(),
                dst: dst.blocks.clone(),
                landing: dst.landing,
            });
        }
        r.dst = Some(dst);
        let go = match self.cfg.send_mode {
            SendMode::Layerwise => true,
            SendMode::Whole => r.prefill_done,
        };
        if go {
            self.issue_all_ready(req, now);
        }
    }

    fn issue_all_ready(&mut self, req: RequestId, now: Nanos) {
        for l in 0..self.cfg.layers {
            let ready = self
                .reqs
                .get(&req)
                .is_some_and(|r| r.ready.contains(l) && !r.issued.contains(l));
            if ready {
                self.issue(req, l, now);
            }
        }
    }

    fn issue(&mut self, req: RequestId, layer: u16, now: Nanos) {
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        let Some(Dst {
            blocks: dst,
            landing,
            ..
        }) = r.dst.clone()
        else {
            return;
        };
        if r.state != PState::Active || !r.issued.insert(layer) {
            return;
        }
        r.inflight += 1;
        r.last_progress = now;
        if r.rec.first_byte.is_none() {
            r.rec.first_byte = Some(now);
        }
        let first_inflight = r.inflight == 1;
        self.metrics.transfers += 1;
        self.actions.push_back(PAction::Transfer {
            req,
            peer: r.peer,
            layer,
            src: r.src.clone(),
            dst,
            landing,
        });
        if first_inflight {
            self.arm(req);
        }
    }

    fn transfer_settled(
        &mut self,
        req: RequestId,
        layer: u16,
        bytes: Option<u64>,
        now: Nanos,
    ) -> Result<(), PError> {
        let layers = self.cfg.layers;
        let Some(r) = self.reqs.get_mut(&req) else {
            if self.tombs.contains(req) {
                self.stats.late += 1;
                return Ok(());
            }
            return Err(PError::UnknownRequest(req));
        };
        if r.state == PState::Early || !r.issued.contains(layer) || r.done.contains(layer) {
            return Err(PError::NoTransfer { req, layer });
        }
        r.inflight -= 1;
        r.last_progress = now;
        // Mark it settled so a second report is refused.
        r.done.insert(layer);
        let peer = r.peer;
        let state = r.state;
        let inflight = r.inflight;
        match bytes {
            Some(b) => {
                self.metrics.transfers_done += 1;
                self.metrics.bytes_sent = self.metrics.bytes_sent.saturating_add(b);
            }
            None => self.metrics.transfers_failed += 1,
        }
        match (state, bytes) {
            (PState::Draining, _) => {
                if inflight == 0 {
                    self.finish_fail(req, now);
                }
            }
            (_, None) => self.fail(req, FailReason::TransferError, true, now),
            (_, Some(b)) => {
                r.rec.bytes = r.rec.bytes.saturating_add(b);
                let complete = r.done.count() == layers;
                self.send(
                    peer,
                    Message::LayerSent {
                        req,
                        layer,
                        bytes: b,
                    },
                );
                if complete {
                    self.complete(req, now);
                }
            }
        }
        Ok(())
    }

    /// Every layer was written: tell D, release P's blocks, end the request.
    fn complete(&mut self, req: RequestId, now: Nanos) {
        let layers = self.cfg.layers;
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        r.rec.last_byte = Some(now);
        let total = r.rec.bytes;
        let blocks = r.src.to_vec();
        let peer = r.peer;
        self.metrics.completed += 1;
        self.metrics.releases += 1;
        self.metrics.released_blocks += blocks.len() as u64;
        if let Some(at) = r.rec.p_scheduled {
            self.metrics.send_latency.observe(now.saturating_sub(at));
        }
        tracing::debug!(
            target: "kvwire_connector",
            req = req.0,
            peer = peer.0,
            blocks = blocks.len(),
            reason = "sent",
            "p released blocks"
        );
        self.send(
            peer,
            Message::AllSent {
                req,
                layers,
                bytes: total,
            },
        );
        self.actions
            .push_back(PAction::ReleaseBlocks { req, blocks });
        self.actions.push_back(PAction::ReportFinished { req });
        self.stats.finished += 1;
        self.end(req, now);
    }

    fn on_message(&mut self, from: PeerId, msg: Message, now: Nanos) {
        self.touch_peer(from, now);
        if let Message::Heartbeat { incarnation, .. } = msg {
            if let Heard::Restarted(lost) = self.peers.heard(from, Some(incarnation), now) {
                for req in lost {
                    self.fail(req, FailReason::PeerRestarted, false, now);
                }
            }
            return;
        }
        let _ = self.peers.heard(from, None, now);
        let Some(req) = msg.request() else {
            return;
        };
        if let Some(r) = self.reqs.get(&req) {
            if r.peer != from {
                self.stats.unexpected_messages += 1;
                return;
            }
        }
        match msg {
            Message::BlockIds {
                blocks,
                first,
                landing,
                ..
            } => {
                let dst = Dst {
                    first,
                    landing,
                    blocks: blocks.into(),
                };
                if self.tombs.contains(req) {
                    self.stats.late += 1;
                    return;
                }
                match self.reqs.get(&req).map(|r| r.state) {
                    Some(PState::Active) => self.set_destination(req, dst, now),
                    Some(PState::Draining) => self.stats.late += 1,
                    Some(PState::Early) | None => {
                        if let Some(r) = self.early_entry(req, from, now) {
                            if r.dst.is_some() {
                                self.stats.duplicate_messages += 1;
                            } else {
                                r.dst = Some(dst);
                            }
                        }
                    }
                }
            }
            Message::Announce { .. } => {
                if self.tombs.contains(req) {
                    self.stats.late += 1;
                    return;
                }
                if !self.reqs.contains_key(&req) {
                    let _ = self.early_entry(req, from, now);
                }
            }
            Message::Abort { .. } => match self.reqs.get(&req).map(|r| r.state) {
                Some(PState::Active) => self.fail(req, FailReason::RemoteAbort, true, now),
                Some(PState::Draining) => {}
                Some(PState::Early) => {
                    self.drop_early(req, now, true);
                    self.ack_abort(from, req);
                }
                // Nothing of ours can be in flight: confirm so D can release at once.
                None => {
                    if !self.tombs.contains(req) {
                        self.tombs
                            .bury(req, now.saturating_add(self.cfg.tombstone_ttl), true);
                    }
                    self.ack_abort(from, req);
                }
            },
            Message::Started { .. }
            | Message::Queued { .. }
            | Message::PrefillDone { .. }
            | Message::LayerSent { .. }
            | Message::AllSent { .. }
            | Message::Heartbeat { .. } => self.stats.unexpected_messages += 1,
        }
    }

    fn ack_abort(&mut self, to: PeerId, req: RequestId) {
        if self.peers.is_up(to) {
            self.send(
                to,
                Message::Abort {
                    req,
                    reason: FailReason::RemoteAbort,
                },
            );
        }
    }

    // ----- failure paths -----

    /// Fails `req`; `notify`: send D an `Abort` once nothing is in flight.
    fn fail(&mut self, req: RequestId, reason: FailReason, notify: bool, now: Nanos) {
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        match r.state {
            PState::Early => {
                let peer = r.peer;
                self.drop_early(req, now, false);
                if notify {
                    self.ack_abort(peer, req);
                }
            }
            PState::Draining => {}
            PState::Active => {
                r.fail = Some(reason);
                r.rec.outcome = Outcome::Failed;
                r.rec.fail_reason = Some(reason);
                if !notify {
                    // The peer is gone: no Abort to send.
                    r.silent = true;
                }
                if r.inflight > 0 {
                    r.state = PState::Draining;
                    r.drain_since = now;
                    self.actions.push_back(PAction::CancelTransfers { req });
                    self.arm(req);
                } else {
                    self.finish_fail(req, now);
                }
            }
        }
    }

    /// Releases P's blocks of a failed request, tells D (if it should) and ends it.
    fn finish_fail(&mut self, req: RequestId, now: Nanos) {
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        let reason = r.fail.unwrap_or(FailReason::LocalAbort);
        let blocks = r.src.to_vec();
        let peer = r.peer;
        let notify = !r.silent;
        self.metrics.failed[reason_index(reason)] += 1;
        self.metrics.releases += 1;
        self.metrics.released_blocks += blocks.len() as u64;
        tracing::debug!(
            target: "kvwire_connector",
            req = req.0,
            peer = peer.0,
            blocks = blocks.len(),
            reason = fail_reason_name(reason),
            "p released blocks"
        );
        self.actions
            .push_back(PAction::ReleaseBlocks { req, blocks });
        self.actions
            .push_back(PAction::ReportFailed { req, reason });
        if notify && self.peers.is_up(peer) {
            self.send(peer, Message::Abort { req, reason });
        }
        self.stats.failed += 1;
        self.end(req, now);
    }

    /// Forgets a request known only from D's messages. `peer_aborted`: D gave it up, so a
    /// later `Scheduled` fails at once.
    fn drop_early(&mut self, req: RequestId, now: Nanos, peer_aborted: bool) {
        if self.reqs.remove(&req).is_some() {
            self.early -= 1;
            self.tombs.bury(
                req,
                now.saturating_add(self.cfg.tombstone_ttl),
                peer_aborted,
            );
        }
    }

    fn end(&mut self, req: RequestId, now: Nanos) {
        if let Some(r) = self.reqs.remove(&req) {
            self.peers.detach(r.peer, req);
            self.tombs
                .bury(req, now.saturating_add(self.cfg.tombstone_ttl), false);
            self.timeline.push_back(r.rec);
        }
    }

    fn peer_down(&mut self, peer: PeerId, reason: FailReason, cause: DownCause, now: Nanos) {
        if let Some(reqs) = self.peers.down(peer) {
            self.actions
                .push_back(PAction::DisconnectPeer { peer, cause });
            for req in reqs {
                self.fail(req, reason, false, now);
            }
        }
    }

    // ----- timers -----

    fn tick(&mut self, now: Nanos) {
        self.peers.hb_seq += 1;
        let seq = self.peers.hb_seq;
        let inc = self.cfg.incarnation;
        let peers: Vec<PeerId> = self.peers.map.keys().copied().collect();
        for p in peers {
            self.send(
                p,
                Message::Heartbeat {
                    incarnation: inc,
                    seq,
                },
            );
        }
        for (p, for_ns) in self.peers.silent(now, self.cfg.peer_timeout) {
            self.peer_silent(p, for_ns, now);
        }
        self.timers
            .arm(now.saturating_add(self.cfg.heartbeat_interval), Timer::Tick);
    }

    /// Fails the requests of a D silent for `for_ns` (see the module's docs), telling it: not
    /// given up, so a stalled D that comes back frees their blocks at once. A request younger
    /// than `peer_timeout` waits: silence is judged over a request's own life (after this
    /// engine stalled itself, D is heard again only once its connections are made again).
    fn peer_silent(&mut self, peer: PeerId, for_ns: Nanos, now: Nanos) {
        let timeout = self.cfg.peer_timeout;
        let reqs = self.peers.failing_for_silence(peer, for_ns, "D", |r| {
            self.reqs.get(&r).is_some_and(|r| {
                r.state != PState::Draining && now.saturating_sub(r.created) >= timeout
            })
        });
        if reqs.is_empty() {
            return;
        }
        self.stats.silences += 1;
        for req in reqs {
            self.fail(req, FailReason::Timeout, true, now);
        }
    }

    fn deadline(&self, r: &PReq) -> Nanos {
        let c = &self.cfg;
        match r.state {
            PState::Early => r.created.saturating_add(c.orphan_timeout),
            PState::Draining => r.drain_since.saturating_add(c.drain_timeout),
            PState::Active => {
                let mut d = r.created.saturating_add(c.request_timeout);
                if r.prefill_done && r.dst.is_none() {
                    d = d.min(r.prefill_done_at.saturating_add(c.block_ids_timeout));
                }
                if r.inflight > 0 {
                    d = d.min(r.last_progress.saturating_add(c.transfer_timeout));
                }
                d
            }
        }
    }

    fn arm(&mut self, req: RequestId) {
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        let at = self.deadline(r);
        let gen = r.gen.wrapping_add(1);
        if let Some(r) = self.reqs.get_mut(&req) {
            r.gen = gen;
        }
        self.timers.arm(at, Timer::Req(req, gen));
    }

    fn req_deadline(&mut self, req: RequestId, gen: u32, now: Nanos) {
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        if r.gen != gen {
            return;
        }
        let at = self.deadline(r);
        if at > now {
            self.timers.arm(at, Timer::Req(req, gen));
            return;
        }
        match r.state {
            PState::Early => {
                let peer = r.peer;
                self.stats.orphans += 1;
                // D is told to give it up; a `Scheduled` after this fails at once.
                self.drop_early(req, now, true);
                self.ack_abort(peer, req);
            }
            PState::Draining => {
                // Transfers never settled: only tearing the connection down guarantees they
                // stop reading our blocks (and writing D's) before the blocks are released.
                self.stats.drain_timeouts += 1;
                let peer = r.peer;
                self.peer_down(peer, FailReason::PeerDown, DownCause::DrainTimeout, now);
                self.finish_fail(req, now);
            }
            PState::Active => self.fail(req, FailReason::Timeout, true, now),
        }
    }

    // ----- helpers -----

    /// Whether `req` is active; `Ok(false)` for a recently ended one (late host event).
    fn known_active(&mut self, req: RequestId) -> Result<bool, PError> {
        match self.reqs.get(&req).map(|r| r.state) {
            Some(PState::Active) => Ok(true),
            Some(PState::Draining) => Ok(false),
            Some(PState::Early) | None => {
                if self.tombs.contains(req) {
                    self.stats.late += 1;
                    Ok(false)
                } else {
                    Err(PError::UnknownRequest(req))
                }
            }
        }
    }

    fn early_entry(&mut self, req: RequestId, from: PeerId, now: Nanos) -> Option<&mut PReq> {
        if !self.reqs.contains_key(&req) {
            if self.early >= self.cfg.max_early {
                self.stats.early_overflow += 1;
                return None;
            }
            self.early += 1;
            self.touch_peer(from, now);
            self.reqs.insert(
                req,
                PReq {
                    peer: from,
                    state: PState::Early,
                    src: Arc::from(Vec::new()),
                    dst: None,
                    ready: LayerSet::default(),
                    issued: LayerSet::default(),
                    done: LayerSet::default(),
                    inflight: 0,
                    prefill_done: false,
                    created: now,
                    prefill_done_at: 0,
                    last_progress: now,
                    drain_since: 0,
                    gen: 0,
                    fail: None,
                    silent: false,
                    rec: TimelineRecord::new(req, Side::P, &self.cfg.transport),
                },
            );
            self.arm(req);
        }
        self.reqs.get_mut(&req)
    }

    fn touch_peer(&mut self, peer: PeerId, now: Nanos) {
        if self.peers.ensure(peer, now) {
            self.peers.hb_seq += 1;
            self.actions.push_back(PAction::Send {
                to: peer,
                msg: Message::Heartbeat {
                    incarnation: self.cfg.incarnation,
                    seq: self.peers.hb_seq,
                },
            });
            if !self.tick_armed {
                self.tick_armed = true;
                self.timers
                    .arm(now.saturating_add(self.cfg.heartbeat_interval), Timer::Tick);
            }
        }
    }

    fn send(&mut self, to: PeerId, msg: Message) {
        self.actions.push_back(PAction::Send { to, msg });
    }
}

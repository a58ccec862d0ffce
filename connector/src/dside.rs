//! The decode (D) side: per-request reservation and reception state machine.
//!
//! Life of a request on D:
//! `arrived (decode_sent) → waiting for P (no blocks) → may reserve → reserved, block ids sent
//! to P → layers landing → complete (report finished) → reported → promoted → first token`.
//!
//! The host owns the block pool: the core says *when* the host may reserve ([`DSide::may_reserve`],
//! [`DAction::MayReserve`]), the host says *which* blocks it reserved ([`DEvent::Reserved`]). A
//! reservation that does not become a running request is handed back exactly once with
//! [`DAction::ReleaseBlocks`]. When D gives up on a request whose block ids P already has, it
//! keeps the blocks until P confirms (its `Abort`) that no write is in flight, P is declared down
//! (the host must then tear its connection down, [`DAction::DisconnectPeer`]), or the drain
//! deadline passes.
//!
//! A P that falls silent (nothing heard for `peer_timeout`) may be dead or only stalled (a
//! process that got no CPU for a while): its requests fail, but it is not given up for its
//! silence. Those whose block ids it has drain like any failed request, so a stalled P that
//! comes back confirms, and keeps its connection and its data path; only a drain that times out
//! gives it up.

use crate::metrics::{reason_index, DGauges, DMetrics};
use crate::msg::{DecodeError, Message};
use crate::peers::{Heard, LayerSet, Peers, Tombstones};
use crate::timeline::{Outcome, Side, TimelineRecord};
use crate::timer::Deadlines;
use crate::types::{
    BlockId, DownCause, FailReason, IdMap, Nanos, PeerId, Policy, RequestId, MS, SEC,
};
use std::collections::VecDeque;
use thiserror::Error;

/// Configuration of one D instance.
#[derive(Clone, Debug)]
pub struct DConfig {
    /// When reservation is allowed.
    pub policy: Policy,
    /// Layers of the model (every request has this many).
    pub layers: u16,
    /// Transport label written into timeline records.
    pub transport: String,
    /// Identifies this life of the engine; must change on restart.
    pub incarnation: u64,
    /// Period of heartbeats to each peer and of liveness checks.
    pub heartbeat_interval: Nanos,
    /// A peer silent this long fails its requests (those whose block ids it has drain first).
    pub peer_timeout: Nanos,
    /// Arrival → P's `Started`; past it the request fails.
    pub wait_for_p_timeout: Nanos,
    /// Arrival → every layer landed; past it the request fails.
    pub request_timeout: Nanos,
    /// How long a failed request's blocks wait for P's confirming `Abort` (re-sent every
    /// `heartbeat_interval`). Past it, P's connection is torn down
    /// ([`DAction::DisconnectPeer`]) before the blocks are released.
    pub drain_timeout: Nanos,
    /// How long a message for a request not (yet) arrived on D is kept.
    pub orphan_timeout: Nanos,
    /// How long an ended request is remembered, to drop late messages.
    pub tombstone_ttl: Nanos,
    /// Most requests known only from P's messages (bounds memory under a flood).
    pub max_early: usize,
}

impl DConfig {
    /// Defaults: heartbeats every 500 ms, requests fail after 3 s of P's silence, 30 s to hear from P,
    /// 60 s to receive everything, 10 s drain, 10 s orphans, 60 s tombstones.
    pub fn new(policy: Policy, layers: u16) -> Self {
        DConfig {
            policy,
            layers,
            transport: "unknown".to_string(),
            incarnation: 1,
            heartbeat_interval: 500 * MS,
            peer_timeout: 3 * SEC,
            wait_for_p_timeout: 30 * SEC,
            request_timeout: 60 * SEC,
            drain_timeout: 10 * SEC,
            orphan_timeout: 10 * SEC,
            tombstone_ttl: 60 * SEC,
            max_early: 65_536,
        }
    }
}

/// Something the host tells the D core.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DEvent {
    /// A request arrived on D (vLLM: the decode request was added). `blocks` is the number of
    /// blocks D will reserve for its `tokens` prompt tokens.
    Arrived {
        /// The request.
        req: RequestId,
        /// The P instance prefilling it.
        peer: PeerId,
        /// Prompt tokens.
        tokens: u32,
        /// Blocks needed for them.
        blocks: u32,
    },
    /// The host reserved these blocks for the request (after [`DSide::may_reserve`] said yes).
    Reserved {
        /// The request.
        req: RequestId,
        /// The reserved block ids, in prompt order.
        blocks: Vec<BlockId>,
    },
    /// D already holds the request's first `blocks` blocks (a local prefix-cache hit): P sends
    /// only the suffix, and the reservation ([`DEvent::Reserved`], [`DEvent::Landing`]) covers
    /// the other blocks. Valid while the request waits for its reservation; the latest wins.
    PrefixHit {
        /// The request.
        req: RequestId,
        /// Blocks D already has, from the first.
        blocks: u32,
    },
    /// Policy `land`: the host gave the request these slots of its landing pool (after
    /// [`DAction::MayLand`]); P writes the request's KV there.
    Landing {
        /// The request.
        req: RequestId,
        /// Landing-pool slots, one per block D receives.
        slots: Vec<BlockId>,
    },
    /// Policy `land`: the landing pool cannot take the request (after [`DAction::MayLand`]); it
    /// is reserved as `lazy` instead (counted in [`DMetrics::land_fallbacks`]).
    LandFallback {
        /// The request.
        req: RequestId,
    },
    /// The local transfer engine delivered the notification that a layer has fully landed.
    LayerLanded {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
        /// Its bytes.
        bytes: u64,
    },
    /// The host reported the request finished to its scheduler (vLLM `finished_recving`).
    Reported {
        /// The request.
        req: RequestId,
    },
    /// The scheduler promoted the request to running; its blocks now belong to it.
    Promoted {
        /// The request.
        req: RequestId,
    },
    /// The request produced its first token.
    FirstToken {
        /// The request.
        req: RequestId,
    },
    /// The host aborts the request (client gone).
    Abort {
        /// The request.
        req: RequestId,
    },
    /// A message from P.
    Message {
        /// The sender.
        from: PeerId,
        /// The message.
        msg: Message,
    },
    /// The transport connected to a P instance.
    PeerUp {
        /// The peer.
        peer: PeerId,
    },
    /// The transport lost a P instance (connection reset, process gone).
    PeerDown {
        /// The peer.
        peer: PeerId,
    },
}

/// Something the D core asks the host to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DAction {
    /// Send a message to P.
    Send {
        /// The P instance.
        to: PeerId,
        /// The message.
        msg: Message,
    },
    /// The request may now reserve `blocks` blocks (emitted once per request; the same answer
    /// is available any time from [`DSide::may_reserve`]).
    MayReserve {
        /// The request.
        req: RequestId,
        /// Blocks to reserve.
        blocks: u32,
    },
    /// Policy `land`: the request may now take `blocks` slots of the landing pool (emitted once
    /// per request); answer with [`DEvent::Landing`] or [`DEvent::LandFallback`].
    MayLand {
        /// The request.
        req: RequestId,
        /// Slots to take.
        blocks: u32,
    },
    /// Free these landing-pool slots: no write of P can land in them any more (a failed `land`
    /// request; a request whose KV landed keeps its slots until the host copied them).
    ReleaseLanding {
        /// The request.
        req: RequestId,
        /// The slots.
        slots: Vec<BlockId>,
    },
    /// Free these blocks: the reservation ends without becoming a running request.
    ReleaseBlocks {
        /// The request.
        req: RequestId,
        /// The blocks.
        blocks: Vec<BlockId>,
    },
    /// Every layer has landed: report the request finished (vLLM `finished_recving`). For a
    /// `land` request the KV is in its landing slots: copy them into the reserved blocks first.
    ReportFinished {
        /// The request.
        req: RequestId,
    },
    /// The request failed. `blocks` are the blocks that did not load (vLLM's load-error path;
    /// already handed back by a preceding `ReleaseBlocks`), empty when none were reserved.
    ReportFailed {
        /// The request.
        req: RequestId,
        /// Blocks that did not load.
        blocks: Vec<BlockId>,
        /// Why.
        reason: FailReason,
    },
    /// Tear down the connection to this peer so that none of its writes can land any more.
    DisconnectPeer {
        /// The peer.
        peer: PeerId,
        /// Why it was given up.
        cause: DownCause,
    },
}

/// A host event the D core refused. The core's state is unchanged; blocks passed in stay the
/// host's.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DError {
    /// The request is not known (never arrived, or already ended).
    #[error("unknown request {0:?}")]
    UnknownRequest(RequestId),
    /// `Arrived` for a request that is live or recently ended.
    #[error("request {0:?} already arrived")]
    DuplicateRequest(RequestId),
    /// `Arrived` with zero blocks.
    #[error("request {0:?} has no blocks to receive")]
    NoBlocks(RequestId),
    /// `Reserved` while the policy does not allow reserving yet.
    #[error("request {0:?} may not reserve yet")]
    NotReservable(RequestId),
    /// `Reserved` for a request that already holds a reservation.
    #[error("request {0:?} already reserved")]
    AlreadyReserved(RequestId),
    /// `Reserved` with a different number of blocks than the request needs.
    #[error("request {req:?} needs {expected} blocks, got {got}")]
    WrongBlockCount {
        /// The request.
        req: RequestId,
        /// Blocks needed.
        expected: u32,
        /// Blocks given.
        got: usize,
    },
    /// `PrefixHit` covering every block of the request (at least one must be received).
    #[error(
        "request {req:?}: a prefix hit of {hit} blocks leaves nothing of its {blocks} to receive"
    )]
    PrefixTooLong {
        /// The request.
        req: RequestId,
        /// Blocks the hit covers.
        hit: u32,
        /// Blocks of the request.
        blocks: u32,
    },
    /// A layer index at or above the model's layer count.
    #[error("layer {layer} out of range for request {req:?}")]
    LayerOutOfRange {
        /// The request.
        req: RequestId,
        /// The layer.
        layer: u16,
    },
    /// The event does not fit the request's state (e.g. `Promoted` before `Reported`).
    #[error("request {req:?}: {event} not valid in state {state}")]
    InvalidState {
        /// The request.
        req: RequestId,
        /// The event.
        event: &'static str,
        /// The state.
        state: &'static str,
    },
    /// Bytes from P that do not decode.
    #[error("undecodable message: {0}")]
    Decode(#[from] DecodeError),
}

/// Counters of unusual but handled situations.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DStats {
    /// Messages for requests that ended recently (dropped).
    pub late_messages: u64,
    /// Repeated messages or landings (dropped); this includes P's `LayerSent`/`AllSent` for
    /// layers the local transfer engine already reported with [`DEvent::LayerLanded`].
    pub duplicate_messages: u64,
    /// Messages of the wrong direction or from the wrong peer (dropped).
    pub unexpected_messages: u64,
    /// Messages for unknown requests dropped because too many were pending.
    pub early_overflow: u64,
    /// Requests P announced that never arrived on D.
    pub orphans: u64,
    /// Reservations for requests that had already ended (released at once).
    pub stale_reservations: u64,
    /// Requests finished (promoted).
    pub finished: u64,
    /// Requests failed.
    pub failed: u64,
    /// Failed requests whose blocks waited for the drain deadline (P was disconnected).
    pub drain_timeouts: u64,
    /// Times a P with live requests fell silent for `peer_timeout` (they failed).
    pub silences: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DState {
    Early,
    Waiting,
    Reserved,
    /// `land`: every layer is in the landing pool; waiting for KV blocks.
    Landed,
    Complete,
    Reported,
    Promoted,
    Draining,
}

impl DState {
    fn name(self) -> &'static str {
        match self {
            DState::Early => "early",
            DState::Waiting => "waiting",
            DState::Reserved => "reserved",
            DState::Landed => "landed",
            DState::Complete => "complete",
            DState::Reported => "reported",
            DState::Promoted => "promoted",
            DState::Draining => "draining",
        }
    }
}

#[derive(Debug)]
struct DReq {
    peer: PeerId,
    state: DState,
    /// Blocks of the request (its whole prompt).
    blocks_needed: u32,
    /// Blocks D already holds (prefix-cache hit): the first `first` are not received.
    first: u32,
    /// The request's policy (`land` falls back to `lazy` when the landing pool is full).
    policy: Policy,
    /// `blocks` are landing-pool slots, not KV blocks.
    landing: bool,
    /// Layer and block counts P announced (checked once D knows its own).
    p_layers: Option<(u16, u32)>,
    p_started: bool,
    p_done: bool,
    /// P said it has the request queued: no more waiting deadline while P is alive.
    p_acked: bool,
    landed: LayerSet,
    blocks: Vec<BlockId>,
    blocks_sent: bool,
    signalled: bool,
    created: Nanos,
    drain_since: Nanos,
    abort_sent: Nanos,
    gen: u32,
    fail: Option<FailReason>,
    rec: TimelineRecord,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    Tick,
    Req(RequestId, u32),
}

/// The D-side core. See the module documentation.
#[derive(Debug)]
pub struct DSide {
    cfg: DConfig,
    reqs: IdMap<RequestId, DReq>,
    early: usize,
    peers: Peers,
    tombs: Tombstones,
    timers: Deadlines<Timer>,
    tick_armed: bool,
    actions: VecDeque<DAction>,
    timeline: VecDeque<TimelineRecord>,
    stats: DStats,
    metrics: DMetrics,
}

impl DSide {
    /// A D core with no requests.
    pub fn new(cfg: DConfig) -> Self {
        DSide {
            reqs: IdMap::default(),
            early: 0,
            peers: Peers::default(),
            tombs: Tombstones::default(),
            timers: Deadlines::new(),
            tick_armed: false,
            actions: VecDeque::new(),
            timeline: VecDeque::new(),
            stats: DStats::default(),
            metrics: DMetrics::new(cfg.policy),
            cfg,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &DConfig {
        &self.cfg
    }

    /// Counters of unusual situations.
    pub fn stats(&self) -> &DStats {
        &self.stats
    }

    /// Cumulative connector metrics (see [`crate::metrics`]).
    pub fn metrics(&self) -> &DMetrics {
        &self.metrics
    }

    /// Requests by state now and the blocks their reservations hold, with the block-nanoseconds
    /// held so far up to `now`. Walks the live requests once: call it per scrape or engine step.
    pub fn gauges(&self, now: Nanos) -> DGauges {
        let mut g = DGauges::default();
        for r in self.reqs.values() {
            match r.state {
                DState::Early => g.early += 1,
                DState::Waiting => g.waiting += 1,
                DState::Reserved => g.reserved += 1,
                DState::Landed => g.landed += 1,
                DState::Complete => g.complete += 1,
                DState::Reported => g.reported += 1,
                DState::Promoted => g.promoted += 1,
                DState::Draining => g.draining += 1,
            }
            if r.landing {
                g.landing_slots += r.blocks.len() as u64;
            } else if r.state != DState::Promoted && !r.blocks.is_empty() {
                let n = r.blocks.len() as u64;
                g.held_blocks += n;
                if let Some(at) = r.rec.d_reserved {
                    g.held_block_ns += u128::from(n) * u128::from(now.saturating_sub(at));
                }
            }
        }
        g
    }

    /// Requests the core currently tracks (arrived and not ended, plus early ones).
    pub fn live_requests(&self) -> usize {
        self.reqs.len()
    }

    /// Whether the host may reserve blocks for `req` now. O(1); vLLM calls it from
    /// `get_num_new_matched_tokens` every step and returns `None` ("not yet") while false.
    pub fn may_reserve(&self, req: RequestId) -> bool {
        self.reqs.get(&req).is_some_and(|r| {
            (r.state == DState::Waiting && r.policy != Policy::Land && allowed(r.policy, r))
                || r.state == DState::Landed
        })
    }

    /// Blocks `req` holds in its reservation (empty if none).
    pub fn reserved_blocks(&self, req: RequestId) -> &[BlockId] {
        self.reqs.get(&req).map_or(&[], |r| r.blocks.as_slice())
    }

    /// Next action for the host, if any.
    pub fn poll_action(&mut self) -> Option<DAction> {
        self.actions.pop_front()
    }

    /// Next finished timeline record, if any.
    pub fn poll_timeline(&mut self) -> Option<TimelineRecord> {
        self.timeline.pop_front()
    }

    /// When the host must call [`DSide::handle_timeout`] next (may be early; never late).
    pub fn poll_timeout(&self) -> Option<Nanos> {
        self.timers.next()
    }

    /// Decodes bytes from P and handles the message. Undecodable bytes change nothing.
    pub fn handle_bytes(&mut self, from: PeerId, bytes: &[u8], now: Nanos) -> Result<(), DError> {
        let msg = Message::decode(bytes)?;
        self.handle(DEvent::Message { from, msg }, now)
    }

    /// Feeds one event at time `now`.
    pub fn handle(&mut self, ev: DEvent, now: Nanos) -> Result<(), DError> {
        self.tombs.expire(now);
        match ev {
            DEvent::Arrived {
                req,
                peer,
                tokens,
                blocks,
            } => self.on_arrived(req, peer, tokens, blocks, now),
            DEvent::Reserved { req, blocks } => self.on_reserved(req, blocks, now),
            DEvent::PrefixHit { req, blocks } => {
                let r = self.get_mut(req)?;
                if r.state != DState::Waiting {
                    return Err(invalid(req, "prefix_hit", r.state));
                }
                if blocks >= r.blocks_needed {
                    return Err(DError::PrefixTooLong {
                        req,
                        hit: blocks,
                        blocks: r.blocks_needed,
                    });
                }
                r.first = blocks;
                r.rec.prefix_blocks = blocks;
                Ok(())
            }
            DEvent::Landing { req, slots } => self.on_landing(req, slots, now),
            DEvent::LandFallback { req } => {
                let r = self.get_mut(req)?;
                if r.state != DState::Waiting || r.policy != Policy::Land || !r.signalled {
                    return Err(invalid(req, "land_fallback", r.state));
                }
                r.policy = Policy::Lazy;
                r.signalled = false;
                self.metrics.land_fallbacks += 1;
                self.signal_if_reservable(req);
                Ok(())
            }
            DEvent::LayerLanded { req, layer, bytes } => {
                if layer >= self.cfg.layers {
                    return Err(DError::LayerOutOfRange { req, layer });
                }
                match self.reqs.get(&req).map(|r| (r.state, r.blocks_sent)) {
                    Some((DState::Reserved, true)) => self.land(req, Some(layer), bytes, now),
                    Some((DState::Early | DState::Waiting, _)) => {
                        return Err(invalid(req, "layer_landed", DState::Waiting))
                    }
                    Some(_) => self.stats.duplicate_messages += 1,
                    None => self.stats.late_messages += 1,
                }
                Ok(())
            }
            DEvent::Reported { req } => {
                let r = self.get_mut(req)?;
                if r.state != DState::Complete {
                    return Err(invalid(req, "reported", r.state));
                }
                r.state = DState::Reported;
                r.rec.d_reported_finished = Some(now);
                Ok(())
            }
            DEvent::Promoted { req } => {
                let r = self.get_mut(req)?;
                if r.state != DState::Reported && r.state != DState::Complete {
                    return Err(invalid(req, "promoted", r.state));
                }
                if r.rec.d_reported_finished.is_none() {
                    r.rec.d_reported_finished = Some(now);
                }
                r.state = DState::Promoted;
                r.rec.d_promoted = Some(now);
                let held = held_ns(r.blocks.len(), r.rec.d_reserved, now);
                self.stats.finished += 1;
                self.metrics.promoted += 1;
                self.metrics.block_ns_waiting += held;
                Ok(())
            }
            DEvent::FirstToken { req } => {
                let r = self.get_mut(req)?;
                if r.state != DState::Promoted {
                    return Err(invalid(req, "first_token", r.state));
                }
                r.rec.first_token = Some(now);
                if let Some(r) = self.reqs.get(&req) {
                    self.metrics.observe_first_token(&r.rec);
                }
                self.end(req, now);
                Ok(())
            }
            DEvent::Abort { req } => {
                match self.reqs.get(&req).map(|r| r.state) {
                    None | Some(DState::Early) => {
                        if !self.tombs.contains(req) {
                            return Err(DError::UnknownRequest(req));
                        }
                    }
                    Some(DState::Promoted) => self.end(req, now),
                    Some(_) => self.fail(req, FailReason::LocalAbort, true, now),
                }
                Ok(())
            }
            DEvent::Message { from, msg } => {
                self.on_message(from, msg, now);
                Ok(())
            }
            DEvent::PeerUp { peer } => {
                self.touch_peer(peer, now);
                let _ = self.peers.heard(peer, None, now);
                Ok(())
            }
            DEvent::PeerDown { peer } => {
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

    fn on_arrived(
        &mut self,
        req: RequestId,
        peer: PeerId,
        tokens: u32,
        blocks: u32,
        now: Nanos,
    ) -> Result<(), DError> {
        if blocks == 0 {
            return Err(DError::NoBlocks(req));
        }
        let peer_aborted = self.tombs.peer_aborted(req);
        if self.tombs.contains(req) && !peer_aborted {
            return Err(DError::DuplicateRequest(req));
        }
        let mut rec = TimelineRecord::new(req, Side::D, &self.cfg.transport);
        rec.policy = Some(self.cfg.policy);
        rec.layers = self.cfg.layers;
        rec.blocks = blocks;
        rec.tokens = tokens;
        rec.decode_sent = Some(now);
        let (p_started, p_done, p_acked, p_layers) = match self.reqs.get(&req) {
            Some(r) if r.state == DState::Early && r.peer == peer => {
                rec.p_scheduled = r.rec.p_scheduled;
                rec.p_last_layer_ready = r.rec.p_last_layer_ready;
                (r.p_started, r.p_done, r.p_acked, r.p_layers)
            }
            Some(_) => return Err(DError::DuplicateRequest(req)),
            None => (false, false, false, None),
        };
        if self.reqs.contains_key(&req) {
            self.early -= 1;
        }
        self.touch_peer(peer, now);
        self.reqs.insert(
            req,
            DReq {
                peer,
                state: DState::Waiting,
                blocks_needed: blocks,
                first: 0,
                policy: self.cfg.policy,
                landing: false,
                p_layers,
                p_started,
                p_done,
                p_acked,
                landed: LayerSet::new(self.cfg.layers),
                blocks: Vec::new(),
                blocks_sent: false,
                signalled: false,
                created: now,
                drain_since: 0,
                abort_sent: 0,
                gen: 0,
                fail: None,
                rec,
            },
        );
        self.peers.attach(peer, req);
        self.metrics.arrived += 1;
        if peer_aborted {
            // P already gave this request up: it fails here at once (no blocks held).
            if let Some(r) = self.reqs.get_mut(&req) {
                r.fail = Some(FailReason::RemoteAbort);
            }
            self.release_failed(req, now);
            return Ok(());
        }
        self.send(
            peer,
            Message::Announce {
                req,
                tokens,
                blocks,
            },
        );
        if !self.check_p_shape(req, now) {
            return Ok(());
        }
        self.arm(req, now);
        self.signal_if_reservable(req);
        Ok(())
    }

    fn on_reserved(
        &mut self,
        req: RequestId,
        blocks: Vec<BlockId>,
        now: Nanos,
    ) -> Result<(), DError> {
        let policy = self.cfg.policy;
        let Some(r) = self.reqs.get_mut(&req) else {
            // The request ended while the host was reserving: hand the blocks straight back.
            self.stats.stale_reservations += 1;
            self.metrics.releases += 1;
            self.metrics.released_blocks += blocks.len() as u64;
            tracing::debug!(
                target: "kvwire_connector",
                req = req.0,
                blocks = blocks.len(),
                reason = "stale",
                "d released blocks"
            );
            self.actions
                .push_back(DAction::ReleaseBlocks { req, blocks });
            return Ok(());
        };
        match r.state {
            DState::Waiting => {}
            DState::Landed => {
                // `land`: the KV is complete in the landing pool; these are its KV blocks.
                if blocks.len() != (r.blocks_needed - r.first) as usize {
                    return Err(DError::WrongBlockCount {
                        req,
                        expected: r.blocks_needed - r.first,
                        got: blocks.len(),
                    });
                }
                r.state = DState::Complete;
                r.rec.d_reserved = Some(now);
                r.landing = false;
                r.blocks = blocks;
                self.metrics.reservations += 1;
                self.metrics.reserved_blocks += r.blocks.len() as u64;
                self.actions.push_back(DAction::ReportFinished { req });
                return Ok(());
            }
            DState::Early => return Err(DError::UnknownRequest(req)),
            DState::Reserved | DState::Draining => return Err(DError::AlreadyReserved(req)),
            s => return Err(invalid(req, "reserved", s)),
        }
        if r.policy == Policy::Land || !allowed(r.policy, r) {
            return Err(DError::NotReservable(req));
        }
        if blocks.len() != (r.blocks_needed - r.first) as usize {
            return Err(DError::WrongBlockCount {
                req,
                expected: r.blocks_needed - r.first,
                got: blocks.len(),
            });
        }
        r.state = DState::Reserved;
        r.rec.d_reserved = Some(now);
        r.rec.blocks_to_p = Some(now);
        r.blocks_sent = true;
        let peer = r.peer;
        let msg = Message::BlockIds {
            req,
            first: r.first,
            landing: false,
            blocks: blocks.clone(),
        };
        self.metrics.reservations += 1;
        self.metrics.reserved_blocks += blocks.len() as u64;
        tracing::debug!(
            target: "kvwire_connector",
            req = req.0,
            peer = peer.0,
            blocks = blocks.len(),
            policy = policy.name(),
            "d reserved blocks"
        );
        r.blocks = blocks;
        self.send(peer, msg);
        Ok(())
    }

    fn on_landing(
        &mut self,
        req: RequestId,
        slots: Vec<BlockId>,
        now: Nanos,
    ) -> Result<(), DError> {
        let Some(r) = self.reqs.get_mut(&req) else {
            // Ended while the host took the slots: hand them straight back.
            self.stats.stale_reservations += 1;
            self.actions
                .push_back(DAction::ReleaseLanding { req, slots });
            return Ok(());
        };
        if r.state != DState::Waiting || r.policy != Policy::Land || !r.signalled {
            return Err(invalid(req, "landing", r.state));
        }
        if slots.len() != (r.blocks_needed - r.first) as usize {
            return Err(DError::WrongBlockCount {
                req,
                expected: r.blocks_needed - r.first,
                got: slots.len(),
            });
        }
        r.state = DState::Reserved;
        r.landing = true;
        r.rec.blocks_to_p = Some(now);
        r.blocks_sent = true;
        let peer = r.peer;
        let msg = Message::BlockIds {
            req,
            first: r.first,
            landing: true,
            blocks: slots.clone(),
        };
        r.blocks = slots;
        self.metrics.landings += 1;
        self.send(peer, msg);
        Ok(())
    }

    fn on_message(&mut self, from: PeerId, msg: Message, now: Nanos) {
        self.touch_peer(from, now);
        if let Message::Heartbeat { incarnation, .. } = msg {
            if let Heard::Restarted(lost) = self.peers.heard(from, Some(incarnation), now) {
                for req in lost {
                    self.fail_for_peer(req, FailReason::PeerRestarted, now);
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
        } else if self.tombs.contains(req) {
            self.stats.late_messages += 1;
            return;
        }
        match msg {
            Message::Started { layers, blocks, .. } => {
                let Some(r) = self.early_or_get(req, from, now) else {
                    return;
                };
                if r.p_started {
                    self.stats.duplicate_messages += 1;
                    return;
                }
                r.p_started = true;
                r.p_layers = Some((layers, blocks));
                r.rec.p_scheduled = Some(now);
                if self.check_p_shape(req, now) {
                    self.signal_if_reservable(req);
                }
            }
            Message::Queued { .. } => {
                let Some(r) = self.early_or_get(req, from, now) else {
                    return;
                };
                if r.p_acked {
                    self.stats.duplicate_messages += 1;
                    return;
                }
                // The waiting deadline moves to `request_timeout` (re-armed when it fires).
                r.p_acked = true;
            }
            Message::PrefillDone { .. } => {
                let Some(r) = self.early_or_get(req, from, now) else {
                    return;
                };
                if r.p_done {
                    self.stats.duplicate_messages += 1;
                    return;
                }
                r.p_started = true;
                r.p_done = true;
                r.rec.p_last_layer_ready = Some(now);
                if r.rec.p_scheduled.is_none() {
                    r.rec.p_scheduled = Some(now);
                }
                self.signal_if_reservable(req);
            }
            Message::LayerSent { layer, bytes, .. } => {
                self.on_data_msg(req, Some(layer), bytes, now);
            }
            Message::AllSent { layers, bytes, .. } => {
                if layers != self.cfg.layers {
                    if self.reqs.contains_key(&req) {
                        self.fail(req, FailReason::Protocol, true, now);
                    }
                    return;
                }
                self.on_data_msg(req, None, bytes, now);
            }
            Message::Abort { .. } => match self.reqs.get(&req).map(|r| r.state) {
                Some(DState::Early) => self.drop_early(req, now, true),
                Some(DState::Waiting) | Some(DState::Reserved) => {
                    self.fail(req, FailReason::RemoteAbort, false, now)
                }
                Some(DState::Draining) => self.release_failed(req, now),
                Some(_) => self.stats.late_messages += 1,
                None => {
                    // P gave up a request D has not seen yet: remember, fail it on arrival.
                    self.tombs
                        .bury(req, now.saturating_add(self.cfg.tombstone_ttl), true);
                }
            },
            Message::Announce { .. } | Message::BlockIds { .. } | Message::Heartbeat { .. } => {
                self.stats.unexpected_messages += 1;
            }
        }
    }

    fn on_data_msg(&mut self, req: RequestId, layer: Option<u16>, bytes: u64, now: Nanos) {
        let Some(state) = self.reqs.get(&req).map(|r| (r.state, r.blocks_sent)) else {
            self.stats.unexpected_messages += 1;
            return;
        };
        match state {
            (DState::Reserved, true) => {
                if layer.is_some_and(|l| l >= self.cfg.layers) {
                    self.fail(req, FailReason::Protocol, true, now);
                } else {
                    self.land(req, layer, bytes, now);
                }
            }
            // P cannot have written anything before it had our block ids.
            (DState::Early, _) | (DState::Waiting, _) | (DState::Reserved, false) => {
                if self
                    .reqs
                    .get(&req)
                    .is_some_and(|r| r.state == DState::Early)
                {
                    self.drop_early(req, now, false);
                } else {
                    self.fail(req, FailReason::Protocol, true, now);
                }
            }
            _ => self.stats.duplicate_messages += 1,
        }
    }

    /// One layer (or, with `None`, every layer) has landed.
    fn land(&mut self, req: RequestId, layer: Option<u16>, bytes: u64, now: Nanos) {
        let layers = self.cfg.layers;
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        let fresh = match layer {
            Some(l) => r.landed.insert(l),
            None => {
                let mut any = false;
                for l in 0..layers {
                    any |= r.landed.insert(l);
                }
                any
            }
        };
        if !fresh {
            self.stats.duplicate_messages += 1;
            return;
        }
        let before = r.rec.bytes;
        match layer {
            Some(_) => r.rec.bytes = r.rec.bytes.saturating_add(bytes),
            None => r.rec.bytes = r.rec.bytes.max(bytes),
        }
        // Saturating: the byte counts come from P's messages.
        self.metrics.bytes_received = self
            .metrics
            .bytes_received
            .saturating_add(r.rec.bytes.saturating_sub(before));
        if r.rec.first_byte.is_none() {
            r.rec.first_byte = Some(now);
        }
        if r.landed.count() == layers {
            r.rec.last_byte = Some(now);
            r.gen += 1;
            let peer = r.peer;
            self.metrics.completed += 1;
            // Everything is here: the peer's death no longer affects this request.
            self.peers.detach(peer, req);
            if r.landing {
                // `land`: now (and only now) the request needs KV blocks.
                r.state = DState::Landed;
                let blocks = r.blocks_needed - r.first;
                self.actions.push_back(DAction::MayReserve { req, blocks });
            } else {
                r.state = DState::Complete;
                self.actions.push_back(DAction::ReportFinished { req });
            }
        }
    }

    // ----- failure paths -----

    /// Fails `req`. `notify`: tell P with an `Abort` (false when P told us, or P is gone).
    fn fail(&mut self, req: RequestId, reason: FailReason, notify: bool, now: Nanos) {
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        let peer = r.peer;
        let state = r.state;
        let blocks_sent = r.blocks_sent;
        let peer_up = self.peers.is_up(peer);
        match state {
            DState::Early => self.drop_early(req, now, false),
            DState::Draining | DState::Promoted => {}
            DState::Waiting | DState::Landed | DState::Complete | DState::Reported => {
                r.fail = Some(reason);
                if notify && peer_up && state == DState::Waiting {
                    self.send(peer, Message::Abort { req, reason });
                }
                self.release_failed(req, now);
            }
            DState::Reserved => {
                r.fail = Some(reason);
                let p_may_write = blocks_sent
                    && peer_up
                    && !matches!(reason, FailReason::RemoteAbort | FailReason::PeerDown);
                if p_may_write {
                    // P has our block ids and may have writes in flight: keep the blocks until
                    // P confirms with its Abort, P dies, or the drain deadline passes.
                    r.state = DState::Draining;
                    r.drain_since = now;
                    r.abort_sent = now;
                    self.send(peer, Message::Abort { req, reason });
                    self.arm(req, now);
                } else {
                    if notify && peer_up {
                        self.send(peer, Message::Abort { req, reason });
                    }
                    self.release_failed(req, now);
                }
            }
        }
    }

    /// Releases a failed request's blocks (if any), reports it failed and ends it.
    fn release_failed(&mut self, req: RequestId, now: Nanos) {
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        let reason = r.fail.unwrap_or(FailReason::LocalAbort);
        let mut blocks = std::mem::take(&mut r.blocks);
        if r.landing {
            r.landing = false;
            let slots = std::mem::take(&mut blocks);
            self.actions
                .push_back(DAction::ReleaseLanding { req, slots });
        }
        r.rec.outcome = Outcome::Failed;
        r.rec.fail_reason = Some(reason);
        self.metrics.failed[reason_index(reason)] += 1;
        if !blocks.is_empty() {
            r.rec.d_released = Some(now);
            self.metrics.releases += 1;
            self.metrics.released_blocks += blocks.len() as u64;
            self.metrics.block_ns_waiting += held_ns(blocks.len(), r.rec.d_reserved, now);
            tracing::debug!(
                target: "kvwire_connector",
                req = req.0,
                peer = r.peer.0,
                blocks = blocks.len(),
                reason = crate::metrics::fail_reason_name(reason),
                "d released blocks"
            );
            self.actions.push_back(DAction::ReleaseBlocks {
                req,
                blocks: blocks.clone(),
            });
        }
        self.actions.push_back(DAction::ReportFailed {
            req,
            blocks,
            reason,
        });
        self.stats.failed += 1;
        self.end(req, now);
    }

    /// Forgets a request known only from P's messages. `peer_aborted`: P gave it up, so a
    /// later arrival fails at once.
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
                .push_back(DAction::DisconnectPeer { peer, cause });
            for req in reqs {
                self.fail_for_peer(req, reason, now);
            }
        }
    }

    /// Fails a request because its P is gone: nothing more can land, so a draining
    /// reservation is released at once.
    ///
    /// A restart is different: the connection is up and the message that revealed the new
    /// incarnation may have been overtaken by requests of the new life (a lost heartbeat), so a
    /// request whose block ids went out still drains through an `Abort` round trip (the new
    /// life confirms unknown requests at once).
    fn fail_for_peer(&mut self, req: RequestId, reason: FailReason, now: Nanos) {
        match (self.reqs.get(&req).map(|r| r.state), reason) {
            (Some(DState::Draining), FailReason::PeerDown) => self.release_failed(req, now),
            (Some(DState::Draining), _) => {}
            (Some(_), FailReason::PeerRestarted) => self.fail(req, reason, true, now),
            (Some(_), _) => self.fail(req, reason, false, now),
            (None, _) => {}
        }
    }

    // ----- timers -----

    fn tick(&mut self, now: Nanos) {
        self.peers.hb_seq += 1;
        let seq = self.peers.hb_seq;
        let inc = self.cfg.incarnation;
        let peers: Vec<PeerId> = self.peers.map.keys().copied().collect();
        for p in peers {
            self.actions.push_back(DAction::Send {
                to: p,
                msg: Message::Heartbeat {
                    incarnation: inc,
                    seq,
                },
            });
        }
        for (p, for_ns) in self.peers.silent(now, self.cfg.peer_timeout) {
            self.peer_silent(p, for_ns, now);
        }
        self.timers
            .arm(now.saturating_add(self.cfg.heartbeat_interval), Timer::Tick);
    }

    /// Fails the requests of a P silent for `for_ns` (see the module's docs): not given up,
    /// so a stalled P that comes back keeps its data path. Those whose block ids it has drain:
    /// their blocks wait for its confirming `Abort` or the drain deadline, and only that
    /// deadline gives it up ([`DownCause::DrainTimeout`]). A request younger than `peer_timeout`
    /// waits: silence is judged over a request's own life (the peer may be heard again as soon
    /// as a connection that broke while it stalled is made again).
    fn peer_silent(&mut self, peer: PeerId, for_ns: Nanos, now: Nanos) {
        let timeout = self.cfg.peer_timeout;
        let reqs = self.peers.failing_for_silence(peer, for_ns, "P", |r| {
            self.reqs.get(&r).is_some_and(|r| {
                r.state != DState::Draining && now.saturating_sub(r.created) >= timeout
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

    fn deadline(&self, r: &DReq) -> Option<Nanos> {
        let c = &self.cfg;
        match r.state {
            DState::Early => Some(r.created.saturating_add(c.orphan_timeout)),
            DState::Waiting | DState::Reserved => {
                let mut d = r.created.saturating_add(c.request_timeout);
                if !r.p_started && !r.p_acked {
                    d = d.min(r.created.saturating_add(c.wait_for_p_timeout));
                }
                Some(d)
            }
            DState::Draining => Some(
                (r.drain_since.saturating_add(c.drain_timeout))
                    .min(r.abort_sent.saturating_add(c.heartbeat_interval)),
            ),
            DState::Landed | DState::Complete | DState::Reported | DState::Promoted => None,
        }
    }

    fn arm(&mut self, req: RequestId, _now: Nanos) {
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        let Some(at) = self.deadline(r) else {
            return;
        };
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
        let Some(at) = self.deadline(r) else {
            return;
        };
        if at > now {
            // The deadline moved later (e.g. P started): wait for the new one.
            self.timers.arm(at, Timer::Req(req, gen));
            return;
        }
        match r.state {
            DState::Early => {
                let peer = r.peer;
                let up = self.peers.is_up(peer);
                self.stats.orphans += 1;
                // P is told to give it up; an arrival after this fails at once.
                self.drop_early(req, now, true);
                if up {
                    self.send(
                        peer,
                        Message::Abort {
                            req,
                            reason: FailReason::Timeout,
                        },
                    );
                }
            }
            DState::Draining => {
                let peer = r.peer;
                let reason = r.fail.unwrap_or(FailReason::Timeout);
                if now < r.drain_since.saturating_add(self.cfg.drain_timeout) {
                    // No confirmation yet: the Abort (or its answer) may have been lost.
                    if let Some(r) = self.reqs.get_mut(&req) {
                        r.abort_sent = now;
                    }
                    self.send(peer, Message::Abort { req, reason });
                    self.arm(req, now);
                    return;
                }
                // P is alive but never confirmed: only tearing its connection down guarantees
                // that no write lands in the blocks once they are released.
                self.stats.drain_timeouts += 1;
                self.peer_down(peer, FailReason::PeerDown, DownCause::DrainTimeout, now);
                self.release_failed(req, now);
            }
            _ => self.fail(req, FailReason::Timeout, true, now),
        }
    }

    // ----- helpers -----

    fn signal_if_reservable(&mut self, req: RequestId) {
        if let Some(r) = self.reqs.get_mut(&req) {
            if r.state == DState::Waiting && !r.signalled && allowed(r.policy, r) {
                r.signalled = true;
                let blocks = r.blocks_needed - r.first;
                self.actions.push_back(if r.policy == Policy::Land {
                    DAction::MayLand { req, blocks }
                } else {
                    DAction::MayReserve { req, blocks }
                });
            }
        }
    }

    /// Checks P's announced shape against ours; fails the request on mismatch.
    fn check_p_shape(&mut self, req: RequestId, now: Nanos) -> bool {
        let layers = self.cfg.layers;
        let bad = self.reqs.get(&req).is_some_and(|r| {
            r.state != DState::Early
                && r.p_layers
                    .is_some_and(|(l, b)| l != layers || b != r.blocks_needed)
        });
        if bad {
            self.fail(req, FailReason::Protocol, true, now);
        }
        !bad
    }

    /// The entry for a message about `req`, creating an early one if D has not seen it yet.
    fn early_or_get(&mut self, req: RequestId, from: PeerId, now: Nanos) -> Option<&mut DReq> {
        if !self.reqs.contains_key(&req) {
            if self.early >= self.cfg.max_early {
                self.stats.early_overflow += 1;
                return None;
            }
            self.early += 1;
            self.reqs.insert(
                req,
                DReq {
                    peer: from,
                    state: DState::Early,
                    blocks_needed: 0,
                    first: 0,
                    policy: self.cfg.policy,
                    landing: false,
                    p_layers: None,
                    p_started: false,
                    p_done: false,
                    p_acked: false,
                    landed: LayerSet::default(),
                    blocks: Vec::new(),
                    blocks_sent: false,
                    signalled: false,
                    created: now,
                    drain_since: 0,
                    abort_sent: 0,
                    gen: 0,
                    fail: None,
                    rec: TimelineRecord::new(req, Side::D, &self.cfg.transport),
                },
            );
            self.arm(req, now);
        }
        self.reqs.get_mut(&req)
    }

    fn touch_peer(&mut self, peer: PeerId, now: Nanos) {
        if self.peers.ensure(peer, now) {
            // First contact: say who we are before anything else, so a restart is visible
            // before any request message of the new life.
            self.peers.hb_seq += 1;
            self.actions.push_back(DAction::Send {
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
        self.actions.push_back(DAction::Send { to, msg });
    }

    fn get_mut(&mut self, req: RequestId) -> Result<&mut DReq, DError> {
        match self.reqs.get_mut(&req) {
            Some(r) if r.state != DState::Early => Ok(r),
            _ => Err(DError::UnknownRequest(req)),
        }
    }

    /// Entries in the deadline heap (stale ones included); for tests and benches.
    pub fn pending_deadlines(&self) -> usize {
        self.timers.len()
    }

    /// Requests remembered as recently ended; for tests and benches.
    pub fn tombstones(&self) -> usize {
        self.tombs.len()
    }
}

fn allowed(policy: Policy, r: &DReq) -> bool {
    match policy {
        Policy::Eager => true,
        Policy::Lazy => r.p_started,
        Policy::Jit => r.p_done,
        Policy::Land => r.p_started,
    }
}

/// Block-nanoseconds of `blocks` held from `reserved` to `now`.
fn held_ns(blocks: usize, reserved: Option<Nanos>, now: Nanos) -> u128 {
    reserved.map_or(0, |at| {
        (blocks as u128) * u128::from(now.saturating_sub(at))
    })
}

fn invalid(req: RequestId, event: &'static str, state: DState) -> DError {
    DError::InvalidState {
        req,
        event,
        state: state.name(),
    }
}

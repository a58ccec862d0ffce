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
//!
//! Files: `vocab` (events, actions, errors, counters), `host_events`, `messages` (from P),
//! `failure`, `deadlines`; here the configuration, the request state, the core's public API and
//! its helpers.

mod deadlines;
mod failure;
mod host_events;
mod messages;
mod vocab;

pub use vocab::*;

use crate::book::{self, Book, Liveness};
use crate::metrics::{reason_index, DGauges, DMetrics};
use crate::msg::{DecodeError, Message};
use crate::peers::LayerSet;
use crate::timeline::{Outcome, Side, TimelineRecord};
use crate::types::{BlockId, DownCause, FailReason, Nanos, PeerId, Policy, RequestId, MS, SEC};
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
pub(crate) struct DReq {
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

impl DReq {
    /// A request of `peer` in `state`, first heard of at `now`, that P has not started and
    /// that holds no blocks.
    fn new(peer: PeerId, state: DState, policy: Policy, now: Nanos, rec: TimelineRecord) -> Self {
        DReq {
            peer,
            state,
            blocks_needed: 0,
            first: 0,
            policy,
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
            rec,
        }
    }

    /// Reserved: `blocks` (landing-pool slots when `landing`) hold it now, and P is to be told
    /// their ids (the message returned, for the peer returned).
    fn reserve(
        &mut self,
        req: RequestId,
        blocks: Vec<BlockId>,
        landing: bool,
        now: Nanos,
    ) -> (PeerId, Message) {
        self.state = DState::Reserved;
        self.landing = landing;
        self.rec.blocks_to_p = Some(now);
        self.blocks_sent = true;
        let msg = Message::BlockIds {
            req,
            first: self.first,
            landing,
            blocks: blocks.clone(),
        };
        self.blocks = blocks;
        (self.peer, msg)
    }

    /// Whether `got` blocks are what the request needs beyond D's prefix-cache hit.
    fn check_count(&self, req: RequestId, got: usize) -> Result<(), DError> {
        let expected = self.blocks_needed - self.first;
        if got == expected as usize {
            return Ok(());
        }
        Err(DError::WrongBlockCount { req, expected, got })
    }
}

book::impl_core!(DSide, DReq, DState::Draining, DAction, "P", fail_for_p);

/// The D-side core. See the module documentation.
#[derive(Debug)]
pub struct DSide {
    cfg: DConfig,
    book: Book<DReq, DAction>,
    stats: DStats,
    metrics: DMetrics,
}

impl DSide {
    /// A D core with no requests.
    pub fn new(cfg: DConfig) -> Self {
        let live = Liveness {
            incarnation: cfg.incarnation,
            heartbeat_interval: cfg.heartbeat_interval,
            peer_timeout: cfg.peer_timeout,
            tombstone_ttl: cfg.tombstone_ttl,
        };
        DSide {
            book: Book::new(live),
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
        for r in self.book.reqs.values() {
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
        self.book.reqs.len()
    }

    /// Whether the host may reserve blocks for `req` now. O(1); vLLM calls it from
    /// `get_num_new_matched_tokens` every step and returns `None` ("not yet") while false.
    pub fn may_reserve(&self, req: RequestId) -> bool {
        self.book.reqs.get(&req).is_some_and(|r| {
            (r.state == DState::Waiting && r.policy != Policy::Land && allowed(r.policy, r))
                || r.state == DState::Landed
        })
    }

    /// Blocks `req` holds in its reservation (empty if none).
    pub fn reserved_blocks(&self, req: RequestId) -> &[BlockId] {
        self.book
            .reqs
            .get(&req)
            .map_or(&[], |r| r.blocks.as_slice())
    }

    /// Layers of `req` that have fully landed so far, in increasing order (empty if none, or if
    /// the request is unknown). A host that lands through a pool of its own copies each of them
    /// into the request's KV blocks as soon as it is listed, not after the last.
    pub fn landed_layers(&self, req: RequestId) -> Vec<u16> {
        self.book
            .reqs
            .get(&req)
            .map_or_else(Vec::new, |r| r.landed.iter().collect())
    }

    /// Next action for the host, if any.
    pub fn poll_action(&mut self) -> Option<DAction> {
        self.book.poll_action()
    }

    /// Next finished timeline record, if any.
    pub fn poll_timeline(&mut self) -> Option<TimelineRecord> {
        self.book.poll_timeline()
    }

    /// When the host must call [`DSide::handle_timeout`] next (may be early; never late).
    pub fn poll_timeout(&self) -> Option<Nanos> {
        self.book.poll_timeout()
    }

    /// Decodes bytes from P and handles the message. Undecodable bytes change nothing.
    pub fn handle_bytes(&mut self, from: PeerId, bytes: &[u8], now: Nanos) -> Result<(), DError> {
        let msg = Message::decode(bytes)?;
        self.handle(DEvent::Message { from, msg }, now)
    }

    /// Feeds one event at time `now`.
    pub fn handle(&mut self, ev: DEvent, now: Nanos) -> Result<(), DError> {
        self.book.tombs.expire(now);
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
                match self.book.reqs.get(&req).map(|r| (r.state, r.blocks_sent)) {
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
                if let Some(r) = self.book.reqs.get(&req) {
                    self.metrics.observe_first_token(&r.rec);
                }
                self.book.end(req, now);
                Ok(())
            }
            DEvent::Abort { req } => {
                match self.book.reqs.get(&req).map(|r| r.state) {
                    None | Some(DState::Early) => {
                        if !self.book.tombs.contains(req) {
                            return Err(DError::UnknownRequest(req));
                        }
                    }
                    Some(DState::Promoted) => self.book.end(req, now),
                    Some(_) => self.fail(req, FailReason::LocalAbort, true, now),
                }
                Ok(())
            }
            DEvent::Message { from, msg } => {
                self.on_message(from, msg, now);
                Ok(())
            }
            DEvent::PeerUp { peer } => {
                self.book.touch_peer(peer, now);
                let _ = self.book.peers.heard(peer, None, now);
                Ok(())
            }
            DEvent::PeerDown { peer } => {
                book::peer_down(self, peer, FailReason::PeerDown, DownCause::Reported, now);
                Ok(())
            }
        }
    }

    /// Handles every deadline due at `now`.
    pub fn handle_timeout(&mut self, now: Nanos) {
        book::run_timers(self, now);
    }

    fn signal_if_reservable(&mut self, req: RequestId) {
        if let Some(r) = self.book.reqs.get_mut(&req) {
            if r.state == DState::Waiting && !r.signalled && allowed(r.policy, r) {
                r.signalled = true;
                let blocks = r.blocks_needed - r.first;
                self.book.actions.push_back(if r.policy == Policy::Land {
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
        let bad = self.book.reqs.get(&req).is_some_and(|r| {
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
        if !self.book.reqs.contains_key(&req) {
            if self.book.early >= self.cfg.max_early {
                self.stats.early_overflow += 1;
                return None;
            }
            self.book.early += 1;
            let rec = TimelineRecord::new(req, Side::D, &self.cfg.transport);
            let r = DReq::new(from, DState::Early, self.cfg.policy, now, rec);
            self.book.reqs.insert(req, r);
            self.arm(req);
        }
        self.book.reqs.get_mut(&req)
    }

    fn get_mut(&mut self, req: RequestId) -> Result<&mut DReq, DError> {
        match self.book.reqs.get_mut(&req) {
            Some(r) if r.state != DState::Early => Ok(r),
            _ => Err(DError::UnknownRequest(req)),
        }
    }

    /// Entries in the deadline heap (stale ones included); for tests and benches.
    pub fn pending_deadlines(&self) -> usize {
        self.book.pending_deadlines()
    }

    /// Requests remembered as recently ended; for tests and benches.
    pub fn tombstones(&self) -> usize {
        self.book.tombs.len()
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

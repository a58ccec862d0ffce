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
//!
//! Files: `vocab` (events, actions, errors, counters), `sending`, `messages` (from D),
//! `failure`, `deadlines`; here the configuration, the request state, the core's public API and
//! its helpers.

mod deadlines;
mod failure;
mod messages;
mod sending;
mod vocab;

pub use vocab::*;

use crate::book::{self, Book, Liveness};
use crate::metrics::{fail_reason_name, reason_index, PMetrics};
use crate::msg::{DecodeError, Message};
use crate::peers::LayerSet;
use crate::timeline::{Outcome, Side, TimelineRecord};
use crate::types::{BlockId, DownCause, FailReason, Nanos, PeerId, RequestId, SendMode, MS, SEC};
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PState {
    Early,
    Active,
    Draining,
}

#[derive(Debug)]
pub(crate) struct PReq {
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

impl PReq {
    /// A request of `peer` in `state`, first heard of at `now`, that reads `src` and has no
    /// layer ready, issued or done of `layers` (empty sets of their size).
    fn new(
        peer: PeerId,
        state: PState,
        src: Arc<[BlockId]>,
        layers: LayerSet,
        now: Nanos,
        rec: TimelineRecord,
    ) -> Self {
        PReq {
            peer,
            state,
            src,
            dst: None,
            ready: layers.clone(),
            issued: layers.clone(),
            done: layers,
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
        }
    }
}

book::impl_core!(PSide, PReq, PState::Draining, PAction, "D", fail_for_d);

/// The P-side core. See the module documentation.
#[derive(Debug)]
pub struct PSide {
    cfg: PConfig,
    book: Book<PReq, PAction>,
    stats: PStats,
    metrics: PMetrics,
}

impl PSide {
    /// A P core with no requests.
    pub fn new(cfg: PConfig) -> Self {
        let live = Liveness {
            incarnation: cfg.incarnation,
            heartbeat_interval: cfg.heartbeat_interval,
            peer_timeout: cfg.peer_timeout,
            tombstone_ttl: cfg.tombstone_ttl,
        };
        PSide {
            book: Book::new(live),
            stats: PStats::default(),
            metrics: PMetrics::default(),
            cfg,
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
        self.book.reqs.len()
    }

    /// Whether D's block ids for `req` are known. O(1).
    pub fn has_destination(&self, req: RequestId) -> bool {
        self.book.reqs.get(&req).is_some_and(|r| r.dst.is_some())
    }

    /// Next action for the host, if any.
    pub fn poll_action(&mut self) -> Option<PAction> {
        self.book.poll_action()
    }

    /// Next finished timeline record, if any.
    pub fn poll_timeline(&mut self) -> Option<TimelineRecord> {
        self.book.poll_timeline()
    }

    /// When the host must call [`PSide::handle_timeout`] next (may be early; never late).
    pub fn poll_timeout(&self) -> Option<Nanos> {
        self.book.poll_timeout()
    }

    /// Entries in the deadline heap (stale ones included); for tests and benches.
    pub fn pending_deadlines(&self) -> usize {
        self.book.pending_deadlines()
    }

    /// Decodes bytes from D and handles the message. Undecodable bytes change nothing.
    pub fn handle_bytes(&mut self, from: PeerId, bytes: &[u8], now: Nanos) -> Result<(), PError> {
        let msg = Message::decode(bytes)?;
        self.handle(PEvent::Message { from, msg }, now)
    }

    /// Feeds one event at time `now`.
    pub fn handle(&mut self, ev: PEvent, now: Nanos) -> Result<(), PError> {
        self.book.tombs.expire(now);
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
                self.book.touch_peer(peer, now);
                self.book.send(peer, Message::Queued { req });
                Ok(())
            }
            PEvent::Abort { req } => {
                match self.book.reqs.get(&req).map(|r| r.state) {
                    Some(PState::Active) => self.fail(req, FailReason::LocalAbort, true, now),
                    Some(PState::Draining) => {}
                    Some(PState::Early) | None => {
                        if !self.book.tombs.contains(req) {
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
                self.book.touch_peer(peer, now);
                let _ = self.book.peers.heard(peer, None, now);
                Ok(())
            }
            PEvent::PeerDown { peer } => {
                book::peer_down(self, peer, FailReason::PeerDown, DownCause::Reported, now);
                Ok(())
            }
        }
    }

    /// Handles every deadline due at `now`.
    pub fn handle_timeout(&mut self, now: Nanos) {
        book::run_timers(self, now);
    }

    /// Whether `req` is active; `Ok(false)` for a recently ended one (late host event).
    fn known_active(&mut self, req: RequestId) -> Result<bool, PError> {
        match self.book.reqs.get(&req).map(|r| r.state) {
            Some(PState::Active) => Ok(true),
            Some(PState::Draining) => Ok(false),
            Some(PState::Early) | None => {
                if self.book.tombs.contains(req) {
                    self.stats.late += 1;
                    Ok(false)
                } else {
                    Err(PError::UnknownRequest(req))
                }
            }
        }
    }

    fn early_entry(&mut self, req: RequestId, from: PeerId, now: Nanos) -> Option<&mut PReq> {
        if !self.book.reqs.contains_key(&req) {
            if self.book.early >= self.cfg.max_early {
                self.stats.early_overflow += 1;
                return None;
            }
            self.book.early += 1;
            self.book.touch_peer(from, now);
            let rec = TimelineRecord::new(req, Side::P, &self.cfg.transport);
            let src = Arc::from(Vec::new());
            let r = PReq::new(from, PState::Early, src, LayerSet::default(), now, rec);
            self.book.reqs.insert(req, r);
            self.arm(req);
        }
        self.book.reqs.get_mut(&req)
    }
}

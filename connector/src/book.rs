//! The book both cores keep around their requests: the live ones by id (and how many of them
//! are known only from the peer's messages), the peers they belong to, the ids recently ended,
//! the deadlines and the heartbeat tick, the actions for the host and the finished timeline
//! records. What a request's state means is each side's own; this bookkeeping is the same on
//! both, so it is written once, with the flows around it that only call back into a side
//! ([`Core`]): timers, a peer lost, a peer heard.

use std::collections::VecDeque;

use crate::msg::Message;
use crate::peers::{Heard, Peers, Tombstones};
use crate::timeline::TimelineRecord;
use crate::timer::Deadlines;
use crate::types::{DownCause, FailReason, IdMap, Nanos, PeerId, RequestId};

/// A side's request, as the book sees it.
pub(crate) trait Entry {
    /// The peer it is exchanged with.
    fn peer(&self) -> PeerId;
    /// When the side first heard of it (silence is judged over a request's own life).
    fn created(&self) -> Nanos;
    /// Whether it already failed and waits for its drain (a silence does not fail it again).
    fn draining(&self) -> bool;
    /// Its deadline's generation: a timer armed under an older one is stale.
    fn generation(&mut self) -> &mut u32;
    /// Its timeline record, taken when it ends.
    fn into_record(self) -> TimelineRecord;
}

/// A side's action for the host, as the book makes them.
pub(crate) trait HostAction {
    /// Send `msg` to `to`.
    fn send(to: PeerId, msg: Message) -> Self;
    /// Tear the connection to `peer` down.
    fn disconnect(peer: PeerId, cause: DownCause) -> Self;
}

/// Makes `$core` a [`Core`] over a `Book<$req, $action>` in its field `book`: implements
/// [`Entry`] for its request type `$req` (fields `peer`, `created`, `gen`, `rec`, and `state`,
/// draining when it is `$draining`), [`HostAction`] for its action type `$action` (variants
/// `Send` and `DisconnectPeer`) and [`Core`] with `$peer` as the peer's role, over the core's
/// own `fail`, `$fail_for_peer`, `deadline_passed` and `stats` (`silences`,
/// `unexpected_messages`): both sides name them alike.
macro_rules! impl_core {
    ($core:ty, $req:ty, $draining:path, $action:ident, $peer:literal, $fail_for_peer:ident) => {
        impl $crate::book::Entry for $req {
            fn peer(&self) -> PeerId {
                self.peer
            }
            fn created(&self) -> Nanos {
                self.created
            }
            fn draining(&self) -> bool {
                self.state == $draining
            }
            fn generation(&mut self) -> &mut u32 {
                &mut self.gen
            }
            fn into_record(self) -> TimelineRecord {
                self.rec
            }
        }

        impl $crate::book::HostAction for $action {
            fn send(to: PeerId, msg: Message) -> Self {
                $action::Send { to, msg }
            }
            fn disconnect(peer: PeerId, cause: DownCause) -> Self {
                $action::DisconnectPeer { peer, cause }
            }
        }

        impl $crate::book::Core for $core {
            type Req = $req;
            type Action = $action;
            const PEER: &'static str = $peer;
            fn book(&mut self) -> &mut $crate::book::Book<$req, $action> {
                &mut self.book
            }
            fn fail_silent(&mut self, req: RequestId, now: Nanos) {
                self.fail(req, FailReason::Timeout, true, now);
            }
            fn fail_for_peer(&mut self, req: RequestId, reason: FailReason, now: Nanos) {
                self.$fail_for_peer(req, reason, now);
            }
            fn req_deadline(&mut self, req: RequestId, gen: u32, now: Nanos) {
                self.deadline_passed(req, gen, now);
            }
            fn count_silences(&mut self, n: u64) {
                self.stats.silences += n;
            }
            fn count_foreign(&mut self) {
                self.stats.unexpected_messages += 1;
            }
        }
    };
}
pub(crate) use impl_core;

/// What a timer stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Timer {
    /// The heartbeat tick.
    Tick,
    /// A request's deadline, armed under this generation.
    Req(RequestId, u32),
}

/// The liveness settings of a side's configuration, as the book applies them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Liveness {
    pub(crate) incarnation: u64,
    pub(crate) heartbeat_interval: Nanos,
    pub(crate) peer_timeout: Nanos,
    pub(crate) tombstone_ttl: Nanos,
}

/// See the module's docs. `R`: the side's request; `A`: its actions for the host.
#[derive(Debug)]
pub(crate) struct Book<R, A> {
    pub(crate) reqs: IdMap<RequestId, R>,
    /// Requests known only from the peer's messages (bounded by the side's `max_early`).
    pub(crate) early: usize,
    pub(crate) peers: Peers,
    pub(crate) tombs: Tombstones,
    pub(crate) actions: VecDeque<A>,
    timers: Deadlines<Timer>,
    tick_armed: bool,
    timeline: VecDeque<TimelineRecord>,
    live: Liveness,
}

impl<R: Entry, A: HostAction> Book<R, A> {
    pub(crate) fn new(live: Liveness) -> Self {
        Book {
            reqs: IdMap::default(),
            early: 0,
            peers: Peers::default(),
            tombs: Tombstones::default(),
            actions: VecDeque::new(),
            timers: Deadlines::new(),
            tick_armed: false,
            timeline: VecDeque::new(),
            live,
        }
    }

    pub(crate) fn send(&mut self, to: PeerId, msg: Message) {
        self.actions.push_back(A::send(to, msg));
    }

    /// Registers `peer` if it is new: it hears who we are (a heartbeat) before anything else,
    /// and the heartbeat tick starts with the first peer.
    pub(crate) fn touch_peer(&mut self, peer: PeerId, now: Nanos) {
        if let Some(hb) = self.peers.first_contact(peer, now, self.live.incarnation) {
            self.send(peer, hb);
            if !self.tick_armed {
                self.tick_armed = true;
                self.arm_tick(now);
            }
        }
    }

    /// Notes that `from` was heard (`msg`). For a heartbeat, `Some` with the requests of the
    /// life it ended (empty unless it reveals a restart); `None` for any other message.
    pub(crate) fn heard(
        &mut self,
        from: PeerId,
        msg: &Message,
        now: Nanos,
    ) -> Option<Vec<RequestId>> {
        self.touch_peer(from, now);
        if let Message::Heartbeat { incarnation, .. } = *msg {
            return match self.peers.heard(from, Some(incarnation), now) {
                Heard::Restarted(lost) => Some(lost),
                Heard::Alive => Some(Vec::new()),
            };
        }
        let _ = self.peers.heard(from, None, now);
        None
    }

    /// The transport lost `peer` (or the side gives it up): the host is told to tear its
    /// connection down. Its live requests (to fail), or `None` if it was already down.
    pub(crate) fn peer_down(&mut self, peer: PeerId, cause: DownCause) -> Option<Vec<RequestId>> {
        let reqs = self.peers.down(peer)?;
        self.actions.push_back(A::disconnect(peer, cause));
        Some(reqs)
    }

    /// Remembers `req` as ended from `now` for `tombstone_ttl`, so that a late message about it
    /// is recognised. `peer_aborted`: the peer gave it up, so a later arrival fails at once.
    pub(crate) fn bury(&mut self, req: RequestId, now: Nanos, peer_aborted: bool) {
        let until = now.saturating_add(self.live.tombstone_ttl);
        self.tombs.bury(req, until, peer_aborted);
    }

    /// Forgets a request known only from the peer's messages (see [`Book::bury`]).
    pub(crate) fn drop_early(&mut self, req: RequestId, now: Nanos, peer_aborted: bool) {
        if self.reqs.remove(&req).is_some() {
            self.early -= 1;
            self.bury(req, now, peer_aborted);
        }
    }

    /// Ends `req`: remembered for a while (a late message is recognised), its record out.
    pub(crate) fn end(&mut self, req: RequestId, now: Nanos) {
        if let Some(r) = self.reqs.remove(&req) {
            self.peers.detach(r.peer(), req);
            self.bury(req, now, false);
            self.timeline.push_back(r.into_record());
        }
    }

    /// Arms `req`'s deadline (`deadline` of it; `None`: none in its state) under a new
    /// generation, so that every earlier timer of it is stale.
    pub(crate) fn arm(&mut self, req: RequestId, deadline: impl FnOnce(&R) -> Option<Nanos>) {
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        let Some(at) = deadline(r) else {
            return;
        };
        let gen = r.generation().wrapping_add(1);
        *r.generation() = gen;
        self.timers.arm(at, Timer::Req(req, gen));
    }

    /// The request whose timer of generation `gen` fired at `now`, if its deadline is due:
    /// `None` for a stale timer, an ended request, or a deadline that moved later (re-armed).
    pub(crate) fn due(
        &mut self,
        req: RequestId,
        gen: u32,
        now: Nanos,
        deadline: impl FnOnce(&R) -> Option<Nanos>,
    ) -> Option<&R> {
        let r = self.reqs.get_mut(&req)?;
        if *r.generation() != gen {
            return None;
        }
        let at = deadline(r)?;
        if at > now {
            // The deadline moved later (e.g. the peer started): wait for the new one.
            self.timers.arm(at, Timer::Req(req, gen));
            return None;
        }
        self.reqs.get(&req)
    }

    /// The timers due at `now`, taken out; expired tombstones are forgotten first.
    pub(crate) fn take_due(&mut self, now: Nanos) -> Vec<Timer> {
        self.tombs.expire(now);
        self.timers.take_due(now)
    }

    /// The heartbeat tick: a heartbeat to every peer. Returns how many peers fell silent with
    /// requests to fail, and those requests: of every peer not heard for `peer_timeout`, the
    /// ones at least that old and not draining (a peer may be heard again as soon as a
    /// connection that broke while it stalled is made again). `who` names the peers' role in
    /// the log line. The side fails them, then arms the next tick ([`Book::arm_tick`]).
    pub(crate) fn tick(&mut self, now: Nanos, who: &'static str) -> (u64, Vec<RequestId>) {
        for (p, hb) in self.peers.heartbeats(self.live.incarnation) {
            self.send(p, hb);
        }
        let timeout = self.live.peer_timeout;
        let (mut silences, mut failing) = (0, Vec::new());
        for (p, for_ns) in self.peers.silent(now, timeout) {
            let reqs = self.peers.failing_for_silence(p, for_ns, who, |r| {
                self.reqs
                    .get(&r)
                    .is_some_and(|r| !r.draining() && now.saturating_sub(r.created()) >= timeout)
            });
            if !reqs.is_empty() {
                silences += 1;
                failing.extend(reqs);
            }
        }
        (silences, failing)
    }

    pub(crate) fn arm_tick(&mut self, now: Nanos) {
        self.timers.arm(
            now.saturating_add(self.live.heartbeat_interval),
            Timer::Tick,
        );
    }

    pub(crate) fn poll_action(&mut self) -> Option<A> {
        self.actions.pop_front()
    }

    pub(crate) fn poll_timeline(&mut self) -> Option<TimelineRecord> {
        self.timeline.pop_front()
    }

    pub(crate) fn poll_timeout(&self) -> Option<Nanos> {
        self.timers.next()
    }

    pub(crate) fn pending_deadlines(&self) -> usize {
        self.timers.len()
    }
}

/// A core over its book: what it adds so that the flows below are written once.
pub(crate) trait Core {
    type Req: Entry;
    type Action: HostAction;
    /// The peer's role, as log lines name it.
    const PEER: &'static str;
    fn book(&mut self) -> &mut Book<Self::Req, Self::Action>;
    /// Fails `req` because its peer fell silent (the peer is told, should it come back).
    fn fail_silent(&mut self, req: RequestId, now: Nanos);
    /// Fails `req` because its peer is gone ([`FailReason::PeerDown`]) or restarted
    /// ([`FailReason::PeerRestarted`]).
    fn fail_for_peer(&mut self, req: RequestId, reason: FailReason, now: Nanos);
    /// The deadline of `req` armed under `gen` fired at `now`.
    fn req_deadline(&mut self, req: RequestId, gen: u32, now: Nanos);
    /// Counts `n` peers fallen silent with requests to fail.
    fn count_silences(&mut self, n: u64);
    /// Counts a message about a request of another peer (ignored).
    fn count_foreign(&mut self);
}

/// Handles every timer due at `now`: the heartbeat tick (the requests of silent peers fail,
/// see [`Book::tick`]) and the requests' deadlines.
pub(crate) fn run_timers<C: Core>(core: &mut C, now: Nanos) {
    for t in core.book().take_due(now) {
        match t {
            Timer::Tick => {
                let (silences, failing) = core.book().tick(now, C::PEER);
                core.count_silences(silences);
                for req in failing {
                    core.fail_silent(req, now);
                }
                core.book().arm_tick(now);
            }
            Timer::Req(req, gen) => core.req_deadline(req, gen, now),
        }
    }
}

/// The transport lost `peer`, or the core gives it up (`cause`): the host tears its
/// connection down and its requests fail (`reason`). Nothing happens twice for a peer
/// already down.
pub(crate) fn peer_down<C: Core>(
    core: &mut C,
    peer: PeerId,
    reason: FailReason,
    cause: DownCause,
    now: Nanos,
) {
    for req in core.book().peer_down(peer, cause).unwrap_or_default() {
        core.fail_for_peer(req, reason, now);
    }
}

/// A drain the peer never confirmed: only tearing its connection down guarantees that nothing
/// of it still moves once the blocks are released.
pub(crate) fn drain_timed_out<C: Core>(core: &mut C, peer: PeerId, now: Nanos) {
    peer_down(
        core,
        peer,
        FailReason::PeerDown,
        DownCause::DrainTimeout,
        now,
    );
}

/// Notes that `from` was heard (`msg`); a heartbeat that reveals a restart fails the requests
/// of the life it ended. The request `msg` is about, for the side to handle; `None` for a
/// heartbeat, a message about no request, or one about a request of another peer (counted).
pub(crate) fn inbound<C: Core>(
    core: &mut C,
    from: PeerId,
    msg: &Message,
    now: Nanos,
) -> Option<RequestId> {
    if let Some(lost) = core.book().heard(from, msg, now) {
        for req in lost {
            core.fail_for_peer(req, FailReason::PeerRestarted, now);
        }
        return None;
    }
    let req = msg.request()?;
    if core.book().reqs.get(&req).is_some_and(|r| r.peer() != from) {
        core.count_foreign();
        return None;
    }
    Some(req)
}

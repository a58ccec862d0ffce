//! The listener: accepted connections are admitted within bounds (`Limits::max_handshakes`,
//! `max_handshakes_per_ip`, the failed-proof throttle), each gets one deadline for its whole
//! handshake (`Limits::handshake_timeout`), and becomes a peer (handshake) or a data lane of a
//! peer (lane join). A connection that is not served is answered with a `Reject` (or closed),
//! never left waiting; what peers can cause at will is logged at a bounded rate.

use std::io::Write;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::core::Core;
use super::handshake::responder_handshake;
use super::peer::{LaneGuard, PeerInner};
use crate::auth::{self, LaneCred};
use crate::error::Error;
use crate::gate::{Admitted, Slot, STAGE_AWAITING_PROOF, STAGE_FIRST, STAGE_PROTECTED};
use crate::limits::Resource;
use crate::metrics;
use crate::net::{refuse, spawn_counted, tune, DeadlineIo};
use crate::session::{self, reject_bytes, Fail};
use crate::transport::tcp::serve_lane;
use crate::transport::TargetCtx;
use crate::wire::{self, body, kind, CtrlMsg, Expect, Stage};

/// What an accepted connection may send first.
const FIRST: Expect<'static> = Expect {
    stage: Stage::FirstMessage,
    kinds: &[
        (kind::HELLO, body::HELLO),
        (kind::LANE_JOIN, body::LANE_JOIN),
    ],
};

// ---------------------------------------------------------------- threads

pub(super) fn accept_loop(core: Arc<Core>) {
    loop {
        let r = core.listener.accept();
        if core.shut.load(Ordering::Acquire) {
            return;
        }
        match r {
            Ok((s, addr)) => core.admit(s, addr),
            Err(e) => {
                if let Some(count) = core.logs.refused.hit() {
                    tracing::warn!(error = %e, count, "accept failed");
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

impl Core {
    /// Admits an accepted connection, or refuses it (with a `Reject`).
    fn admit(self: &Arc<Self>, s: TcpStream, addr: SocketAddr) {
        let accepted = Instant::now();
        let ip = addr.ip();
        let limits = &self.cfg.limits;
        if self.throttle.blocked(ip) {
            let e = Error::ResourceLimit {
                resource: Resource::AuthFailures,
                limit: u64::from(limits.auth_failures_per_ip),
            };
            self.refused(&s, addr, &e);
            return;
        }
        let Admitted { slot, evicted } = match self.gate.admit(&s, ip) {
            Ok(a) => a,
            Err(resource) => {
                let e = self.limit_error(resource);
                self.refused(&s, addr, &e);
                return;
            }
        };
        if let Some((victim, resource)) = evicted {
            let e = self.limit_error(resource);
            refuse(&victim, &reject_bytes(&e));
            if let Some(count) = self.logs.refused.hit() {
                tracing::warn!(%addr, error = %e, count, "handshake evicted to admit another");
            }
        }
        let c = self.clone();
        let spawned = spawn_counted("kvwire-conn".into(), &self.threads, move || {
            handle_conn(c, s, addr, slot, accepted)
        });
        if let Err(e) = spawned {
            if let Some(count) = self.logs.refused.hit() {
                tracing::warn!(error = %e, count, "cannot spawn a connection thread");
            }
        }
    }

    fn limit_error(&self, resource: Resource) -> Error {
        let l = &self.cfg.limits;
        let limit = match resource {
            Resource::HandshakesPerAddress => l.max_handshakes_per_ip,
            _ => l.max_handshakes,
        };
        Error::ResourceLimit {
            resource,
            limit: limit as u64,
        }
    }

    /// Refuses a connection that was not admitted: a `Reject`, a close, a counted error and a
    /// rate-limited log line.
    fn refused(&self, s: &TcpStream, addr: SocketAddr, e: &Error) {
        refuse(s, &reject_bytes(e));
        self.metrics.error(metrics::STAGE_CONNECT, e);
        if let Some(count) = self.logs.refused.hit() {
            tracing::warn!(%addr, error = %e, count, "connection refused");
        } else {
            tracing::debug!(%addr, error = %e, "connection refused");
        }
    }

    /// A failed proof from `ip`: counted, throttled, logged at a bounded rate.
    pub(super) fn auth_failed(&self, ip: IpAddr) {
        self.throttle.failed(ip);
        self.metrics
            .security
            .auth_failures
            .fetch_add(1, Ordering::Relaxed);
        if let Some(count) = self.logs.auth.hit() {
            tracing::warn!(%ip, count, "authentication failed");
        }
    }

    /// The credentials of the lanes of session `sid`, and its peer.
    fn lane_session(&self, sid: &[u8; 16]) -> Result<(Arc<PeerInner>, LaneCred), Error> {
        if let Some(p) = self.sessions.lock().get(sid).and_then(Weak::upgrade) {
            return Ok((p.clone(), p.lane_in));
        }
        match self.fenced.of_session(sid) {
            Some(addr) => Err(Error::Fenced { addr }),
            None => Err(Error::AuthFailed),
        }
    }
}

fn handle_conn(core: Arc<Core>, s: TcpStream, addr: SocketAddr, slot: Slot, accepted: Instant) {
    let _ = tune(&s);
    let until = accepted + core.cfg.limits.handshake_timeout;
    let mut io = DeadlineIo::new(&s, until);
    let r: Result<(), Fail> = match wire::read_ctrl_limited(&mut io, FIRST) {
        Err(e) => Err(Fail::from(e)),
        Ok((m @ CtrlMsg::Hello { .. }, raw)) => {
            slot.set(STAGE_FIRST);
            match responder_handshake(&core, &s, &mut io, &slot, &m, &raw) {
                Ok(hs) => {
                    drop(slot);
                    if let Err(e) = core.make_peer(s, hs, false) {
                        core.metrics.error(metrics::STAGE_CONNECT, &e);
                        tracing::debug!(%addr, error = %e, "peer setup failed");
                    }
                    return;
                }
                Err(f) => Err(f),
            }
        }
        Ok((m @ CtrlMsg::LaneJoin { .. }, _)) => {
            slot.set(STAGE_FIRST);
            match lane_join(&core, &s, &mut io, &slot, &m) {
                Ok((p, guard)) => {
                    drop(slot);
                    serve(core, s, p, guard, addr);
                    return;
                }
                Err(f) => Err(f),
            }
        }
        Ok((CtrlMsg::Reject { error }, _)) => Err(Fail::Quiet(
            wire::decode_error(&error, true).unwrap_or_else(|e| e),
        )),
        Ok(_) => unreachable!("read_ctrl_limited returns only expected kinds"),
    };
    if let Err(f) = r {
        let e = f.error();
        if matches!(e, Error::Timeout) {
            core.gate.stats.timed_out.fetch_add(1, Ordering::Relaxed);
        }
        if matches!(e, Error::AuthFailed) {
            if let Fail::Answer(_) = f {
                core.auth_failed(addr.ip());
            }
        }
        core.metrics.error(metrics::STAGE_CONNECT, e);
        tracing::debug!(%addr, error = %e, "handshake refused");
        match f.reject() {
            Some(b) => refuse(&s, &b),
            None => {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

/// The listener's side of a lane join: the session looked up, both proofs, the lane admitted
/// among the peer's lanes, `LaneOk`.
fn lane_join(
    core: &Core,
    s: &TcpStream,
    io: &mut DeadlineIo<'_>,
    slot: &Slot,
    m: &CtrlMsg,
) -> Result<(Arc<PeerInner>, LaneGuard), Fail> {
    let mut peer = None;
    let lookup = |sid: &[u8; 16]| {
        core.lane_session(sid).map(|(p, cred)| {
            peer = Some(p);
            cred
        })
    };
    let lane = session::accept_lane(io, m, auth::random(), lookup, || {
        slot.set(STAGE_AWAITING_PROOF)
    })?;
    slot.set(STAGE_PROTECTED);
    let p = peer.ok_or(Fail::Answer(Error::AuthFailed))?;
    let guard = p.join_lane(lane, s.try_clone()?).map_err(|e| {
        core.metrics
            .security
            .lanes_refused
            .fetch_add(1, Ordering::Relaxed);
        if let Some(count) = core.logs.lane.hit() {
            tracing::warn!(peer = p.id.0, lane, error = %e, count, "lane refused");
        }
        Fail::Answer(e)
    })?;
    io.write_all(&CtrlMsg::LaneOk.encode())?;
    Ok((p, guard))
}

/// Serves an admitted lane until it closes (its guard releases it then).
fn serve(core: Arc<Core>, s: TcpStream, p: Arc<PeerInner>, guard: LaneGuard, addr: SocketAddr) {
    let setup = (|| -> std::io::Result<()> {
        s.set_read_timeout(None)?;
        s.set_write_timeout(None)
    })();
    if let Err(e) = setup {
        tracing::debug!(%addr, error = %e, "lane setup failed");
        return;
    }
    if p.dead.load(Ordering::Acquire) {
        return;
    }
    tracing::debug!(peer = ?p.id, "lane accepted");
    let ctx = TargetCtx {
        regions: core.regions.clone(),
        notify: core.notify.clone(),
        peer: p.id,
        tracker: p.tracker.clone(),
        marks: p.marks.clone(),
        gate: p.gate.clone(),
        budget: p.notify_budget.clone(),
    };
    drop(p);
    drop(core);
    serve_lane(s, ctx);
    drop(guard);
}

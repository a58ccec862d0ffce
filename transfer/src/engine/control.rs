//! A peer's control connection, read side: region updates, shm notifications, fences and
//! their answers, heartbeats, transport messages. Every read is bounded (the kinds a control
//! connection carries, each with its largest body, from `Limits`), the peer's region table too
//! (`Limits::max_remote_regions`), and a connection silent for `Limits::idle_timeout` is dead.

use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::core::Core;
use super::handshake::{kind_bit, regions_cap};
use super::peer::PeerInner;
use crate::error::Error;
use crate::limits::Resource;
use crate::notify::{Notification, NOTIFY_OVERHEAD};
use crate::wire::fence::{EngineMsg, FenceKind, ENGINE_MSG_BIT};
use crate::wire::{self, kind, CtrlMsg, Expect, ProtocolError, Stage, MAX_TAG};

pub(super) fn ctrl_loop(core: Weak<Core>, p: Arc<PeerInner>, mut s: TcpStream) {
    let (regions, removed) = match core.upgrade() {
        Some(c) => (
            regions_cap(&c),
            4 + 8 * c.cfg.limits.max_remote_regions as u32,
        ),
        None => return,
    };
    let kinds = [
        (kind::REGIONS_ADDED, regions),
        (kind::REGIONS_SET, regions),
        (kind::REGIONS_REMOVED, removed),
        (kind::NOTIFY, 4 + MAX_TAG),
        (kind::TRANSPORT, 5 + wire::MAX_TRANSPORT_MSG as u32),
    ];
    let expect = Expect {
        stage: Stage::Control,
        kinds: &kinds,
    };
    // A notification refused (budget spent) whose fence is still to come: the bound.
    let mut refused: Option<u64> = None;
    let failure = loop {
        let m = match wire::read_ctrl_limited(&mut s, expect) {
            Ok((m, _)) => m,
            Err(Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break Some(Error::Timeout)
            }
            Err(e @ Error::Io(_)) => {
                tracing::debug!(peer = ?p.id, error = %e, "control connection closed");
                break None;
            }
            Err(e) => break Some(e),
        };
        let r = handle(&core, &p, m, &mut refused);
        if let Err(e) = r {
            break Some(e);
        }
    };
    // The writer may have failed the peer first (a full queue shuts the connection down).
    let failure = failure.or_else(|| p.ctrl.failure());
    if let Some(c) = core.upgrade() {
        match failure {
            Some(e) if !c.shut.load(Ordering::Acquire) => c.peer_failed(p.id, &e),
            _ => c.kill_peer(
                p.id,
                "control connection closed",
                c.shut.load(Ordering::Acquire),
            ),
        }
    }
}

/// One message on the control connection.
fn handle(
    core: &Weak<Core>,
    p: &Arc<PeerInner>,
    m: CtrlMsg,
    refused: &mut Option<u64>,
) -> Result<(), Error> {
    let ops = |n: u64| {
        if let Some(c) = core.upgrade() {
            c.metrics
                .security
                .remote_table_ops
                .fetch_add(n, Ordering::Relaxed);
        }
    };
    match m {
        CtrlMsg::RegionsAdded(v) => ops(p.remote.write().upsert_many(v)?),
        CtrlMsg::RegionsSet(v) => ops(p.remote.write().replace_all(v)?),
        CtrlMsg::RegionsRemoved(ids) => {
            ops(p.remote.write().remove_many(&ids));
            p.transport.regions_removed(&ids);
        }
        CtrlMsg::Notify(tag) => {
            if let Some(c) = core.upgrade() {
                match p.notify_budget.charge(tag.len() + NOTIFY_OVERHEAD) {
                    Ok(charge) => c
                        .notify
                        .push(Notification { peer: p.id, tag }, Some(charge)),
                    Err(_) => {
                        c.notify.refused.fetch_add(1, Ordering::Relaxed);
                        *refused = Some(p.notify_budget.cap() as u64);
                    }
                }
            }
        }
        CtrlMsg::Transport {
            bit: ENGINE_MSG_BIT,
            data,
        } => on_engine_msg(core, p, &data, refused)?,
        CtrlMsg::Transport { bit, data } => {
            let t = std::iter::once(&p.transport)
                .chain(p.passive.iter())
                .find(|t| kind_bit(t.kind()) == bit);
            match t {
                Some(t) => t.on_ctrl(&data)?,
                None => return Err(ProtocolError::TransportNotInUse { bit }.into()),
            }
        }
        m => {
            return Err(ProtocolError::Unexpected {
                stage: Stage::Control,
                got: Some(Box::new(m)),
            }
            .into())
        }
    }
    Ok(())
}

/// An engine control message from peer `p` (fences, their answers, heartbeats).
fn on_engine_msg(
    core: &Weak<Core>,
    p: &Arc<PeerInner>,
    data: &[u8],
    refused: &mut Option<u64>,
) -> Result<(), Error> {
    match EngineMsg::decode(data)? {
        EngineMsg::Ping => Ok(()),
        // Everything the peer sent before the fence was handled (in order, on this thread):
        // its notification is queued (or was refused: then so is the fence), its region
        // withdrawal took effect.
        EngineMsg::Fence(FenceKind::Notify, id) => match refused.take() {
            Some(limit) => p
                .ctrl
                .send(&EngineMsg::NotifyRefused { id, limit }.to_ctrl()),
            None => p
                .ctrl
                .send(&EngineMsg::FenceAck(FenceKind::Notify, id).to_ctrl()),
        },
        EngineMsg::Fence(kind, id) => p.ctrl.send(&EngineMsg::FenceAck(kind, id).to_ctrl()),
        EngineMsg::FenceAck(FenceKind::Notify, id) => {
            if p.ctrl.confirm(id) {
                if let Some(st) = p.pending.get(id) {
                    st.part_done();
                }
                Ok(())
            } else {
                Err(ProtocolError::UnexpectedFenceAck { batch: id }.into())
            }
        }
        EngineMsg::NotifyRefused { id, limit } => {
            if p.ctrl.confirm(id) {
                if let Some(st) = p.pending.get(id) {
                    st.fail(Error::ResourceLimit {
                        resource: Resource::NotifyBytes,
                        limit,
                    });
                }
                Ok(())
            } else {
                Err(ProtocolError::UnexpectedFenceAck { batch: id }.into())
            }
        }
        EngineMsg::FenceAck(FenceKind::Regions, id) => {
            if let Some(c) = core.upgrade() {
                c.fences.acked(id, p.id);
            }
            Ok(())
        }
    }
}

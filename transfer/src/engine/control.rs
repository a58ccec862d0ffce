//! A peer's control connection, read side: region updates, shm notifications, fences and
//! their answers, transport messages.

use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::core::Core;
use super::handshake::kind_bit;
use super::peer::PeerInner;
use crate::error::Error;
use crate::notify::Notification;
use crate::types::RegionId;
use crate::wire::fence::{EngineMsg, FenceKind, ENGINE_MSG_BIT};
use crate::wire::{self, CtrlMsg, ProtocolError};

pub(super) fn ctrl_loop(core: Weak<Core>, p: Arc<PeerInner>, mut s: TcpStream) {
    let reason = loop {
        let m = match wire::read_ctrl(&mut s) {
            Ok(m) => m,
            Err(e) => break format!("control connection: {e}"),
        };
        match m {
            CtrlMsg::RegionsAdded(v) => {
                let mut t = p.remote.write();
                for r in v {
                    if r.access.offered() {
                        t.upsert(r);
                    }
                }
            }
            CtrlMsg::RegionsSet(v) => {
                let mut t = p.remote.write();
                let old: Vec<RegionId> = t.by_index.values().map(|r| r.id).collect();
                for id in old {
                    if !v.iter().any(|r| r.id == id) {
                        t.remove(id);
                    }
                }
                for r in v {
                    if r.access.offered() {
                        t.upsert(r);
                    }
                }
            }
            CtrlMsg::RegionsRemoved(ids) => {
                {
                    let mut t = p.remote.write();
                    for id in &ids {
                        t.remove(*id);
                    }
                }
                p.transport.regions_removed(&ids);
            }
            CtrlMsg::Notify(tag) => {
                if let Some(c) = core.upgrade() {
                    c.notify.push(Notification { peer: p.id, tag });
                }
            }
            CtrlMsg::Transport {
                bit: ENGINE_MSG_BIT,
                data,
            } => {
                if let Err(e) = on_engine_msg(&core, &p, &data) {
                    break format!("engine control message: {e}");
                }
            }
            CtrlMsg::Transport { bit, data } => {
                let t = std::iter::once(&p.transport)
                    .chain(p.passive.iter())
                    .find(|t| kind_bit(t.kind()) == bit);
                let r = match t {
                    Some(t) => t.on_ctrl(&data),
                    None => Err(ProtocolError::TransportNotInUse { bit }.into()),
                };
                if let Err(e) = r {
                    break format!("transport message: {e}");
                }
            }
            m => break format!("unexpected control message {m:?}"),
        }
    };
    if let Some(c) = core.upgrade() {
        c.kill_peer(p.id, &reason, c.shut.load(Ordering::Acquire));
    }
}

/// An engine control message from peer `p` (fences and their answers).
fn on_engine_msg(core: &Weak<Core>, p: &Arc<PeerInner>, data: &[u8]) -> Result<(), Error> {
    match EngineMsg::decode(data)? {
        // Everything the peer sent before the fence was handled (in order, on this thread):
        // its notification is queued, its region withdrawal took effect.
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
        EngineMsg::FenceAck(FenceKind::Regions, id) => {
            if let Some(c) = core.upgrade() {
                c.fences.acked(id, p.id);
            }
            Ok(())
        }
    }
}

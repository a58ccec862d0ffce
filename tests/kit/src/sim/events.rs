//! The simulator's events and their dispatch to the engines.

use std::sync::Arc;

use kvwire_connector::{BlockId, DEvent, Message, Nanos, PEvent, PeerId, RequestId};

use super::check::Violation;

use super::config::D_PEER;
use super::world::{DPhase, Sim};

#[derive(Debug)]
pub(super) enum Ev {
    Arrival,
    PRecv {
        p: usize,
        life: u32,
        req: u64,
    },
    DRecv {
        req: u64,
    },
    PStepEnd {
        p: usize,
        life: u32,
    },
    PLayerReady {
        p: usize,
        life: u32,
        req: u64,
        layer: u16,
    },
    DStep,
    DStepEnd,
    MsgToD {
        p: usize,
        life: u32,
        bytes: Vec<u8>,
    },
    MsgToP {
        p: usize,
        life: u32,
        bytes: Vec<u8>,
    },
    DataLand(Box<Landing>),
    Settle {
        p: usize,
        life: u32,
        epoch: u32,
        req: u64,
        layer: u16,
        bytes: u64,
        ok: bool,
    },
    DWake {
        at: Nanos,
    },
    PWake {
        p: usize,
        life: u32,
        at: Nanos,
    },
    PCrash {
        p: usize,
    },
    PRestart {
        p: usize,
    },
    DPeerDown {
        p: usize,
        life: u32,
    },
    /// The connection P→D was torn down by one end; the other end notices.
    DLinkDown {
        p: usize,
    },
    PLinkDown {
        p: usize,
        life: u32,
    },
    DAbort {
        req: u64,
    },
}

#[derive(Debug)]
pub(super) struct Landing {
    pub(super) p: usize,
    pub(super) life: u32,
    pub(super) epoch: u32,
    pub(super) req: u64,
    pub(super) layer: u16,
    pub(super) bytes: u64,
    pub(super) src: Arc<[BlockId]>,
    pub(super) dst: Arc<[BlockId]>,
    /// `dst` are landing-pool slots.
    pub(super) landing: bool,
}

impl Sim {
    pub(super) fn traced(&self, req: u64) -> bool {
        self.cfg.trace == Some(RequestId(req))
    }

    pub(super) fn dispatch(&mut self, ev: Ev) {
        if let Some(t) = self.cfg.trace {
            let about = match &ev {
                Ev::PRecv { req, .. }
                | Ev::DRecv { req }
                | Ev::PLayerReady { req, .. }
                | Ev::Settle { req, .. }
                | Ev::DAbort { req } => *req == t.0,
                Ev::DataLand(l) => l.req == t.0,
                Ev::MsgToD { bytes, .. } | Ev::MsgToP { bytes, .. } => {
                    Message::decode(bytes).ok().and_then(|m| m.request()) == Some(t)
                }
                Ev::PCrash { .. } | Ev::PRestart { .. } | Ev::DPeerDown { .. } => true,
                _ => false,
            };
            if about {
                match &ev {
                    Ev::MsgToD { p, life, bytes } => eprintln!(
                        "t={} MsgToD p{p} life{life} {:?}",
                        self.now,
                        Message::decode(bytes)
                    ),
                    Ev::MsgToP { p, life, bytes } => eprintln!(
                        "t={} MsgToP p{p} life{life} {:?}",
                        self.now,
                        Message::decode(bytes)
                    ),
                    Ev::DataLand(l) => eprintln!(
                        "t={} DataLand p{} life{} epoch{} layer{}",
                        self.now, l.p, l.life, l.epoch, l.layer
                    ),
                    other => eprintln!("t={} {other:?}", self.now),
                }
            }
        }
        match ev {
            Ev::Arrival => self.on_arrival(),
            Ev::PRecv { p, life, req } => {
                let e = &mut self.ps[p];
                if e.up && e.life == life {
                    e.queue.push_back(req);
                    self.p_try_step(p);
                }
            }
            Ev::DRecv { req } => self.on_d_recv(req),
            Ev::PStepEnd { p, life } => {
                if self.ps[p].life == life {
                    self.on_p_step_end(p);
                }
            }
            Ev::PLayerReady {
                p,
                life,
                req,
                layer,
            } => {
                if self.ps[p].life == life {
                    let r = self.ps[p].core.handle(
                        PEvent::LayerReady {
                            req: RequestId(req),
                            layer,
                        },
                        self.now,
                    );
                    self.host_result(r.map_err(|e| e.to_string()));
                    self.drain_p(p);
                }
            }
            Ev::DStep => self.on_d_step(),
            Ev::DStepEnd => self.on_d_step_end(),
            Ev::MsgToD { p, life, bytes } => {
                if self.ps[p].life == life {
                    let r = self.d.core.handle_bytes(PeerId(p as u32), &bytes, self.now);
                    self.host_result(r.map_err(|e| e.to_string()));
                    self.drain_d();
                }
            }
            Ev::MsgToP { p, life, bytes } => {
                if self.ps[p].up && self.ps[p].life == life {
                    let r = self.ps[p].core.handle_bytes(D_PEER, &bytes, self.now);
                    self.host_result(r.map_err(|e| e.to_string()));
                    self.drain_p(p);
                }
            }
            Ev::DataLand(l) => self.on_landing(*l),
            Ev::Settle {
                p,
                life,
                epoch,
                req,
                layer,
                bytes,
                ok,
            } => {
                self.pending_transfers -= 1;
                if self.ps[p].life == life {
                    let ev = if ok && self.ps[p].epoch == epoch {
                        PEvent::TransferDone {
                            req: RequestId(req),
                            layer,
                            bytes,
                        }
                    } else {
                        PEvent::TransferFailed {
                            req: RequestId(req),
                            layer,
                        }
                    };
                    let r = self.ps[p].core.handle(ev, self.now);
                    self.host_result(r.map_err(|e| e.to_string()));
                    self.drain_p(p);
                }
            }
            Ev::DWake { at } => {
                if self.d.wake_at == Some(at) {
                    self.d.wake_at = None;
                    self.d.core.handle_timeout(self.now);
                    self.drain_d();
                }
            }
            Ev::PWake { p, life, at } => {
                if self.ps[p].life == life && self.ps[p].wake_at == Some(at) {
                    self.ps[p].wake_at = None;
                    self.ps[p].core.handle_timeout(self.now);
                    self.drain_p(p);
                }
            }
            Ev::PCrash { p } => self.on_p_crash(p),
            Ev::PRestart { p } => self.on_p_restart(p),
            Ev::DPeerDown { p, life } => {
                // The transport noticed the crash of that life (not of a later one).
                if self.ps[p].life == life + 1 || !self.ps[p].up {
                    let _ = self.d.core.handle(
                        DEvent::PeerDown {
                            peer: PeerId(p as u32),
                        },
                        self.now,
                    );
                    self.drain_d();
                }
            }
            Ev::DLinkDown { p } => {
                let _ = self.d.core.handle(
                    DEvent::PeerDown {
                        peer: PeerId(p as u32),
                    },
                    self.now,
                );
                self.drain_d();
            }
            Ev::PLinkDown { p, life } => {
                if self.ps[p].up && self.ps[p].life == life {
                    let _ = self.ps[p]
                        .core
                        .handle(PEvent::PeerDown { peer: D_PEER }, self.now);
                    self.drain_p(p);
                }
            }
            Ev::DAbort { req } => {
                let phase = self.reqs[req as usize].d_phase;
                if phase == DPhase::Live {
                    let r = self.d.core.handle(
                        DEvent::Abort {
                            req: RequestId(req),
                        },
                        self.now,
                    );
                    self.host_result(r.map_err(|e| e.to_string()));
                    self.drain_d();
                }
            }
        }
    }

    pub(super) fn host_result(&mut self, r: Result<(), String>) {
        if let Err(e) = r {
            self.check
                .report(Violation::Host(format!("t={} {e}", self.now)));
        }
    }

    pub(super) fn host_result_at(&mut self, what: &str, r: Result<(), String>) {
        if let Err(e) = r {
            self.check
                .report(Violation::Host(format!("t={} {what}: {e}", self.now)));
        }
    }
}

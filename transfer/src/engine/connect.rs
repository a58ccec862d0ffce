//! Connecting: [`Engine::connect`] (the initiator's side), and the per-peer state both sides
//! build once a handshake succeeded (`Core::make_peer`).

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::control::ctrl_loop;
use super::core::{timeout_err, Core, Engine};
use super::handshake::{initiator_handshake, Handshaken};
use super::peer::{InboundLanes, Peer, PeerInner, PeerSlot, RemoteTable};
use crate::batch::Pending;
use crate::ctrl::{CtrlWriter, OnCtrlDead};
use crate::error::Error;
use crate::metrics::{self};
use crate::net::{refuse, spawn_counted, tune};
use crate::notify::Budget;
use crate::region::RegionGate;
use crate::session::{reject_bytes, seal};
use crate::transport::{CopyMarks, EstablishCtx, NotifyTracker, OnDead, PeerTransport};
use crate::types::PeerId;
use crate::wire::CtrlMsg;

impl Engine {
    /// Connects to a peer engine: handshake (version, mutual secret proof, region descriptors,
    /// transport choice), then data lanes for TCP. Refused with `Error::Fenced` for a fenced
    /// address ([`Engine::fence`]) and `Error::ResourceLimit` beyond `Limits::max_peers`.
    pub fn connect(&self, addr: SocketAddr) -> Result<Peer, Error> {
        let _span = tracing::debug_span!("kvwire.connect", %addr).entered();
        let r = self.connect_inner(addr);
        match &r {
            Ok(p) => tracing::debug!(
                peer = p.id().0,
                transport = metrics::transport_label(p.transport()),
                "connected"
            ),
            Err(e) => {
                self.core().metrics.error(metrics::STAGE_CONNECT, e);
                tracing::debug!(error = %e, "connect failed");
            }
        }
        r
    }

    fn connect_inner(&self, addr: SocketAddr) -> Result<Peer, Error> {
        let core = self.core();
        core.check_open()?;
        if core.fenced.refuses(addr, None) {
            return Err(Error::Fenced { addr });
        }
        let slot = PeerSlot::take(&core.peer_count, core.cfg.limits.max_peers)?;
        let t = core.cfg.connect_timeout;
        let s = TcpStream::connect_timeout(&addr, t).map_err(|e| match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Error::Timeout,
            _ => Error::Io(e),
        })?;
        tune(&s)?;
        let hs = match initiator_handshake(core, &s, addr, slot) {
            Ok(hs) => hs,
            Err(f) => {
                if let Some(b) = f.reject() {
                    refuse(&s, &b);
                }
                return Err(timeout_err(f.into_error()));
            }
        };
        let peer = core.make_peer(s, hs, true)?;
        if let Err(e) = peer.transport.warm_up() {
            core.kill_peer(
                peer.id,
                &format!("setting up the data path failed: {e}"),
                false,
            );
            return Err(timeout_err(e));
        }
        Ok(Peer { inner: peer })
    }
}

impl Core {
    pub(super) fn make_peer(
        self: &Arc<Self>,
        s: TcpStream,
        hs: Handshaken,
        initiator: bool,
    ) -> Result<Arc<PeerInner>, Error> {
        let id = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        let remote_addr = s.peer_addr()?;
        let limits = &self.cfg.limits;
        // Silent this long = dead (the peer's writer sends heartbeats).
        s.set_read_timeout(Some(limits.idle_timeout))?;
        s.set_write_timeout(None)?;
        let ctrl = Arc::new(CtrlWriter::new(limits.ctrl_queue_bytes));
        let obs = self.cfg.metrics.then(|| self.metrics.peer_obs(hs.kind));
        let pending = Arc::new(Pending::with_obs(obs));
        let weak_core = Arc::downgrade(self);
        let on_dead: OnDead = {
            let wc = weak_core.clone();
            Arc::new(move |reason: String| {
                if let Some(c) = wc.upgrade() {
                    c.kill_peer(id, &reason, false);
                }
            })
        };
        let t = self
            .transports
            .iter()
            .find(|t| t.kind() == hs.kind)
            .ok_or_else(|| Error::Unsupported(format!("transport {:?} not available", hs.kind)))?;
        fn blob_of(v: &[(u8, Vec<u8>)], bit: u8) -> Option<&[u8]> {
            v.iter().find(|(k, _)| *k == bit).map(|(_, b)| b.as_slice())
        }
        let copy_tx = self.copy_tx.lock().clone().ok_or(Error::Shutdown)?;
        let marks = Arc::new(CopyMarks::default());
        let ctx = |remote_blob, local_blob, on_dead| EstablishCtx {
            remote_blob,
            local_blob,
            remote_host: &hs.remote_host,
            lane_addr: hs.lane_addr,
            lane_cred: hs.lane_out,
            cfg: &self.cfg,
            ctrl: ctrl.clone(),
            pending: pending.clone(),
            on_dead,
            copy_tx: copy_tx.clone(),
            marks: marks.clone(),
            threads: self.threads.clone(),
        };
        let mut passive: Vec<Arc<dyn PeerTransport>> = Vec::new();
        for other in &self.transports {
            if other.kind() == hs.kind || !other.attach_always() {
                continue;
            }
            let (Some(rb), Some(lb)) = (
                blob_of(&hs.remote_blobs, other.bit()),
                blob_of(&hs.our_blobs.list, other.bit()),
            ) else {
                continue;
            };
            match other.establish(ctx(Some(rb), Some(lb), on_dead.clone())) {
                Ok(p) => passive.push(p),
                Err(e) => {
                    tracing::warn!(kind = ?other.kind(), error = %e, "passive transport setup failed")
                }
            }
        }
        let rb = blob_of(&hs.remote_blobs, t.bit());
        let lb = blob_of(&hs.our_blobs.list, t.bit());
        let transport = t.establish(ctx(rb, lb, on_dead))?;
        let mut table = RemoteTable::new(limits.max_remote_regions);
        table.upsert_many(hs.remote_regions)?;
        let same_host = self.host.same_host(&hs.remote_host);
        let peer = Arc::new(PeerInner {
            id,
            kind: hs.kind,
            remote_addr,
            remote_host: hs.remote_host,
            ctrl,
            ctrl_stream: s,
            remote: RwLock::new(table),
            pending,
            tracker: Arc::new(NotifyTracker::default()),
            transport,
            passive,
            listen_addr: hs.lane_addr,
            lane_in: hs.lane_in,
            lanes_in: Mutex::new(InboundLanes::new(hs.lanes_in)),
            gate: Arc::new(RegionGate::default()),
            notify_budget: Budget::new(limits.peer_notify_bytes),
            slot: Mutex::new(Some(hs.slot)),
            marks,
            dead: AtomicBool::new(false),
            same_host,
            engine: self.id,
        });
        peer.ctrl.attach(peer.ctrl_stream.try_clone()?);
        let reader = peer.ctrl_stream.try_clone()?;
        let mut welcome = hs.welcome;
        {
            let _g = self.reg_lock.lock();
            if self.shut.load(Ordering::Acquire) {
                return Err(Error::Shutdown);
            }
            // Under `reg_lock`: a fence of this address either came first (refused here) or
            // comes after the peer is registered (and closes it).
            if self
                .fenced
                .refuses(peer.listen_addr, Some(&peer.remote_host))
            {
                let e = Error::Fenced {
                    addr: peer.listen_addr,
                };
                refuse(&peer.ctrl_stream, &reject_bytes(&e));
                peer.transport.close();
                for t in &peer.passive {
                    t.close();
                }
                return Err(e);
            }
            self.sessions
                .lock()
                .insert(peer.lane_in.sid, Arc::downgrade(&peer));
            self.peers.lock().insert(id, peer.clone());
            self.fenced.saw(peer.listen_addr, &peer.remote_host);
            // Counted before the handshake's last message goes out (visible to the remote).
            self.metrics.connections[usize::from(!initiator)].fetch_add(1, Ordering::Relaxed);
            let shm = peer.same_host;
            let sent = match welcome.as_mut() {
                // Our region list went out in `Auth` before the peer existed: resend the
                // current one now that updates reach this peer.
                None => peer.ctrl.send(&CtrlMsg::RegionsSet(self.offered_wire(shm))),
                Some(w) => {
                    let m = CtrlMsg::Welcome {
                        regions: self.offered_wire(shm),
                        mac: [0; 32],
                    };
                    let keys = &w.keys;
                    let enc = seal(&mut w.th, &m, |t, b| keys.welcome_mac(t, b));
                    peer.ctrl.write_encoded(&enc)
                }
            };
            if let Err(e) = sent {
                drop(_g);
                self.kill_peer(id, &format!("control send failed: {e}"), false);
                return Err(e);
            }
        }
        let idle = limits.idle_timeout;
        let (wc, p2) = (Arc::downgrade(self), peer.clone());
        let failed: OnCtrlDead = Box::new(move |e: Error| {
            if let Some(c) = wc.upgrade() {
                c.peer_failed(id, &e);
            }
        });
        let spawned = spawn_counted("kvwire-ctrl-tx".into(), &self.threads, move || {
            p2.ctrl.run(idle, failed)
        })
        .and_then(|_| {
            let (wc, p3) = (Arc::downgrade(self), peer.clone());
            spawn_counted("kvwire-ctrl".into(), &self.threads, move || {
                ctrl_loop(wc, p3, reader)
            })
        });
        if let Err(e) = spawned {
            self.kill_peer(id, &format!("cannot start its threads: {e}"), false);
            return Err(e.into());
        }
        tracing::info!(
            peer = id.0,
            transport = metrics::transport_label(hs.kind),
            %remote_addr,
            initiator,
            "peer connected"
        );
        Ok(peer)
    }
}

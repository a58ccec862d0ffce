//! Connecting: [`Engine::connect`] (the initiator's side), and the per-peer state both sides
//! build once a handshake succeeded (`Core::make_peer`).

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use super::control::ctrl_loop;
use super::core::{timeout_err, Core, Engine};
use super::handshake::{initiator_handshake, Handshaken};
use super::peer::{Peer, PeerInner, RemoteTable};
use crate::batch::Pending;
use crate::ctrl::CtrlWriter;
use crate::error::Error;
use crate::metrics::{self};
use crate::transport::{CopyMarks, EstablishCtx, NotifyTracker, OnDead, PeerTransport};
use crate::types::PeerId;
use crate::wire::CtrlMsg;

impl Engine {
    /// Connects to a peer engine: handshake (version, mutual secret proof, region descriptors,
    /// transport choice), then data lanes for TCP.
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
        let t = core.cfg.connect_timeout;
        let mut s = TcpStream::connect_timeout(&addr, t).map_err(|e| match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Error::Timeout,
            _ => Error::Io(e),
        })?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(t))?;
        s.set_write_timeout(Some(t))?;
        let hs = initiator_handshake(core, &mut s, addr).map_err(timeout_err)?;
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
        s.set_read_timeout(None)?;
        s.set_write_timeout(Some(self.cfg.connect_timeout.max(Duration::from_secs(1))))?;
        let ctrl = Arc::new(CtrlWriter::new(s.try_clone()?));
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
        let blob_of = |v: &[(u8, Vec<u8>)], bit: u8| -> Option<Vec<u8>> {
            v.iter().find(|(k, _)| *k == bit).map(|(_, b)| b.clone())
        };
        let copy_tx = self.copy_tx.lock().clone().ok_or(Error::Shutdown)?;
        let marks = Arc::new(CopyMarks::default());
        let mut passive: Vec<Arc<dyn PeerTransport>> = Vec::new();
        for other in &self.transports {
            if other.kind() == hs.kind || !other.attach_always() {
                continue;
            }
            let (Some(rb), Some(lb)) = (
                blob_of(&hs.remote_blobs, other.bit()),
                blob_of(&hs.our_blobs, other.bit()),
            ) else {
                continue;
            };
            match other.establish(EstablishCtx {
                remote_blob: Some(&rb),
                local_blob: Some(&lb),
                remote_host: &hs.remote_host,
                lane_addr: hs.lane_addr,
                remote_token: hs.remote_token,
                cfg: &self.cfg,
                ctrl: ctrl.clone(),
                pending: pending.clone(),
                on_dead: on_dead.clone(),
                copy_tx: copy_tx.clone(),
                marks: marks.clone(),
            }) {
                Ok(p) => passive.push(p),
                Err(e) => {
                    tracing::warn!(kind = ?other.kind(), error = %e, "passive transport setup failed")
                }
            }
        }
        let rb = blob_of(&hs.remote_blobs, t.bit());
        let lb = blob_of(&hs.our_blobs, t.bit());
        let transport = t.establish(EstablishCtx {
            remote_blob: rb.as_deref(),
            local_blob: lb.as_deref(),
            remote_host: &hs.remote_host,
            lane_addr: hs.lane_addr,
            remote_token: hs.remote_token,
            cfg: &self.cfg,
            ctrl: ctrl.clone(),
            pending: pending.clone(),
            on_dead,
            copy_tx,
            marks: marks.clone(),
        })?;
        let mut table = RemoteTable::default();
        for r in hs.remote_regions {
            if r.access.offered() {
                table.upsert(r);
            }
        }
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
            our_token: hs.our_token,
            inbound_lanes: Mutex::new(Vec::new()),
            marks,
            dead: AtomicBool::new(false),
            same_host,
            engine: self.id,
        });
        {
            let _g = self.reg_lock.lock();
            if self.shut.load(Ordering::Acquire) {
                return Err(Error::Shutdown);
            }
            self.tokens
                .lock()
                .insert(hs.our_token, Arc::downgrade(&peer));
            self.peers.lock().insert(id, peer.clone());
            // Counted before the handshake's last message goes out (visible to the remote).
            self.metrics.connections[usize::from(!initiator)].fetch_add(1, Ordering::Relaxed);
            let shm = peer.same_host;
            let msg = if initiator {
                // Our region list went out in `Auth` before the peer existed: resend the current
                // one now that updates reach this peer.
                Some(CtrlMsg::RegionsSet(self.offered_wire(shm)))
            } else {
                Some(CtrlMsg::Welcome {
                    regions: self.offered_wire(shm),
                })
            };
            if let Some(m) = msg {
                if let Err(e) = peer.ctrl.send(&m) {
                    drop(_g);
                    self.kill_peer(id, &format!("control send failed: {e}"), false);
                    return Err(e);
                }
            }
        }
        let reader = peer.ctrl_stream.try_clone()?;
        let (wc, p2) = (Arc::downgrade(self), peer.clone());
        std::thread::Builder::new()
            .name("kvwire-ctrl".into())
            .spawn(move || ctrl_loop(wc, p2, reader))?;
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

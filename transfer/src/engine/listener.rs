//! The listener: accepted connections become peers (handshake) or data lanes of a peer.

use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::core::{timeout_err, Core};
use super::handshake::{responder_handshake, send_reject};
use crate::error::Error;
use crate::metrics::{self};
use crate::transport::tcp::serve_lane;
use crate::transport::TargetCtx;
use crate::wire::{self, CtrlMsg, ProtocolError, Stage};

/// Concurrent handshakes accepted at once (beyond this, new connections are closed).
const MAX_HANDSHAKES: usize = 64;

// ---------------------------------------------------------------- threads

pub(super) fn accept_loop(core: Arc<Core>) {
    loop {
        let r = core.listener.accept();
        if core.shut.load(Ordering::Acquire) {
            return;
        }
        match r {
            Ok((s, addr)) => {
                if core.handshakes.load(Ordering::Acquire) >= MAX_HANDSHAKES {
                    tracing::warn!(%addr, "too many concurrent handshakes; closing connection");
                    continue;
                }
                core.handshakes.fetch_add(1, Ordering::AcqRel);
                let c = core.clone();
                let spawned = std::thread::Builder::new()
                    .name("kvwire-conn".into())
                    .spawn(move || handle_conn(c, s, addr));
                if let Err(e) = spawned {
                    core.handshakes.fetch_sub(1, Ordering::AcqRel);
                    tracing::warn!(error = %e, "cannot spawn connection thread");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn handle_conn(core: Arc<Core>, mut s: TcpStream, addr: SocketAddr) {
    let first = (|| -> Result<CtrlMsg, Error> {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(core.cfg.connect_timeout))?;
        s.set_write_timeout(Some(core.cfg.connect_timeout))?;
        wire::read_ctrl(&mut s)
    })();
    let r = match first {
        Err(e) => Err(e),
        Ok(m @ CtrlMsg::Hello { .. }) => match responder_handshake(&core, &mut s, m) {
            Ok(hs) => {
                core.handshakes.fetch_sub(1, Ordering::AcqRel);
                if let Err(e) = core.make_peer(s, hs, false) {
                    tracing::warn!(%addr, error = %e, "peer setup failed");
                }
                return;
            }
            Err(e) => Err(e),
        },
        Ok(CtrlMsg::LaneJoin { token, lane }) => {
            let peer = core.tokens.lock().get(&token).and_then(|w| w.upgrade());
            match peer {
                Some(p) => Ok((p, lane)),
                None => Err(Error::AuthFailed),
            }
        }
        Ok(m) => Err(ProtocolError::Unexpected {
            stage: Stage::FirstMessage,
            got: Some(Box::new(m)),
        }
        .into()),
    };
    core.handshakes.fetch_sub(1, Ordering::AcqRel);
    match r {
        Ok((p, lane)) => {
            let setup = (|| -> Result<TcpStream, Error> {
                s.write_all(&CtrlMsg::LaneOk.encode())?;
                s.set_read_timeout(None)?;
                s.set_write_timeout(None)?;
                Ok(s.try_clone()?)
            })();
            match setup {
                Ok(c) => {
                    p.inbound_lanes.lock().push(c);
                    if p.dead.load(Ordering::Acquire) {
                        return;
                    }
                    tracing::debug!(peer = ?p.id, lane, "lane accepted");
                    let ctx = TargetCtx {
                        regions: core.regions.clone(),
                        notify: core.notify.clone(),
                        peer: p.id,
                        tracker: p.tracker.clone(),
                        marks: p.marks.clone(),
                    };
                    drop(p);
                    drop(core);
                    serve_lane(s, ctx);
                }
                Err(e) => tracing::warn!(%addr, error = %e, "lane setup failed"),
            }
        }
        Err(e) => {
            tracing::warn!(%addr, error = %e, "connection refused");
            let e = timeout_err(e);
            core.metrics.error(metrics::STAGE_CONNECT, &e);
            if !matches!(e, Error::Io(_)) {
                send_reject(&mut s, &e);
            }
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

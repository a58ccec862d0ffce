//! The handshake: the transports each side allows and chooses, the mutual secret proof, the
//! exchange of region tables and transport blobs ([`initiator_handshake`],
//! [`responder_handshake`]).

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use super::core::Core;
use crate::auth;
use crate::error::Error;
use crate::transport::Transport;
use crate::types::TransportKind;
use crate::wire::{
    self, CtrlMsg, HostIdentity, ProtocolError, Stage, WireRegion, TRANSPORT_RDMA, TRANSPORT_SHM,
    TRANSPORT_TCP,
};

pub(super) struct Handshaken {
    pub(super) kind: TransportKind,
    pub(super) remote_host: HostIdentity,
    pub(super) remote_regions: Vec<WireRegion>,
    pub(super) remote_token: [u8; 16],
    pub(super) our_token: [u8; 16],
    pub(super) lane_addr: SocketAddr,
    pub(super) remote_blobs: Vec<(u8, Vec<u8>)>,
    pub(super) our_blobs: Vec<(u8, Vec<u8>)>,
}

impl Core {
    /// Our handshake blobs for the transports we allow and the peer accepts (`theirs`).
    pub(super) fn hello_blobs(&self, theirs: u8) -> Vec<(u8, Vec<u8>)> {
        let allowed = allowed_transports(self) & theirs;
        self.transports
            .iter()
            .filter(|t| t.bit() & allowed != 0)
            .filter_map(|t| t.hello_blob().map(|b| (t.bit(), b)))
            .collect()
    }
}

pub(super) fn allowed_transports(core: &Core) -> u8 {
    let rdma = if core.has_rdma() { TRANSPORT_RDMA } else { 0 };
    match core.cfg.transport {
        TransportKind::Tcp => TRANSPORT_TCP,
        TransportKind::Shm => TRANSPORT_SHM,
        TransportKind::Rdma => rdma,
        TransportKind::Auto => TRANSPORT_TCP | TRANSPORT_SHM | rdma,
    }
}

pub(super) fn kind_bit(k: TransportKind) -> u8 {
    match k {
        TransportKind::Shm => TRANSPORT_SHM,
        TransportKind::Rdma => TRANSPORT_RDMA,
        TransportKind::Tcp | TransportKind::Auto => TRANSPORT_TCP,
    }
}

/// This side's transport towards a peer: shm when both allow it and the peer's memory is
/// reachable (same host, probe read succeeds), else tcp when both allow it.
fn choose_transport(
    core: &Core,
    theirs: u8,
    rhost: &HostIdentity,
    rblobs: &[(u8, Vec<u8>)],
) -> Result<TransportKind, Error> {
    let ours = allowed_transports(core);
    let both = ours & theirs;
    // Shared memory before RDMA on one host, unless `EngineConfig::prefer_rdma`.
    let mut order: Vec<&dyn Transport> = core.transports.iter().map(|t| t.as_ref()).collect();
    if core.cfg.prefer_rdma.unwrap_or(false) {
        order.sort_by_key(|t| t.kind() != TransportKind::Rdma);
    }
    for t in order {
        if both & t.bit() == 0 || t.kind() == TransportKind::Tcp {
            continue;
        }
        let blob = rblobs
            .iter()
            .find(|(k, _)| *k == t.bit())
            .map(|(_, b)| b.as_slice());
        if t.usable_with(rhost, blob) {
            return Ok(t.kind());
        }
    }
    if both & TRANSPORT_TCP != 0 {
        return Ok(TransportKind::Tcp);
    }
    Err(Error::Unsupported(format!(
        "no usable common transport (ours {ours:#x}, theirs {theirs:#x}, same host: {})",
        core.host.same_host(rhost)
    )))
}

pub(super) fn send_reject(s: &mut TcpStream, e: &Error) {
    let _ = s.write_all(
        &CtrlMsg::Reject {
            error: wire::encode_error(e),
        }
        .encode(),
    );
}

pub(super) fn initiator_handshake(
    core: &Arc<Core>,
    s: &mut TcpStream,
    addr: SocketAddr,
) -> Result<Handshaken, Error> {
    let nonce_i: [u8; 32] = auth::random();
    let secret = core.cfg.secret.as_deref();
    let our_blobs = core.hello_blobs(u8::MAX);
    s.write_all(
        &CtrlMsg::Hello {
            nonce: nonce_i,
            auth: secret.is_some(),
            host: core.host.clone(),
            listen_port: core.listen_addr.port(),
            transports: allowed_transports(core),
            blobs: our_blobs.clone(),
        }
        .encode(),
    )?;
    let (nonce_r, mac_r, auth_required, rhost, rtransports, rtoken, rblobs) =
        match wire::read_ctrl(s)? {
            CtrlMsg::HelloReply {
                nonce,
                mac,
                auth_required,
                host,
                transports,
                token,
                blobs,
            } => (nonce, mac, auth_required, host, transports, token, blobs),
            CtrlMsg::Reject { error } => return Err(wire::decode_error(&error, true)?),
            m => {
                return Err(ProtocolError::Unexpected {
                    stage: Stage::HelloReply,
                    got: Some(Box::new(m)),
                }
                .into())
            }
        };
    // Mutual proof: the responder must prove the secret when we hold one; we must prove it when
    // the responder requires it.
    let mac_i = match secret {
        Some(k) => {
            if !auth::verify_responder(k, &nonce_i, &nonce_r, &mac_r) {
                send_reject(s, &Error::AuthFailed);
                return Err(Error::AuthFailed);
            }
            auth::initiator_proof(k, &nonce_i, &nonce_r)
        }
        None => {
            if auth_required {
                send_reject(s, &Error::AuthFailed);
                return Err(Error::AuthFailed);
            }
            Vec::new()
        }
    };
    let kind = match choose_transport(core, rtransports, &rhost, &rblobs) {
        Ok(k) => k,
        Err(e) => {
            send_reject(s, &e);
            return Err(e);
        }
    };
    let same = core.host.same_host(&rhost);
    let our_token: [u8; 16] = auth::random();
    s.write_all(
        &CtrlMsg::Auth {
            mac: mac_i,
            transport: kind_bit(kind),
            token: our_token,
            regions: core.offered_wire(same),
        }
        .encode(),
    )?;
    let regions = match wire::read_ctrl(s)? {
        CtrlMsg::Welcome { regions } => regions,
        CtrlMsg::Reject { error } => return Err(wire::decode_error(&error, true)?),
        m => {
            return Err(ProtocolError::Unexpected {
                stage: Stage::Welcome,
                got: Some(Box::new(m)),
            }
            .into())
        }
    };
    Ok(Handshaken {
        kind,
        remote_host: rhost,
        remote_regions: regions,
        remote_token: rtoken,
        our_token,
        lane_addr: addr,
        remote_blobs: rblobs,
        our_blobs,
    })
}

pub(super) fn responder_handshake(
    core: &Arc<Core>,
    s: &mut TcpStream,
    hello: CtrlMsg,
) -> Result<Handshaken, Error> {
    let CtrlMsg::Hello {
        nonce: nonce_i,
        auth: _,
        host: ihost,
        listen_port,
        transports: itransports,
        blobs: iblobs,
    } = hello
    else {
        return Err(ProtocolError::Unexpected {
            stage: Stage::Hello,
            got: None,
        }
        .into());
    };
    let secret = core.cfg.secret.as_deref();
    let nonce_r: [u8; 32] = auth::random();
    let our_token: [u8; 16] = auth::random();
    let our_blobs = core.hello_blobs(itransports);
    let ours = allowed_transports(core);
    if ours & itransports == 0 {
        let e = Error::Unsupported(format!(
            "no common transport (ours {ours:#x}, theirs {itransports:#x})"
        ));
        send_reject(s, &e);
        return Err(e);
    }
    s.write_all(
        &CtrlMsg::HelloReply {
            nonce: nonce_r,
            mac: secret
                .map(|k| auth::responder_proof(k, &nonce_i, &nonce_r))
                .unwrap_or_default(),
            auth_required: secret.is_some(),
            host: core.host.clone(),
            transports: ours,
            token: our_token,
            blobs: our_blobs.clone(),
        }
        .encode(),
    )?;
    let (mac_i, transport, rtoken, regions) = match wire::read_ctrl(s)? {
        CtrlMsg::Auth {
            mac,
            transport,
            token,
            regions,
        } => (mac, transport, token, regions),
        CtrlMsg::Reject { error } => return Err(wire::decode_error(&error, true)?),
        m => {
            return Err(ProtocolError::Unexpected {
                stage: Stage::Auth,
                got: Some(Box::new(m)),
            }
            .into())
        }
    };
    if let Some(k) = secret {
        if !auth::verify_initiator(k, &nonce_i, &nonce_r, &mac_i) {
            send_reject(s, &Error::AuthFailed);
            return Err(Error::AuthFailed);
        }
    }
    // The initiator's choice is for its direction; ours is made the same way for ours.
    if transport == TRANSPORT_SHM && !core.host.same_host(&ihost) {
        let e = Error::from(ProtocolError::ShmAcrossHosts);
        send_reject(s, &e);
        return Err(e);
    }
    let kind = match choose_transport(core, itransports, &ihost, &iblobs) {
        Ok(k) => k,
        Err(e) => {
            send_reject(s, &e);
            return Err(e);
        }
    };
    let peer_ip = s.peer_addr()?.ip();
    Ok(Handshaken {
        kind,
        remote_host: ihost,
        remote_regions: regions,
        remote_token: rtoken,
        our_token,
        lane_addr: SocketAddr::new(peer_ip, listen_port),
        remote_blobs: iblobs,
        our_blobs,
    })
}

//! The handshake (protocol version 6): the transports each side allows and chooses, and the
//! engine's side of the six messages ([`initiator_handshake`], [`responder_handshake`]; the
//! exchange up to the initiator's proof is in `session`, the keys in `auth`).
//!
//! 1. I→R `Hello` (nonce, "I hold a secret", X25519 key share);
//! 2. R→I `Challenge` (nonce, "a secret is required", key share): nothing else before 3;
//! 3. I→R `Proof`: the initiator proves the secret over the transcript. Both or neither: an
//!    initiator with a secret refuses a responder without one before proving anything, a
//!    responder with one refuses an initiator without one after `Hello`;
//! 4. R→I `Accept` (host, transports, lanes, blobs), MAC'd: the responder proves the secret
//!    too, and only now tells anything about its host, or creates RDMA queue pairs;
//! 5. I→R `Auth` (host, listen port, transports, lanes, blobs, regions), MAC'd;
//! 6. R→I `Welcome` (regions), MAC'd, sent when the peer joins the engine.
//!
//! Every MAC covers the transcript, so nothing of the exchange can be replaced on the way. The
//! lane credentials of both directions derive from the session key; a peer's lanes join with a
//! proof of them (`session::join_lane`), never with a value sent in the clear.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::core::Core;
use super::peer::PeerSlot;
use crate::auth::{self, KeyShare, Keys, LaneCred, Transcript};
use crate::error::Error;
use crate::gate::{Slot, STAGE_AWAITING_PROOF, STAGE_PROTECTED};
use crate::limits::Resource;
use crate::net::DeadlineIo;
use crate::session::{self, Fail, Proved, Responder};
use crate::transport::Transport;
use crate::types::TransportKind;
use crate::wire::{
    self, body, kind, CtrlMsg, Expect, HostIdentity, Stage, WireRegion, TRANSPORT_CUDA_IPC,
    TRANSPORT_RDMA, TRANSPORT_SHM, TRANSPORT_TCP,
};

pub(super) struct Handshaken {
    pub(super) kind: TransportKind,
    pub(super) remote_host: HostIdentity,
    pub(super) remote_regions: Vec<WireRegion>,
    /// The peer engine's listen address (where our lanes go; what a fence names).
    pub(super) lane_addr: SocketAddr,
    pub(super) remote_blobs: Vec<(u8, Vec<u8>)>,
    pub(super) our_blobs: OurBlobs,
    /// Credentials of the lanes the peer opens into us, and of ours into it.
    pub(super) lane_in: LaneCred,
    pub(super) lane_out: LaneCred,
    /// Lanes the peer may open into us.
    pub(super) lanes_in: u16,
    pub(super) slot: PeerSlot,
    pub(super) welcome: Option<WelcomeSeal>,
}

/// Our handshake blobs, and the transport state each names (RDMA: queue pairs prepared for the
/// peer). What `establish` did not claim is released when these are dropped: a handshake refused
/// midway (a fenced peer, a failed proof, a timeout) holds nothing until expiry, so a peer that
/// reconnects in a loop cannot use up the prepared sets.
pub(super) struct OurBlobs {
    core: Arc<Core>,
    pub(super) list: Vec<(u8, Vec<u8>)>,
}

impl Drop for OurBlobs {
    fn drop(&mut self) {
        for (bit, blob) in &self.list {
            if let Some(t) = self.core.transports.iter().find(|t| t.bit() == *bit) {
                t.discard_blob(blob);
            }
        }
    }
}

impl Core {
    /// Our handshake blobs for the transports we allow and the peer accepts (`theirs`).
    pub(super) fn hello_blobs(self: &Arc<Self>, theirs: u8) -> OurBlobs {
        let allowed = allowed_transports(self) & theirs;
        let list = self
            .transports
            .iter()
            .filter(|t| t.bit() & allowed != 0)
            .filter_map(|t| t.hello_blob().map(|b| (t.bit(), b)))
            .collect();
        OurBlobs {
            core: self.clone(),
            list,
        }
    }
}

pub(super) fn allowed_transports(core: &Core) -> u8 {
    let rdma = if core.has_rdma() { TRANSPORT_RDMA } else { 0 };
    let cuda = if core.has_cuda_ipc() {
        TRANSPORT_CUDA_IPC
    } else {
        0
    };
    match core.cfg.transport {
        TransportKind::Tcp => TRANSPORT_TCP,
        TransportKind::Shm => TRANSPORT_SHM,
        TransportKind::Rdma => rdma,
        TransportKind::CudaIpc => cuda,
        TransportKind::Auto => TRANSPORT_TCP | TRANSPORT_SHM | rdma | cuda,
    }
}

pub(super) fn kind_bit(k: TransportKind) -> u8 {
    match k {
        TransportKind::Shm => TRANSPORT_SHM,
        TransportKind::Rdma => TRANSPORT_RDMA,
        TransportKind::CudaIpc => TRANSPORT_CUDA_IPC,
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
        if t.kind() == TransportKind::CudaIpc
            && core.cfg.transport == TransportKind::Auto
            && !core.has_device_region()
        {
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

/// The responder's `Welcome` still to be sealed (in `make_peer`, with the region list of the
/// moment the peer joins the engine).
pub(super) struct WelcomeSeal {
    pub(super) keys: Keys,
    pub(super) th: Transcript,
}

/// The largest region list a peer may send (`Limits::max_remote_regions`).
pub(super) fn regions_cap(core: &Core) -> u32 {
    body::regions(core.cfg.limits.max_remote_regions as u32)
}

/// Inbound lanes a peer announcing `lanes` may open here; `Err` beyond our bound.
fn lanes_allowed(core: &Core, lanes: u16) -> Result<u16, Fail> {
    let max = core.cfg.limits.max_peer_lanes;
    if usize::from(lanes) > max {
        return Err(Fail::Answer(Error::ResourceLimit {
            resource: Resource::Lanes,
            limit: max as u64,
        }));
    }
    Ok(lanes)
}

/// The initiator's handshake over `s` (to the engine listening at `addr`), within
/// `connect_timeout` as a whole.
pub(super) fn initiator_handshake(
    core: &Arc<Core>,
    s: &TcpStream,
    addr: SocketAddr,
    slot: PeerSlot,
) -> Result<Handshaken, Fail> {
    let mut io = DeadlineIo::new(s, Instant::now() + core.cfg.connect_timeout);
    let secret = core.cfg.secret.as_deref();
    let share = KeyShare::random();
    let Proved { keys, mut th } = session::initiate(&mut io, secret, &share, auth::random())?;
    let expect = Expect {
        stage: Stage::Accept,
        kinds: &[(kind::ACCEPT, body::HANDSHAKE)],
    };
    let (m, raw) = wire::read_ctrl_limited(&mut io, expect)?;
    let (rhost, rtransports, rlanes, rblobs) = match m {
        CtrlMsg::Accept {
            host,
            transports,
            lanes,
            blobs,
            ..
        } => (host, transports, lanes, blobs),
        CtrlMsg::Reject { error } => return Err(Fail::Quiet(rejected(&error))),
        _ => unreachable!("read_ctrl_limited returns only expected kinds"),
    };
    if !session::check_mac(&mut th, &raw, |t, b| keys.accept_mac(t, b)) {
        return Err(Fail::Answer(Error::AuthFailed));
    }
    let lanes_in = lanes_allowed(core, rlanes)?;
    let kind = choose_transport(core, rtransports, &rhost, &rblobs).map_err(Fail::Answer)?;
    let our_blobs = core.hello_blobs(rtransports);
    let same = core.host.same_host(&rhost);
    let auth_msg = CtrlMsg::Auth {
        host: core.host.clone(),
        listen_port: core.listen_addr.port(),
        transports: allowed_transports(core),
        lanes: core.cfg.lanes as u16,
        blobs: our_blobs.list.clone(),
        regions: core.offered_wire(same),
        mac: [0; 32],
    };
    let enc = session::seal(&mut th, &auth_msg, |t, b| keys.auth_mac(t, b));
    io.write_all(&enc)?;
    let th5 = th.hash();
    let expect = Expect {
        stage: Stage::Welcome,
        kinds: &[(kind::WELCOME, regions_cap(core) + 32)],
    };
    let (m, raw) = wire::read_ctrl_limited(&mut io, expect)?;
    let regions = match m {
        CtrlMsg::Welcome { regions, .. } => regions,
        CtrlMsg::Reject { error } => return Err(Fail::Quiet(rejected(&error))),
        _ => unreachable!("read_ctrl_limited returns only expected kinds"),
    };
    if !session::check_mac(&mut th, &raw, |t, b| keys.welcome_mac(t, b)) {
        return Err(Fail::Answer(Error::AuthFailed));
    }
    let sess = keys.session(&th5);
    Ok(Handshaken {
        kind,
        remote_host: rhost,
        remote_regions: regions,
        lane_addr: addr,
        remote_blobs: rblobs,
        our_blobs,
        lane_in: sess.r_to_i,
        lane_out: sess.i_to_r,
        lanes_in,
        slot,
        welcome: None,
    })
}

/// The error a `Reject` of the peer carries.
fn rejected(error: &[u8]) -> Error {
    match wire::decode_error(error, true) {
        Ok(e) | Err(e) => e,
    }
}

/// The responder's handshake once `Hello` (`raw` as received) was read from `s` (peer address
/// `ip`), over `io` (the exchange's deadline), marking its progress in `slot`.
pub(super) fn responder_handshake(
    core: &Arc<Core>,
    s: &TcpStream,
    io: &mut DeadlineIo<'_>,
    slot: &Slot,
    hello: &CtrlMsg,
    raw: &[u8],
) -> Result<Handshaken, Fail> {
    let share = KeyShare::random();
    let r = Responder {
        psk: core.cfg.secret.as_deref(),
        share: &share,
        nonce_r: auth::random(),
    };
    let Proved { keys, mut th } =
        session::respond(io, &r, hello, raw, || slot.set(STAGE_AWAITING_PROOF))?;
    slot.set(STAGE_PROTECTED);
    let peer_slot = PeerSlot::take(&core.peer_count, core.cfg.limits.max_peers).map_err(|e| {
        core.metrics
            .security
            .peers_refused
            .fetch_add(1, Ordering::Relaxed);
        Fail::Answer(e)
    })?;
    // Only now, for a peer that proved the secret: host details, transport blobs (RDMA queue
    // pairs are created here).
    let our_blobs = core.hello_blobs(u8::MAX);
    let accept = CtrlMsg::Accept {
        host: core.host.clone(),
        transports: allowed_transports(core),
        lanes: core.cfg.lanes as u16,
        blobs: our_blobs.list.clone(),
        mac: [0; 32],
    };
    let enc = session::seal(&mut th, &accept, |t, b| keys.accept_mac(t, b));
    io.write_all(&enc)?;
    let expect = Expect {
        stage: Stage::Auth,
        kinds: &[(kind::AUTH, body::HANDSHAKE + regions_cap(core))],
    };
    let (m, raw) = wire::read_ctrl_limited(io, expect)?;
    let (ihost, listen_port, itransports, ilanes, iblobs, regions) = match m {
        CtrlMsg::Auth {
            host,
            listen_port,
            transports,
            lanes,
            blobs,
            regions,
            ..
        } => (host, listen_port, transports, lanes, blobs, regions),
        CtrlMsg::Reject { error } => return Err(Fail::Quiet(rejected(&error))),
        _ => unreachable!("read_ctrl_limited returns only expected kinds"),
    };
    if !session::check_mac(&mut th, &raw, |t, b| keys.auth_mac(t, b)) {
        return Err(Fail::Answer(Error::AuthFailed));
    }
    let lanes_in = lanes_allowed(core, ilanes)?;
    let lane_addr = SocketAddr::new(s.peer_addr()?.ip(), listen_port);
    if core.fenced.refuses(lane_addr, Some(&ihost)) {
        return Err(Fail::Answer(Error::Fenced { addr: lane_addr }));
    }
    let kind = choose_transport(core, itransports, &ihost, &iblobs).map_err(Fail::Answer)?;
    let sess = keys.session(&th.hash());
    Ok(Handshaken {
        kind,
        remote_host: ihost,
        remote_regions: regions,
        lane_addr,
        remote_blobs: iblobs,
        our_blobs,
        lane_in: sess.i_to_r,
        lane_out: sess.r_to_i,
        lanes_in,
        slot: peer_slot,
        welcome: Some(WelcomeSeal { keys, th }),
    })
}

//! A hand-written tcp peer: the handshake (protocol 4) and the data-lane frames written and read
//! by hand. The key schedule is the engine's (`kvwire_transfer::auth`, hidden); every message,
//! its order and its checks are spelled out here.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use kvwire_transfer::auth::{self, KeyShare, Keys, LaneCred, LaneRole, Transcript};
use kvwire_transfer::wire::{
    self, CtrlMsg, FrameHeader, FrameKind, HostIdentity, WireRegion, FRAME_HEADER_LEN,
};
use kvwire_transfer::{Error, RegionId};

/// The `Hello` of an initiator with nonce `[nonce; 32]` and key share `share`, saying whether
/// it holds a secret.
pub fn hello(nonce: u8, auth: bool, share: &KeyShare) -> CtrlMsg {
    CtrlMsg::Hello {
        nonce: [nonce; 32],
        auth,
        dh: share.public,
    }
}

/// Reads one control message, skipping heartbeats (an engine message with op 4).
pub fn read_msg(s: &mut impl Read) -> Result<(CtrlMsg, Vec<u8>), Error> {
    loop {
        let (m, raw) = wire::read_ctrl_limited(s, wire::ANY)?;
        match &m {
            CtrlMsg::Transport { bit: 0x80, data } if data.first() == Some(&4) => continue,
            _ => return Ok((m, raw)),
        }
    }
}

/// Writes `m` with its MAC (the last 32 bytes) computed by `mac` over the transcript and the
/// message before the MAC; adds it to the transcript.
pub fn sealed(
    th: &mut Transcript,
    m: &CtrlMsg,
    mac: impl Fn(&[u8; 32], &[u8]) -> [u8; 32],
) -> Vec<u8> {
    let mut enc = m.encode();
    let n = enc.len() - 32;
    let tag = mac(&th.hash(), &enc[..n]);
    enc[n..].copy_from_slice(&tag);
    th.add(&enc);
    enc
}

/// Whether the MAC at the end of `raw` is right; adds it to the transcript.
pub fn verify(th: &mut Transcript, raw: &[u8], mac: impl Fn(&[u8; 32], &[u8]) -> [u8; 32]) -> bool {
    let n = raw.len() - 32;
    let ok = mac(&th.hash(), &raw[..n])[..] == raw[n..];
    th.add(raw);
    ok
}

/// An authenticated hand-written session.
pub struct Raw {
    /// The control connection.
    pub ctrl: TcpStream,
    /// The credentials of lanes into the responder.
    pub cred: LaneCred,
    /// The credentials of lanes the responder opens back.
    pub back: LaneCred,
    /// The responder's regions (from `Welcome`).
    pub regions: Vec<WireRegion>,
    /// The responder's `Accept` as received.
    pub accept: CtrlMsg,
}

/// The whole handshake by hand on `c` (a tcp-only peer on another host announcing `lanes`
/// lanes, listen port 1, no regions), with secret `secret`.
pub fn handshake(mut c: TcpStream, secret: Option<&[u8]>, lanes: u16) -> Result<Raw, Error> {
    let share = KeyShare::random();
    let nonce_i: [u8; 32] = auth::random();
    let mut th = Transcript::default();
    let h = CtrlMsg::Hello {
        nonce: nonce_i,
        auth: secret.is_some(),
        dh: share.public,
    }
    .encode();
    c.write_all(&h)?;
    th.add(&h);
    let (m, raw) = read_msg(&mut c)?;
    let (nonce_r, dh_r) = match m {
        CtrlMsg::Challenge { nonce, dh, .. } => (nonce, dh),
        CtrlMsg::Reject { error } => return Err(wire::decode_error(&error, true)?),
        m => panic!("expected Challenge, got {m:?}"),
    };
    th.add(&raw);
    let dh = share.agree(&dh_r).expect("contributory");
    let keys = Keys::derive(secret.unwrap_or_default(), &nonce_i, &nonce_r, &dh);
    let p = CtrlMsg::Proof {
        mac: keys.proof(&th.hash()),
    }
    .encode();
    c.write_all(&p)?;
    th.add(&p);
    let (accept, raw) = read_msg(&mut c)?;
    match &accept {
        CtrlMsg::Accept { .. } => {}
        CtrlMsg::Reject { error } => return Err(wire::decode_error(error, true)?),
        m => panic!("expected Accept, got {m:?}"),
    }
    assert!(
        verify(&mut th, &raw, |t, b| keys.accept_mac(t, b)),
        "the responder's MAC"
    );
    let auth_msg = CtrlMsg::Auth {
        host: HostIdentity::default(),
        listen_port: 1,
        transports: wire::TRANSPORT_TCP,
        lanes,
        blobs: vec![],
        regions: vec![],
        mac: [0; 32],
    };
    let enc = sealed(&mut th, &auth_msg, |t, b| keys.auth_mac(t, b));
    c.write_all(&enc)?;
    let th5 = th.hash();
    let (m, raw) = read_msg(&mut c)?;
    let regions = match m {
        CtrlMsg::Welcome { regions, .. } => regions,
        CtrlMsg::Reject { error } => return Err(wire::decode_error(&error, true)?),
        m => panic!("expected Welcome, got {m:?}"),
    };
    assert!(
        verify(&mut th, &raw, |t, b| keys.welcome_mac(t, b)),
        "the Welcome's MAC"
    );
    let s = keys.session(&th5);
    Ok(Raw {
        ctrl: c,
        cred: s.i_to_r,
        back: s.r_to_i,
        regions,
        accept,
    })
}

/// Joins lane `lane` on `s` with `cred`: `LaneJoin`, the listener's proof checked,
/// `LaneProof`, `LaneOk` (or the `Reject`'s error).
pub fn join(s: &mut TcpStream, cred: &LaneCred, lane: u16) -> Result<(), Error> {
    let nonce_j: [u8; 32] = auth::random();
    s.write_all(
        &CtrlMsg::LaneJoin {
            sid: cred.sid,
            lane,
            nonce: nonce_j,
        }
        .encode(),
    )?;
    let (nonce_l, mac) = match read_msg(s)?.0 {
        CtrlMsg::LaneChallenge { nonce, mac } => (nonce, mac),
        CtrlMsg::Reject { error } => return Err(wire::decode_error(&error, true)?),
        m => panic!("expected LaneChallenge, got {m:?}"),
    };
    assert_eq!(
        auth::lane_mac(cred, LaneRole::Listener, lane, &nonce_j, &nonce_l),
        mac,
        "the listener's lane proof"
    );
    s.write_all(
        &CtrlMsg::LaneProof {
            mac: auth::lane_mac(cred, LaneRole::Joiner, lane, &nonce_j, &nonce_l),
        }
        .encode(),
    )?;
    match read_msg(s)?.0 {
        CtrlMsg::LaneOk => Ok(()),
        CtrlMsg::Reject { error } => Err(wire::decode_error(&error, true)?),
        m => panic!("expected LaneOk, got {m:?}"),
    }
}

/// Handshake by hand (a peer on another host: no shm, no fence, no secret), over streams
/// opened with `connect`; returns the control stream and a joined data lane.
pub fn raw_session(
    addr: SocketAddr,
    connect: impl Fn(SocketAddr) -> TcpStream,
) -> (TcpStream, TcpStream) {
    let r = handshake(connect(addr), None, 1).expect("handshake");
    let mut lane = connect(addr);
    join(&mut lane, &r.cred, 0).expect("lane join");
    (r.ctrl, lane)
}

/// The header of a write frame of `len` payload bytes into `region` at `offset`.
pub fn write_header(
    region: RegionId,
    offset: u64,
    len: usize,
    batch: u64,
) -> [u8; FRAME_HEADER_LEN] {
    FrameHeader {
        kind: FrameKind::Write,
        flags: 0,
        batch,
        region,
        offset,
        len: len as u32,
        aux: 0,
    }
    .encode()
}

/// Reads one answer frame from the target (header + payload).
pub fn answer(s: &mut TcpStream) -> (FrameHeader, Vec<u8>) {
    let mut h = [0u8; FRAME_HEADER_LEN];
    s.read_exact(&mut h).expect("answer header");
    let h = FrameHeader::decode(&h).expect("valid answer");
    let n = if h.kind.has_payload() {
        h.len as usize
    } else {
        0
    };
    let mut p = vec![0u8; n];
    s.read_exact(&mut p).expect("answer payload");
    (h, p)
}

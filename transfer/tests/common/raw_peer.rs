//! A hand-written tcp peer: the handshake and the data-lane frames written and read by hand.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use kvwire_transfer::wire::{
    self, CtrlMsg, FrameHeader, FrameKind, HostIdentity, FRAME_HEADER_LEN,
};
use kvwire_transfer::RegionId;

/// The `Hello` of a tcp-only initiator on another host (nonce: 32 bytes `nonce`), asking the
/// responder to prove its secret when `auth`.
pub fn hello(nonce: u8, auth: bool) -> CtrlMsg {
    CtrlMsg::Hello {
        nonce: [nonce; 32],
        auth,
        host: HostIdentity::default(),
        listen_port: 1,
        transports: wire::TRANSPORT_TCP,
        blobs: vec![],
    }
}

/// The initiator's `Auth` with proof `mac` (empty without secret), choosing tcp, offering no
/// region.
pub fn auth(mac: Vec<u8>) -> CtrlMsg {
    CtrlMsg::Auth {
        mac,
        transport: wire::TRANSPORT_TCP,
        token: [9; 16],
        regions: vec![],
    }
}

/// Handshake by hand (a peer on another host: no shm, no fence, no secret), over streams
/// opened with `connect`; returns the control stream and a joined data lane.
pub fn raw_session(
    addr: SocketAddr,
    connect: impl Fn(SocketAddr) -> TcpStream,
) -> (TcpStream, TcpStream) {
    let mut c = connect(addr);
    c.write_all(&hello(3, false).encode()).expect("hello");
    let token = match wire::read_ctrl(&mut c).expect("reply") {
        CtrlMsg::HelloReply { token, .. } => token,
        m => panic!("expected HelloReply, got {m:?}"),
    };
    c.write_all(&auth(vec![]).encode()).expect("auth");
    match wire::read_ctrl(&mut c).expect("welcome") {
        CtrlMsg::Welcome { .. } => {}
        m => panic!("expected Welcome, got {m:?}"),
    }
    let mut lane = connect(addr);
    lane.write_all(&CtrlMsg::LaneJoin { token, lane: 0 }.encode())
        .expect("join");
    assert_eq!(
        wire::read_ctrl(&mut lane).expect("lane ok"),
        CtrlMsg::LaneOk
    );
    (c, lane)
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

//! A hand-written raw TCP client against a target engine: malformed, truncated, oversized and
//! wrong-version input, and writes that skip the initiator's checks. The target must answer with
//! a clear error (or close), land nothing, never panic, and keep serving.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::hostile::write_checked;
use common::raw_peer::{self, answer, write_header};
use common::{mismatch, pattern};
use kvwire_transfer::auth::KeyShare;
use kvwire_transfer::wire::{self, CtrlMsg, FrameHeader, FrameKind, FRAME_HEADER_LEN};
use kvwire_transfer::{
    Access, Engine, EngineConfig, Error, Limits, RegionHandle, RegionId, TransportKind,
};

/// A target whose handshakes end after `handshake`.
fn target_with(handshake: Duration) -> Engine {
    Engine::new(EngineConfig {
        transport: TransportKind::Tcp,
        connect_timeout: handshake,
        limits: Limits {
            handshake_timeout: handshake,
            ..Limits::default()
        },
        ..Default::default()
    })
    .expect("engine")
}

/// A target for the hand-written sessions: the test thread is the peer of its handshake, and
/// a loaded host can pause that thread between two messages for longer than a short timeout,
/// so the timeout here only bounds a hang.
fn target() -> Engine {
    target_with(Duration::from_secs(30))
}

/// A raw connection; its read timeout only bounds a hang (every answer read is due at once,
/// or after a target's handshake timeout of a few seconds).
fn raw(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    s
}

/// Reads what the target says before closing: its control messages, then EOF.
fn drain_ctrl(s: &mut TcpStream) -> (Vec<CtrlMsg>, bool) {
    let mut msgs = Vec::new();
    loop {
        match wire::read_ctrl(s) {
            Ok(m) => msgs.push(m),
            Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return (msgs, true)
            }
            Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (msgs, true)
            }
            Err(e) => panic!("unexpected error reading the target: {e}"),
        }
    }
}

fn reject_error(msgs: &[CtrlMsg]) -> Error {
    match msgs.first() {
        Some(CtrlMsg::Reject { error }) => {
            wire::decode_error(error, true).expect("decodable reject")
        }
        other => panic!("expected a Reject, got {other:?}"),
    }
}

/// Proves the target still works: a real engine connects and writes, bytes verified.
fn good_transfer(t: &Engine, r: RegionHandle, seed: u64) {
    let i = Engine::new(EngineConfig {
        transport: TransportKind::Tcp,
        ..Default::default()
    })
    .expect("engine");
    let src = i.alloc_region(4096, Access::Local).expect("alloc");
    let p = i.connect(t.listen_addr()).expect("connect after bad input");
    write_checked((&i, &p, src), (t, r, 0), seed, 4096);
}

#[test]
fn malformed_handshakes_are_refused_and_the_target_keeps_serving() {
    let t = target();
    let r = t.alloc_region(4096, Access::ReadWrite).expect("alloc");
    let addr = t.listen_addr();

    // Garbage: clear protocol error, then closed.
    let mut s = raw(addr);
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send");
    let (msgs, closed) = drain_ctrl(&mut s);
    assert!(matches!(reject_error(&msgs), Error::Protocol(_)));
    assert!(closed);

    // Wrong version.
    let mut hello = raw_peer::hello(1, false, &KeyShare::random()).encode();
    hello[4..6].copy_from_slice(&99u16.to_le_bytes());
    let mut s = raw(addr);
    s.write_all(&hello).expect("send");
    let (msgs, closed) = drain_ctrl(&mut s);
    match reject_error(&msgs) {
        Error::VersionMismatch { ours, theirs } => {
            assert_eq!(ours, 99, "from the client's point of view");
            assert_eq!(theirs, wire::PROTOCOL_VERSION);
        }
        e => panic!("expected VersionMismatch, got {e}"),
    }
    assert!(closed);

    // Oversized body length.
    let mut h = hello.clone();
    h[4..6].copy_from_slice(&wire::PROTOCOL_VERSION.to_le_bytes());
    h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut s = raw(addr);
    s.write_all(&h[..wire::CTRL_HEADER_LEN]).expect("send");
    let (msgs, closed) = drain_ctrl(&mut s);
    assert!(matches!(reject_error(&msgs), Error::Protocol(_)));
    assert!(closed);

    // Truncated: half a header, then the client closes its side.
    let mut s = raw(addr);
    s.write_all(&h[..5]).expect("send");
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let (_, closed) = drain_ctrl(&mut s);
    assert!(closed);

    // Truncated body: a header announcing more than is sent, and silence (handshake timeout),
    // against a target with a short timeout (the client's read timeout, 60 s, is far longer).
    let quick = target_with(Duration::from_secs(2));
    let mut h2 = hello.clone();
    h2[4..6].copy_from_slice(&wire::PROTOCOL_VERSION.to_le_bytes());
    let mut s = raw(quick.listen_addr());
    s.write_all(&h2[..h2.len() - 3]).expect("send");
    let (_, closed) = drain_ctrl(&mut s);
    assert!(closed);
    quick.shutdown();

    // A lane join with a session nobody has.
    let mut s = raw(addr);
    s.write_all(
        &CtrlMsg::LaneJoin {
            sid: [7; 16],
            lane: 0,
            nonce: [1; 32],
        }
        .encode(),
    )
    .expect("send");
    let (msgs, closed) = drain_ctrl(&mut s);
    assert!(matches!(reject_error(&msgs), Error::AuthFailed));
    assert!(closed);

    good_transfer(&t, r, 11);
}

fn raw_session(addr: SocketAddr) -> (TcpStream, TcpStream) {
    raw_peer::raw_session(addr, raw)
}

fn write_frame(region: RegionId, offset: u64, payload: &[u8], batch: u64) -> Vec<u8> {
    let mut v = write_header(region, offset, payload.len(), batch).to_vec();
    v.extend_from_slice(payload);
    v
}

fn expect_error(s: &mut TcpStream, batch: u64) -> Error {
    let (h, p) = answer(s);
    assert_eq!(h.kind, FrameKind::Error);
    assert_eq!(h.batch, batch);
    wire::decode_error(&p, true).expect("decodable error")
}

#[test]
fn target_checks_every_write_before_a_byte_lands() {
    let t = target();
    let rw = t.alloc_region(8192, Access::ReadWrite).expect("alloc");
    let ro = t.alloc_region(8192, Access::ReadOnly).expect("alloc");
    let lo = t.alloc_region(8192, Access::Local).expect("alloc");
    let gone = t.alloc_region(8192, Access::ReadWrite).expect("alloc");
    let gone_id = t.region_id(gone);
    t.unregister(gone).expect("unregister");
    for r in [rw, ro, lo] {
        t.local_write(r, 0, &pattern(21, 0, 8192)).expect("fill");
    }
    let (_c, mut lane) = raw_session(t.listen_addr());
    let junk = vec![0xAB; 300];
    let rid = t.region_id(rw);

    lane.write_all(&write_frame(rid, 8000, &junk, 1))
        .expect("send");
    assert!(matches!(
        expect_error(&mut lane, 1),
        Error::OutOfBounds {
            region_len: 8192,
            ..
        }
    ));
    lane.write_all(&write_frame(rid, u64::MAX - 100, &junk, 2))
        .expect("send");
    assert!(matches!(
        expect_error(&mut lane, 2),
        Error::OutOfBounds { .. }
    ));
    lane.write_all(&write_frame(
        RegionId {
            index: 4242,
            generation: 1,
        },
        0,
        &junk,
        3,
    ))
    .expect("send");
    assert!(matches!(
        expect_error(&mut lane, 3),
        Error::UnknownRegion(_)
    ));
    lane.write_all(&write_frame(gone_id, 0, &junk, 4))
        .expect("send");
    assert!(matches!(expect_error(&mut lane, 4), Error::StaleRegion(_)));
    lane.write_all(&write_frame(t.region_id(lo), 0, &junk, 5))
        .expect("send");
    assert!(matches!(expect_error(&mut lane, 5), Error::AccessDenied(_)));
    lane.write_all(&write_frame(t.region_id(ro), 0, &junk, 6))
        .expect("send");
    assert!(matches!(expect_error(&mut lane, 6), Error::AccessDenied(_)));
    // Reads are checked too (LOCAL region).
    let mut rq = FrameHeader::simple(FrameKind::ReadReq, 7, 16, 0);
    rq.region = t.region_id(lo);
    lane.write_all(&rq.encode()).expect("send");
    assert!(matches!(expect_error(&mut lane, 7), Error::AccessDenied(_)));

    // Nothing landed.
    for r in [rw, ro, lo] {
        let mut buf = vec![0u8; 8192];
        t.local_read(r, 0, &mut buf).expect("read");
        assert_eq!(mismatch(21, 0, &buf), None, "target memory changed");
    }
    // The lane still works: a valid write is acked and lands.
    let good = pattern(22, 100, 500);
    lane.write_all(&write_frame(rid, 100, &good, 8))
        .expect("send");
    let (h, _) = answer(&mut lane);
    assert_eq!((h.kind, h.batch), (FrameKind::Ack, 8));
    let mut buf = vec![0u8; 500];
    t.local_read(rw, 100, &mut buf).expect("read");
    assert_eq!(mismatch(22, 100, &buf), None);

    // A batch with a notification and one refused slice: the tag is never delivered; with every
    // slice accepted it is, after the bytes.
    let notes = t.notifications();
    let tracked = |region: RegionId, off: u64, payload: &[u8], batch: u64| {
        let mut f = write_frame(region, off, payload, batch);
        f[7] = wire::FLAG_TRACKED;
        f
    };
    let notify = |batch: u64, slices: u32, tag: &[u8]| {
        let mut f = FrameHeader::simple(FrameKind::Notify, batch, tag.len() as u32, slices)
            .encode()
            .to_vec();
        f.extend_from_slice(tag);
        f
    };
    lane.write_all(&tracked(rid, 0, &good, 20)).expect("send");
    lane.write_all(&tracked(rid, 9000, &good, 20))
        .expect("send"); // out of bounds
    lane.write_all(&notify(20, 2, b"refused")).expect("send");
    assert_eq!(answer(&mut lane).0.kind, FrameKind::Ack);
    assert!(matches!(
        expect_error(&mut lane, 20),
        Error::OutOfBounds { .. }
    ));
    assert_eq!(answer(&mut lane).0.kind, FrameKind::Ack);
    lane.write_all(&notify(21, 2, b"accepted")).expect("send");
    lane.write_all(&tracked(rid, 2000, &pattern(24, 2000, 100), 21))
        .expect("send");
    lane.write_all(&tracked(rid, 2100, &pattern(24, 2100, 100), 21))
        .expect("send");
    // Consecutive acks of one batch may be merged (aux counts them).
    let mut acked = 0;
    while acked < 3 {
        let (h, _) = answer(&mut lane);
        assert_eq!((h.kind, h.batch), (FrameKind::Ack, 21));
        acked += h.aux.max(1);
    }
    assert_eq!(acked, 3);
    let n = notes
        .recv_timeout(Duration::from_secs(5))
        .expect("notification");
    assert_eq!(n.tag, b"accepted");
    let mut buf = vec![0u8; 200];
    t.local_read(rw, 2000, &mut buf).expect("read");
    assert_eq!(mismatch(24, 2000, &buf), None);
    assert!(
        notes.try_recv().is_none(),
        "the refused batch's tag was delivered"
    );

    // Malformed data frames close the lane with an error (batch 0), and nothing else breaks.
    let bad_frames: Vec<Vec<u8>> = vec![
        {
            let mut f = write_frame(rid, 0, &junk, 9);
            f[0] = b'X'; // bad magic
            f
        },
        {
            let mut f = write_frame(rid, 0, &junk, 9);
            f[4..6].copy_from_slice(&7u16.to_le_bytes()); // wrong version
            f
        },
        {
            let mut f = write_frame(rid, 0, &[], 9);
            f[32..36].copy_from_slice(&u32::MAX.to_le_bytes()); // oversized
            f
        },
        {
            let mut f = write_frame(rid, 0, &[], 9);
            f[6] = 200; // unknown kind
            f
        },
        FrameHeader::simple(FrameKind::Ack, 9, 0, 0)
            .encode()
            .to_vec(), // wrong direction
    ];
    for (k, f) in bad_frames.iter().enumerate() {
        let (_c2, mut l2) = raw_session(t.listen_addr());
        l2.write_all(f).expect("send");
        let e = expect_error(&mut l2, 0);
        if k == 1 {
            assert!(matches!(e, Error::VersionMismatch { .. }), "got {e}");
        } else {
            assert!(matches!(e, Error::Protocol(_)), "got {e}");
        }
        let mut rest = Vec::new();
        let n = l2.read_to_end(&mut rest).unwrap_or(0);
        assert_eq!(n, 0, "lane closed after the error");
    }
    // Truncated payload: header promises 300 bytes, 10 arrive, then the client goes away.
    {
        let (_c3, mut l3) = raw_session(t.listen_addr());
        let f = write_frame(rid, 0, &junk, 10);
        l3.write_all(&f[..FRAME_HEADER_LEN + 10]).expect("send");
        drop(l3);
    }
    good_transfer(&t, rw, 23);
    // The truncated frame's bytes may have started landing (it passed the checks), but the rest
    // of the region is intact and the region is untouched elsewhere.
    let mut buf = vec![0u8; 8192];
    t.local_read(ro, 0, &mut buf).expect("read");
    assert_eq!(mismatch(21, 0, &buf), None);
}

#[test]
fn each_side_checks_the_other_sides_proof() {
    // A fake responder that does not require a secret: an initiator that holds one refuses
    // before proving anything (nothing is learned from it), and sends no proof.
    let (i_msgs, i_err) = fake_responder(|s, _| {
        let share = KeyShare::random();
        s.write_all(
            &CtrlMsg::Challenge {
                nonce: [5; 32],
                auth_required: false,
                dh: share.public,
            }
            .encode(),
        )
        .expect("challenge");
    });
    assert!(matches!(i_err, Error::AuthFailed), "{i_err}");
    assert_eq!(
        i_msgs.len(),
        1,
        "only a Reject after the Challenge: {i_msgs:?}"
    );
    assert!(matches!(reject_error(&i_msgs), Error::AuthFailed));

    // A fake responder that requires one, takes the proof, and cannot prove it back: refused.
    let (i_msgs, i_err) = fake_responder(|s, _| {
        let share = KeyShare::random();
        s.write_all(
            &CtrlMsg::Challenge {
                nonce: [5; 32],
                auth_required: true,
                dh: share.public,
            }
            .encode(),
        )
        .expect("challenge");
        assert!(matches!(
            wire::read_ctrl(s).expect("proof"),
            CtrlMsg::Proof { .. }
        ));
        s.write_all(
            &CtrlMsg::Accept {
                host: Default::default(),
                transports: wire::TRANSPORT_TCP,
                lanes: 1,
                blobs: vec![],
                mac: [0xAA; 32],
            }
            .encode(),
        )
        .expect("accept");
    });
    assert!(matches!(i_err, Error::AuthFailed), "{i_err}");
    assert!(matches!(reject_error(&i_msgs), Error::AuthFailed));

    // A raw initiator with a made-up proof: the responder refuses and keeps no peer.
    let t = Engine::new(EngineConfig {
        secret: Some(b"s3cret".to_vec()),
        ..Default::default()
    })
    .expect("engine");
    let mut c = raw(t.listen_addr());
    c.write_all(&raw_peer::hello(3, true, &KeyShare::random()).encode())
        .expect("hello");
    match wire::read_ctrl(&mut c).expect("reply") {
        CtrlMsg::Challenge { auth_required, .. } => assert!(auth_required),
        m => panic!("expected Challenge, got {m:?}"),
    }
    c.write_all(&CtrlMsg::Proof { mac: [0x55; 32] }.encode())
        .expect("proof");
    let (msgs, closed) = drain_ctrl(&mut c);
    assert!(matches!(reject_error(&msgs), Error::AuthFailed));
    assert!(closed);
    assert!(t.peers().is_empty());
}

/// Runs `answer` as a fake responder to an initiator holding a secret, after its `Hello`;
/// returns what the initiator sent after that (until it closed) and its error.
fn fake_responder(
    answer: impl FnOnce(&mut TcpStream, CtrlMsg) + Send + 'static,
) -> (Vec<CtrlMsg>, Error) {
    let fake = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let fake_addr = fake.local_addr().expect("addr");
    let server = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().expect("accept");
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let hello = wire::read_ctrl(&mut s).expect("hello");
        assert!(matches!(hello, CtrlMsg::Hello { auth: true, .. }));
        answer(&mut s, hello);
        drain_ctrl(&mut s).0
    });
    let i = Engine::new(EngineConfig {
        secret: Some(b"s3cret".to_vec()),
        ..Default::default()
    })
    .expect("engine");
    let err = i.connect(fake_addr).expect_err("refused");
    (server.join().expect("fake responder"), err)
}

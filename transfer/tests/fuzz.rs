//! Property tests of every decoder of network bytes: arbitrary input never panics, and
//! encode → decode round-trips; the bounded reader refuses from the header alone; the
//! handshake's pre-authentication exchanges (both sides) over arbitrary bytes never reveal
//! anything before a valid proof. Bounded case counts so this runs in seconds (the same
//! decoders run under `cargo fuzz` too: `transfer/fuzz`).

use kvwire_transfer::wire::{
    self, CtrlMsg, FrameHeader, FrameKind, HostIdentity, MrChunks, WireRegion,
};
use kvwire_transfer::{Access, Error, RegionId, Resource};
use proptest::prelude::*;

fn cfg() -> ProptestConfig {
    ProptestConfig {
        cases: 512,
        ..ProptestConfig::default()
    }
}

fn kind() -> impl Strategy<Value = FrameKind> {
    prop_oneof![
        Just(FrameKind::Write),
        Just(FrameKind::Ack),
        Just(FrameKind::ReadReq),
        Just(FrameKind::ReadData),
        Just(FrameKind::Notify),
        Just(FrameKind::Error),
    ]
}

fn access() -> impl Strategy<Value = Access> + Clone {
    prop_oneof![
        Just(Access::ReadWrite),
        Just(Access::WriteOnly),
        Just(Access::ReadOnly),
        Just(Access::Local)
    ]
}

fn region() -> impl Strategy<Value = WireRegion> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        access(),
        any::<u64>(),
        any::<i32>(),
        any::<u64>(),
    )
        .prop_map(
            |(index, generation, len, access, addr, fd, ino)| WireRegion {
                id: RegionId { index, generation },
                len,
                access,
                addr,
                fd,
                ino,
                rkey: (addr >> 7) as u32,
                chunks: (ino & 2 == 2 && len >= 3).then(|| {
                    let chunk = len / 3 + 1;
                    let rkeys: Vec<u32> =
                        (1..MrChunks::count(chunk, len)).map(|i| i as u32).collect();
                    MrChunks {
                        len: chunk,
                        rkeys: rkeys.into(),
                    }
                }),
                ipc: (fd & 1 == 1).then_some(kvwire_transfer::DeviceIpc {
                    handle: [(ino & 0xff) as u8; 64],
                    offset: ino,
                }),
            },
        )
}

fn host() -> impl Strategy<Value = HostIdentity> {
    (
        "[a-z0-9-]{0,40}",
        "[a-z:\\[\\]0-9]{0,30}",
        ".{0,30}",
        any::<u32>(),
    )
        .prop_map(|(b, p, m, pid)| HostIdentity {
            boot_id: b,
            pid_ns: p,
            mnt_ns: m,
            pid,
        })
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..max)
}

fn blobs() -> impl Strategy<Value = Vec<(u8, Vec<u8>)>> {
    proptest::collection::vec((any::<u8>(), bytes(64)), 0..4)
}

fn ctrl_msg() -> impl Strategy<Value = CtrlMsg> {
    let regions = || proptest::collection::vec(region(), 0..8);
    prop_oneof![
        (any::<[u8; 32]>(), any::<bool>(), any::<[u8; 32]>())
            .prop_map(|(nonce, auth, dh)| CtrlMsg::Hello { nonce, auth, dh }),
        (any::<[u8; 32]>(), any::<bool>(), any::<[u8; 32]>()).prop_map(
            |(nonce, auth_required, dh)| CtrlMsg::Challenge {
                nonce,
                auth_required,
                dh
            }
        ),
        any::<[u8; 32]>().prop_map(|mac| CtrlMsg::Proof { mac }),
        (
            host(),
            any::<u8>(),
            any::<u16>(),
            blobs(),
            any::<[u8; 32]>()
        )
            .prop_map(|(host, transports, lanes, blobs, mac)| CtrlMsg::Accept {
                host,
                transports,
                lanes,
                blobs,
                mac
            }),
        (
            host(),
            any::<u16>(),
            any::<u8>(),
            any::<u16>(),
            blobs(),
            regions(),
            any::<[u8; 32]>()
        )
            .prop_map(
                |(host, listen_port, transports, lanes, blobs, regions, mac)| CtrlMsg::Auth {
                    host,
                    listen_port,
                    transports,
                    lanes,
                    blobs,
                    regions,
                    mac
                }
            ),
        (regions(), any::<[u8; 32]>()).prop_map(|(regions, mac)| CtrlMsg::Welcome { regions, mac }),
        bytes(100).prop_map(|error| CtrlMsg::Reject { error }),
        (any::<[u8; 16]>(), any::<u16>(), any::<[u8; 32]>())
            .prop_map(|(sid, lane, nonce)| CtrlMsg::LaneJoin { sid, lane, nonce }),
        (any::<[u8; 32]>(), any::<[u8; 32]>())
            .prop_map(|(nonce, mac)| CtrlMsg::LaneChallenge { nonce, mac }),
        any::<[u8; 32]>().prop_map(|mac| CtrlMsg::LaneProof { mac }),
        Just(CtrlMsg::LaneOk),
        regions().prop_map(CtrlMsg::RegionsAdded),
        regions().prop_map(CtrlMsg::RegionsSet),
        proptest::collection::vec((any::<u32>(), any::<u32>()), 0..8).prop_map(|v| {
            CtrlMsg::RegionsRemoved(
                v.into_iter()
                    .map(|(index, generation)| RegionId { index, generation })
                    .collect(),
            )
        }),
        bytes(200).prop_map(CtrlMsg::Notify),
        (any::<u8>(), bytes(64)).prop_map(|(bit, data)| CtrlMsg::Transport { bit, data }),
    ]
}

/// The responder's first-message expectation (as the engine reads it).
const FIRST: wire::Expect<'static> = wire::Expect {
    stage: wire::Stage::FirstMessage,
    kinds: &[
        (wire::kind::HELLO, wire::body::HELLO),
        (wire::kind::LANE_JOIN, wire::body::LANE_JOIN),
    ],
};

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn frame_header_decoder_never_panics(b in bytes(80)) {
        let _ = FrameHeader::decode(&b);
    }

    #[test]
    fn frame_header_round_trips(k in kind(), flags in any::<u8>(), batch in any::<u64>(), index in any::<u32>(),
                                generation in any::<u32>(), offset in any::<u64>(), len in 0u32..4096, aux in any::<u32>()) {
        let len = if k == FrameKind::Ack { 0 } else { len };
        let h = FrameHeader { kind: k, flags, batch, region: RegionId { index, generation }, offset, len, aux };
        prop_assert_eq!(FrameHeader::decode(&h.encode()).expect("valid"), h);
    }

    #[test]
    fn frame_header_mutations_never_panic(idx in 0usize..40, v in any::<u8>()) {
        let mut b = FrameHeader::simple(FrameKind::Write, 1, 10, 0).encode();
        b[idx] = v;
        let _ = FrameHeader::decode(&b);
    }

    #[test]
    fn ctrl_decoder_never_panics(b in bytes(300)) {
        let _ = CtrlMsg::decode(&b);
        if b.len() > 1 {
            let _ = CtrlMsg::decode_body(b[0] % 19, &b[1..]);
        }
        let mut cur = std::io::Cursor::new(&b);
        let _ = wire::read_ctrl(&mut cur);
        let mut cur = std::io::Cursor::new(&b);
        let _ = wire::read_ctrl_limited(&mut cur, FIRST);
    }

    #[test]
    fn limited_reads_refuse_from_the_header(k in any::<u8>(), len in any::<u32>()) {
        // A header alone: anything but an expected kind within its bound is refused before a
        // byte of the body is read (the reader sees only the 12 header bytes).
        let mut h = CtrlMsg::LaneOk.encode();
        h[6] = k;
        h[8..12].copy_from_slice(&len.to_le_bytes());
        let fits = [(1u8, 65u32), (6, 50), (5, wire::body::REJECT)]
            .iter()
            .any(|(kk, max)| *kk == k && len <= *max);
        let mut cur = std::io::Cursor::new(&h);
        match wire::read_ctrl_limited(&mut cur, FIRST) {
            Err(Error::Protocol(_)) => {}
            // Only an expected kind within its bound waits for (here: misses) its body.
            Err(Error::Io(_)) => prop_assert!(fits && len > 0, "read a body it should refuse"),
            other => prop_assert!(false, "{:?}", other.map(|(m, _)| m)),
        }
    }

    #[test]
    fn responder_never_reveals_anything_before_a_valid_proof(b in bytes(400), secret in any::<bool>()) {
        let psk: Option<&[u8]> = if secret { Some(b"fuzz-secret") } else { None };
        let (proved, out) = kvwire_transfer::session::fuzzing::responder(&b, psk);
        prop_assert!(!proved || !secret, "proved the secret from random bytes");
        // Whatever we wrote before a proof is a Challenge and/or a Reject, nothing else.
        let mut cur = std::io::Cursor::new(&out);
        while (cur.position() as usize) < out.len() {
            match wire::read_ctrl(&mut cur).expect("our own output decodes") {
                CtrlMsg::Challenge { .. } | CtrlMsg::Reject { .. } | CtrlMsg::LaneChallenge { .. } => {}
                m => prop_assert!(false, "sent {:?} before a proof", m),
            }
        }
    }

    #[test]
    fn responder_survives_mutated_hellos(at in 0usize..77, v in any::<u8>()) {
        let share = kvwire_transfer::auth::KeyShare::from_bytes([4; 32]);
        let mut h = CtrlMsg::Hello { nonce: [1; 32], auth: true, dh: share.public }.encode();
        h[at] = v;
        let (proved, _) = kvwire_transfer::session::fuzzing::responder(&h, Some(b"k"));
        prop_assert!(!proved);
    }

    #[test]
    fn initiator_never_panics_and_proves_only_to_a_responder_asking(b in bytes(400)) {
        let out = kvwire_transfer::session::fuzzing::initiator(&b, Some(b"fuzz-secret"));
        let mut cur = std::io::Cursor::new(&out);
        let mut sent = Vec::new();
        while (cur.position() as usize) < out.len() {
            sent.push(wire::read_ctrl(&mut cur).expect("our own output decodes"));
        }
        // A proof only after a Challenge that required one.
        let mut challenge = None;
        let mut cur = std::io::Cursor::new(&b);
        if let Ok(CtrlMsg::Challenge { auth_required, .. }) = wire::read_ctrl(&mut cur) {
            challenge = Some(auth_required);
        }
        if sent.iter().any(|m| matches!(m, CtrlMsg::Proof { .. })) {
            prop_assert_eq!(challenge, Some(true));
        }
    }

    #[test]
    fn ctrl_round_trips(m in ctrl_msg()) {
        let enc = m.encode();
        prop_assert_eq!(CtrlMsg::decode(&enc).expect("valid"), m.clone());
        let mut cur = std::io::Cursor::new(&enc);
        prop_assert_eq!(wire::read_ctrl(&mut cur).expect("valid"), m);
    }

    #[test]
    fn ctrl_truncations_and_mutations_never_panic(m in ctrl_msg(), cut in any::<prop::sample::Index>(), at in any::<prop::sample::Index>(), v in any::<u8>()) {
        let enc = m.encode();
        let _ = CtrlMsg::decode(&enc[..cut.index(enc.len())]);
        let mut e2 = enc.clone();
        let i = at.index(e2.len());
        e2[i] = v;
        let _ = CtrlMsg::decode(&e2);
    }

    #[test]
    fn error_payload_decoder_never_panics(b in bytes(120), flip in any::<bool>()) {
        let _ = wire::decode_error(&b, flip);
    }

    #[test]
    fn error_payload_round_trips(index in any::<u32>(), generation in any::<u32>(), offset in any::<u64>(), len in any::<u64>(), region_len in any::<u64>()) {
        let region = RegionId { index, generation };
        let e = Error::OutOfBounds { region, offset, len, region_len };
        match wire::decode_error(&wire::encode_error(&e), false).expect("valid") {
            Error::OutOfBounds { region: r, offset: o, len: l, region_len: rl } => {
                prop_assert_eq!((r, o, l, rl), (region, offset, len, region_len));
            }
            other => prop_assert!(false, "decoded {:?}", other),
        }
        for e in [Error::UnknownRegion(region), Error::StaleRegion(region), Error::AccessDenied(region)] {
            let d = wire::decode_error(&wire::encode_error(&e), false).expect("valid");
            prop_assert_eq!(d.to_string(), e.to_string());
        }
    }

    #[test]
    fn new_error_codes_round_trip(limit in any::<u64>(), r in 0usize..9, ip in any::<[u8; 16]>(), v4 in any::<[u8; 4]>(), port in any::<u16>()) {
        let resources = [
            Resource::Handshakes, Resource::HandshakesPerAddress, Resource::AuthFailures,
            Resource::Peers, Resource::Lanes, Resource::NotifyBytes, Resource::RemoteRegions,
            Resource::CtrlQueue, Resource::MetricsConns,
        ];
        let e = Error::ResourceLimit { resource: resources[r], limit };
        let d = wire::decode_error(&wire::encode_error(&e), true).expect("valid");
        prop_assert_eq!(d.to_string(), e.to_string());
        for addr in [
            std::net::SocketAddr::new(std::net::Ipv6Addr::from(ip).into(), port),
            std::net::SocketAddr::new(std::net::Ipv4Addr::from(v4).into(), port),
        ] {
            // An IPv6 address that is an IPv4-mapped one decodes as that IPv4 address.
            let want = match addr.ip() {
                std::net::IpAddr::V6(a) => match a.to_ipv4_mapped() {
                    Some(v4) => std::net::SocketAddr::new(v4.into(), port),
                    None => addr,
                },
                _ => addr,
            };
            match wire::decode_error(&wire::encode_error(&Error::Fenced { addr }), true).expect("valid") {
                Error::Fenced { addr: got } => prop_assert_eq!(got, want),
                other => prop_assert!(false, "decoded {:?}", other),
            }
        }
    }
}

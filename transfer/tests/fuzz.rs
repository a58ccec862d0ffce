//! Property tests of every decoder of network bytes: arbitrary input never panics, and
//! encode → decode round-trips. Bounded case counts so this runs in seconds.

use kvwire_transfer::wire::{self, CtrlMsg, FrameHeader, FrameKind, HostIdentity, WireRegion};
use kvwire_transfer::{Access, Error, RegionId};
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

fn ctrl_msg() -> impl Strategy<Value = CtrlMsg> {
    let regions = || proptest::collection::vec(region(), 0..8);
    prop_oneof![
        (
            any::<[u8; 32]>(),
            any::<bool>(),
            host(),
            any::<u16>(),
            any::<u8>(),
            proptest::collection::vec((any::<u8>(), bytes(64)), 0..4)
        )
            .prop_map(|(nonce, auth, host, listen_port, transports, blobs)| {
                CtrlMsg::Hello {
                    nonce,
                    auth,
                    host,
                    listen_port,
                    transports,
                    blobs,
                }
            }),
        (
            any::<[u8; 32]>(),
            bytes(64),
            any::<bool>(),
            host(),
            any::<u8>(),
            any::<[u8; 16]>()
        )
            .prop_map(|(nonce, mac, auth_required, host, transports, token)| {
                CtrlMsg::HelloReply {
                    nonce,
                    mac,
                    auth_required,
                    host,
                    transports,
                    token,
                    blobs: vec![],
                }
            }),
        (bytes(64), any::<u8>(), any::<[u8; 16]>(), regions()).prop_map(
            |(mac, transport, token, regions)| CtrlMsg::Auth {
                mac,
                transport,
                token,
                regions
            }
        ),
        regions().prop_map(|regions| CtrlMsg::Welcome { regions }),
        bytes(100).prop_map(|error| CtrlMsg::Reject { error }),
        (any::<[u8; 16]>(), any::<u16>())
            .prop_map(|(token, lane)| CtrlMsg::LaneJoin { token, lane }),
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
            let _ = CtrlMsg::decode_body(b[0] % 14, &b[1..]);
        }
        let mut cur = std::io::Cursor::new(&b);
        let _ = wire::read_ctrl(&mut cur);
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
}

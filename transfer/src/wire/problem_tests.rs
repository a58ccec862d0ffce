//! The messages of [`ProtocolError`], pinned.

use super::*;

/// Every message as the engine wrote it before the errors were typed (the format strings
/// of the call sites, filled with the same values).
#[test]
fn messages_are_the_ones_peers_and_callers_always_saw() {
    use Layout as At;
    use ProtocolError as P;
    let m = format!("{:?}", CtrlMsg::LaneOk);
    let magic = [1u8, 0xab, 0, 0x4b];
    let cases: Vec<(P, String)> = vec![
        (
            P::Truncated {
                at: At::FrameHeader,
                need: 40,
                have: 7,
            },
            format!("truncated frame header ({} bytes)", 7),
        ),
        (
            P::Truncated {
                at: At::CtrlHeader,
                need: 12,
                have: 3,
            },
            "truncated control header".into(),
        ),
        (
            P::Truncated {
                at: At::Field,
                need: 8,
                have: 2,
            },
            format!("truncated message: need {} bytes, have {}", 8, 2),
        ),
        (
            P::Truncated {
                at: At::RdmaBlobHead,
                need: 17,
                have: 3,
            },
            "rdma blob too short".into(),
        ),
        (
            P::Truncated {
                at: At::RdmaBlobDevice,
                need: 5,
                have: 1,
            },
            "rdma blob truncated".into(),
        ),
        (
            P::Truncated {
                at: At::RdmaBlob,
                need: 24,
                have: 1,
            },
            "rdma blob truncated".into(),
        ),
        (
            P::BadMagic {
                at: At::FrameHeader,
                got: magic,
            },
            format!("bad frame magic {:02x?}", &magic[..]),
        ),
        (
            P::BadMagic {
                at: At::CtrlHeader,
                got: magic,
            },
            format!("bad control magic {:02x?}", &magic[..]),
        ),
        (
            P::UnknownKind {
                at: At::FrameHeader,
                kind: 9,
            },
            format!("unknown frame kind {}", 9),
        ),
        (
            P::UnknownKind {
                at: At::CtrlBody,
                kind: 99,
            },
            format!("unknown control message kind {}", 99),
        ),
        (
            P::TooLong {
                at: At::FramePayload(FrameKind::Notify),
                len: 70000,
                max: 65536,
            },
            format!(
                "{:?} frame length {} exceeds bound {}",
                FrameKind::Notify,
                70000,
                65536
            ),
        ),
        (
            P::TooLong {
                at: At::CtrlHeader,
                len: 1 << 30,
                max: 32 << 20,
            },
            format!(
                "control body length {} exceeds bound {}",
                1u32 << 30,
                32u32 << 20
            ),
        ),
        (
            P::TooLong {
                at: At::Field,
                len: 300,
                max: 256,
            },
            format!("field length {} exceeds bound {}", 300, 256),
        ),
        (
            P::BadLength {
                at: At::CtrlBody,
                len: 5,
            },
            "control body length mismatch".into(),
        ),
        (
            P::BadLength {
                at: At::EngineMsg,
                len: 9,
            },
            format!("engine control message of {} bytes", 9),
        ),
        (
            P::BadLength {
                at: At::RdmaLaneMsg,
                len: 1,
            },
            "rdma control message: bad length".into(),
        ),
        (
            P::BadLength {
                at: At::RdmaKeysReq,
                len: 1,
            },
            "rdma key request: bad length".into(),
        ),
        (
            P::BadLength {
                at: At::RdmaKeys,
                len: 1,
            },
            "rdma keys: bad length".into(),
        ),
        (
            P::TrailingBytes {
                at: At::CtrlBody,
                n: 3,
            },
            format!("{} trailing bytes in control message", 3),
        ),
        (
            P::TrailingBytes {
                at: At::RdmaBlob,
                n: 1,
            },
            "rdma blob: trailing bytes".into(),
        ),
        (
            P::BadCount {
                at: At::Field,
                n: 77,
            },
            format!("item count {} exceeds message", 77),
        ),
        (
            P::BadCount {
                at: At::HelloBlobs,
                n: 17,
            },
            format!("{} transport blobs (max 16)", 17),
        ),
        (
            P::BadCount {
                at: At::RdmaBlobHead,
                n: 0,
            },
            format!("rdma blob: {} devices", 0),
        ),
        (
            P::BadCount {
                at: At::RdmaBlobDevice,
                n: 0,
            },
            "rdma blob: bad endpoint count".into(),
        ),
        (
            P::BadValue {
                field: Field::Bool,
                value: 2,
            },
            format!("bad boolean {}", 2),
        ),
        (
            P::BadValue {
                field: Field::Access,
                value: 7,
            },
            format!("bad access {}", 7),
        ),
        (
            P::BadValue {
                field: Field::Mtu,
                value: 9,
            },
            "rdma blob: bad MTU".into(),
        ),
        (
            P::BadValue {
                field: Field::LinkClass,
                value: 0,
            },
            "rdma blob: bad link class".into(),
        ),
        (P::BadUtf8, "invalid utf-8 string".into()),
        (
            P::BadEndpoint {
                at: At::RdmaBlob,
                reason: "x".into(),
            },
            format!("rdma blob: {}", "x"),
        ),
        (
            P::BadEndpoint {
                at: At::RdmaLaneMsg,
                reason: "y".into(),
            },
            format!("rdma control message: {}", "y"),
        ),
        (
            P::Unexpected {
                stage: Stage::Challenge,
                got: Some(Box::new(CtrlMsg::LaneOk)),
            },
            format!("expected Challenge, got {m}"),
        ),
        (
            P::Unexpected {
                stage: Stage::Welcome,
                got: Some(Box::new(CtrlMsg::LaneOk)),
            },
            format!("expected Welcome, got {m}"),
        ),
        (
            P::Unexpected {
                stage: Stage::Auth,
                got: Some(Box::new(CtrlMsg::LaneOk)),
            },
            format!("expected Auth, got {m}"),
        ),
        (
            P::Unexpected {
                stage: Stage::Hello,
                got: None,
            },
            "expected Hello".into(),
        ),
        (
            P::Unexpected {
                stage: Stage::FirstMessage,
                got: Some(Box::new(CtrlMsg::LaneOk)),
            },
            format!("unexpected first message {m}"),
        ),
        (
            P::Unexpected {
                stage: Stage::LaneJoinAnswer,
                got: Some(Box::new(CtrlMsg::LaneOk)),
            },
            format!("unexpected answer to a lane join: {m}"),
        ),
        (P::ShmAcrossHosts, "shm chosen across hosts".into()),
        (
            P::UnexpectedKind {
                stage: Stage::Proof,
                kind: 11,
            },
            "expected Proof, got a message of kind 11".into(),
        ),
        (
            P::UnexpectedKind {
                stage: Stage::FirstMessage,
                kind: 2,
            },
            "unexpected first message of kind 2".into(),
        ),
        (P::LaneAlreadyOpen { lane: 3 }, "lane 3 already open".into()),
        (
            P::WeakKeyShare,
            "the peer's key share is a low-order point".into(),
        ),
        (
            P::TransportNotInUse { bit: 4 },
            format!("transport message for {:#x}, which is not in use", 4u8),
        ),
        (
            P::NoTransportMessages {
                kind: TransportKind::Tcp,
            },
            format!(
                "transport message for {:?}, which has none",
                TransportKind::Tcp
            ),
        ),
        (
            P::UnknownEngineMsg { op: 3, kind: 1 },
            format!("unknown engine control message {}/{}", 3, 1),
        ),
        (
            P::UnexpectedFenceAck { batch: 12 },
            format!("notification confirmed for batch {}, which awaits none", 12),
        ),
        (
            P::UnknownRdmaOp { op: 7 },
            format!("rdma control message: op {}", 7),
        ),
        (
            P::BadLane { lane: 65 },
            format!("rdma control message: lane {}", 65),
        ),
        (
            P::KeysDeviceCount { got: 3, listed: 2 },
            format!("rdma keys for {} devices, the peer listed {}", 3, 2),
        ),
        (
            P::EchoedNonce,
            "rdma blob: the peer echoed our nonce".into(),
        ),
        (
            P::WrongLane {
                kind: FrameKind::Ack,
                side: LaneSide::Target,
            },
            format!("unexpected {:?} frame on a target lane", FrameKind::Ack),
        ),
        (
            P::WrongLane {
                kind: FrameKind::Write,
                side: LaneSide::Initiator,
            },
            format!(
                "unexpected {:?} frame on an initiator lane",
                FrameKind::Write
            ),
        ),
        (
            P::ReadSliceLength {
                slice: 4,
                len: 10,
                requested: 20,
            },
            format!("read slice {} length {} != requested {}", 4, 10, 20),
        ),
        (
            P::LaneClosedByPeer {
                reason: "timed out".into(),
            },
            format!("peer closed the lane: {}", "timed out"),
        ),
        (
            P::TooManyTracked,
            "too many batches awaiting their notification".into(),
        ),
        (
            P::DuplicateNotify { batch: 6 },
            format!("second notification for batch {}", 6),
        ),
        (
            P::NotAnnouncedMemfd {
                path: "/proc/1/fd/3".into(),
            },
            format!("{} is not the announced memfd", "/proc/1/fd/3"),
        ),
        (
            P::PeerReported { msg: "z".into() },
            format!("peer reported: {}", "z"),
        ),
    ];
    for (e, want) in cases {
        assert_eq!(e.to_string(), want, "{e:?}");
    }
}

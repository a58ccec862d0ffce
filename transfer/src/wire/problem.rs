//! [`ProtocolError`]: what a peer sent that does not follow the wire protocol, and where.
//!
//! The `Display` text of every variant is the message the engine has always given for that
//! fault: it travels to peers (in `Reject` and `Error` payloads), into `PeerDead` reasons and
//! into Python exception messages, so it does not change with the representation.

use std::fmt;

use super::msg::{CtrlMsg, FrameKind};
use crate::types::TransportKind;

/// A violation of the wire protocol: what was wrong, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtocolError {
    /// Fewer bytes than the layout needs.
    Truncated {
        /// Where.
        at: Layout,
        /// Bytes needed.
        need: usize,
        /// Bytes there.
        have: usize,
    },
    /// A header does not start with the magic of its kind.
    BadMagic {
        /// Which header.
        at: Layout,
        /// The first four bytes received.
        got: [u8; 4],
    },
    /// A frame or message kind this build does not know.
    UnknownKind {
        /// Frame header or control header.
        at: Layout,
        /// The kind code.
        kind: u8,
    },
    /// A length above its bound.
    TooLong {
        /// What carries the length.
        at: Layout,
        /// The length announced.
        len: u64,
        /// Its bound.
        max: u64,
    },
    /// A message whose length does not match its layout.
    BadLength {
        /// Which message.
        at: Layout,
        /// Its length in bytes.
        len: usize,
    },
    /// Bytes after the end of a message.
    TrailingBytes {
        /// Which message.
        at: Layout,
        /// How many.
        n: usize,
    },
    /// An item count the message cannot hold, or beyond its bound.
    BadCount {
        /// What is counted.
        at: Layout,
        /// The count.
        n: usize,
    },
    /// A field with a value outside its code table.
    BadValue {
        /// Which field.
        field: Field,
        /// The value received.
        value: u8,
    },
    /// A string that is not UTF-8.
    BadUtf8,
    /// An RDMA endpoint (GID, QPN, PSN, LID) that does not parse.
    BadEndpoint {
        /// Where it was.
        at: Layout,
        /// Why it was refused.
        reason: String,
    },
    /// A message that does not belong at this point of the conversation.
    Unexpected {
        /// What was expected.
        stage: Stage,
        /// What came instead (`None`: the caller was handed another message kind).
        got: Option<Box<CtrlMsg>>,
    },
    /// A message kind that does not belong at this point of the conversation, refused from its
    /// header (its body is never read).
    UnexpectedKind {
        /// What was expected.
        stage: Stage,
        /// The kind received.
        kind: u8,
    },
    /// A data lane joined twice while the first is open.
    LaneAlreadyOpen {
        /// The lane index.
        lane: u16,
    },
    /// The peer's key share is a low-order point (no shared secret results).
    WeakKeyShare,
    /// The initiator chose shared memory, but the engines run on different hosts.
    ShmAcrossHosts,
    /// A transport message for a transport bit no transport of this peer uses.
    TransportNotInUse {
        /// The bit.
        bit: u8,
    },
    /// A transport message for a transport that has no messages of its own.
    NoTransportMessages {
        /// The transport.
        kind: TransportKind,
    },
    /// An engine control message with an unknown `(op, kind)` pair.
    UnknownEngineMsg {
        /// Its op code.
        op: u8,
        /// Its kind code.
        kind: u8,
    },
    /// A notification fence answered for a batch that awaits none.
    UnexpectedFenceAck {
        /// The batch named.
        batch: u64,
    },
    /// An RDMA lane message with an unknown op code.
    UnknownRdmaOp {
        /// The op code.
        op: u8,
    },
    /// An RDMA lane message naming a lane that does not exist.
    BadLane {
        /// The lane.
        lane: usize,
    },
    /// RDMA keys for another number of devices than the peer listed in its handshake.
    KeysDeviceCount {
        /// Devices in the message.
        got: usize,
        /// Devices the peer listed.
        listed: usize,
    },
    /// The peer's RDMA blob carries the nonce of ours.
    EchoedNonce,
    /// A frame kind that only travels the other way on a lane.
    WrongLane {
        /// The frame kind.
        kind: FrameKind,
        /// The side of the lane that received it.
        side: LaneSide,
    },
    /// Read data of another length than the slice requested.
    ReadSliceLength {
        /// The slice index.
        slice: u32,
        /// Bytes received.
        len: u32,
        /// Bytes requested.
        requested: u32,
    },
    /// The target closed the lane with an error frame for no batch (the error's text).
    LaneClosedByPeer {
        /// The error the peer reported.
        reason: String,
    },
    /// More batches awaiting their notification than a target tracks per peer.
    TooManyTracked,
    /// A second notification for one batch.
    DuplicateNotify {
        /// The batch.
        batch: u64,
    },
    /// The file descriptor a same-host peer announced is not the memfd it described.
    NotAnnouncedMemfd {
        /// The `/proc` path opened.
        path: String,
    },
    /// The peer reported a protocol error of its own (its message).
    PeerReported {
        /// The peer's message.
        msg: String,
    },
}

// `Error` embeds it: keep it no larger than the largest other variant of `Error`.
const _: () = assert!(std::mem::size_of::<ProtocolError>() <= 32);

/// Where on the wire a fault was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Layout {
    /// A data-lane frame header.
    FrameHeader,
    /// The payload of a data-lane frame of this kind.
    FramePayload(FrameKind),
    /// A control message header.
    CtrlHeader,
    /// A control message body.
    CtrlBody,
    /// A field inside a control message body.
    Field,
    /// The transport blobs of an `Accept` or `Auth`.
    HelloBlobs,
    /// An engine control message (fence, fence answer).
    EngineMsg,
    /// The head of an RDMA handshake blob (nonce, device count).
    RdmaBlobHead,
    /// A device entry of an RDMA handshake blob.
    RdmaBlobDevice,
    /// An RDMA handshake blob as a whole.
    RdmaBlob,
    /// An RDMA lane message (queue pair reconnection).
    RdmaLaneMsg,
    /// An RDMA key request.
    RdmaKeysReq,
    /// An RDMA key answer.
    RdmaKeys,
    /// The RDMA chunks of a region (their length and keys).
    RegionChunks,
}

/// A field whose value is a code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Field {
    /// A boolean (0 or 1).
    Bool,
    /// A region access code.
    Access,
    /// An RDMA MTU code.
    Mtu,
    /// An RDMA link class.
    LinkClass,
    /// A region's device-memory flag (0 or 1).
    DeviceIpc,
}

/// The message expected at a point of a conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stage {
    /// The initiator's `Hello`.
    Hello,
    /// The responder's `Challenge`.
    Challenge,
    /// The initiator's `Proof`.
    Proof,
    /// The responder's `Accept`.
    Accept,
    /// The initiator's `Auth`.
    Auth,
    /// The responder's `Welcome`.
    Welcome,
    /// The first message on an accepted connection (`Hello` or `LaneJoin`).
    FirstMessage,
    /// The answer to a `LaneJoin` (`LaneChallenge`).
    LaneJoinAnswer,
    /// The joiner's `LaneProof`.
    LaneProof,
    /// The answer to a `LaneProof` (`LaneOk`).
    LaneOk,
    /// A message on an established control connection.
    Control,
}

/// The side of a data lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneSide {
    /// The accepting engine (lands writes, answers reads).
    Target,
    /// The engine that opened the lane.
    Initiator,
}

impl Stage {
    /// What the message text says was expected.
    fn expected(self) -> &'static str {
        match self {
            Stage::Hello => "expected Hello",
            Stage::Challenge => "expected Challenge",
            Stage::Proof => "expected Proof",
            Stage::Accept => "expected Accept",
            Stage::Auth => "expected Auth",
            Stage::Welcome => "expected Welcome",
            Stage::FirstMessage => "unexpected first message",
            Stage::LaneJoinAnswer => "unexpected answer to a lane join",
            Stage::LaneProof => "expected LaneProof",
            Stage::LaneOk => "expected LaneOk",
            Stage::Control => "unexpected control message",
        }
    }
}

impl std::error::Error for ProtocolError {}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use Layout as At;
        use ProtocolError as P;
        match self {
            P::Truncated {
                at: At::FrameHeader,
                have,
                ..
            } => write!(f, "truncated frame header ({have} bytes)"),
            P::Truncated {
                at: At::CtrlHeader, ..
            } => f.write_str("truncated control header"),
            P::Truncated {
                at: At::RdmaBlobHead,
                ..
            } => f.write_str("rdma blob too short"),
            P::Truncated {
                at: At::RdmaBlob | At::RdmaBlobDevice,
                ..
            } => f.write_str("rdma blob truncated"),
            P::Truncated { need, have, .. } => {
                write!(f, "truncated message: need {need} bytes, have {have}")
            }
            P::BadMagic {
                at: At::FrameHeader,
                got,
            } => write!(f, "bad frame magic {got:02x?}"),
            P::BadMagic { got, .. } => write!(f, "bad control magic {got:02x?}"),
            P::UnknownKind {
                at: At::FrameHeader,
                kind,
            } => write!(f, "unknown frame kind {kind}"),
            P::UnknownKind { kind, .. } => write!(f, "unknown control message kind {kind}"),
            P::TooLong {
                at: At::FramePayload(k),
                len,
                max,
            } => write!(f, "{k:?} frame length {len} exceeds bound {max}"),
            P::TooLong {
                at: At::CtrlHeader | At::CtrlBody,
                len,
                max,
            } => write!(f, "control body length {len} exceeds bound {max}"),
            P::TooLong { len, max, .. } => write!(f, "field length {len} exceeds bound {max}"),
            P::BadLength { at, len } => match at {
                At::CtrlHeader | At::CtrlBody => f.write_str("control body length mismatch"),
                At::EngineMsg => write!(f, "engine control message of {len} bytes"),
                At::RdmaLaneMsg => f.write_str("rdma control message: bad length"),
                At::RdmaKeysReq => f.write_str("rdma key request: bad length"),
                At::RdmaKeys => f.write_str("rdma keys: bad length"),
                at => write!(f, "{at:?}: bad length {len}"),
            },
            P::TrailingBytes {
                at: At::RdmaBlob | At::RdmaBlobDevice | At::RdmaBlobHead,
                ..
            } => f.write_str("rdma blob: trailing bytes"),
            P::TrailingBytes { n, .. } => write!(f, "{n} trailing bytes in control message"),
            P::BadCount { at, n } => match at {
                At::HelloBlobs => write!(f, "{n} transport blobs (max 16)"),
                At::RdmaBlobHead => write!(f, "rdma blob: {n} devices"),
                At::RdmaBlobDevice => f.write_str("rdma blob: bad endpoint count"),
                At::RegionChunks => write!(f, "{n} rdma chunk keys do not cover the region"),
                _ => write!(f, "item count {n} exceeds message"),
            },
            P::BadValue { field, value } => match field {
                Field::Bool => write!(f, "bad boolean {value}"),
                Field::Access => write!(f, "bad access {value}"),
                Field::Mtu => f.write_str("rdma blob: bad MTU"),
                Field::LinkClass => f.write_str("rdma blob: bad link class"),
                Field::DeviceIpc => write!(f, "bad device-memory flag {value} in a region"),
            },
            P::BadUtf8 => f.write_str("invalid utf-8 string"),
            P::BadEndpoint {
                at: At::RdmaLaneMsg,
                reason,
            } => write!(f, "rdma control message: {reason}"),
            P::BadEndpoint { reason, .. } => write!(f, "rdma blob: {reason}"),
            P::Unexpected { stage, got } => {
                let expected = stage.expected();
                match (stage, got) {
                    (_, None) => f.write_str(expected),
                    (Stage::FirstMessage | Stage::Control, Some(m)) => {
                        write!(f, "{expected} {m:?}")
                    }
                    (Stage::LaneJoinAnswer, Some(m)) => write!(f, "{expected}: {m:?}"),
                    (_, Some(m)) => write!(f, "{expected}, got {m:?}"),
                }
            }
            P::UnexpectedKind { stage, kind } => match stage {
                Stage::FirstMessage | Stage::Control | Stage::LaneJoinAnswer => {
                    write!(f, "{} of kind {kind}", stage.expected())
                }
                _ => write!(f, "{}, got a message of kind {kind}", stage.expected()),
            },
            P::LaneAlreadyOpen { lane } => write!(f, "lane {lane} already open"),
            P::WeakKeyShare => f.write_str("the peer's key share is a low-order point"),
            P::ShmAcrossHosts => f.write_str("shm chosen across hosts"),
            P::TransportNotInUse { bit } => {
                write!(f, "transport message for {bit:#x}, which is not in use")
            }
            P::NoTransportMessages { kind } => {
                write!(f, "transport message for {kind:?}, which has none")
            }
            P::UnknownEngineMsg { op, kind } => {
                write!(f, "unknown engine control message {op}/{kind}")
            }
            P::UnexpectedFenceAck { batch } => write!(
                f,
                "notification confirmed for batch {batch}, which awaits none"
            ),
            P::UnknownRdmaOp { op } => write!(f, "rdma control message: op {op}"),
            P::BadLane { lane } => write!(f, "rdma control message: lane {lane}"),
            P::KeysDeviceCount { got, listed } => {
                write!(f, "rdma keys for {got} devices, the peer listed {listed}")
            }
            P::EchoedNonce => f.write_str("rdma blob: the peer echoed our nonce"),
            P::WrongLane { kind, side } => match side {
                LaneSide::Target => write!(f, "unexpected {kind:?} frame on a target lane"),
                LaneSide::Initiator => write!(f, "unexpected {kind:?} frame on an initiator lane"),
            },
            P::ReadSliceLength {
                slice,
                len,
                requested,
            } => write!(
                f,
                "read slice {slice} length {len} != requested {requested}"
            ),
            P::LaneClosedByPeer { reason } => write!(f, "peer closed the lane: {reason}"),
            P::TooManyTracked => f.write_str("too many batches awaiting their notification"),
            P::DuplicateNotify { batch } => write!(f, "second notification for batch {batch}"),
            P::NotAnnouncedMemfd { path } => write!(f, "{path} is not the announced memfd"),
            P::PeerReported { msg } => write!(f, "peer reported: {msg}"),
        }
    }
}

#[cfg(test)]
#[path = "problem_tests.rs"]
mod tests;

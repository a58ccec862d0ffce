//! The engine's own control messages: fences, their answers, heartbeats.
//!
//! They travel as `CtrlMsg::Transport` with the bit [`ENGINE_MSG_BIT`] (not a transport bit),
//! so the control-message codec does not know them; the payload is 10 bytes (18 for a refusal):
//!
//! ```text
//! 0 op (1: fence, 2: its answer, 3: its refusal, 4: heartbeat)
//! 1 kind (1: notification, 2: region withdrawal; 0 for a heartbeat)   2..10 id (u64 LE)
//! 10..18 (refusal only) the bound that refused it (u64 LE)
//! ```
//!
//! A fence asks the receiver to answer once it handled every message sent before it: for a
//! notification (id: its batch) the notification is then queued at the target; for a region
//! withdrawal (id: the withdrawal's sequence number) the region is withdrawn at the peer. A
//! notification fence is refused (op 3) when the notification was not queued because the
//! sender's notification budget at the target is spent (`Error::ResourceLimit`). A heartbeat
//! keeps an idle control connection alive (`Limits::idle_timeout`).

use super::msg::CtrlMsg;
use super::problem::{Layout, ProtocolError};

/// `CtrlMsg::Transport::bit` of the engine's own control messages (not a transport bit).
pub(crate) const ENGINE_MSG_BIT: u8 = 0x80;
/// Op: "answer with [`FENCE_ACK`] once every earlier message was handled".
const FENCE: u8 = 1;
/// Op: the answer to a [`FENCE`], with its kind and id.
const FENCE_ACK: u8 = 2;
/// Op: a notification fence refused: the notification before it was not queued.
const FENCE_NACK: u8 = 3;
/// Op: a heartbeat (kind 0, id 0).
const PING: u8 = 4;
/// Fence kind: a notification (id: its batch) was queued by the target.
const FENCE_NOTIFY: u8 = 1;
/// Fence kind: the peer handled a region withdrawal (id: the unregister sequence number).
const FENCE_REGIONS: u8 = 2;
/// Length of every engine message but a refusal.
const LEN: usize = 10;
/// Length of a refusal.
const NACK_LEN: usize = 18;

/// What a fence waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FenceKind {
    /// A notification was queued (id: its batch).
    Notify,
    /// A region withdrawal took effect (id: the withdrawal's sequence number).
    Regions,
}

/// An engine control message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineMsg {
    /// Answer once every earlier message was handled.
    Fence(FenceKind, u64),
    /// The answer to a fence.
    FenceAck(FenceKind, u64),
    /// A notification fence refused: the notification of batch `id` was not queued (the
    /// sender's notification budget at the target, `limit` bytes, is spent).
    NotifyRefused {
        /// The batch.
        id: u64,
        /// The budget.
        limit: u64,
    },
    /// A heartbeat.
    Ping,
}

impl EngineMsg {
    /// The payload bytes.
    pub(crate) fn encode(self) -> Vec<u8> {
        let kind_code = |k: FenceKind| match k {
            FenceKind::Notify => FENCE_NOTIFY,
            FenceKind::Regions => FENCE_REGIONS,
        };
        let (op, kind, id) = match self {
            EngineMsg::Fence(k, id) => (FENCE, kind_code(k), id),
            EngineMsg::FenceAck(k, id) => (FENCE_ACK, kind_code(k), id),
            EngineMsg::NotifyRefused { id, .. } => (FENCE_NACK, FENCE_NOTIFY, id),
            EngineMsg::Ping => (PING, 0, 0),
        };
        let mut data = Vec::with_capacity(NACK_LEN);
        data.push(op);
        data.push(kind);
        data.extend_from_slice(&id.to_le_bytes());
        if let EngineMsg::NotifyRefused { limit, .. } = self {
            data.extend_from_slice(&limit.to_le_bytes());
        }
        data
    }

    /// The control message carrying it.
    pub(crate) fn to_ctrl(self) -> CtrlMsg {
        CtrlMsg::Transport {
            bit: ENGINE_MSG_BIT,
            data: self.encode(),
        }
    }

    /// Decodes the payload of a `CtrlMsg::Transport` with bit [`ENGINE_MSG_BIT`].
    pub(crate) fn decode(d: &[u8]) -> Result<EngineMsg, ProtocolError> {
        let want = if d.first() == Some(&FENCE_NACK) {
            NACK_LEN
        } else {
            LEN
        };
        if d.len() != want {
            return Err(ProtocolError::BadLength {
                at: Layout::EngineMsg,
                len: d.len(),
            });
        }
        let u64at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&d[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let id = u64at(2);
        let (op, kind) = (d[0], d[1]);
        let unknown = ProtocolError::UnknownEngineMsg { op, kind };
        if op == PING {
            return if kind == 0 && id == 0 {
                Ok(EngineMsg::Ping)
            } else {
                Err(unknown)
            };
        }
        let k = match kind {
            FENCE_NOTIFY => FenceKind::Notify,
            FENCE_REGIONS => FenceKind::Regions,
            _ => return Err(unknown),
        };
        match (op, k) {
            (FENCE, k) => Ok(EngineMsg::Fence(k, id)),
            (FENCE_ACK, k) => Ok(EngineMsg::FenceAck(k, id)),
            (FENCE_NACK, FenceKind::Notify) => Ok(EngineMsg::NotifyRefused {
                id,
                limit: u64at(10),
            }),
            _ => Err(unknown),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_and_refusals() {
        let id = 0x0102_0304_0506_0708u64;
        let cases = [
            (EngineMsg::Fence(FenceKind::Notify, id), [1u8, 1]),
            (EngineMsg::Fence(FenceKind::Regions, id), [1, 2]),
            (EngineMsg::FenceAck(FenceKind::Notify, id), [2, 1]),
            (EngineMsg::FenceAck(FenceKind::Regions, id), [2, 2]),
        ];
        for (m, head) in cases {
            let mut want = head.to_vec();
            want.extend_from_slice(&id.to_le_bytes());
            assert_eq!(m.encode(), want);
            assert_eq!(EngineMsg::decode(&want), Ok(m));
            assert_eq!(
                m.to_ctrl(),
                CtrlMsg::Transport {
                    bit: 0x80,
                    data: want
                }
            );
        }
        let nack = EngineMsg::NotifyRefused { id, limit: 77 };
        let mut want = vec![3u8, 1];
        want.extend_from_slice(&id.to_le_bytes());
        want.extend_from_slice(&77u64.to_le_bytes());
        assert_eq!(nack.encode(), want);
        assert_eq!(EngineMsg::decode(&want), Ok(nack));
        assert_eq!(EngineMsg::Ping.encode(), vec![4, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            EngineMsg::decode(&EngineMsg::Ping.encode()),
            Ok(EngineMsg::Ping)
        );
        for len in [0, 9, 11] {
            assert_eq!(
                EngineMsg::decode(&vec![1; len]).map_err(|e| e.to_string()),
                Err(format!("engine control message of {len} bytes"))
            );
        }
        for (op, kind) in [(0u8, 1u8), (5, 1), (1, 0), (2, 3), (3, 2), (4, 1)] {
            let mut d = vec![op, kind];
            d.resize(if op == 3 { 18 } else { 10 }, 0);
            assert_eq!(
                EngineMsg::decode(&d),
                Err(ProtocolError::UnknownEngineMsg { op, kind })
            );
        }
    }
}

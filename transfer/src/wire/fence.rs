//! The engine's own control messages: fences and their answers.
//!
//! They travel as `CtrlMsg::Transport` with the bit [`ENGINE_MSG_BIT`] (not a transport bit),
//! so the control-message codec does not know them; the payload is 10 bytes:
//!
//! ```text
//! 0 op (1: fence, 2: its answer)   1 kind (1: notification, 2: region withdrawal)   2..10 id (u64 LE)
//! ```
//!
//! A fence asks the receiver to answer once it handled every message sent before it: for a
//! notification (id: its batch) the notification is then queued at the target; for a region
//! withdrawal (id: the withdrawal's sequence number) the region is withdrawn at the peer.

use super::msg::CtrlMsg;
use super::problem::{Layout, ProtocolError};

/// `CtrlMsg::Transport::bit` of the engine's own control messages (not a transport bit).
pub(crate) const ENGINE_MSG_BIT: u8 = 0x80;
/// Op: "answer with [`FENCE_ACK`] once every earlier message was handled".
const FENCE: u8 = 1;
/// Op: the answer to a [`FENCE`], with its kind and id.
const FENCE_ACK: u8 = 2;
/// Fence kind: a notification (id: its batch) was queued by the target.
const FENCE_NOTIFY: u8 = 1;
/// Fence kind: the peer handled a region withdrawal (id: the unregister sequence number).
const FENCE_REGIONS: u8 = 2;
/// Length of every engine message.
const LEN: usize = 10;

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
}

impl EngineMsg {
    /// The payload bytes.
    pub(crate) fn encode(self) -> Vec<u8> {
        let (op, kind, id) = match self {
            EngineMsg::Fence(k, id) => (FENCE, k, id),
            EngineMsg::FenceAck(k, id) => (FENCE_ACK, k, id),
        };
        let mut data = Vec::with_capacity(LEN);
        data.push(op);
        data.push(match kind {
            FenceKind::Notify => FENCE_NOTIFY,
            FenceKind::Regions => FENCE_REGIONS,
        });
        data.extend_from_slice(&id.to_le_bytes());
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
        if d.len() != LEN {
            return Err(ProtocolError::BadLength {
                at: Layout::EngineMsg,
                len: d.len(),
            });
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&d[2..]);
        let id = u64::from_le_bytes(id);
        let (op, kind) = (d[0], d[1]);
        let k = match kind {
            FENCE_NOTIFY => FenceKind::Notify,
            FENCE_REGIONS => FenceKind::Regions,
            _ => return Err(ProtocolError::UnknownEngineMsg { op, kind }),
        };
        match op {
            FENCE => Ok(EngineMsg::Fence(k, id)),
            FENCE_ACK => Ok(EngineMsg::FenceAck(k, id)),
            _ => Err(ProtocolError::UnknownEngineMsg { op, kind }),
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
        for len in [0, 9, 11] {
            assert_eq!(
                EngineMsg::decode(&vec![1; len]).map_err(|e| e.to_string()),
                Err(format!("engine control message of {len} bytes"))
            );
        }
        for (op, kind) in [(0u8, 1u8), (3, 1), (1, 0), (2, 3)] {
            let mut d = vec![op, kind];
            d.extend_from_slice(&[0; 8]);
            assert_eq!(
                EngineMsg::decode(&d),
                Err(ProtocolError::UnknownEngineMsg { op, kind })
            );
        }
    }
}

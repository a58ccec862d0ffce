//! The RDMA transport's bytes: its handshake blob and its control messages.
//!
//! Handshake blob (`Hello`/`HelloReply`, transport bit `TRANSPORT_RDMA`):
//!
//! ```text
//! nonce (16)  device count (u8, 1..=16)
//! per device: port (u8)  GID index (u8)  MTU code (u8)  link class (u8)  QP count (u8, 1..=64)
//!             QP count x endpoint (`Endpoint::ENCODED_LEN` bytes each)
//! ```
//!
//! Control messages (`CtrlMsg::Transport` with bit `TRANSPORT_RDMA`), all integers little
//! endian, told apart by their first byte:
//!
//! ```text
//! 1 reconnect request   [1][lane u8][nonce u64][endpoint]
//! 2 reconnect answer    [2][lane u8][nonce u64][endpoint]
//! 3 key request         [3][count u16][(region index u32, generation u32) x count]
//! 4 keys                [4][devices u8][count u16]
//!                       [(index u32, generation u32, chunks u16, rkey u32 x devices x chunks) x count]
//! ```
//!
//! A key answer carries all-zero keys for a region that is not (or no longer) offered; a
//! region registered in chunks (`wire::MrChunks`) has every chunk's keys, chunk by chunk, each
//! with one key per device.

use kvwire_verbs::{Endpoint, Mtu};

use super::msg::{CtrlMsg, MAX_MR_CHUNKS, MAX_TRANSPORT_MSG, TRANSPORT_RDMA};
use super::problem::{Field, Layout, ProtocolError};
use crate::types::RegionId;

/// At most this many devices per engine.
pub(crate) const MAX_DEVICES: usize = 16;
/// At most this many lanes (QPs) per peer over all device pairs (the per-batch lane mask is a
/// `u64`; reconnection messages name a lane in one byte).
pub(crate) const MAX_LANES: usize = 64;
/// Blob: nonce(16) + device count(1).
pub(crate) const BLOB_HEAD: usize = 16 + 1;
/// Per device in the blob: port, GID index, MTU code, link class, QP count.
pub(crate) const BLOB_DEV_HEAD: usize = 5;

/// Link classes that can reach each other (same link layer; RoCE: same GID family).
pub(crate) const LINK_ETH_V4: u8 = 1;
pub(crate) const LINK_ETH_V6: u8 = 2;
pub(crate) const LINK_IB: u8 = 3;

/// Reconnection request: `[1][lane][nonce u64][endpoint]`; answer: `[2][lane][nonce][endpoint]`.
const MSG_RECONNECT: u8 = 1;
const MSG_RECONNECT_ACK: u8 = 2;
const MSG_LEN: usize = 10 + Endpoint::ENCODED_LEN;
/// Remote keys request: `[3][count u16][(region index u32, generation u32) x count]`.
const MSG_KEYS_REQ: u8 = 3;
/// Remote keys: `[4][devices u8][count u16][(index u32, generation u32, chunks u16, rkey u32 x
/// devices x chunks) x count]`; all-zero keys for a region that is not (or no longer) offered.
const MSG_KEYS: u8 = 4;
/// Bytes of a key answer before its entries, and of an entry before its keys.
const KEYS_HEAD: usize = 4;
const KEYS_ENTRY_HEAD: usize = 10;

/// Regions named in one key request (it fits a transport message).
pub(crate) const KEYS_REQ_PER_MSG: usize = (MAX_TRANSPORT_MSG - 3) / 8;

/// Bytes of a key answer's entry with `keys` keys (every device's of every chunk).
pub(crate) const fn keys_entry_len(keys: usize) -> usize {
    KEYS_ENTRY_HEAD + 4 * keys
}

/// Room for entries in one key answer (it fits a transport message).
pub(crate) const KEYS_ROOM: usize = MAX_TRANSPORT_MSG - KEYS_HEAD;

/// One local device as our blob describes it.
pub(crate) struct BlobDev {
    pub port: u8,
    pub gid_index: u8,
    pub mtu: Mtu,
    pub link: u8,
    /// One per prepared queue pair.
    pub endpoints: Vec<Endpoint>,
}

/// Our handshake blob.
pub(crate) fn encode_blob(nonce: &[u8; 16], devs: &[BlobDev]) -> Vec<u8> {
    let lanes = devs.iter().map(|d| d.endpoints.len()).max().unwrap_or(0);
    let mut b = Vec::with_capacity(
        BLOB_HEAD + devs.len() * (BLOB_DEV_HEAD + lanes * Endpoint::ENCODED_LEN),
    );
    b.extend_from_slice(nonce);
    b.push(devs.len() as u8);
    for d in devs {
        b.push(d.port);
        b.push(d.gid_index);
        b.push(mtu_code(d.mtu));
        b.push(d.link);
        b.push(d.endpoints.len() as u8);
        for ep in &d.endpoints {
            b.extend_from_slice(&ep.to_bytes());
        }
    }
    b
}

/// The nonce a blob starts with (`None` for a blob too short to carry one).
pub(crate) fn blob_nonce(b: &[u8]) -> Option<[u8; 16]> {
    let mut n = [0u8; 16];
    n.copy_from_slice(b.get(..16)?);
    Some(n)
}

pub(crate) fn mtu_code(m: Mtu) -> u8 {
    match m {
        Mtu::M256 => 1,
        Mtu::M512 => 2,
        Mtu::M1024 => 3,
        Mtu::M2048 => 4,
        Mtu::M4096 => 5,
    }
}

pub(crate) fn mtu_from_code(c: u8) -> Option<Mtu> {
    Some(match c {
        1 => Mtu::M256,
        2 => Mtu::M512,
        3 => Mtu::M1024,
        4 => Mtu::M2048,
        5 => Mtu::M4096,
        _ => return None,
    })
}

/// One device of a parsed remote blob.
#[derive(Debug, PartialEq)]
pub(crate) struct RemoteDev {
    pub mtu: Mtu,
    pub link: u8,
    pub endpoints: Vec<Endpoint>,
}

/// A parsed remote blob.
#[derive(Debug)]
pub(crate) struct RemoteBlob {
    pub nonce: [u8; 16],
    pub devs: Vec<RemoteDev>,
}

/// Parses a peer's handshake blob (every length bounded, every code checked).
pub(crate) fn parse_blob(b: &[u8]) -> Result<RemoteBlob, ProtocolError> {
    if b.len() < BLOB_HEAD {
        return Err(ProtocolError::Truncated {
            at: Layout::RdmaBlobHead,
            need: BLOB_HEAD,
            have: b.len(),
        });
    }
    let mut nonce = [0u8; 16];
    nonce.copy_from_slice(&b[..16]);
    let n = b[16] as usize;
    if n == 0 || n > MAX_DEVICES {
        return Err(ProtocolError::BadCount {
            at: Layout::RdmaBlobHead,
            n,
        });
    }
    let mut at = BLOB_HEAD;
    let mut devs = Vec::with_capacity(n);
    for _ in 0..n {
        let h = b
            .get(at..at + BLOB_DEV_HEAD)
            .ok_or(ProtocolError::Truncated {
                at: Layout::RdmaBlobDevice,
                need: at + BLOB_DEV_HEAD,
                have: b.len(),
            })?;
        let mtu = mtu_from_code(h[2]).ok_or(ProtocolError::BadValue {
            field: Field::Mtu,
            value: h[2],
        })?;
        let link = h[3];
        if !matches!(link, LINK_ETH_V4 | LINK_ETH_V6 | LINK_IB) {
            return Err(ProtocolError::BadValue {
                field: Field::LinkClass,
                value: link,
            });
        }
        let q = h[4] as usize;
        if q == 0 || q > MAX_LANES {
            return Err(ProtocolError::BadCount {
                at: Layout::RdmaBlobDevice,
                n: q,
            });
        }
        at += BLOB_DEV_HEAD;
        let body = b
            .get(at..at + q * Endpoint::ENCODED_LEN)
            .ok_or(ProtocolError::Truncated {
                at: Layout::RdmaBlob,
                need: at + q * Endpoint::ENCODED_LEN,
                have: b.len(),
            })?;
        let endpoints = body
            .chunks_exact(Endpoint::ENCODED_LEN)
            .map(Endpoint::from_bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ProtocolError::BadEndpoint {
                at: Layout::RdmaBlob,
                reason: e.to_string(),
            })?;
        at += q * Endpoint::ENCODED_LEN;
        devs.push(RemoteDev {
            mtu,
            link,
            endpoints,
        });
    }
    if at != b.len() {
        return Err(ProtocolError::TrailingBytes {
            at: Layout::RdmaBlob,
            n: b.len() - at,
        });
    }
    Ok(RemoteBlob { nonce, devs })
}

/// What a reconnection message asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LaneOp {
    /// Re-establish the lane with this endpoint.
    Reconnect,
    /// The answer to a [`LaneOp::Reconnect`], with the answering side's endpoint.
    ReconnectAck,
    /// An op this build does not know (refused by the receiver after its own checks).
    Unknown(u8),
}

/// An RDMA control message.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum RdmaMsg {
    /// Queue pair reconnection of one lane.
    Lane {
        op: LaneOp,
        lane: usize,
        /// Tie-break between two requests crossing each other.
        nonce: u64,
        ep: Endpoint,
    },
    /// Asks for the rkeys of these regions on every device of the receiver.
    KeysReq(Vec<RegionId>),
    /// The sender's rkeys of some of its regions: `ndev` per chunk, chunk by chunk (one
    /// chunk unless the region is registered in chunks).
    Keys {
        ndev: u8,
        entries: Vec<(RegionId, Vec<u32>)>,
    },
}

impl RdmaMsg {
    /// The message's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            RdmaMsg::Lane {
                op,
                lane,
                nonce,
                ep,
            } => {
                let mut d = Vec::with_capacity(MSG_LEN);
                d.push(match op {
                    LaneOp::Reconnect => MSG_RECONNECT,
                    LaneOp::ReconnectAck => MSG_RECONNECT_ACK,
                    LaneOp::Unknown(op) => *op,
                });
                d.push(*lane as u8);
                d.extend_from_slice(&nonce.to_le_bytes());
                d.extend_from_slice(&ep.to_bytes());
                d
            }
            RdmaMsg::KeysReq(ids) => {
                let mut d = Vec::with_capacity(3 + ids.len() * 8);
                d.push(MSG_KEYS_REQ);
                d.extend_from_slice(&(ids.len() as u16).to_le_bytes());
                for id in ids {
                    d.extend_from_slice(&id.index.to_le_bytes());
                    d.extend_from_slice(&id.generation.to_le_bytes());
                }
                d
            }
            RdmaMsg::Keys { ndev, entries } => {
                let len: usize = entries.iter().map(|(_, k)| keys_entry_len(k.len())).sum();
                let mut out = Vec::with_capacity(KEYS_HEAD + len);
                out.push(MSG_KEYS);
                out.push(*ndev);
                out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
                for (id, keys) in entries {
                    out.extend_from_slice(&id.index.to_le_bytes());
                    out.extend_from_slice(&id.generation.to_le_bytes());
                    let chunks = keys.len() / usize::from(*ndev).max(1);
                    out.extend_from_slice(&(chunks as u16).to_le_bytes());
                    for k in keys {
                        out.extend_from_slice(&k.to_le_bytes());
                    }
                }
                out
            }
        }
    }

    /// The control message carrying it.
    pub(crate) fn to_ctrl(&self) -> CtrlMsg {
        CtrlMsg::Transport {
            bit: TRANSPORT_RDMA,
            data: self.encode(),
        }
    }

    /// Decodes a message from a peer with `lanes` lanes towards us that listed `remote_devs`
    /// devices in its handshake. The checks run in a fixed order (key messages: length, device
    /// count, length of the entries; lane messages: length, lane, endpoint), so a message with
    /// several faults is always refused for the same one. A lane message with an unknown op
    /// decodes (as [`LaneOp::Unknown`]); the receiver refuses it.
    pub(crate) fn decode(
        d: &[u8],
        lanes: usize,
        remote_devs: usize,
    ) -> Result<RdmaMsg, ProtocolError> {
        match d.first() {
            Some(&MSG_KEYS_REQ) => return decode_keys_req(d),
            Some(&MSG_KEYS) => return decode_keys(d, remote_devs),
            _ => {}
        }
        if d.len() != MSG_LEN {
            return Err(ProtocolError::BadLength {
                at: Layout::RdmaLaneMsg,
                len: d.len(),
            });
        }
        let lane = d[1] as usize;
        if lane >= lanes {
            return Err(ProtocolError::BadLane { lane });
        }
        let mut n = [0u8; 8];
        n.copy_from_slice(&d[2..10]);
        let nonce = u64::from_le_bytes(n);
        let ep = Endpoint::from_bytes(&d[10..]).map_err(|e| ProtocolError::BadEndpoint {
            at: Layout::RdmaLaneMsg,
            reason: e.to_string(),
        })?;
        let op = match d[0] {
            MSG_RECONNECT => LaneOp::Reconnect,
            MSG_RECONNECT_ACK => LaneOp::ReconnectAck,
            op => LaneOp::Unknown(op),
        };
        Ok(RdmaMsg::Lane {
            op,
            lane,
            nonce,
            ep,
        })
    }
}

fn decode_keys_req(d: &[u8]) -> Result<RdmaMsg, ProtocolError> {
    let bad = || ProtocolError::BadLength {
        at: Layout::RdmaKeysReq,
        len: d.len(),
    };
    let n = u16::from_le_bytes([*d.get(1).ok_or_else(bad)?, *d.get(2).ok_or_else(bad)?]) as usize;
    if d.len() != 3 + n * 8 {
        return Err(bad());
    }
    Ok(RdmaMsg::KeysReq(
        d[3..]
            .chunks_exact(8)
            .map(|c| RegionId {
                index: u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                generation: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            })
            .collect(),
    ))
}

fn decode_keys(d: &[u8], remote_devs: usize) -> Result<RdmaMsg, ProtocolError> {
    let bad = || ProtocolError::BadLength {
        at: Layout::RdmaKeys,
        len: d.len(),
    };
    if d.len() < KEYS_HEAD {
        return Err(bad());
    }
    let ndev = d[1] as usize;
    let n = u16::from_le_bytes([d[2], d[3]]) as usize;
    if ndev != remote_devs {
        return Err(ProtocolError::KeysDeviceCount {
            got: ndev,
            listed: remote_devs,
        });
    }
    let w = |i: usize| u32::from_le_bytes([d[i], d[i + 1], d[i + 2], d[i + 3]]);
    let mut entries = Vec::with_capacity(n.min(KEYS_ROOM / KEYS_ENTRY_HEAD));
    let mut at = KEYS_HEAD;
    for _ in 0..n {
        if d.len() < at + KEYS_ENTRY_HEAD {
            return Err(bad());
        }
        let chunks = u16::from_le_bytes([d[at + 8], d[at + 9]]) as usize;
        if chunks == 0 || chunks > MAX_MR_CHUNKS {
            return Err(ProtocolError::BadCount {
                at: Layout::RegionChunks,
                n: chunks,
            });
        }
        let end = at + keys_entry_len(chunks * ndev);
        if d.len() < end {
            return Err(bad());
        }
        let id = RegionId {
            index: w(at),
            generation: w(at + 4),
        };
        let keys = (0..chunks * ndev)
            .map(|i| w(at + KEYS_ENTRY_HEAD + 4 * i))
            .collect();
        entries.push((id, keys));
        at = end;
    }
    if at != d.len() {
        return Err(bad());
    }
    Ok(RdmaMsg::Keys {
        ndev: d[1],
        entries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(q: u32) -> Endpoint {
        Endpoint {
            gid: kvwire_verbs::Gid([1; 16]),
            qpn: q,
            psn: 3,
            lid: 0,
        }
    }

    fn blob(devs: &[(u8, u8, &[Endpoint])]) -> Vec<u8> {
        let mut b = vec![7u8; 16];
        b.push(devs.len() as u8);
        for (mtu, link, eps) in devs {
            b.extend_from_slice(&[1, 1, *mtu, *link, eps.len() as u8]);
            for e in *eps {
                b.extend_from_slice(&e.to_bytes());
            }
        }
        b
    }

    #[test]
    fn blob_parsing_rejects_malformed_input() {
        assert!(parse_blob(&[]).is_err());
        assert!(parse_blob(&blob(&[])).is_err()); // no devices
        let good = blob(&[(5, LINK_ETH_V4, &[ep(17), ep(18)]), (3, LINK_IB, &[ep(19)])]);
        let p = parse_blob(&good).expect("valid blob");
        assert_eq!(p.nonce, [7u8; 16]);
        assert_eq!(p.devs.len(), 2);
        assert_eq!(p.devs[0].endpoints, vec![ep(17), ep(18)]);
        assert_eq!(p.devs[0].mtu, Mtu::M4096);
        assert_eq!(p.devs[1].mtu, Mtu::M1024);
        assert_eq!(p.devs[1].link, LINK_IB);
        // every truncation is refused
        for n in 0..good.len() {
            assert!(parse_blob(&good[..n]).is_err(), "truncated to {n}");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(parse_blob(&long).is_err()); // trailing byte
        assert!(parse_blob(&blob(&[(9, LINK_ETH_V4, &[ep(1)])])).is_err()); // bad MTU
        assert!(parse_blob(&blob(&[(5, 0, &[ep(1)])])).is_err()); // bad link class
        assert!(parse_blob(&blob(&[(5, LINK_ETH_V4, &[])])).is_err()); // no endpoints
        let mut b = blob(&[(5, LINK_ETH_V4, &[ep(1)])]);
        b[BLOB_HEAD + BLOB_DEV_HEAD + 16..BLOB_HEAD + BLOB_DEV_HEAD + 20]
            .copy_from_slice(&0u32.to_be_bytes());
        assert!(parse_blob(&b).is_err()); // QPN 0
        let mut b = good.clone();
        b[16] = 200; // more devices than allowed
        assert!(parse_blob(&b).is_err());
    }

    #[test]
    fn our_blob_parses_back() {
        let devs = [
            BlobDev {
                port: 1,
                gid_index: 3,
                mtu: Mtu::M1024,
                link: LINK_ETH_V6,
                endpoints: vec![ep(5), ep(6)],
            },
            BlobDev {
                port: 1,
                gid_index: 0,
                mtu: Mtu::M4096,
                link: LINK_IB,
                endpoints: vec![ep(7)],
            },
        ];
        let b = encode_blob(&[9; 16], &devs);
        assert_eq!(&b[16..22], &[2, 1, 3, 3, LINK_ETH_V6, 2]);
        assert_eq!(blob_nonce(&b), Some([9; 16]));
        assert_eq!(blob_nonce(&b[..15]), None);
        let p = parse_blob(&b).expect("our own blob");
        assert_eq!(p.nonce, [9; 16]);
        assert_eq!(p.devs[0].endpoints, vec![ep(5), ep(6)]);
        assert_eq!((p.devs[1].mtu, p.devs[1].link), (Mtu::M4096, LINK_IB));
    }

    #[test]
    fn control_messages_keep_their_bytes_and_refusal_order() {
        let e = ep(21);
        let m = RdmaMsg::Lane {
            op: LaneOp::ReconnectAck,
            lane: 3,
            nonce: 0x1122_3344_5566_7788,
            ep: e,
        };
        let mut want = vec![2u8, 3];
        want.extend_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        want.extend_from_slice(&e.to_bytes());
        assert_eq!(m.encode(), want);
        assert_eq!(RdmaMsg::decode(&want, 4, 1), Ok(m));
        let err = |d: &[u8], lanes, devs| RdmaMsg::decode(d, lanes, devs).unwrap_err().to_string();
        assert_eq!(err(&want, 3, 1), "rdma control message: lane 3");
        assert_eq!(err(&want[..5], 4, 1), "rdma control message: bad length");
        assert_eq!(err(&[], 4, 1), "rdma control message: bad length");
        let mut unknown = want.clone();
        unknown[0] = 9;
        assert!(matches!(
            RdmaMsg::decode(&unknown, 4, 1),
            Ok(RdmaMsg::Lane {
                op: LaneOp::Unknown(9),
                ..
            })
        ));
        let ids = vec![
            RegionId {
                index: 1,
                generation: 2,
            },
            RegionId {
                index: 0x0a0b_0c0d,
                generation: 7,
            },
        ];
        let req = RdmaMsg::KeysReq(ids.clone());
        let mut want = vec![3u8, 2, 0];
        for id in &ids {
            want.extend_from_slice(&id.index.to_le_bytes());
            want.extend_from_slice(&id.generation.to_le_bytes());
        }
        assert_eq!(req.encode(), want);
        assert_eq!(RdmaMsg::decode(&want, 0, 0), Ok(req));
        assert_eq!(
            err(&want[..want.len() - 1], 0, 0),
            "rdma key request: bad length"
        );
        assert_eq!(err(&[3, 1], 0, 0), "rdma key request: bad length");
        let keys = RdmaMsg::Keys {
            ndev: 2,
            entries: vec![(ids[0], vec![5, 6]), (ids[1], vec![0, 0])],
        };
        let mut want = vec![4u8, 2, 2, 0];
        for (id, k) in [(ids[0], [5u32, 6]), (ids[1], [0, 0])] {
            want.extend_from_slice(&id.index.to_le_bytes());
            want.extend_from_slice(&id.generation.to_le_bytes());
            want.extend_from_slice(&1u16.to_le_bytes());
            for k in k {
                want.extend_from_slice(&k.to_le_bytes());
            }
        }
        assert_eq!(keys.encode(), want);
        assert_eq!(RdmaMsg::decode(&want, 0, 2), Ok(keys));
        assert_eq!(err(&want[..3], 0, 2), "rdma keys: bad length");
        // the device count is checked before the length of the entries
        assert_eq!(
            err(&want[..5], 0, 3),
            "rdma keys for 2 devices, the peer listed 3"
        );
        assert_eq!(err(&want[..5], 0, 2), "rdma keys: bad length");
        const { assert!(KEYS_REQ_PER_MSG * 8 + 3 <= MAX_TRANSPORT_MSG) };
        // every device's keys of every chunk of one region fit one answer
        const { assert!(keys_entry_len(MAX_DEVICES * MAX_MR_CHUNKS) <= KEYS_ROOM) };
    }

    #[test]
    fn keys_of_a_region_in_chunks_round_trip_and_bad_chunk_counts_are_refused() {
        let err = |d: &[u8], lanes, devs| RdmaMsg::decode(d, lanes, devs).unwrap_err().to_string();
        let id = RegionId {
            index: 4,
            generation: 9,
        };
        // two devices, three chunks: chunk by chunk, a key per device
        let keys = RdmaMsg::Keys {
            ndev: 2,
            entries: vec![(id, vec![1, 2, 3, 4, 5, 6]), (id, vec![7, 8])],
        };
        let bytes = keys.encode();
        assert_eq!(
            bytes.len(),
            KEYS_HEAD + keys_entry_len(6) + keys_entry_len(2)
        );
        assert_eq!(&bytes[12..14], &3u16.to_le_bytes());
        assert_eq!(RdmaMsg::decode(&bytes, 0, 2), Ok(keys));
        let mut zero = bytes.clone();
        zero[12..14].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(
            err(&zero, 0, 2),
            "0 rdma chunk keys do not cover the region"
        );
        let mut over = bytes.clone();
        over[12..14].copy_from_slice(&(MAX_MR_CHUNKS as u16 + 1).to_le_bytes());
        assert!(err(&over, 0, 2).contains("rdma chunk keys"));
        let mut long = bytes.clone();
        long[12..14].copy_from_slice(&9u16.to_le_bytes()); // more keys than the message has
        assert_eq!(err(&long, 0, 2), "rdma keys: bad length");
        let mut trailing = bytes;
        trailing.push(0);
        assert_eq!(err(&trailing, 0, 2), "rdma keys: bad length");
    }
}

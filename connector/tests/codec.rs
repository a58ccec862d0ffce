//! Property tests of the message codec: arbitrary bytes never panic, round trips hold,
//! truncations and oversized counts give typed errors.

use kvwire_connector::msg::{
    DecodeError, EncodeError, Message, HEADER_LEN, MAGIC, MAX_BLOCKS, MAX_BODY_LEN, MAX_LAYERS,
    VERSION,
};
use kvwire_connector::{FailReason, RequestId};
use proptest::prelude::*;

fn reason() -> impl Strategy<Value = FailReason> {
    prop_oneof![
        Just(FailReason::PeerDown),
        Just(FailReason::PeerRestarted),
        Just(FailReason::LocalAbort),
        Just(FailReason::RemoteAbort),
        Just(FailReason::TransferError),
        Just(FailReason::Timeout),
        Just(FailReason::Protocol),
    ]
}

fn message() -> impl Strategy<Value = Message> {
    let req = any::<u64>().prop_map(RequestId);
    prop_oneof![
        (req.clone(), any::<u32>(), any::<u32>()).prop_map(|(req, tokens, blocks)| {
            Message::Announce {
                req,
                tokens,
                blocks,
            }
        }),
        (req.clone(), 0..=MAX_LAYERS, any::<u32>()).prop_map(|(req, layers, blocks)| {
            Message::Started {
                req,
                layers,
                blocks,
            }
        }),
        req.clone().prop_map(|req| Message::PrefillDone { req }),
        req.clone().prop_map(|req| Message::Queued { req }),
        (
            req.clone(),
            any::<u32>(),
            any::<bool>(),
            proptest::collection::vec(any::<u32>(), 0..300)
        )
            .prop_map(|(req, first, landing, blocks)| Message::BlockIds {
                req,
                first,
                landing,
                blocks
            }),
        (req.clone(), 0..MAX_LAYERS, any::<u64>())
            .prop_map(|(req, layer, bytes)| Message::LayerSent { req, layer, bytes }),
        (req.clone(), 0..=MAX_LAYERS, any::<u64>())
            .prop_map(|(req, layers, bytes)| Message::AllSent { req, layers, bytes }),
        (req, reason()).prop_map(|(req, reason)| Message::Abort { req, reason }),
        (any::<u64>(), any::<u64>())
            .prop_map(|(incarnation, seq)| Message::Heartbeat { incarnation, seq }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Message::decode(&bytes);
        let _ = Message::decode_prefix(&bytes);
    }

    #[test]
    fn valid_header_arbitrary_body_never_panics(
        kind in 0u8..12,
        body in proptest::collection::vec(any::<u8>(), 0..256),
        lie in any::<bool>(),
        len in any::<u32>(),
    ) {
        let mut buf = Vec::new();
        buf.extend_from_slice(&MAGIC);
        buf.push(VERSION);
        buf.push(kind);
        let l = if lie { len } else { body.len() as u32 };
        buf.extend_from_slice(&l.to_le_bytes());
        buf.extend_from_slice(&body);
        if let Ok(m) = Message::decode(&buf) {
            // Whatever decodes re-encodes to the same bytes.
            prop_assert_eq!(m.encode().unwrap(), buf);
        }
    }

    #[test]
    fn round_trip(m in message()) {
        let bytes = m.encode().unwrap();
        prop_assert_eq!(Message::decode(&bytes), Ok(m.clone()));
        // Two frames back to back decode one after the other.
        let mut two = bytes.clone();
        m.encode_into(&mut two).unwrap();
        let (first, used) = Message::decode_prefix(&two).unwrap();
        prop_assert_eq!(&first, &m);
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(Message::decode(&two[used..]), Ok(m));
    }

    #[test]
    fn every_truncation_is_a_typed_error(m in message(), cut in any::<prop::sample::Index>()) {
        let bytes = m.encode().unwrap();
        let at = cut.index(bytes.len());
        let err = Message::decode(&bytes[..at]).unwrap_err();
        let needed = if at < HEADER_LEN { HEADER_LEN } else { bytes.len() };
        prop_assert_eq!(err, DecodeError::Truncated { needed, have: at });
    }

    #[test]
    fn trailing_bytes_are_refused(m in message(), extra in 1usize..16) {
        let mut bytes = m.encode().unwrap();
        bytes.extend(std::iter::repeat_n(0u8, extra));
        prop_assert_eq!(Message::decode(&bytes), Err(DecodeError::TrailingBytes { extra }));
    }

    #[test]
    fn oversized_block_counts_are_refused(count in (MAX_BLOCKS as u32 + 1)..=u32::MAX) {
        let mut bytes = Message::BlockIds { req: RequestId(1), first: 0, landing: false, blocks: vec![] }.encode().unwrap();
        bytes[HEADER_LEN + 13..HEADER_LEN + 17].copy_from_slice(&count.to_le_bytes());
        prop_assert_eq!(
            Message::decode(&bytes),
            Err(DecodeError::TooManyBlocks { count: count as usize, max: MAX_BLOCKS })
        );
    }

    #[test]
    fn block_count_disagreeing_with_length_is_refused(n in 0usize..64, claim in 0u32..1000) {
        prop_assume!(claim as usize != n);
        let mut bytes = Message::BlockIds { req: RequestId(1), first: 0, landing: false, blocks: vec![7; n] }
            .encode()
            .unwrap();
        bytes[HEADER_LEN + 13..HEADER_LEN + 17].copy_from_slice(&claim.to_le_bytes());
        prop_assert_eq!(
            Message::decode(&bytes),
            Err(DecodeError::CountMismatch { count: claim as usize, body_len: 17 + 4 * n })
        );
    }

    #[test]
    fn oversized_layer_counts_are_refused(layers in (MAX_LAYERS + 1)..=u16::MAX) {
        let mut bytes = Message::Started { req: RequestId(1), layers: 1, blocks: 1 }
            .encode()
            .unwrap();
        bytes[HEADER_LEN + 8..HEADER_LEN + 10].copy_from_slice(&layers.to_le_bytes());
        prop_assert_eq!(
            Message::decode(&bytes),
            Err(DecodeError::TooManyLayers { count: layers, max: MAX_LAYERS })
        );
        prop_assert_eq!(
            Message::Started { req: RequestId(1), layers, blocks: 1 }.encode(),
            Err(EncodeError::TooManyLayers { count: layers, max: MAX_LAYERS })
        );
    }
}

#[test]
fn header_errors_are_typed() {
    let good = Message::PrefillDone { req: RequestId(9) }.encode().unwrap();
    let mut b = good.clone();
    b[0] = b'X';
    assert_eq!(
        Message::decode(&b),
        Err(DecodeError::BadMagic([b'X', MAGIC[1]]))
    );
    let mut b = good.clone();
    b[2] = VERSION + 1;
    assert_eq!(
        Message::decode(&b),
        Err(DecodeError::UnsupportedVersion(VERSION + 1))
    );
    let mut b = good.clone();
    b[3] = 200;
    assert_eq!(Message::decode(&b), Err(DecodeError::UnknownType(200)));
    let mut b = good.clone();
    b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        Message::decode(&b),
        Err(DecodeError::BodyTooLong {
            len: u32::MAX as usize,
            max: MAX_BODY_LEN
        })
    );
    let mut b = good;
    b[4..8].copy_from_slice(&9u32.to_le_bytes());
    b.push(0);
    assert_eq!(
        Message::decode(&b),
        Err(DecodeError::BadBodyLength { kind: 3, len: 9 })
    );
    let mut abort = Message::Abort {
        req: RequestId(1),
        reason: FailReason::Timeout,
    }
    .encode()
    .unwrap();
    let last = abort.len() - 1;
    abort[last] = 99;
    assert_eq!(Message::decode(&abort), Err(DecodeError::UnknownReason(99)));
}

#[test]
fn encoder_refuses_what_the_decoder_would() {
    let too_many = Message::BlockIds {
        req: RequestId(1),
        first: 0,
        landing: false,
        blocks: vec![0; MAX_BLOCKS + 1],
    };
    assert_eq!(
        too_many.encode(),
        Err(EncodeError::TooManyBlocks {
            count: MAX_BLOCKS + 1,
            max: MAX_BLOCKS
        })
    );
    let max = Message::BlockIds {
        req: RequestId(1),
        first: 0,
        landing: false,
        blocks: vec![3; MAX_BLOCKS],
    };
    let bytes = max.encode().unwrap();
    assert_eq!(bytes.len(), HEADER_LEN + MAX_BODY_LEN);
    assert_eq!(Message::decode(&bytes), Ok(max));
}

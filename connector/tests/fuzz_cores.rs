//! Property tests: arbitrary interleavings of host events, peer messages (including
//! nonsense, duplicates and out-of-range values) and timeouts never panic either core, and
//! every reservation handed to a core comes back at most once.

use kvwire_connector::msg::Message;
use kvwire_connector::*;
use proptest::prelude::*;
use std::collections::HashMap;

#[derive(Clone, Debug)]
enum Step {
    Host(u8, u64, u16),
    Peer(u8, u64, u16, u32),
    Time(u64),
    Bytes(Vec<u8>),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u8..9, 0u64..5, 0u16..6).prop_map(|(k, r, l)| Step::Host(k, r, l)),
        (0u8..9, 0u64..5, 0u16..6, 0u32..5).prop_map(|(k, r, l, n)| Step::Peer(k, r, l, n)),
        (0u64..5_000_000_000).prop_map(Step::Time),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(Step::Bytes),
    ]
}

fn peer_msg(k: u8, req: RequestId, l: u16, n: u32) -> Message {
    match k {
        0 => Message::Announce {
            req,
            tokens: n * 16,
            blocks: n,
        },
        1 => Message::Started {
            req,
            layers: l,
            blocks: n,
        },
        2 => Message::PrefillDone { req },
        3 => Message::BlockIds {
            req,
            first: 0,
            landing: false,
            blocks: (0..n).collect(),
        },
        4 => Message::LayerSent {
            req,
            layer: l,
            bytes: 1,
        },
        5 => Message::AllSent {
            req,
            layers: l,
            bytes: 1,
        },
        6 => Message::Abort {
            req,
            reason: FailReason::Timeout,
        },
        _ => Message::Heartbeat {
            incarnation: u64::from(n % 2),
            seq: 0,
        },
    }
}

const LAYERS: u16 = 4;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1_000))]

    #[test]
    fn d_core_never_panics_and_returns_each_reservation_at_most_once(
        steps in proptest::collection::vec(step(), 0..120),
        policy in 0u8..3,
    ) {
        let policy = Policy::ALL[policy as usize];
        let mut d = DSide::new(DConfig::new(policy, LAYERS));
        let p = PeerId(1);
        let mut now: Nanos = u64::MAX - 10_000_000_000;
        let mut next_block = 0u32;
        // Blocks the host handed to the core and has not got back.
        let mut held: HashMap<BlockId, RequestId> = HashMap::new();
        for s in steps {
            match s {
                Step::Host(k, r, l) => {
                    let req = RequestId(r);
                    let ev = match k {
                        0 => DEvent::Arrived { req, peer: p, tokens: 32, blocks: 2 },
                        1 => {
                            let blocks = vec![next_block, next_block + 1];
                            next_block += 2;
                            DEvent::Reserved { req, blocks }
                        }
                        2 => DEvent::LayerLanded { req, layer: l, bytes: 1 },
                        3 => DEvent::Reported { req },
                        4 => DEvent::Promoted { req },
                        5 => DEvent::FirstToken { req },
                        6 => DEvent::Abort { req },
                        7 => DEvent::PeerDown { peer: p },
                        _ => DEvent::PeerUp { peer: p },
                    };
                    let given = match &ev {
                        DEvent::Reserved { req, blocks } => Some((*req, blocks.clone())),
                        _ => None,
                    };
                    let promoted = matches!(ev, DEvent::Promoted { .. });
                    let res = d.handle(ev, now);
                    if let (Some((req, blocks)), Ok(())) = (given, &res) {
                        for b in blocks {
                            held.insert(b, req);
                        }
                    }
                    if promoted && res.is_ok() {
                        // Now owned by the running request.
                        held.retain(|_, owner| *owner != req);
                    }
                }
                Step::Peer(k, r, l, n) => {
                    let _ = d.handle(DEvent::Message { from: p, msg: peer_msg(k, RequestId(r), l, n) }, now);
                }
                Step::Time(dt) => {
                    now = now.saturating_add(dt);
                    d.handle_timeout(now);
                }
                Step::Bytes(b) => {
                    let _ = d.handle_bytes(p, &b, now);
                }
            }
            while let Some(a) = d.poll_action() {
                if let DAction::ReleaseBlocks { req, blocks } = a {
                    for b in blocks {
                        // A stale reservation (request already gone) comes straight back too.
                        let owner = held.remove(&b);
                        prop_assert!(owner.is_none() || owner == Some(req), "block {} released twice or by the wrong request", b);
                    }
                }
            }
            while d.poll_timeline().is_some() {}
        }
    }

    #[test]
    fn p_core_never_panics_and_releases_once(
        steps in proptest::collection::vec(step(), 0..120),
        mode in 0u8..2,
    ) {
        let mode = SendMode::ALL[mode as usize];
        let mut pc = PSide::new(PConfig::new(mode, LAYERS));
        let d = PeerId(0);
        let mut now: Nanos = u64::MAX - 10_000_000_000;
        let mut scheduled: HashMap<RequestId, usize> = HashMap::new();
        let mut inflight: Vec<(RequestId, u16)> = Vec::new();
        for s in steps {
            match s {
                Step::Host(k, r, l) => {
                    let req = RequestId(r);
                    let ev = match k {
                        0 | 1 => PEvent::Scheduled { req, peer: d, tokens: 32, blocks: vec![1, 2] },
                        2 => PEvent::LayerReady { req, layer: l },
                        3 => PEvent::PrefillDone { req },
                        4 => match inflight.pop() {
                            Some((req, layer)) => PEvent::TransferDone { req, layer, bytes: 1 },
                            None => PEvent::TransferDone { req, layer: l, bytes: 1 },
                        },
                        5 => match inflight.pop() {
                            Some((req, layer)) => PEvent::TransferFailed { req, layer },
                            None => PEvent::TransferFailed { req, layer: l },
                        },
                        6 => PEvent::Abort { req },
                        7 => PEvent::PeerDown { peer: d },
                        _ => PEvent::PeerUp { peer: d },
                    };
                    let sched = matches!(ev, PEvent::Scheduled { .. });
                    if pc.handle(ev, now).is_ok() && sched {
                        *scheduled.entry(req).or_default() += 1;
                    }
                }
                Step::Peer(k, r, l, n) => {
                    let _ = pc.handle(PEvent::Message { from: d, msg: peer_msg(k, RequestId(r), l, n) }, now);
                }
                Step::Time(dt) => {
                    now = now.saturating_add(dt);
                    pc.handle_timeout(now);
                }
                Step::Bytes(b) => {
                    let _ = pc.handle_bytes(d, &b, now);
                }
            }
            while let Some(a) = pc.poll_action() {
                match a {
                    PAction::Transfer { req, layer, .. } => inflight.insert(0, (req, layer)),
                    // The connection is torn down: nothing in flight reads our blocks any more.
                    PAction::DisconnectPeer { .. } => inflight.clear(),
                    PAction::ReleaseBlocks { req, .. } => {
                        let n = scheduled.entry(req).or_default();
                        prop_assert!(*n > 0, "{:?} released without being scheduled", req);
                        *n -= 1;
                        prop_assert!(!inflight.iter().any(|(r, _)| *r == req), "{:?} released with transfers in flight", req);
                    }
                    _ => {}
                }
            }
            while pc.poll_timeline().is_some() {}
        }
    }
}

//! The P core: layerwise and whole sends, failures that drain in-flight transfers, aborts,
//! deadlines and host errors.

use super::*;

fn schedule(p: &mut PSide, req: u64, blocks: Vec<BlockId>, now: Nanos) {
    p.handle(
        PEvent::Scheduled {
            req: RequestId(req),
            peer: D,
            tokens: 32,
            blocks,
        },
        now,
    )
    .unwrap();
}

fn transfers(a: &[PAction]) -> Vec<u16> {
    a.iter()
        .filter_map(|x| match x {
            PAction::Transfer { layer, .. } => Some(*layer),
            _ => None,
        })
        .collect()
}

/// D's block ids (5, 6) for `r`, at `now`.
fn block_ids(p: &mut PSide, r: RequestId, now: Nanos) {
    from_d(
        p,
        Message::BlockIds {
            req: r,
            first: 0,
            landing: false,
            blocks: vec![5, 6],
        },
        now,
    );
}

/// A layerwise P with request 1 scheduled (blocks 20, 21) and D's block ids at t = 1.
fn layerwise_with_block_ids() -> (PSide, RequestId) {
    let mut p = p(SendMode::Layerwise);
    schedule(&mut p, 1, vec![20, 21], 0);
    block_ids(&mut p, RequestId(1), 1);
    (p, RequestId(1))
}

#[test]
fn layerwise_holds_layers_until_block_ids_then_streams() {
    let mut p = p(SendMode::Layerwise);
    let r = RequestId(1);
    schedule(&mut p, 1, vec![20, 21], 0);
    let a = p_actions(&mut p);
    assert!(a.iter().any(|x| matches!(
        x,
        PAction::Send {
            msg: Message::Started { blocks: 2, .. },
            ..
        }
    )));
    p.handle(PEvent::LayerReady { req: r, layer: 0 }, 1)
        .unwrap();
    p.handle(PEvent::LayerReady { req: r, layer: 1 }, 2)
        .unwrap();
    assert!(transfers(&p_actions(&mut p)).is_empty());
    block_ids(&mut p, r, 3);
    let a = p_actions(&mut p);
    assert_eq!(transfers(&a), vec![0, 1]);
    assert!(a.iter().any(|x| matches!(x, PAction::Transfer { src, dst, .. } if src[..] == [20, 21] && dst[..] == [5, 6])));
    p.handle(PEvent::LayerReady { req: r, layer: 2 }, 4)
        .unwrap();
    assert_eq!(transfers(&p_actions(&mut p)), vec![2]);
    p.handle(PEvent::LayerReady { req: r, layer: 3 }, 5)
        .unwrap();
    let a = p_actions(&mut p);
    assert_eq!(transfers(&a), vec![3]);
    assert!(a.iter().any(|x| matches!(
        x,
        PAction::Send {
            msg: Message::PrefillDone { .. },
            ..
        }
    )));
    for l in 0..LAYERS {
        assert!(!p_actions(&mut p)
            .iter()
            .any(|x| matches!(x, PAction::ReleaseBlocks { .. })));
        p.handle(
            PEvent::TransferDone {
                req: r,
                layer: l,
                bytes: 10,
            },
            6,
        )
        .unwrap();
    }
    let a = p_actions(&mut p);
    assert!(a.contains(&PAction::ReleaseBlocks {
        req: r,
        blocks: vec![20, 21]
    }));
    assert!(a.iter().any(|x| matches!(
        x,
        PAction::Send {
            msg: Message::AllSent { bytes: 40, .. },
            ..
        }
    )));
    assert!(a.contains(&PAction::ReportFinished { req: r }));
    assert_eq!(p.live_requests(), 0);
    // A second report of a transfer is a late event, not a second release.
    p.handle(
        PEvent::TransferDone {
            req: r,
            layer: 0,
            bytes: 10,
        },
        7,
    )
    .unwrap();
    assert!(p_actions(&mut p).is_empty());
}

#[test]
fn whole_mode_sends_after_prefill_only() {
    let mut p = p(SendMode::Whole);
    let r = RequestId(1);
    from_d(
        &mut p,
        Message::BlockIds {
            req: r,
            first: 0,
            landing: false,
            blocks: vec![5, 6],
        },
        0,
    );
    schedule(&mut p, 1, vec![20, 21], 1);
    for l in 0..LAYERS - 1 {
        p.handle(PEvent::LayerReady { req: r, layer: l }, 2)
            .unwrap();
    }
    assert!(transfers(&p_actions(&mut p)).is_empty());
    p.handle(PEvent::PrefillDone { req: r }, 3).unwrap();
    assert_eq!(transfers(&p_actions(&mut p)), vec![0, 1, 2, 3]);
}

#[test]
fn p_failure_drains_in_flight_transfers_before_release() {
    let (mut p, r) = layerwise_with_block_ids();
    p.handle(PEvent::LayerReady { req: r, layer: 0 }, 2)
        .unwrap();
    p.handle(PEvent::LayerReady { req: r, layer: 1 }, 2)
        .unwrap();
    p_actions(&mut p);
    p.handle(PEvent::TransferFailed { req: r, layer: 0 }, 3)
        .unwrap();
    let a = p_actions(&mut p);
    assert!(a.contains(&PAction::CancelTransfers { req: r }));
    assert!(!a.iter().any(|x| matches!(x, PAction::ReleaseBlocks { .. })));
    assert!(!a.iter().any(|x| matches!(
        x,
        PAction::Send {
            msg: Message::Abort { .. },
            ..
        }
    )));
    // Layers becoming ready now are not sent.
    p.handle(PEvent::LayerReady { req: r, layer: 2 }, 4)
        .unwrap();
    assert!(transfers(&p_actions(&mut p)).is_empty());
    p.handle(PEvent::TransferFailed { req: r, layer: 1 }, 5)
        .unwrap();
    let a = p_actions(&mut p);
    assert_eq!(
        a.iter()
            .filter(|x| matches!(x, PAction::ReleaseBlocks { .. }))
            .count(),
        1
    );
    assert!(a.iter().any(|x| matches!(
        x,
        PAction::Send {
            msg: Message::Abort {
                reason: FailReason::TransferError,
                ..
            },
            ..
        }
    )));
    assert!(a.contains(&PAction::ReportFailed {
        req: r,
        reason: FailReason::TransferError
    }));
}

#[test]
fn a_silent_d_fails_its_requests_once_transfers_settle_but_is_not_given_up() {
    let (mut p, r) = layerwise_with_block_ids();
    p.handle(PEvent::LayerReady { req: r, layer: 0 }, 2)
        .unwrap();
    assert_eq!(transfers(&p_actions(&mut p)), vec![0]);
    // Nothing heard from D: at the tick past peer_timeout the request fails, its transfer in
    // flight is cancelled first; D is not disconnected.
    let (a, now) = loop {
        let now = p.poll_timeout().unwrap();
        p.handle_timeout(now);
        let a = p_actions(&mut p);
        if a.contains(&PAction::CancelTransfers { req: r }) {
            break (a, now);
        }
        assert!(now < 10 * SEC, "no failure by {now} ns");
    };
    assert!(now >= p.config().peer_timeout);
    assert!(!a.iter().any(|x| matches!(
        x,
        PAction::ReleaseBlocks { .. } | PAction::DisconnectPeer { .. }
    )));
    assert_eq!(p.stats().silences, 1);
    // The transfer settles: P's blocks go and D is told (a stalled D frees its blocks on it).
    p.handle(PEvent::TransferFailed { req: r, layer: 0 }, now + 1)
        .unwrap();
    let a = p_actions(&mut p);
    assert!(a.iter().any(|x| matches!(x, PAction::ReleaseBlocks { .. })));
    assert!(a.iter().any(|x| matches!(
        x,
        PAction::Send {
            to: D,
            msg: Message::Abort {
                reason: FailReason::Timeout,
                ..
            },
        }
    )));
    assert!(!a
        .iter()
        .any(|x| matches!(x, PAction::DisconnectPeer { .. })));
}

#[test]
fn p_answers_abort_for_unknown_and_fails_a_later_schedule() {
    let mut p = p(SendMode::Layerwise);
    let r = RequestId(3);
    from_d(
        &mut p,
        Message::Abort {
            req: r,
            reason: FailReason::LocalAbort,
        },
        0,
    );
    assert!(p_actions(&mut p).iter().any(|x| matches!(
        x,
        PAction::Send {
            msg: Message::Abort { .. },
            ..
        }
    )));
    schedule(&mut p, 3, vec![1], 1);
    let a = p_actions(&mut p);
    assert!(a.contains(&PAction::ReleaseBlocks {
        req: r,
        blocks: vec![1]
    }));
    assert!(a.contains(&PAction::ReportFailed {
        req: r,
        reason: FailReason::RemoteAbort
    }));
}

#[test]
fn p_block_ids_deadline_after_prefill() {
    let mut p = p(SendMode::Layerwise);
    let r = RequestId(1);
    schedule(&mut p, 1, vec![1, 2], 0);
    p.handle(PEvent::PrefillDone { req: r }, 10).unwrap();
    p_actions(&mut p);
    let t = 10 + p.config().block_ids_timeout;
    let mut now = 0;
    while now < t {
        now = p.poll_timeout().unwrap();
        p.handle_timeout(now);
        from_d(&mut p, heartbeat(1, now), now);
    }
    let a = p_actions(&mut p);
    assert!(a.contains(&PAction::ReportFailed {
        req: r,
        reason: FailReason::Timeout
    }));
    assert!(a.contains(&PAction::ReleaseBlocks {
        req: r,
        blocks: vec![1, 2]
    }));
}

#[test]
fn p_host_errors_are_typed() {
    let mut p = p(SendMode::Layerwise);
    let r = RequestId(1);
    assert_eq!(
        p.handle(PEvent::LayerReady { req: r, layer: 0 }, 0),
        Err(PError::UnknownRequest(r))
    );
    schedule(&mut p, 1, vec![1], 0);
    assert_eq!(
        p.handle(
            PEvent::LayerReady {
                req: r,
                layer: LAYERS
            },
            0
        ),
        Err(PError::LayerOutOfRange {
            req: r,
            layer: LAYERS
        })
    );
    assert_eq!(
        p.handle(
            PEvent::TransferDone {
                req: r,
                layer: 0,
                bytes: 1
            },
            0
        ),
        Err(PError::NoTransfer { req: r, layer: 0 })
    );
    assert_eq!(
        p.handle(
            PEvent::Scheduled {
                req: r,
                peer: D,
                tokens: 1,
                blocks: vec![2]
            },
            0
        ),
        Err(PError::DuplicateRequest(r))
    );
    // Wrong block count from D is a protocol failure of the request, not a host error.
    from_d(
        &mut p,
        Message::BlockIds {
            req: r,
            first: 0,
            landing: false,
            blocks: vec![1, 2, 3],
        },
        1,
    );
    assert!(p_actions(&mut p).contains(&PAction::ReportFailed {
        req: r,
        reason: FailReason::Protocol
    }));
}

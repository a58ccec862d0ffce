//! D's prefix cache (only the suffix is asked for) and the land policy (slots at P's start,
//! KV blocks once complete, fallback to lazy); a queued P past the wait-for-P deadline.

use super::*;

fn layer_sent(req: u64, layer: u16) -> Message {
    Message::LayerSent {
        req: RequestId(req),
        layer,
        bytes: 100,
    }
}

#[test]
fn prefix_hit_reserves_and_asks_for_the_suffix_only() {
    let mut d = d(Policy::Eager);
    arrive(&mut d, 1, 5, 0);
    let r = RequestId(1);
    // Covering every block is refused: one must be received.
    assert!(matches!(
        d.handle(DEvent::PrefixHit { req: r, blocks: 5 }, 1),
        Err(DError::PrefixTooLong { .. })
    ));
    d.handle(DEvent::PrefixHit { req: r, blocks: 3 }, 1)
        .unwrap();
    let _ = d_actions(&mut d);
    // The reservation covers the two missing blocks, not five.
    assert!(matches!(
        d.handle(
            DEvent::Reserved {
                req: r,
                blocks: vec![10, 11, 12, 13, 14]
            },
            2
        ),
        Err(DError::WrongBlockCount {
            expected: 2,
            got: 5,
            ..
        })
    ));
    d.handle(
        DEvent::Reserved {
            req: r,
            blocks: vec![13, 14],
        },
        2,
    )
    .unwrap();
    let sent: Vec<Message> = d_actions(&mut d)
        .into_iter()
        .filter_map(|a| match a {
            DAction::Send { msg, .. } => Some(msg),
            _ => None,
        })
        .collect();
    assert_eq!(
        sent,
        vec![Message::BlockIds {
            req: r,
            first: 3,
            landing: false,
            blocks: vec![13, 14]
        }]
    );
    // P sends only its blocks 3 and 4 of the request, into D's 13 and 14.
    let mut p = p(SendMode::Layerwise);
    p.handle(
        PEvent::Scheduled {
            req: r,
            peer: D,
            tokens: 80,
            blocks: vec![40, 41, 42, 43, 44],
        },
        0,
    )
    .unwrap();
    from_d(&mut p, sent[0].clone(), 3);
    p.handle(PEvent::LayerReady { req: r, layer: 0 }, 4)
        .unwrap();
    let t = p_actions(&mut p)
        .into_iter()
        .find_map(|a| match a {
            PAction::Transfer {
                src, dst, landing, ..
            } => Some((src.to_vec(), dst.to_vec(), landing)),
            _ => None,
        })
        .unwrap();
    assert_eq!(t, (vec![43, 44], vec![13, 14], false));
    // A suffix that does not fit P's blocks is a protocol error on P.
    let mut p2 = p_side_with(RequestId(2), vec![1, 2]);
    from_d(
        &mut p2,
        Message::BlockIds {
            req: RequestId(2),
            first: 1,
            landing: false,
            blocks: vec![5, 6],
        },
        1,
    );
    assert!(p_actions(&mut p2).iter().any(|a| matches!(
        a,
        PAction::ReportFailed {
            reason: FailReason::Protocol,
            ..
        }
    )));
}

fn p_side_with(req: RequestId, blocks: Vec<u32>) -> PSide {
    let mut p = p(SendMode::Layerwise);
    p.handle(
        PEvent::Scheduled {
            req,
            peer: D,
            tokens: 32,
            blocks,
        },
        0,
    )
    .unwrap();
    let _ = p_actions(&mut p);
    p
}

#[test]
fn land_takes_slots_at_p_start_and_kv_blocks_only_once_complete() {
    let mut d = d(Policy::Land);
    arrive(&mut d, 1, 3, 0);
    let r = RequestId(1);
    assert!(!d.may_reserve(r));
    let _ = d_actions(&mut d);
    from_p(&mut d, started(1, 3), 10);
    let a = d_actions(&mut d);
    assert!(a
        .iter()
        .any(|x| matches!(x, DAction::MayLand { blocks: 3, .. })));
    assert!(
        !has_may_reserve(&a, 1) && !d.may_reserve(r),
        "no KV block before the KV is complete"
    );
    d.handle(
        DEvent::Landing {
            req: r,
            slots: vec![7, 8, 9],
        },
        11,
    )
    .unwrap();
    let a = d_actions(&mut d);
    assert!(a.iter().any(|x| matches!(x, DAction::Send { msg: Message::BlockIds { landing: true, blocks, .. }, .. } if blocks == &vec![7, 8, 9])));
    for l in 0..LAYERS {
        from_p(&mut d, layer_sent(1, l), 20 + u64::from(l));
        if l + 1 < LAYERS {
            assert!(!d.may_reserve(r));
        }
    }
    // Complete in the pool: now the KV blocks, and then the report.
    let a = d_actions(&mut d);
    assert!(has_may_reserve(&a, 1) && d.may_reserve(r));
    assert!(!a
        .iter()
        .any(|x| matches!(x, DAction::ReportFinished { .. })));
    d.handle(
        DEvent::Reserved {
            req: r,
            blocks: vec![30, 31, 32],
        },
        50,
    )
    .unwrap();
    let a = d_actions(&mut d);
    assert!(a
        .iter()
        .any(|x| matches!(x, DAction::ReportFinished { req } if *req == r)));
    // No BlockIds for the KV blocks: P wrote into the landing slots.
    assert!(!a.iter().any(|x| matches!(x, DAction::Send { .. })));
    assert_eq!(d.reserved_blocks(r), &[30, 31, 32]);
    // Block-seconds are counted from the KV reservation (t=50), not from the landing.
    let g = d.gauges(60);
    assert_eq!((g.held_blocks, g.held_block_ns), (3, 30));
}

#[test]
fn land_failure_releases_the_slots_after_p_confirms_and_fallback_is_lazy() {
    let mut d = d(Policy::Land);
    let (r1, r2) = (RequestId(1), RequestId(2));
    arrive(&mut d, 1, 2, 0);
    arrive(&mut d, 2, 2, 0);
    from_p(&mut d, started(1, 2), 1);
    from_p(&mut d, started(2, 2), 1);
    let _ = d_actions(&mut d);
    d.handle(
        DEvent::Landing {
            req: r1,
            slots: vec![0, 1],
        },
        2,
    )
    .unwrap();
    d.handle(DEvent::LandFallback { req: r2 }, 2).unwrap();
    let a = d_actions(&mut d);
    assert!(
        has_may_reserve(&a, 2),
        "the fallback is lazy: P started, so reserve now"
    );
    assert_eq!(d.metrics().land_fallbacks, 1);
    // r1 aborted while P may write into its slots: they wait for P's Abort.
    d.handle(DEvent::Abort { req: r1 }, 3).unwrap();
    let a = d_actions(&mut d);
    assert!(!a
        .iter()
        .any(|x| matches!(x, DAction::ReleaseLanding { .. })));
    from_p(
        &mut d,
        Message::Abort {
            req: r1,
            reason: FailReason::RemoteAbort,
        },
        4,
    );
    let a = d_actions(&mut d);
    assert!(a.iter().any(|x| matches!(x, DAction::ReleaseLanding { req, slots } if *req == r1 && slots == &vec![0, 1])));
    // The slots are not KV blocks: nothing to hand back to vLLM's block pool.
    assert!(!a.iter().any(|x| matches!(x, DAction::ReleaseBlocks { .. })));
    assert!(a.iter().any(|x| matches!(x, DAction::ReportFailed { req, blocks, .. } if *req == r1 && blocks.is_empty())));
}

#[test]
fn a_request_p_reports_queued_waits_past_wait_for_p_timeout() {
    let mut cfg = DConfig::new(Policy::Lazy, LAYERS);
    cfg.wait_for_p_timeout = 10 * SEC;
    cfg.peer_timeout = 1_000 * SEC;
    let mut d = DSide::new(cfg);
    arrive(&mut d, 1, 2, 0);
    arrive(&mut d, 2, 2, 0);
    from_p(&mut d, Message::Queued { req: RequestId(1) }, 1);
    // Past the 10 s wait: the request P acknowledged lives on, the other one failed.
    let mut t = 0;
    while t < 20 * SEC {
        t += SEC;
        d.handle_timeout(t);
        // P keeps talking (it is alive).
        from_p(&mut d, heartbeat(1, t), t);
    }
    let a = d_actions(&mut d);
    assert!(a.iter().any(|x| matches!(x, DAction::ReportFailed { req, reason: FailReason::Timeout, .. } if req.0 == 2)));
    assert!(!a
        .iter()
        .any(|x| matches!(x, DAction::ReportFailed { req, .. } if req.0 == 1)));
    // P starts it after 20 s: it reserves as usual.
    from_p(&mut d, started(1, 2), t);
    assert!(d.may_reserve(RequestId(1)));
    // And P's core sends the acknowledgement when its host says the request is queued.
    let mut p = p(SendMode::Whole);
    p.handle(
        PEvent::Queued {
            req: RequestId(9),
            peer: D,
        },
        0,
    )
    .unwrap();
    assert!(p_actions(&mut p)
        .iter()
        .any(|a| matches!(a, PAction::Send { msg: Message::Queued { req }, .. } if req.0 == 9)));
}

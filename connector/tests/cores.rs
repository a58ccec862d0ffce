//! Unit tests of the D and P state machines, driven by hand, and of the invariant checker.

use kvwire_connector::msg::Message;
use kvwire_connector::*;
use kvwire_testkit::sim::check::{BlockUse, Checker, Role, Violation};

const P: PeerId = PeerId(7);
const D: PeerId = PeerId(0);
const LAYERS: u16 = 4;

fn d(policy: Policy) -> DSide {
    DSide::new(DConfig::new(policy, LAYERS))
}

fn p(mode: SendMode) -> PSide {
    PSide::new(PConfig::new(mode, LAYERS))
}

fn d_actions(d: &mut DSide) -> Vec<DAction> {
    std::iter::from_fn(|| d.poll_action()).collect()
}

fn p_actions(p: &mut PSide) -> Vec<PAction> {
    std::iter::from_fn(|| p.poll_action()).collect()
}

fn arrive(d: &mut DSide, req: u64, blocks: u32, now: Nanos) {
    d.handle(
        DEvent::Arrived {
            req: RequestId(req),
            peer: P,
            tokens: blocks * 16,
            blocks,
        },
        now,
    )
    .unwrap();
}

fn from_p(d: &mut DSide, msg: Message, now: Nanos) {
    d.handle(DEvent::Message { from: P, msg }, now).unwrap();
}

fn from_d(p: &mut PSide, msg: Message, now: Nanos) {
    p.handle(PEvent::Message { from: D, msg }, now).unwrap();
}

fn has_may_reserve(a: &[DAction], req: u64) -> bool {
    a.iter()
        .any(|x| matches!(x, DAction::MayReserve { req: r, .. } if r.0 == req))
}

fn started(req: u64, blocks: u32) -> Message {
    Message::Started {
        req: RequestId(req),
        layers: LAYERS,
        blocks,
    }
}

#[test]
fn eager_may_reserve_at_arrival() {
    let mut d = d(Policy::Eager);
    arrive(&mut d, 1, 3, 0);
    assert!(d.may_reserve(RequestId(1)));
    assert!(has_may_reserve(&d_actions(&mut d), 1));
}

#[test]
fn lazy_waits_for_p_started() {
    let mut d = d(Policy::Lazy);
    arrive(&mut d, 1, 3, 0);
    assert!(!d.may_reserve(RequestId(1)));
    assert!(!has_may_reserve(&d_actions(&mut d), 1));
    from_p(&mut d, started(1, 3), 10);
    assert!(d.may_reserve(RequestId(1)));
    assert!(has_may_reserve(&d_actions(&mut d), 1));
}

#[test]
fn jit_waits_for_prefill_done() {
    let mut d = d(Policy::Jit);
    arrive(&mut d, 1, 3, 0);
    from_p(&mut d, started(1, 3), 10);
    assert!(!d.may_reserve(RequestId(1)));
    assert!(!has_may_reserve(&d_actions(&mut d), 1));
    from_p(&mut d, Message::PrefillDone { req: RequestId(1) }, 20);
    assert!(d.may_reserve(RequestId(1)));
    assert!(has_may_reserve(&d_actions(&mut d), 1));
}

#[test]
fn messages_before_arrival_are_kept_for_the_arrival() {
    // The proxy dispatches to P and D concurrently: P's Started can beat D's own arrival.
    let mut d = d(Policy::Lazy);
    from_p(&mut d, started(1, 3), 5);
    assert!(!d.may_reserve(RequestId(1)));
    arrive(&mut d, 1, 3, 10);
    assert!(d.may_reserve(RequestId(1)));
}

#[test]
fn full_d_path_and_timeline() {
    let mut d = d(Policy::Lazy);
    let r = RequestId(1);
    arrive(&mut d, 1, 2, 100);
    from_p(&mut d, started(1, 2), 200);
    d.handle(
        DEvent::Reserved {
            req: r,
            blocks: vec![10, 11],
        },
        300,
    )
    .unwrap();
    let a = d_actions(&mut d);
    assert!(a.iter().any(|x| matches!(x, DAction::Send { msg: Message::BlockIds { blocks, .. }, .. } if blocks == &vec![10, 11])));
    for l in 0..LAYERS {
        assert!(!d_actions(&mut d)
            .iter()
            .any(|x| matches!(x, DAction::ReportFinished { .. })));
        from_p(
            &mut d,
            Message::LayerSent {
                req: r,
                layer: l,
                bytes: 100,
            },
            400 + u64::from(l),
        );
    }
    // Finished only after the last layer, exactly once.
    let a = d_actions(&mut d);
    assert_eq!(
        a.iter()
            .filter(|x| matches!(x, DAction::ReportFinished { .. }))
            .count(),
        1
    );
    // A duplicate AllSent changes nothing.
    from_p(
        &mut d,
        Message::AllSent {
            req: r,
            layers: LAYERS,
            bytes: 400,
        },
        410,
    );
    assert!(d_actions(&mut d).is_empty());
    d.handle(DEvent::Reported { req: r }, 500).unwrap();
    d.handle(DEvent::Promoted { req: r }, 600).unwrap();
    d.handle(DEvent::FirstToken { req: r }, 700).unwrap();
    let rec = d.poll_timeline().unwrap();
    assert_eq!(rec.outcome, Outcome::Finished);
    assert_eq!(rec.decode_sent, Some(100));
    assert_eq!(rec.d_reserved, Some(300));
    assert_eq!(rec.last_byte, Some(403));
    assert_eq!(rec.bytes, 400);
    let dec = rec.decompose().unwrap();
    assert_eq!(dec.total(), 600);
    assert_eq!(dec.first_step, 100);
    assert_eq!(dec.promotion_delay, 100);
    assert_eq!(dec.report_delay, 97);
    let line = rec.to_json_line();
    assert!(line.contains("\"policy\":\"lazy\""));
    assert_eq!(TimelineRecord::from_json_line(&line).unwrap(), rec);
    assert_eq!(d.live_requests(), 0);
    // The request is over: late messages are dropped, not resurrected.
    from_p(&mut d, started(1, 2), 800);
    assert_eq!(d.live_requests(), 0);
    assert!(d.stats().late_messages > 0);
}

fn reserved_lazy(d: &mut DSide, req: u64) {
    arrive(d, req, 2, 0);
    from_p(d, started(req, 2), 1);
    d.handle(
        DEvent::Reserved {
            req: RequestId(req),
            blocks: vec![1, 2],
        },
        2,
    )
    .unwrap();
    d_actions(d);
}

fn releases(a: &[DAction]) -> usize {
    a.iter()
        .filter(|x| matches!(x, DAction::ReleaseBlocks { .. }))
        .count()
}

#[test]
fn d_abort_after_block_ids_waits_for_p_before_release() {
    let mut d = d(Policy::Lazy);
    reserved_lazy(&mut d, 1);
    d.handle(DEvent::Abort { req: RequestId(1) }, 10).unwrap();
    let a = d_actions(&mut d);
    // P may have writes in flight: Abort sent, blocks kept.
    assert!(a.iter().any(|x| matches!(
        x,
        DAction::Send {
            msg: Message::Abort { .. },
            ..
        }
    )));
    assert_eq!(releases(&a), 0);
    assert_eq!(d.reserved_blocks(RequestId(1)), &[1, 2]);
    // A second abort and late layers change nothing.
    d.handle(DEvent::Abort { req: RequestId(1) }, 11).unwrap();
    from_p(
        &mut d,
        Message::LayerSent {
            req: RequestId(1),
            layer: 0,
            bytes: 1,
        },
        12,
    );
    assert_eq!(releases(&d_actions(&mut d)), 0);
    // P confirms: released exactly once, reported failed with the block ids.
    from_p(
        &mut d,
        Message::Abort {
            req: RequestId(1),
            reason: FailReason::RemoteAbort,
        },
        20,
    );
    let a = d_actions(&mut d);
    assert_eq!(releases(&a), 1);
    assert!(a.iter().any(|x| matches!(x, DAction::ReportFailed { blocks, reason: FailReason::LocalAbort, .. } if blocks == &vec![1, 2])));
    from_p(
        &mut d,
        Message::Abort {
            req: RequestId(1),
            reason: FailReason::RemoteAbort,
        },
        21,
    );
    assert_eq!(releases(&d_actions(&mut d)), 0);
}

#[test]
fn drain_deadline_releases_when_p_never_answers() {
    let mut d = d(Policy::Lazy);
    reserved_lazy(&mut d, 1);
    d.handle(DEvent::Abort { req: RequestId(1) }, 10).unwrap();
    d_actions(&mut d);
    let until = 10 + d.config().drain_timeout;
    // P stays alive (heartbeats) but never confirms.
    let mut now = 10;
    let mut released_at = None;
    while released_at.is_none() && now < 2 * until {
        now = d.poll_timeout().unwrap();
        d.handle_timeout(now);
        from_p(
            &mut d,
            Message::Heartbeat {
                incarnation: 1,
                seq: now,
            },
            now,
        );
        if releases(&d_actions(&mut d)) > 0 {
            released_at = Some(now);
        }
    }
    assert_eq!(released_at, Some(until));
    assert_eq!(d.stats().drain_timeouts, 1);
}

#[test]
fn peer_down_releases_at_once_and_disconnects() {
    let mut d = d(Policy::Lazy);
    reserved_lazy(&mut d, 1);
    arrive(&mut d, 2, 1, 3);
    d_actions(&mut d);
    d.handle(DEvent::PeerDown { peer: P }, 5).unwrap();
    let a = d_actions(&mut d);
    assert!(a.contains(&DAction::DisconnectPeer { peer: P }));
    assert_eq!(releases(&a), 1);
    assert_eq!(
        a.iter()
            .filter(|x| matches!(
                x,
                DAction::ReportFailed {
                    reason: FailReason::PeerDown,
                    ..
                }
            ))
            .count(),
        2
    );
    assert_eq!(d.live_requests(), 0);
}

#[test]
fn heartbeat_silence_is_peer_down() {
    let mut d = d(Policy::Lazy);
    reserved_lazy(&mut d, 1);
    let mut now = 0;
    let mut failed = false;
    while now < 10 * SEC && !failed {
        now = d.poll_timeout().unwrap();
        d.handle_timeout(now);
        failed = d_actions(&mut d)
            .iter()
            .any(|x| matches!(x, DAction::ReportFailed { .. }));
    }
    assert!(failed);
    assert!(now >= d.config().peer_timeout);
    assert!(now <= d.config().peer_timeout + d.config().heartbeat_interval);
}

#[test]
fn new_incarnation_fails_the_old_lifes_requests() {
    let mut d = d(Policy::Lazy);
    from_p(
        &mut d,
        Message::Heartbeat {
            incarnation: 1,
            seq: 1,
        },
        0,
    );
    reserved_lazy(&mut d, 1);
    from_p(
        &mut d,
        Message::Heartbeat {
            incarnation: 2,
            seq: 1,
        },
        5,
    );
    // The connection is up and the new life may already be writing (its heartbeat may have
    // been overtaken): the reservation drains through an Abort round trip.
    let a = d_actions(&mut d);
    assert_eq!(releases(&a), 0);
    assert!(a.iter().any(|x| matches!(
        x,
        DAction::Send {
            msg: Message::Abort {
                reason: FailReason::PeerRestarted,
                ..
            },
            ..
        }
    )));
    from_p(
        &mut d,
        Message::Abort {
            req: RequestId(1),
            reason: FailReason::RemoteAbort,
        },
        6,
    );
    let a = d_actions(&mut d);
    assert_eq!(releases(&a), 1);
    assert!(a.iter().any(|x| matches!(
        x,
        DAction::ReportFailed {
            reason: FailReason::PeerRestarted,
            ..
        }
    )));
}

#[test]
fn lost_abort_is_resent_until_confirmed() {
    let mut d = d(Policy::Lazy);
    reserved_lazy(&mut d, 1);
    d.handle(DEvent::Abort { req: RequestId(1) }, 10).unwrap();
    let count_aborts = |a: &[DAction]| {
        a.iter()
            .filter(|x| {
                matches!(
                    x,
                    DAction::Send {
                        msg: Message::Abort { .. },
                        ..
                    }
                )
            })
            .count()
    };
    assert_eq!(count_aborts(&d_actions(&mut d)), 1);
    let mut now = 10;
    let mut resent = 0;
    while now < 10 + 3 * d.config().heartbeat_interval {
        now = d.poll_timeout().unwrap();
        d.handle_timeout(now);
        from_p(
            &mut d,
            Message::Heartbeat {
                incarnation: 1,
                seq: now,
            },
            now,
        );
        resent += count_aborts(&d_actions(&mut d));
    }
    assert!(resent >= 2, "resent {resent}");
}

#[test]
fn wait_for_p_deadline() {
    let mut d = d(Policy::Lazy);
    arrive(&mut d, 1, 2, 0);
    d_actions(&mut d);
    let t = d.config().wait_for_p_timeout;
    let mut now = 0;
    while now < t {
        now = d.poll_timeout().unwrap();
        d.handle_timeout(now);
        from_p(
            &mut d,
            Message::Heartbeat {
                incarnation: 1,
                seq: now,
            },
            now,
        );
    }
    let a = d_actions(&mut d);
    assert!(a.iter().any(|x| matches!(x, DAction::ReportFailed { reason: FailReason::Timeout, blocks, .. } if blocks.is_empty())));
    assert_eq!(releases(&a), 0);
}

#[test]
fn protocol_violations_fail_the_request() {
    // P writes before it could know our block ids.
    let mut d = d(Policy::Lazy);
    arrive(&mut d, 1, 2, 0);
    from_p(
        &mut d,
        Message::LayerSent {
            req: RequestId(1),
            layer: 0,
            bytes: 1,
        },
        1,
    );
    assert!(d_actions(&mut d).iter().any(|x| matches!(
        x,
        DAction::ReportFailed {
            reason: FailReason::Protocol,
            ..
        }
    )));
    // P announces a different shape.
    arrive(&mut d, 2, 2, 0);
    from_p(&mut d, started(2, 5), 1);
    assert!(d_actions(&mut d).iter().any(|x| matches!(
        x,
        DAction::ReportFailed {
            reason: FailReason::Protocol,
            ..
        }
    )));
}

#[test]
fn host_errors_are_typed_and_change_nothing() {
    let mut d = d(Policy::Lazy);
    arrive(&mut d, 1, 2, 0);
    let r = RequestId(1);
    assert_eq!(
        d.handle(
            DEvent::Arrived {
                req: r,
                peer: P,
                tokens: 1,
                blocks: 1
            },
            1
        ),
        Err(DError::DuplicateRequest(r))
    );
    assert_eq!(
        d.handle(
            DEvent::Reserved {
                req: r,
                blocks: vec![1, 2]
            },
            1
        ),
        Err(DError::NotReservable(r))
    );
    from_p(&mut d, started(1, 2), 2);
    assert_eq!(
        d.handle(
            DEvent::Reserved {
                req: r,
                blocks: vec![1]
            },
            3
        ),
        Err(DError::WrongBlockCount {
            req: r,
            expected: 2,
            got: 1
        })
    );
    assert!(matches!(
        d.handle(DEvent::Promoted { req: r }, 3),
        Err(DError::InvalidState { .. })
    ));
    assert_eq!(
        d.handle(DEvent::Reported { req: RequestId(9) }, 3),
        Err(DError::UnknownRequest(RequestId(9)))
    );
    assert!(matches!(
        d.handle_bytes(P, &[1, 2, 3], 4),
        Err(DError::Decode(_))
    ));
    assert!(d.may_reserve(r));
    assert_eq!(
        d.handle(
            DEvent::Arrived {
                req: RequestId(5),
                peer: P,
                tokens: 0,
                blocks: 0
            },
            1
        ),
        Err(DError::NoBlocks(RequestId(5)))
    );
}

#[test]
fn stale_reservation_is_handed_back() {
    let mut d = d(Policy::Eager);
    arrive(&mut d, 1, 2, 0);
    d.handle(DEvent::Abort { req: RequestId(1) }, 1).unwrap();
    d_actions(&mut d);
    d.handle(
        DEvent::Reserved {
            req: RequestId(1),
            blocks: vec![4, 5],
        },
        2,
    )
    .unwrap();
    assert_eq!(
        d_actions(&mut d),
        vec![DAction::ReleaseBlocks {
            req: RequestId(1),
            blocks: vec![4, 5]
        }]
    );
}

// ----- P side -----

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
    from_d(
        &mut p,
        Message::BlockIds {
            req: r,
            first: 0,
            landing: false,
            blocks: vec![5, 6],
        },
        3,
    );
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
    let mut p = p(SendMode::Layerwise);
    let r = RequestId(1);
    schedule(&mut p, 1, vec![20, 21], 0);
    from_d(
        &mut p,
        Message::BlockIds {
            req: r,
            first: 0,
            landing: false,
            blocks: vec![5, 6],
        },
        1,
    );
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
        from_d(
            &mut p,
            Message::Heartbeat {
                incarnation: 1,
                seq: now,
            },
            now,
        );
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

// ----- the checker itself can fail -----

#[test]
fn checker_reports_broken_sequences() {
    let r1 = RequestId(1);
    let r2 = RequestId(2);
    let mut c = Checker::new(&[8]);
    c.reserve(0, r1, &[0, 1]);
    c.reserve(0, r2, &[1]);
    assert_eq!(
        c.violations(),
        &[Violation::DoubleReserve {
            pool: 0,
            block: 1,
            req: r2,
            was: BlockUse::Reserved(r1)
        }]
    );

    let mut c = Checker::new(&[8]);
    c.reserve(0, r1, &[0]);
    c.release(0, r1, &[0]);
    c.release(0, r1, &[0]);
    assert!(matches!(
        c.violations(),
        [Violation::BadRelease { block: 0, .. }]
    ));

    let mut c = Checker::new(&[8]);
    c.reserve(0, r1, &[0, 1]);
    c.release(0, r1, &[0, 1]);
    c.touch(0, r1, 0, 2, &[0, 1], true);
    assert!(matches!(
        c.violations(),
        [Violation::WriteToUnheld {
            block: 0,
            was: BlockUse::Free,
            ..
        }]
    ));

    let mut c = Checker::new(&[8]);
    c.reserve(0, r1, &[0]);
    c.touch(0, r1, 0, 2, &[0], true);
    c.report_finished(r1, 2);
    assert!(matches!(
        c.violations(),
        [Violation::FinishedEarly {
            landed: 1,
            layers: 2,
            ..
        }]
    ));

    let mut c = Checker::new(&[8]);
    c.begin(Role::D, r1);
    c.begin(Role::D, r2);
    c.end(Role::D, r1);
    c.end(Role::D, r1);
    c.reserve(0, r2, &[3]);
    c.drain_check();
    assert_eq!(
        c.violations(),
        &[
            Violation::EndedTwice {
                role: Role::D,
                req: r1
            },
            Violation::Leaked { pool: 0, blocks: 1 },
            Violation::NeverEnded {
                role: Role::D,
                req: r2
            },
        ]
    );

    // And a clean sequence passes.
    let mut c = Checker::new(&[8]);
    c.begin(Role::D, r1);
    c.reserve(0, r1, &[0, 1]);
    c.touch(0, r1, 0, 2, &[0, 1], true);
    c.touch(0, r1, 1, 2, &[0, 1], true);
    c.report_finished(r1, 2);
    c.promote(0, r1, &[0, 1]);
    c.host_free(0, r1, &[0, 1]);
    c.end(Role::D, r1);
    c.drain_check();
    assert!(c.violations().is_empty());
}

#[test]
fn decomposition_telescopes_with_missing_and_unordered_milestones() {
    let mut r = TimelineRecord::new(RequestId(1), Side::Merged, "t");
    r.decode_sent = Some(100);
    r.p_last_layer_ready = Some(50); // before decode_sent (migration case): clamped
    r.blocks_to_p = Some(400);
    r.last_byte = None;
    r.d_reported_finished = Some(900);
    r.d_promoted = Some(2_000); // after first_token: clamped
    r.first_token = Some(1_000);
    let d = r.decompose().unwrap();
    assert_eq!(d.total(), 900);
    assert_eq!(d.wait_for_p, 0);
    assert_eq!(d.reservation_wait, 300);
    assert_eq!(d.exposed_transfer, 0);
    assert_eq!(d.report_delay, 500);
    assert_eq!(d.promotion_delay, 100);
    assert_eq!(d.first_step, 0);
    r.first_token = None;
    assert!(r.decompose().is_none());
}

#[test]
fn names_parse_back() {
    for p in Policy::ALL {
        assert_eq!(p.name().parse::<Policy>(), Ok(p));
    }
    for m in SendMode::ALL {
        assert_eq!(m.name().parse::<SendMode>(), Ok(m));
    }
    assert!("greedy".parse::<Policy>().is_err());
    assert!("".parse::<SendMode>().is_err());
}

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
        from_p(
            &mut d,
            Message::Heartbeat {
                incarnation: 1,
                seq: t,
            },
            t,
        );
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

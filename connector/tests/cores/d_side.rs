//! The D core: when each policy may reserve, the full path and its timeline, aborts, deadlines,
//! peers that go down or restart, protocol violations and host errors.

use super::*;

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
        now = d_next_deadline_p_alive(&mut d);
        let a = d_actions(&mut d);
        if releases(&a) > 0 {
            released_at = Some(now);
            // the connection goes, and the log can say why: P was heard all along
            assert!(a.contains(&DAction::DisconnectPeer {
                peer: P,
                cause: DownCause::DrainTimeout
            }));
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
    assert!(a.contains(&DAction::DisconnectPeer {
        peer: P,
        cause: DownCause::Reported
    }));
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

/// Ticks with nothing heard from P until one tick's actions satisfy `done`; those actions and
/// the time of that tick.
fn tick_silent_until(
    d: &mut DSide,
    until: Nanos,
    done: impl Fn(&[DAction]) -> bool,
) -> (Vec<DAction>, Nanos) {
    let mut now = 0;
    while now < until {
        now = d.poll_timeout().unwrap();
        d.handle_timeout(now);
        let a = d_actions(d);
        if done(&a) {
            return (a, now);
        }
    }
    panic!("nothing expected happened by {until} ns");
}

fn failed(a: &[DAction], req: u64) -> bool {
    a.iter()
        .any(|x| matches!(x, DAction::ReportFailed { req: r, .. } if r.0 == req))
}

fn aborts_sent(a: &[DAction], req: u64) -> bool {
    a.iter().any(|x| {
        matches!(x, DAction::Send { to, msg: Message::Abort { req: r, .. } } if *to == P && r.0 == req)
    })
}

#[test]
fn a_silent_p_fails_its_requests_but_is_not_given_up() {
    // Request 1: P has its block ids (it may be writing); request 2: waiting for P.
    let mut d = d(Policy::Lazy);
    reserved_lazy(&mut d, 1);
    arrive(&mut d, 2, 1, 2);
    d_actions(&mut d);
    let (a, now) = tick_silent_until(&mut d, 10 * SEC, |a| failed(a, 2));
    assert!(now >= d.config().peer_timeout);
    assert!(now <= d.config().peer_timeout + d.config().heartbeat_interval);
    // Both are aborted at P; only the one P cannot write to is released at once.
    assert!(aborts_sent(&a, 1) && aborts_sent(&a, 2), "{a:?}");
    assert!(!failed(&a, 1) && releases(&a) == 0, "{a:?}");
    assert_eq!(d.reserved_blocks(RequestId(1)), &[1, 2]);
    assert!(
        !a.iter()
            .any(|x| matches!(x, DAction::DisconnectPeer { .. })),
        "{a:?}"
    );
    assert_eq!(d.stats().silences, 1);
    // P was only stalled: it comes back and confirms; the blocks go, P keeps its connection.
    from_p(
        &mut d,
        Message::Abort {
            req: RequestId(1),
            reason: FailReason::Timeout,
        },
        now + 1,
    );
    let a = d_actions(&mut d);
    assert!(failed(&a, 1) && releases(&a) == 1, "{a:?}");
    assert!(
        !a.iter()
            .any(|x| matches!(x, DAction::DisconnectPeer { .. })),
        "{a:?}"
    );
    assert_eq!((d.live_requests(), d.stats().drain_timeouts), (0, 0));
    // ... and serves the next request.
    arrive(&mut d, 3, 2, now + 2);
    from_p(&mut d, started(3, 2), now + 3);
    assert!(d.may_reserve(RequestId(3)));
}

#[test]
fn a_request_younger_than_peer_timeout_waits_out_its_own_silence() {
    // P has been silent a long time when request 2 arrives (say this engine itself stalled,
    // and P's messages wait for a connection made again): it is not failed at the next tick
    // but only once it too has waited peer_timeout.
    let mut d = d(Policy::Lazy);
    reserved_lazy(&mut d, 1);
    let (_, t1) = tick_silent_until(&mut d, 10 * SEC, |a| aborts_sent(a, 1));
    arrive(&mut d, 2, 1, t1 + 1);
    d_actions(&mut d);
    let (_, t2) = tick_silent_until(&mut d, 20 * SEC, |a| failed(a, 2));
    assert!(t2 >= t1 + 1 + d.config().peer_timeout, "{t1} {t2}");
    assert!(
        t2 <= t1 + 1 + d.config().peer_timeout + d.config().heartbeat_interval,
        "{t1} {t2}"
    );
    assert_eq!(d.stats().silences, 2);
}

#[test]
fn a_silent_p_that_never_confirms_is_given_up_after_the_drain() {
    let mut d = d(Policy::Lazy);
    reserved_lazy(&mut d, 1);
    let (a, silent_at) = tick_silent_until(&mut d, 10 * SEC, |a| aborts_sent(a, 1));
    assert_eq!(releases(&a), 0);
    let (a, now) = tick_silent_until(&mut d, 100 * SEC, |a| releases(a) > 0);
    // The blocks go only once the connection is torn down, and the log can say why.
    assert!(
        now >= silent_at + d.config().drain_timeout,
        "{now} {silent_at}"
    );
    let down = a.iter().position(|x| {
        matches!(
            x,
            DAction::DisconnectPeer {
                peer: P,
                cause: DownCause::DrainTimeout
            }
        )
    });
    let released = a
        .iter()
        .position(|x| matches!(x, DAction::ReleaseBlocks { .. }));
    assert!(
        matches!((down, released), (Some(x), Some(y)) if x < y),
        "{a:?}"
    );
    assert!(failed(&a, 1));
    assert_eq!((d.stats().drain_timeouts, d.stats().silences), (1, 1));
}

#[test]
fn new_incarnation_fails_the_old_lifes_requests() {
    let mut d = d(Policy::Lazy);
    from_p(&mut d, heartbeat(1, 1), 0);
    reserved_lazy(&mut d, 1);
    from_p(&mut d, heartbeat(2, 1), 5);
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
        now = d_next_deadline_p_alive(&mut d);
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
        now = d_next_deadline_p_alive(&mut d);
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

#[test]
fn landed_layers_lists_each_layer_as_it_lands() {
    let mut d = d(Policy::Lazy);
    assert!(d.landed_layers(RequestId(1)).is_empty());
    reserved_lazy(&mut d, 1);
    assert!(d.landed_layers(RequestId(1)).is_empty());
    // Out of order, and a duplicate: listed once each, in increasing order.
    for (i, l) in [2u16, 0, 2].into_iter().enumerate() {
        from_p(
            &mut d,
            Message::LayerSent {
                req: RequestId(1),
                layer: l,
                bytes: 1,
            },
            10 + i as u64,
        );
    }
    assert_eq!(d.landed_layers(RequestId(1)), vec![0, 2]);
    assert!(!d_actions(&mut d)
        .iter()
        .any(|x| matches!(x, DAction::ReportFinished { .. })));
    from_p(
        &mut d,
        Message::AllSent {
            req: RequestId(1),
            layers: LAYERS,
            bytes: 4,
        },
        20,
    );
    assert_eq!(
        d.landed_layers(RequestId(1)),
        (0..LAYERS).collect::<Vec<_>>()
    );
    assert!(d_actions(&mut d)
        .iter()
        .any(|x| matches!(x, DAction::ReportFinished { .. })));
}

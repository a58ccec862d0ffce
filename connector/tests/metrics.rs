//! Connector metrics: exact values after a known sequence of events on each core (a finished
//! request, a host abort before and after reservation, a peer abort caused by a failed transfer,
//! a stale reservation; on P a failed layer transfer and a host abort).

use kvwire_connector::metrics::{bucket_le_seconds, DECOMPOSITION_PARTS, HIST_BUCKETS};
use kvwire_connector::msg::Message;
use kvwire_connector::*;

mod common;
use common::*;

/// The bucket a value must land in: the first bound >= it.
fn bucket_of(ns: Nanos) -> usize {
    (0..HIST_BUCKETS)
        .find(|i| ns as f64 / 1e9 <= bucket_le_seconds(*i))
        .unwrap()
}

#[test]
fn d_metrics_after_a_known_sequence() {
    let mut d = DSide::new(DConfig::new(Policy::Lazy, LAYERS));
    // r1: finished. Reserved at 12 ms, promoted at 33 ms, first token at 40 ms.
    arrive(&mut d, 1, 3, 0);
    started(&mut d, 1, 3, 10 * MS);
    reserve(&mut d, 1, &[1, 2, 3], 12 * MS);
    let g = d.gauges(15 * MS);
    assert_eq!((g.reserved, g.held_blocks), (1, 3));
    assert_eq!(g.held_block_ns, 3 * 3 * u128::from(MS));
    from_p(&mut d, Message::PrefillDone { req: RequestId(1) }, 20 * MS);
    for (layer, at) in [(0u16, 25 * MS), (1, 30 * MS)] {
        let ev = DEvent::LayerLanded {
            req: RequestId(1),
            layer,
            bytes: 1000,
        };
        d.handle(ev, at).unwrap();
    }
    assert_eq!(d.gauges(30 * MS).complete, 1);
    d.handle(DEvent::Reported { req: RequestId(1) }, 31 * MS)
        .unwrap();
    assert_eq!(d.gauges(32 * MS).reported, 1);
    d.handle(DEvent::Promoted { req: RequestId(1) }, 33 * MS)
        .unwrap();
    let g = d.gauges(34 * MS);
    assert_eq!(
        (g.promoted, g.held_blocks),
        (1, 0),
        "a promoted request holds nothing waiting"
    );
    d.handle(DEvent::FirstToken { req: RequestId(1) }, 40 * MS)
        .unwrap();

    // r2: the host aborts it while it waits (nothing reserved, nothing released).
    arrive(&mut d, 2, 2, 50 * MS);
    assert_eq!(d.gauges(51 * MS).waiting, 1);
    d.handle(DEvent::Abort { req: RequestId(2) }, 55 * MS)
        .unwrap();

    // r3: reserved at 62 ms; P's transfer failed and P aborts at 70 ms: released at once.
    arrive(&mut d, 3, 2, 60 * MS);
    started(&mut d, 3, 2, 61 * MS);
    reserve(&mut d, 3, &[4, 5], 62 * MS);
    let abort = Message::Abort {
        req: RequestId(3),
        reason: FailReason::TransferError,
    };
    from_p(&mut d, abort, 70 * MS);

    // r4: reserved at 82 ms, aborted by the host at 90 ms: its block drains until P confirms
    // at 100 ms.
    arrive(&mut d, 4, 1, 80 * MS);
    started(&mut d, 4, 1, 81 * MS);
    reserve(&mut d, 4, &[6], 82 * MS);
    d.handle(DEvent::Abort { req: RequestId(4) }, 90 * MS)
        .unwrap();
    // r7: P started it before it arrived on D.
    started(&mut d, 7, 1, 95 * MS);
    let g = d.gauges(95 * MS);
    assert_eq!((g.draining, g.early, g.held_blocks), (1, 1, 1));
    assert_eq!(g.held_block_ns, 13 * u128::from(MS));
    let abort = Message::Abort {
        req: RequestId(4),
        reason: FailReason::LocalAbort,
    };
    from_p(&mut d, abort, 100 * MS);

    // A reservation for a request that never arrived: handed straight back.
    reserve(&mut d, 99, &[9], 101 * MS);
    let releases = drain_d(&mut d)
        .into_iter()
        .filter(|a| matches!(a, DAction::ReleaseBlocks { .. }))
        .count();

    let m = d.metrics();
    assert_eq!(m.policy, Policy::Lazy);
    assert_eq!(m.arrived, 4);
    assert_eq!((m.reservations, m.reserved_blocks), (3, 6));
    assert_eq!((m.releases, m.released_blocks), (3, 4));
    assert_eq!(
        releases as u64, m.releases,
        "one release counted per ReleaseBlocks action"
    );
    assert_eq!((m.completed, m.promoted, m.first_tokens), (1, 1, 1));
    assert_eq!(m.aborted(), 2);
    assert_eq!(m.failed[3], 1, "remote_abort");
    assert_eq!(m.failed_total(), 3);
    assert_eq!(m.bytes_received, 2000);
    // r1: 3 × 21 ms, r3: 2 × 8 ms, r4: 1 × 18 ms.
    assert_eq!(m.block_ns_waiting, u128::from(63 * MS + 16 * MS + 18 * MS));
    assert!((m.block_seconds_waiting() - 0.097).abs() < 1e-12);
    // r1's decode_sent (0) -> first_token (40 ms): wait_for_p 20, reservation_wait 0 (ids went
    // out at 12 < 20), exposed_transfer 10, report 1, promotion 2, first step 7.
    let expect = [20, 0, 10, 1, 2, 7, 40];
    for (i, (h, ms)) in m.decomposition.iter().zip(expect).enumerate() {
        let name = DECOMPOSITION_PARTS[i];
        assert_eq!(h.count, 1, "{name}");
        assert_eq!(h.sum_ns, u128::from(ms * MS), "{name}");
        let mut buckets = [0u64; HIST_BUCKETS];
        buckets[bucket_of(ms * MS)] = 1;
        assert_eq!(h.buckets, buckets, "{name}");
    }
    let g = d.gauges(110 * MS);
    assert_eq!(
        g.by_state(),
        [1, 0, 0, 0, 0, 0, 0, 0],
        "only the early r7 is left"
    );
    assert_eq!((g.held_blocks, g.held_block_ns), (0, 0));
}

#[test]
fn p_metrics_after_a_known_sequence() {
    let mut p = PSide::new(PConfig::new(SendMode::Whole, LAYERS));
    let sched = |p: &mut PSide, req: u64, blocks: Vec<u32>, now| {
        let ev = PEvent::Scheduled {
            req: RequestId(req),
            peer: D,
            tokens: 16 * blocks.len() as u32,
            blocks,
        };
        p.handle(ev, now).unwrap();
    };
    let ids = |p: &mut PSide, req: u64, blocks: Vec<u32>, now| {
        let msg = Message::BlockIds {
            req: RequestId(req),
            first: 0,
            landing: false,
            blocks,
        };
        p.handle(PEvent::Message { from: D, msg }, now).unwrap();
    };
    let prefill = |p: &mut PSide, req: u64, now| {
        for layer in 0..LAYERS {
            let ev = PEvent::LayerReady {
                req: RequestId(req),
                layer,
            };
            p.handle(ev, now).unwrap();
        }
        p.handle(
            PEvent::PrefillDone {
                req: RequestId(req),
            },
            now,
        )
        .unwrap();
    };
    let done = |p: &mut PSide, req: u64, layer: u16, now| {
        let ev = PEvent::TransferDone {
            req: RequestId(req),
            layer,
            bytes: 500,
        };
        p.handle(ev, now).unwrap();
    };
    // p1: sent in full; scheduled at 0, last layer written at 20 ms.
    sched(&mut p, 1, vec![1, 2], 0);
    ids(&mut p, 1, vec![7, 8], 5 * MS);
    prefill(&mut p, 1, 10 * MS);
    done(&mut p, 1, 0, 15 * MS);
    done(&mut p, 1, 1, 20 * MS);
    // p2: layer 0's transfer fails; layer 1 settles after, then the blocks are released.
    sched(&mut p, 2, vec![3], 30 * MS);
    ids(&mut p, 2, vec![9], 31 * MS);
    prefill(&mut p, 2, 32 * MS);
    let ev = PEvent::TransferFailed {
        req: RequestId(2),
        layer: 0,
    };
    p.handle(ev, 35 * MS).unwrap();
    done(&mut p, 2, 1, 36 * MS);
    // p3: the host aborts it before D's ids arrived.
    sched(&mut p, 3, vec![4], 40 * MS);
    p.handle(PEvent::Abort { req: RequestId(3) }, 41 * MS)
        .unwrap();
    let acts = drain_p(&mut p);
    let count = |f: fn(&PAction) -> bool| acts.iter().filter(|a| f(a)).count() as u64;

    let m = p.metrics();
    assert_eq!(m.scheduled, 3);
    assert_eq!(m.transfers, 4);
    assert_eq!(
        m.transfers,
        count(|a| matches!(a, PAction::Transfer { .. }))
    );
    assert_eq!((m.transfers_done, m.transfers_failed), (3, 1));
    assert_eq!(m.bytes_sent, 1500);
    assert_eq!(m.completed, 1);
    assert_eq!(m.failed[4], 1, "transfer_error");
    assert_eq!(m.aborted(), 1);
    assert_eq!(m.failed_total(), 2);
    assert_eq!((m.releases, m.released_blocks), (3, 4));
    assert_eq!(
        m.releases,
        count(|a| matches!(a, PAction::ReleaseBlocks { .. }))
    );
    assert_eq!(m.send_latency.count, 1);
    assert_eq!(m.send_latency.sum_ns, u128::from(20 * MS));
    assert_eq!(m.send_latency.buckets[bucket_of(20 * MS)], 1);
}

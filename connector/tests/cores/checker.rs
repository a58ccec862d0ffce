//! The invariant checker itself can fail; the timeline decomposition; names parse back.

use super::*;

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

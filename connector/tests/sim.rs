//! Simulator runs: invariants under injected failures for every policy × send mode,
//! reproducibility, and the behaviour that distinguishes the policies and send modes.

use kvwire_connector::{Outcome, Policy, SendMode};
use kvwire_testkit::sim::check::Violation;
use kvwire_testkit::sim::{self, HostBug, SimConfig, SimReport};

const FAULTY_REQUESTS: usize = 10_000;

fn summary(label: &str, r: &SimReport) {
    eprintln!(
        "{label}: finished {} failed {} reasons {:?} P reasons {:?} crashes {} events {} d_steps {} \
         D block-s waiting {:.1} ttft p50 {:.1} ms p90 {:.1} ms exposed {:.2} ms \
         d_stats {:?} p_stats {:?}",
        r.finished,
        r.failed,
        r.fail_reasons,
        r.p_fail_reasons,
        r.p_crashes,
        r.events,
        r.d_steps,
        r.d_block_seconds_waiting,
        r.ttft_quantile_ms(0.5),
        r.ttft_quantile_ms(0.9),
        r.mean_ms(|d| d.exposed_transfer),
        r.d_stats,
        r.p_stats,
    );
}

fn assert_clean(label: &str, r: &SimReport, requests: usize) {
    assert!(
        r.violations.is_empty(),
        "{label}: {} violations, first: {:?}",
        r.violations.len(),
        r.violations.iter().take(5).collect::<Vec<_>>()
    );
    assert_eq!(
        r.records.len(),
        requests,
        "{label}: every request ends exactly once"
    );
    assert_eq!(r.finished + r.failed, requests, "{label}");
    for rec in &r.records {
        if let Some(d) = rec.decompose() {
            let (Some(a), Some(b)) = (rec.decode_sent, rec.first_token) else {
                panic!("{label}: decomposed without endpoints");
            };
            assert_eq!(d.total(), b - a, "{label}: decomposition must sum exactly");
        }
        if rec.outcome == Outcome::Finished {
            assert!(
                rec.first_token.is_some(),
                "{label}: finished without first token"
            );
            assert!(rec.last_byte.is_some() && rec.d_reported_finished >= rec.last_byte);
        } else {
            assert!(
                rec.fail_reason.is_some(),
                "{label}: failed without a reason"
            );
        }
    }
}

fn faulty_cell(policy: Policy, mode: SendMode) {
    let label = format!("{}/{}", policy.name(), mode.name());
    let r = sim::run(SimConfig::faulty(11, policy, mode, FAULTY_REQUESTS));
    summary(&label, &r);
    assert_clean(&label, &r, FAULTY_REQUESTS);
    // The failures were really exercised.
    assert!(r.p_crashes > 0, "{label}: no P crash injected");
    for reason in ["LocalAbort", "TransferError", "Timeout"] {
        let n = r.fail_reasons.get(reason).copied().unwrap_or(0)
            + r.p_fail_reasons.get(reason).copied().unwrap_or(0);
        assert!(
            n > 0,
            "{label}: no {reason} failure in D {:?} / P {:?}",
            r.fail_reasons,
            r.p_fail_reasons
        );
    }
    let peer = r.fail_reasons.get("PeerDown").copied().unwrap_or(0)
        + r.fail_reasons.get("PeerRestarted").copied().unwrap_or(0);
    assert!(peer > 0, "{label}: no peer failure in {:?}", r.fail_reasons);
    assert!(
        r.finished > FAULTY_REQUESTS * 8 / 10,
        "{label}: too few finished"
    );
}

#[test]
fn faulty_eager_layerwise() {
    faulty_cell(Policy::Eager, SendMode::Layerwise);
}

#[test]
fn faulty_eager_whole() {
    faulty_cell(Policy::Eager, SendMode::Whole);
}

#[test]
fn faulty_lazy_layerwise() {
    faulty_cell(Policy::Lazy, SendMode::Layerwise);
}

#[test]
fn faulty_lazy_whole() {
    faulty_cell(Policy::Lazy, SendMode::Whole);
}

#[test]
fn faulty_jit_layerwise() {
    faulty_cell(Policy::Jit, SendMode::Layerwise);
}

#[test]
fn faulty_jit_whole() {
    faulty_cell(Policy::Jit, SendMode::Whole);
}

#[test]
fn faulty_land_layerwise() {
    faulty_cell(Policy::Land, SendMode::Layerwise);
}

#[test]
fn faulty_land_whole() {
    faulty_cell(Policy::Land, SendMode::Whole);
}

#[test]
fn same_seed_same_timeline_other_seed_differs() {
    let a = sim::run(SimConfig::faulty(
        5,
        Policy::Lazy,
        SendMode::Layerwise,
        2_000,
    ));
    let b = sim::run(SimConfig::faulty(
        5,
        Policy::Lazy,
        SendMode::Layerwise,
        2_000,
    ));
    let c = sim::run(SimConfig::faulty(
        6,
        Policy::Lazy,
        SendMode::Layerwise,
        2_000,
    ));
    assert_clean("seed5", &a, 2_000);
    assert_clean("seed6", &c, 2_000);
    assert_eq!(a.timeline_hash, b.timeline_hash);
    assert_eq!(a.json_lines(), b.json_lines());
    assert_ne!(a.timeline_hash, c.timeline_hash);
}

fn queueing(policy: Policy, mode: SendMode) -> SimReport {
    let r = sim::run(SimConfig::queueing(3, policy, mode, 2_000));
    let label = format!("queueing {}/{}", policy.name(), mode.name());
    summary(&label, &r);
    assert_clean(&label, &r, 2_000);
    assert_eq!(r.failed, 0, "{label}: no failures injected");
    r
}

#[test]
fn lazy_and_jit_hold_far_fewer_block_seconds_than_eager_under_p_queueing() {
    let eager = queueing(Policy::Eager, SendMode::Layerwise);
    let lazy = queueing(Policy::Lazy, SendMode::Layerwise);
    let jit = queueing(Policy::Jit, SendMode::Layerwise);
    let (e, l, j) = (
        eager.d_block_seconds_waiting,
        lazy.d_block_seconds_waiting,
        jit.d_block_seconds_waiting,
    );
    eprintln!("D block-seconds held before promotion: eager {e:.1}, lazy {l:.1}, jit {j:.1}");
    assert!(e > 2.0 * l, "eager {e} must exceed 2× lazy {l}");
    assert!(l > j, "lazy {l} must exceed jit {j}");
    // P's queue is the same in all three runs (the arrival stream does not depend on policy).
    let wait = |r: &SimReport| r.mean_ms(|d| d.wait_for_p);
    assert!((wait(&eager) - wait(&lazy)).abs() < 1e-9);
}

#[test]
fn land_holds_jits_block_seconds_with_lazys_overlap() {
    let lazy = queueing(Policy::Lazy, SendMode::Layerwise);
    let jit = queueing(Policy::Jit, SendMode::Layerwise);
    let land = queueing(Policy::Land, SendMode::Layerwise);
    let bs = |r: &SimReport| r.d_block_seconds_waiting;
    let exposed = |r: &SimReport| r.mean_ms(|d| d.exposed_transfer);
    eprintln!(
        "block-seconds: lazy {:.1} jit {:.1} land {:.1}; exposed ms: lazy {:.2} jit {:.2} land {:.2}",
        bs(&lazy),
        bs(&jit),
        bs(&land),
        exposed(&lazy),
        exposed(&jit),
        exposed(&land)
    );
    // KV blocks are reserved only once the KV is complete: fewer block-seconds than jit
    // (which reserves when P's prefill is done, then waits for the whole transfer) ...
    assert!(
        bs(&land) < bs(&jit),
        "land {} vs jit {}",
        bs(&land),
        bs(&jit)
    );
    // ... while the transfer overlaps P's prefill as with lazy.
    assert!(exposed(&land) < 0.5 * exposed(&jit));
    assert_eq!(land.d_stats.failed, 0);
}

#[test]
fn land_falls_back_to_lazy_when_the_landing_pool_is_full() {
    let mut cfg = SimConfig::queueing(3, Policy::Land, SendMode::Layerwise, 500);
    // Room for one prompt (64 blocks) at a time, with two P engines prefilling.
    cfg.land_pool_blocks = 100;
    let r = sim::run(cfg);
    assert_clean("land, small pool", &r, 500);
    assert_eq!(r.failed, 0);
    assert!(r.d_land_fallbacks > 0, "the small pool must overflow");
    assert!(r.d_landings > 0, "and still take some requests");
}

#[test]
fn layerwise_exposes_about_one_layer_whole_exposes_the_whole_transfer() {
    let cfg = SimConfig::queueing(3, Policy::Lazy, SendMode::Layerwise, 2_000);
    let bytes = 8_192 * cfg.kv_bytes_per_token;
    let whole_ms = bytes as f64 * 1e3 / cfg.net.bandwidth as f64;
    let layer_ms = whole_ms / f64::from(cfg.layers);
    let lw = queueing(Policy::Lazy, SendMode::Layerwise).mean_ms(|d| d.exposed_transfer);
    let wh = queueing(Policy::Lazy, SendMode::Whole).mean_ms(|d| d.exposed_transfer);
    let jit_lw = queueing(Policy::Jit, SendMode::Layerwise).mean_ms(|d| d.exposed_transfer);
    eprintln!(
        "exposed transfer after the last layer: layerwise {lw:.2} ms, whole {wh:.2} ms, \
         jit+layerwise {jit_lw:.2} ms (one layer {layer_ms:.2} ms, all layers {whole_ms:.2} ms)"
    );
    assert!(
        lw < 1.5 * layer_ms,
        "layerwise {lw} vs one layer {layer_ms}"
    );
    assert!(
        wh > 0.9 * whole_ms,
        "whole {wh} vs whole transfer {whole_ms}"
    );
    assert!(wh > 4.0 * lw);
    // jit gives P its block ids only after prefill: nothing overlaps even in layerwise mode.
    assert!(jit_lw > 0.9 * whole_ms);
}

#[test]
fn the_checks_catch_a_host_that_frees_before_p_confirms() {
    // Freeing on abort without waiting for P lets in-flight layers land in freed blocks.
    let mut cfg = SimConfig::faulty(11, Policy::Lazy, SendMode::Layerwise, 3_000);
    cfg.faults.d_abort = 0.2;
    cfg.strict = false;
    cfg.host_bug = Some(HostBug::FreeOnAbortSent);
    let r = sim::run(cfg.clone());
    let writes = r
        .violations
        .iter()
        .filter(|v| matches!(v, Violation::WriteToUnheld { pool: 0, .. }))
        .count();
    eprintln!("write-after-free violations caught: {writes}");
    assert!(
        writes > 0,
        "violations: {:?}",
        &r.violations[..r.violations.len().min(5)]
    );
    // Without the bug the same run is clean.
    cfg.host_bug = None;
    cfg.strict = true;
    assert_clean("no bug", &sim::run(cfg), 3_000);
}

#[test]
fn the_checks_catch_a_double_free() {
    let mut cfg = SimConfig::faulty(11, Policy::Eager, SendMode::Whole, 1_000);
    cfg.host_bug = Some(HostBug::DoubleFreeOnFailure);
    let r = sim::run(cfg);
    assert!(
        matches!(
            r.violations.first(),
            Some(Violation::BadRelease { pool: 0, .. })
        ),
        "{:?}",
        r.violations.first()
    );
}

#[test]
fn harsh_faults_and_message_loss_hold_invariants() {
    // Ten times the failure rates and 1% control-message loss (lost aborts, lost heartbeats of
    // a restarted P overtaken by its requests): the cases that need abort re-sends and
    // connection teardown to stay safe.
    for (seed, policy, mode) in [
        (13, Policy::Lazy, SendMode::Layerwise),
        (15, Policy::Jit, SendMode::Layerwise),
        (15, Policy::Eager, SendMode::Whole),
    ] {
        let mut cfg = SimConfig::faulty(seed, policy, mode, 2_000);
        cfg.faults.p_crash_per_s *= 10.0;
        cfg.faults.transfer_error *= 10.0;
        cfg.faults.transfer_hang *= 10.0;
        cfg.faults.d_abort *= 10.0;
        cfg.net.loss = 0.01;
        let label = format!("harsh {seed} {}/{}", policy.name(), mode.name());
        let r = sim::run(cfg);
        summary(&label, &r);
        assert_clean(&label, &r, 2_000);
    }
}

//! Runs the fault-injection simulation over many seeds for every policy × send mode and reports
//! any invariant violation (a wider net than the test suite's fixed seeds).
//!
//! `cargo run --release -p kvwire-connector --example sweep [seeds] [requests] [harsh]`
//! (`harsh`: ten times the failure rates and 1% message loss).

use kvwire_connector::{Policy, SendMode};
use kvwire_testkit::sim::{self, SimConfig};

fn main() {
    let mut args = std::env::args().skip(1);
    let seeds: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(20);
    let requests: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(3_000);
    let harsh = args.next().is_some_and(|s| s == "harsh");
    let mut bad = 0;
    let mut runs = 0;
    for seed in 0..seeds {
        for policy in Policy::ALL {
            for mode in SendMode::ALL {
                let mut cfg = SimConfig::faulty(seed, policy, mode, requests);
                if harsh {
                    cfg.faults.p_crash_per_s *= 10.0;
                    cfg.faults.transfer_error *= 10.0;
                    cfg.faults.transfer_hang *= 10.0;
                    cfg.faults.d_abort *= 10.0;
                    cfg.net.loss = std::env::var("SWEEP_LOSS")
                        .ok()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0.01);
                }
                if let Some((ts, tp, tm, tr)) = trace_target() {
                    if (ts, tp, tm) != (seed, policy, mode) {
                        continue;
                    }
                    cfg.trace = Some(kvwire_connector::RequestId(tr));
                }
                let r = sim::run(cfg);
                runs += 1;
                let ended = r.records.len() == requests;
                if !r.violations.is_empty() || !ended {
                    bad += 1;
                    println!(
                        "seed {seed} {}/{}: {} records, violations {:?}",
                        policy.name(),
                        mode.name(),
                        r.records.len(),
                        &r.violations[..r.violations.len().min(3)]
                    );
                }
            }
        }
    }
    println!("{runs} runs of {requests} requests, {bad} with violations");
    if bad > 0 {
        std::process::exit(1);
    }
}

/// `SWEEP_TRACE=seed:policy:mode:req` runs only that cell and traces that request.
fn trace_target() -> Option<(u64, Policy, SendMode, u64)> {
    let v = std::env::var("SWEEP_TRACE").ok()?;
    let parts: Vec<&str> = v.split(':').collect();
    let (pn, mn) = (*parts.get(1)?, *parts.get(2)?);
    let policy = Policy::ALL.into_iter().find(|p| p.name() == pn)?;
    let mode = SendMode::ALL.into_iter().find(|m| m.name() == mn)?;
    Some((
        parts.first()?.parse().ok()?,
        policy,
        mode,
        parts.get(3)?.parse().ok()?,
    ))
}

//! Prints, for each reservation policy × send mode, what the simulator measures: D
//! block-seconds held before promotion, the decomposition of decode_sent → first_token, and the
//! same under injected failures.
//!
//! `cargo run --release -p kvwire-connector --example policies [requests]`

use kvwire_connector::{Policy, SendMode};
use kvwire_testkit::sim::{self, SimConfig, SimReport};

fn row(name: &str, r: &SimReport) {
    println!(
        "{name:<22} {:>7} {:>6} {:>12.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>4}",
        r.finished,
        r.failed,
        r.d_block_seconds_waiting,
        r.ttft_quantile_ms(0.5),
        r.ttft_quantile_ms(0.9),
        r.mean_ms(|d| d.wait_for_p),
        r.mean_ms(|d| d.reservation_wait),
        r.mean_ms(|d| d.exposed_transfer),
        r.mean_ms(|d| d.report_delay),
        r.mean_ms(|d| d.promotion_delay),
        r.mean_ms(|d| d.first_step),
        r.violations.len(),
    );
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000);
    println!(
        "{:<22} {:>7} {:>6} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>4}",
        "cell",
        "done",
        "failed",
        "D blk-s wait",
        "ttft p50",
        "ttft p90",
        "waitP",
        "resWait",
        "exposed",
        "report",
        "promote",
        "1st step",
        "viol"
    );
    for (label, make) in [
        (
            "queueing",
            SimConfig::queueing as fn(u64, Policy, SendMode, usize) -> SimConfig,
        ),
        ("faulty", SimConfig::faulty),
    ] {
        println!("-- {label} ({n} requests, seed 7; times in ms, means over finished requests)");
        for policy in Policy::ALL {
            for mode in SendMode::ALL {
                let r = sim::run(make(7, policy, mode, n));
                row(&format!("{}/{}", policy.name(), mode.name()), &r);
                for v in r.violations.iter().take(3) {
                    println!("    violation: {v}");
                }
            }
        }
    }
}

//! Cost of one D step and one P step of the connector core, with 1k vs 1M cached blocks in the
//! host's pool and 10 vs 1,000 live requests, 4 of them changing state per step.
//!
//! A "step" is what the glue does once per engine step: feed the events of the requests that
//! changed (an arrival, P's messages, a reservation, layers landing or ready, transfer
//! completions, promotion...), run due timers, drain the actions, ask for the next deadline.
//!
//! `cargo bench -p kvwire-connector --bench step -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvwire_testkit::steploop::{DStepLoop, PStepLoop};

fn steps(c: &mut Criterion) {
    let mut g = c.benchmark_group("connector_step");
    for cached in [1_000usize, 1_000_000] {
        for live in [10usize, 1_000] {
            let id = format!("cached={cached}/live={live}");
            let mut d = DStepLoop::new(cached, live);
            g.bench_function(BenchmarkId::new("d_step", &id), |b| b.iter(|| d.step()));
            assert_eq!(d.d.live_requests(), live, "the D bench keeps its live set");
            let mut p = PStepLoop::new(cached, live);
            g.bench_function(BenchmarkId::new("p_step", &id), |b| b.iter(|| p.step()));
            assert_eq!(p.p.live_requests(), live, "the P bench keeps its live set");
        }
    }
    g.finish();
}

criterion_group!(benches, steps);
criterion_main!(benches);

//! Connector core per-step cost (Rust level, runs anywhere): what the glue does once per engine
//! step for one side — feed the events of the requests that changed, run due timers, drain the
//! actions and timeline records — with 1k and 1M cached blocks in the host's pool and 10 and
//! 1,000 live requests, 4 of them changing state per step. Each step is timed on its own with
//! `Instant` (in-process; no harness), after a warm-up.
//!
//! The core never sees the block pool, so the cached-block count enters only through the host's
//! free list; the figure shows whether anything in the per-step path depends on it.

use std::hint::black_box;
use std::time::Instant;

use kvwire_testkit::steploop::{DStepLoop, PStepLoop};
use serde::Serialize;

/// One configuration's per-step cost.
#[derive(Clone, Debug, Serialize)]
pub struct CoreStep {
    /// `"d"` or `"p"`.
    pub side: &'static str,
    /// Blocks cached in the host pool besides the live requests' blocks.
    pub cached_blocks: usize,
    /// Live requests.
    pub live: usize,
    /// Timed steps.
    pub steps: usize,
    /// Median ns per step.
    pub median_ns: f64,
    /// 99th percentile ns per step.
    pub p99_ns: f64,
    /// Mean ns per step.
    pub mean_ns: f64,
    /// Live requests at the end (must equal `live`: the bench keeps its live set).
    pub live_end: usize,
}

fn summarize(
    side: &'static str,
    cached: usize,
    live: usize,
    mut t: Vec<u64>,
    end: usize,
) -> CoreStep {
    t.sort_unstable();
    let q = |p: f64| t[((t.len() - 1) as f64 * p).round() as usize] as f64;
    CoreStep {
        side,
        cached_blocks: cached,
        live,
        steps: t.len(),
        median_ns: q(0.5),
        p99_ns: q(0.99),
        mean_ns: t.iter().sum::<u64>() as f64 / t.len() as f64,
        live_end: end,
    }
}

fn time_steps(steps: usize, mut f: impl FnMut() -> usize) -> Vec<u64> {
    let mut t = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t0 = Instant::now();
        black_box(f());
        t.push(t0.elapsed().as_nanos() as u64);
    }
    t
}

/// Runs D and P at every (cached, live) pair; `steps` timed steps each after `steps / 5`
/// warm-up steps.
pub fn run(cached: &[usize], live: &[usize], steps: usize) -> Vec<CoreStep> {
    let steps = steps.max(10);
    let mut out = Vec::new();
    for &c in cached {
        for &l in live {
            let mut d = DStepLoop::new(c, l);
            let _ = time_steps(steps / 5, || d.step());
            let t = time_steps(steps, || d.step());
            out.push(summarize("d", c, l, t, d.d.live_requests()));
            drop(d);
            let mut p = PStepLoop::new(c, l);
            let _ = time_steps(steps / 5, || p.step());
            let t = time_steps(steps, || p.step());
            out.push(summarize("p", c, l, t, p.p.live_requests()));
        }
    }
    out
}

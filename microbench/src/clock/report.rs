//! Aggregates of a clock run: per-cell summary, JSON and timeline lines (the table is in
//! [`super::table`]).

use kvwire_connector::{Nanos, Outcome, TimelineRecord};
use serde::Serialize;
use serde_json::{json, Value};

use super::config::{Preset, STUDY_MOONCAKE};
use super::sim::{CellRun, HeldBlocks};
use super::workload::RequestSpec;
use super::ClockConfig;

/// Fixed term of the seed study's cost model, ns.
pub const SEED_FIXED_NS: Nanos = 300_000_000;
/// Bandwidth term of the seed study's cost model, bytes/s.
pub const SEED_BYTES_PER_S: f64 = 2.7e9;

/// Names of the decomposition segments, in order (the connector's).
pub use kvwire_connector::SEGMENT_NAMES as SEGMENTS;

/// Quantiles in milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Quantiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
}

/// Quantiles of nanosecond values, in milliseconds (zeros for none).
pub fn quantiles(v: &mut [Nanos]) -> Quantiles {
    if v.is_empty() {
        return Quantiles::default();
    }
    v.sort_unstable();
    let q = |p: f64| {
        let i = ((v.len() - 1) as f64 * p).round() as usize;
        v[i.min(v.len() - 1)] as f64 / 1e6
    };
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64 / 1e6;
    Quantiles {
        p50: q(0.5),
        p90: q(0.9),
        p99: q(0.99),
        mean,
    }
}

/// Cache capacity of one pool lost to blocks held by kv_both, time-weighted over the cell.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PoolSide {
    /// Blocks in the pool.
    pub capacity_blocks: u32,
    /// Time-weighted mean of the blocks held.
    pub held_mean_blocks: f64,
    /// Time-weighted 99th percentile of the blocks held (held no more than this 99% of the
    /// time).
    pub held_p99_blocks: u64,
    /// `held_mean_blocks / capacity_blocks`.
    pub lost_frac_mean: f64,
    /// `held_p99_blocks / capacity_blocks`.
    pub lost_frac_p99: f64,
    /// `"p"` (prefill done → KV sent: the deferred free), `"d"` (reserved → running: the
    /// reservation ahead of the KV) or `"land"` (D's landing pool, apart from its KV pool).
    pub side: &'static str,
}

impl PoolSide {
    /// The figures of one pool's record.
    pub fn of(h: &HeldBlocks, side: &'static str) -> Self {
        let mean = h.mean();
        let p99 = h.quantile(0.99);
        let cap = f64::from(h.capacity.max(1));
        PoolSide {
            capacity_blocks: h.capacity,
            held_mean_blocks: mean,
            held_p99_blocks: p99,
            lost_frac_mean: mean / cap,
            lost_frac_p99: p99 as f64 / cap,
            side,
        }
    }
}

/// The pools of a cell (`"pool": {"p": {...}, "d": {...}, "land": {...}}` in the JSON).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PoolSummary {
    /// P's pool.
    pub p: PoolSide,
    /// D's pool.
    pub d: PoolSide,
    /// D's landing pool.
    pub land: PoolSide,
}

/// The requests D served, one kind or all: their own TTFT and TPOT.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct ServedSummary {
    /// Requests.
    pub requests: usize,
    /// Time to first token (P/D: `decode_sent → first_token`), ms.
    pub ttft_ms: Quantiles,
    /// Time per output token after the first, ms (requests of two tokens or more).
    pub tpot_ms: Quantiles,
    /// Preemptions they suffered.
    pub preemptions: u64,
}

impl ServedSummary {
    fn of<'a>(it: impl Iterator<Item = &'a super::sim::ServedRecord>) -> Self {
        let (mut ttft, mut tpot) = (Vec::new(), Vec::new());
        let mut s = ServedSummary::default();
        for r in it {
            s.requests += 1;
            s.preemptions += u64::from(r.preemptions);
            ttft.extend(r.ttft());
            tpot.extend(r.tpot());
        }
        s.ttft_ms = quantiles(&mut ttft);
        s.tpot_ms = quantiles(&mut tpot);
        s
    }
}

/// One cell's figures.
#[derive(Clone, Debug, Serialize)]
pub struct CellSummary {
    /// D's policy.
    pub policy: String,
    /// P's send mode.
    pub send_mode: String,
    /// P/D requests run.
    pub requests: usize,
    /// Local requests D served next to them.
    pub local_requests: usize,
    /// P/D requests that reached their first token.
    pub finished: usize,
    /// P/D requests whose every layer's bytes were checked on D and matched (`land`: in the
    /// landing slots and again in the KV blocks).
    pub verified_requests: usize,
    /// Layers whose bytes on D did not match.
    pub corrupt_layers: usize,
    /// Wire bytes checked on D as they landed.
    pub bytes_verified: u64,
    /// Bytes checked again in D's KV blocks after a `land` request's copy.
    pub copy_bytes_verified: u64,
    /// `decode_sent → first_token`, ms.
    pub clock_ms: Quantiles,
    /// Each segment of the decomposition, ms (mean and quantiles of the segment itself).
    pub decomposition_ms: std::collections::BTreeMap<String, Quantiles>,
    /// Exposed tail after P's last chunk: `last layer ready on P → last byte on D`, ms
    /// (reservation wait included).
    pub tail_ms: Quantiles,
    /// `last layer ready on P → KV complete in D's KV blocks` (`land`: after the copy), ms.
    pub kv_ready_ms: Quantiles,
    /// What the seed study's cost model `0.3 s + bytes / 2.7 GB/s` predicts for the same
    /// requests (modelled bytes), ms.
    pub seed_model_ms: Quantiles,
    /// D KV blocks × seconds reserved before promotion (reserved blocks: a prefix hit's
    /// blocks are D's cache; `land`: from the KV reservation), summed over requests.
    pub d_block_seconds_waiting: f64,
    /// D steps in which the head of D's waiting queue could not get blocks.
    pub admission_stalls: u64,
    /// Running requests preempted (recompute) for lack of blocks.
    pub preemptions: u64,
    /// Tokens D recomputed for them.
    pub recompute_tokens: u64,
    /// Every request D served (P/D and local).
    pub served: ServedSummary,
    /// The P/D requests.
    pub served_pd: ServedSummary,
    /// The local requests.
    pub served_local: ServedSummary,
    /// D's prefix-cache hit rate over every lookup (tokens found / prompt tokens looked up;
    /// P/D requests are looked up with `d_prefix_cache`).
    pub apc: Option<f64>,
    /// Of local requests.
    pub apc_local: Option<f64>,
    /// D's prefix-cache hit rate of P/D requests (not transferred).
    pub apc_pd: Option<f64>,
    /// Cached blocks D evicted.
    pub evicted_blocks: u64,
    /// `land` requests that got landing slots.
    pub landings: u64,
    /// `land` requests that fell back to `lazy`.
    pub land_fallbacks: u64,
    /// Virtual time of a `land` request's local copy, ms.
    pub land_copy_ms: Quantiles,
    /// Cache capacity held by kv_both in P's and D's pools (time-weighted over the cell).
    pub pool: PoolSummary,
    /// D steps run.
    pub d_steps: u64,
    /// Writes (after coalescing) per request, mean.
    pub writes_per_request: f64,
    /// Ops (blocks × layers) per request, mean.
    pub ops_per_request: f64,
    /// Wire bytes moved.
    pub wire_bytes: u64,
    /// Wire bytes the requests' whole contexts are (what moves without D's prefix cache).
    pub context_wire_bytes: u64,
    /// Wall seconds in transfers (post → D's notification).
    pub transfer_wall_s: f64,
    /// Wire throughput measured over those transfers, GB/s (1e9 bytes/s).
    pub wire_gbps: f64,
    /// Measured wall time of one layer batch, µs.
    pub layer_wall_us: Quantiles,
    /// Virtual seconds the cell ran.
    pub virtual_s: f64,
    /// Wall seconds the cell took.
    pub wall_s: f64,
}

/// A whole run.
#[derive(Clone, Debug)]
pub struct ClockReport {
    /// The configuration.
    pub config: ClockConfig,
    /// Transport the engines used.
    pub transport: String,
    /// Measured fixed cost of one batch (not stretched).
    pub fixed_batch_cost: std::time::Duration,
    /// Wire nanoseconds per byte used for every cell ([`super::LinkSpeed::Frozen`]).
    pub frozen_ns_per_byte: Option<f64>,
    /// P/D requests per cell.
    pub requests: usize,
    /// Local requests per cell.
    pub local_requests: usize,
    /// Prompt tokens of the P/D requests, mean.
    pub mean_prompt_tokens: f64,
    /// Uncached (prefilled) tokens of the P/D requests, mean.
    pub mean_uncached_tokens: f64,
    /// Cells with their raw records.
    pub cells: Vec<CellRun>,
    /// Cells' figures (same order).
    pub summaries: Vec<CellSummary>,
    /// D serving the local requests alone (no P/D request: plain vLLM), when there are any.
    pub baseline: Option<CellRun>,
    /// Its figures.
    pub baseline_summary: Option<CellSummary>,
}

impl ClockReport {
    /// Builds the report from the cells of a run.
    pub fn new(
        cfg: &ClockConfig,
        specs: &[RequestSpec],
        transport: &str,
        fixed_batch_cost: std::time::Duration,
        cells: Vec<CellRun>,
    ) -> Self {
        let pd: Vec<&RequestSpec> = specs.iter().filter(|s| !s.local).collect();
        let n = pd.len().max(1) as f64;
        let summaries = cells.iter().map(|c| summarize(c, pd.len())).collect();
        ClockReport {
            config: cfg.clone(),
            transport: transport.to_string(),
            fixed_batch_cost,
            frozen_ns_per_byte: None,
            requests: pd.len(),
            local_requests: specs.len() - pd.len(),
            mean_prompt_tokens: pd.iter().map(|s| f64::from(s.prompt_tokens)).sum::<f64>() / n,
            mean_uncached_tokens: pd.iter().map(|s| f64::from(s.uncached())).sum::<f64>() / n,
            cells,
            summaries,
            baseline: None,
            baseline_summary: None,
        }
    }

    /// Sets the reference cell of D serving the local requests alone.
    pub fn set_baseline(&mut self, b: Option<CellRun>) {
        self.baseline_summary = b.as_ref().map(|c| summarize(c, 0));
        self.baseline = b;
    }

    /// Every request of every cell finished and had all its bytes verified.
    pub fn all_verified(&self) -> bool {
        self.summaries.iter().all(|s| {
            s.corrupt_layers == 0 && s.verified_requests == s.requests && s.finished == s.requests
        })
    }

    /// The prefix-cache hit rate of a cell's local requests minus plain vLLM's (the baseline:
    /// D serving them alone), percentage points: what hosting the P/D requests costs D's own
    /// traffic in cache; with local requests.
    pub fn apc_delta_pp(&self, s: &CellSummary) -> Option<f64> {
        let base = self.baseline_summary.as_ref()?.apc_local?;
        Some(100.0 * (s.apc_local? - base))
    }

    /// The cell of `policy`/`send_mode`.
    pub fn cell(&self, policy: &str, send_mode: &str) -> Option<&CellSummary> {
        self.summaries
            .iter()
            .find(|s| s.policy == policy && s.send_mode == send_mode)
    }
}

fn rate(hit: u64, query: u64) -> Option<f64> {
    (query > 0).then(|| hit as f64 / query as f64)
}

fn summarize(c: &CellRun, requests: usize) -> CellSummary {
    let mut clock = Vec::new();
    let mut segs: Vec<Vec<Nanos>> = vec![Vec::new(); 6];
    let mut block_ns = 0u128;
    let mut seed = Vec::new();
    let (mut tail, mut ready, mut copy) = (Vec::new(), Vec::new(), Vec::new());
    let mut finished = 0;
    for (r, h) in c.records.iter().zip(&c.host) {
        block_ns += r.d_block_ns_waiting() * u128::from(r.blocks - r.prefix_blocks.min(r.blocks))
            / u128::from(r.blocks.max(1));
        if r.outcome != Outcome::Finished {
            continue;
        }
        if let Some(d) = r.decompose() {
            finished += 1;
            seed.push(SEED_FIXED_NS + (r.bytes as f64 / SEED_BYTES_PER_S * 1e9) as Nanos);
            clock.push(d.total());
            for (v, s) in segs.iter_mut().zip(d.segments()) {
                v.push(s);
            }
        }
        if let (Some(p), Some(l)) = (r.p_last_layer_ready, r.last_byte) {
            tail.push(l.saturating_sub(p));
            if let Some(k) = h.kv_ready {
                ready.push(k.saturating_sub(p));
            }
        }
        if h.landed {
            copy.push(h.copy_ns);
        }
    }
    let decomposition_ms = SEGMENTS
        .iter()
        .zip(segs.iter_mut())
        .map(|(k, v)| (k.to_string(), quantiles(v)))
        .collect();
    let nreq = requests.max(1) as f64;
    let wall = c.transfer_wall.as_secs_f64();
    CellSummary {
        policy: c.policy.name().to_string(),
        send_mode: c.send_mode.name().to_string(),
        requests,
        local_requests: c.served.iter().filter(|s| s.local).count(),
        finished,
        verified_requests: c.verified_requests,
        corrupt_layers: c.corrupt_layers,
        bytes_verified: c.bytes_verified,
        copy_bytes_verified: c.copy_bytes_verified,
        clock_ms: quantiles(&mut clock),
        seed_model_ms: quantiles(&mut seed),
        decomposition_ms,
        tail_ms: quantiles(&mut tail),
        kv_ready_ms: quantiles(&mut ready),
        d_block_seconds_waiting: block_ns as f64 / 1e9,
        admission_stalls: c.admission_stalls,
        preemptions: c.preemptions,
        recompute_tokens: c.recompute_tokens,
        served: ServedSummary::of(c.served.iter()),
        served_pd: ServedSummary::of(c.served.iter().filter(|s| !s.local)),
        served_local: ServedSummary::of(c.served.iter().filter(|s| s.local)),
        apc: rate(
            c.apc.local_hit + c.apc.pd_hit,
            c.apc.local_query + c.apc.pd_query,
        ),
        apc_local: rate(c.apc.local_hit, c.apc.local_query),
        apc_pd: rate(c.apc.pd_hit, c.apc.pd_query),
        evicted_blocks: c.evicted_blocks,
        landings: c.landings,
        land_fallbacks: c.land_fallbacks,
        land_copy_ms: quantiles(&mut copy),
        pool: PoolSummary {
            p: PoolSide::of(&c.pool.p, "p"),
            d: PoolSide::of(&c.pool.d, "d"),
            land: PoolSide::of(&c.pool.land, "land"),
        },
        d_steps: c.d_steps,
        writes_per_request: c.writes as f64 / nreq,
        ops_per_request: c.ops as f64 / nreq,
        wire_bytes: c.wire_bytes,
        context_wire_bytes: c.host.iter().map(|h| h.context_wire_bytes).sum(),
        transfer_wall_s: wall,
        wire_gbps: if wall > 0.0 {
            c.wire_bytes as f64 / wall / 1e9
        } else {
            0.0
        },
        layer_wall_us: {
            let mut v: Vec<Nanos> = c
                .layer_wall_us
                .iter()
                .map(|&u| (u * 1e6) as Nanos)
                .collect();
            // quantiles() divides by 1e6: feed picoseconds to get µs back.
            quantiles(&mut v)
        },
        virtual_s: c.virtual_end as f64 / 1e9,
        wall_s: c.wall.as_secs_f64(),
    }
}

/// The study comparison (preset `study`): the eager/whole cell (the Mooncake connector's
/// behaviour: D reserves at arrival, P sends after prefill) next to what the study measured,
/// and every other cell relative to it.
pub fn study_comparison(r: &ClockReport) -> Option<Value> {
    if r.config.preset != Preset::Study {
        return None;
    }
    let base = r.cell("eager", "whole")?;
    let m = STUDY_MOONCAKE;
    let cells: Vec<Value> = r
        .summaries
        .iter()
        .map(|s| {
            json!({
                "policy": s.policy, "send_mode": s.send_mode,
                "clock_p50_s": s.clock_ms.p50 / 1e3, "clock_p90_s": s.clock_ms.p90 / 1e3,
                "clock_p50_vs_eager_whole": s.clock_ms.p50 / base.clock_ms.p50.max(1e-9),
                "clock_p90_vs_eager_whole": s.clock_ms.p90 / base.clock_ms.p90.max(1e-9),
                "d_block_seconds_vs_eager_whole":
                    s.d_block_seconds_waiting / base.d_block_seconds_waiting.max(1e-9),
                "preemptions": s.preemptions,
                "apc_delta_pp": r.apc_delta_pp(s),
                "ttft_p90_ms": s.served.ttft_ms.p90, "tpot_p90_ms": s.served.tpot_ms.p90,
            })
        })
        .collect();
    Some(json!({
        "mooncake_measured": m,
        "eager_whole": {
            "clock_p50_s": base.clock_ms.p50 / 1e3,
            "clock_p90_s": base.clock_ms.p90 / 1e3,
            "clock_p50_vs_measured": base.clock_ms.p50 / 1e3 / m.clock_p50_s,
            "clock_p90_vs_measured": base.clock_ms.p90 / 1e3 / m.clock_p90_s,
            "apc_delta_pp": r.apc_delta_pp(base),
        },
        "cells": cells,
    }))
}

/// The JSON document of `--json`.
pub fn to_json(r: &ClockReport) -> Value {
    let c = &r.config;
    let assumptions: Vec<Value> = c
        .assumptions()
        .into_iter()
        .map(|(k, v, why)| json!({"parameter": k, "value": v, "source": why}))
        .collect();
    let baseline = r.baseline_summary.as_ref().map(|b| {
        json!({
            "what": "plain vLLM: D serving its local requests alone (no P/D request)",
            "served_local": b.served_local, "apc_local": b.apc_local,
            "preemptions": b.preemptions, "evicted_blocks": b.evicted_blocks,
        })
    });
    json!({
        "schema": "kvwire.clock/1",
        "preset": c.preset.name(),
        "scenario": c.scenario.name(),
        "transport": r.transport,
        "requests": r.requests,
        "local_requests": r.local_requests,
        "seed": c.seed,
        "verified": r.all_verified(),
        "workload": {
            "mean_prompt_tokens": r.mean_prompt_tokens,
            "mean_uncached_tokens": r.mean_uncached_tokens,
            "local_rate": c.local_rate,
        },
        "config": {
            "layers": c.layers,
            "block_tokens": c.block_tokens,
            "model_bytes_per_token": c.model_bytes_per_token,
            "wire_bytes_per_token": c.wire_bytes_per_token,
            "transfer_scale": c.transfer_scale,
            "p_pool_blocks": c.p_pool_blocks,
            "d_pool_blocks": c.d_pool_blocks,
            "land_pool_blocks": c.land_pool_blocks,
            "land_copy_gbps": c.land_copy_bytes_per_s / 1e9,
            "p_step_base_ms": c.p_step_base as f64 / 1e6,
            "p_step_per_token_us": c.p_step_per_token as f64 / 1e3,
            "p_step_per_token_sq_ns": c.p_step_per_token_sq,
            "p_token_budget": c.p_token_budget,
            "chunk_tokens": c.chunk_tokens,
            "d_step_base_ms": c.d_step_base as f64 / 1e6,
            "d_step_per_running_ms": c.d_step_per_running as f64 / 1e6,
            "d_step_per_kv_token_ns": c.d_step_per_kv_token,
            "d_prefill_per_token_us": c.d_prefill_per_token as f64 / 1e3,
            "d_token_budget": c.d_token_budget,
            "d_prefix_cache": c.d_prefix_cache,
            "msg_latency_us": c.msg_latency as f64 / 1e3,
            "link_speed": c.link_speed.name(),
            "link_gbps": c.link_gbps,
            "frozen_wire_gbps": r.frozen_ns_per_byte.filter(|&v| v > 0.0).map(|v| 1.0 / v),
            "fixed_batch_cost_us": r.fixed_batch_cost.as_secs_f64() * 1e6,
            "clock": "virtual for step loops and control messages; transfers measured on the wall clock and stretched by transfer_scale",
            "assumptions": assumptions,
        },
        "cells": r.summaries,
        "baseline": baseline,
        "study": study_comparison(r),
    })
}

/// Timeline JSON lines for the calibrator: the connector's merged records, each with what a
/// router knows at `decode_sent` added — D's load (`dst_waiting`, `dst_running`), P's queue
/// ahead of the request and the step P is running (`src_waiting`, `src_queued_tokens`,
/// `src_running`, `src_running_tokens`: tokens of that step not computed yet by P's
/// layer-ready count; `src_pending_bytes`: modelled KV bytes P sends before this request's),
/// the request's own prefill work (`prefill_tokens`:
/// uncached tokens P computes after `decode_sent`, 0 in migration; `cached_tokens`) — and the
/// scenario. Bytes are those of the modelled model.
pub fn timeline_lines(r: &ClockReport) -> String {
    let mut s = String::new();
    for c in &r.cells {
        for ((rec, load), src) in c
            .records
            .iter()
            .zip(&c.load_at_arrival)
            .zip(&c.src_at_arrival)
        {
            let mut v = serde_json::to_value(rec).unwrap_or(Value::Null);
            if let Value::Object(m) = &mut v {
                m.insert("dst_waiting".into(), json!(load.0));
                m.insert("dst_running".into(), json!(load.1));
                m.insert("src_waiting".into(), json!(src.waiting));
                m.insert("src_queued_tokens".into(), json!(src.queued_tokens));
                m.insert("src_running".into(), json!(src.running));
                m.insert("src_running_tokens".into(), json!(src.running_tokens));
                m.insert("src_pending_bytes".into(), json!(src.pending_bytes));
                m.insert("prefill_tokens".into(), json!(src.prefill_tokens));
                m.insert("cached_tokens".into(), json!(src.cached_tokens));
                m.insert("scenario".into(), json!(r.config.scenario.name()));
            }
            s.push_str(&v.to_string());
            s.push('\n');
        }
    }
    s
}

/// Parses one line of [`timeline_lines`] back into the connector's record.
pub fn parse_timeline_line(line: &str) -> Result<TimelineRecord, serde_json::Error> {
    TimelineRecord::from_json_line(line)
}

//! Aggregates of a clock run: per-cell summary, table, JSON and timeline lines.

use kvwire_connector::{Nanos, Outcome, TimelineRecord};
use serde::Serialize;
use serde_json::{json, Value};

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

fn quantiles(v: &mut [Nanos]) -> Quantiles {
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
    /// `"p"` (prefill done → KV sent: the deferred free) or `"d"` (reserved → running: the
    /// reservation ahead of the KV).
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

/// Both pools of a cell (`"pool": {"p": {...}, "d": {...}}` in the JSON).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PoolSummary {
    /// P's pool.
    pub p: PoolSide,
    /// D's pool.
    pub d: PoolSide,
}

/// One cell's figures.
#[derive(Clone, Debug, Serialize)]
pub struct CellSummary {
    /// D's policy.
    pub policy: String,
    /// P's send mode.
    pub send_mode: String,
    /// Requests run.
    pub requests: usize,
    /// Requests that reached their first token.
    pub finished: usize,
    /// Requests whose every layer's bytes were checked on D and matched.
    pub verified_requests: usize,
    /// Layers whose bytes on D did not match.
    pub corrupt_layers: usize,
    /// Wire bytes checked on D.
    pub bytes_verified: u64,
    /// `decode_sent → first_token`, ms.
    pub clock_ms: Quantiles,
    /// Each segment of the decomposition, ms (mean and quantiles of the segment itself).
    pub decomposition_ms: std::collections::BTreeMap<String, Quantiles>,
    /// What the seed study's cost model `0.3 s + bytes / 2.7 GB/s` predicts for the same
    /// requests (modelled bytes), ms.
    pub seed_model_ms: Quantiles,
    /// D blocks × seconds reserved before promotion, summed over requests.
    pub d_block_seconds_waiting: f64,
    /// D steps in which a reservable request could not get blocks.
    pub admission_stalls: u64,
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
    /// Requests per cell.
    pub requests: usize,
    /// Prompt tokens, mean.
    pub mean_prompt_tokens: f64,
    /// Uncached (prefilled) tokens, mean.
    pub mean_uncached_tokens: f64,
    /// Cells with their raw records.
    pub cells: Vec<CellRun>,
    /// Cells' figures (same order).
    pub summaries: Vec<CellSummary>,
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
        let n = specs.len().max(1) as f64;
        let summaries = cells.iter().map(|c| summarize(c, specs.len())).collect();
        ClockReport {
            config: cfg.clone(),
            transport: transport.to_string(),
            fixed_batch_cost,
            frozen_ns_per_byte: None,
            requests: specs.len(),
            mean_prompt_tokens: specs
                .iter()
                .map(|s| f64::from(s.prompt_tokens))
                .sum::<f64>()
                / n,
            mean_uncached_tokens: specs.iter().map(|s| f64::from(s.uncached())).sum::<f64>() / n,
            cells,
            summaries,
        }
    }

    /// Every request of every cell finished and had all its bytes verified.
    pub fn all_verified(&self) -> bool {
        self.summaries.iter().all(|s| {
            s.corrupt_layers == 0 && s.verified_requests == s.requests && s.finished == s.requests
        })
    }
}

fn summarize(c: &CellRun, requests: usize) -> CellSummary {
    let mut clock = Vec::new();
    let mut segs: Vec<Vec<Nanos>> = vec![Vec::new(); 6];
    let mut block_ns = 0u128;
    let mut seed = Vec::new();
    let mut finished = 0;
    for r in &c.records {
        block_ns += r.d_block_ns_waiting();
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
        finished,
        verified_requests: c.verified_requests,
        corrupt_layers: c.corrupt_layers,
        bytes_verified: c.bytes_verified,
        clock_ms: quantiles(&mut clock),
        seed_model_ms: quantiles(&mut seed),
        decomposition_ms,
        d_block_seconds_waiting: block_ns as f64 / 1e9,
        admission_stalls: c.admission_stalls,
        pool: PoolSummary {
            p: PoolSide::of(&c.pool.p, "p"),
            d: PoolSide::of(&c.pool.d, "d"),
        },
        d_steps: c.d_steps,
        writes_per_request: c.writes as f64 / nreq,
        ops_per_request: c.ops as f64 / nreq,
        wire_bytes: c.wire_bytes,
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

/// The table printed on stdout.
pub fn table(r: &ClockReport) -> String {
    let c = &r.config;
    let mut s = format!(
        "kvwire clock: scenario {}, transport {}, {} requests/cell (prompt mean {:.0} tok, prefilled mean {:.0} tok), \
         {} layers, {} B/token on the wire for {} B/token modelled (transfer time: {:.1} us fixed + measured rest x{:.0}), D pool {} blocks of {} tokens\n",
        c.scenario.name(),
        r.transport,
        r.requests,
        r.mean_prompt_tokens,
        r.mean_uncached_tokens,
        c.layers,
        c.wire_bytes_per_token,
        c.model_bytes_per_token,
        r.fixed_batch_cost.as_secs_f64() * 1e6,
        c.transfer_scale,
        c.d_pool_blocks,
        c.block_tokens
    );
    s.push_str(
        "decode_sent->first_token (ms)           | mean of the decomposition (ms)                        |\n",
    );
    s.push_str(&format!(
        "{:<6} {:<9} {:>8} {:>8} {:>8} | {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} | {:>9} {:>6} {:>8} {:>9}\n",
        "policy", "send", "p50", "p90", "p99", "waitP", "resv", "xfer", "report", "promo", "step",
        "D blk*s", "stalls", "wr/req", "verified"
    ));
    for x in &r.summaries {
        let m = |k: &str| x.decomposition_ms.get(k).map_or(0.0, |q| q.mean);
        s.push_str(&format!(
            "{:<6} {:<9} {:>8.1} {:>8.1} {:>8.1} | {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>7.1} | {:>9.1} {:>6} {:>8.1} {:>4}/{:<4}\n",
            x.policy,
            x.send_mode,
            x.clock_ms.p50,
            x.clock_ms.p90,
            x.clock_ms.p99,
            m("wait_for_p"),
            m("reservation_wait"),
            m("exposed_transfer"),
            m("report_delay"),
            m("promotion_delay"),
            m("first_step"),
            x.d_block_seconds_waiting,
            x.admission_stalls,
            x.writes_per_request,
            x.verified_requests,
            x.requests
        ));
    }
    s.push_str(&format!(
        "block pool held by kv_both (time-weighted; P: prefill done -> KV sent, pool {} blocks; D: reserved -> running, pool {} blocks)\n",
        c.p_pool_blocks, c.d_pool_blocks
    ));
    s.push_str(&format!(
        "{:<6} {:<9} | {:>10} {:>8} {:>8} {:>8} | {:>10} {:>8} {:>8} {:>8}\n",
        "policy",
        "send",
        "P mean blk",
        "P p99",
        "P mean%",
        "P p99%",
        "D mean blk",
        "D p99",
        "D mean%",
        "D p99%"
    ));
    for x in &r.summaries {
        let (p, d) = (&x.pool.p, &x.pool.d);
        s.push_str(&format!(
            "{:<6} {:<9} | {:>10.1} {:>8} {:>7.2}% {:>7.2}% | {:>10.1} {:>8} {:>7.2}% {:>7.2}%\n",
            x.policy,
            x.send_mode,
            p.held_mean_blocks,
            p.held_p99_blocks,
            100.0 * p.lost_frac_mean,
            100.0 * p.lost_frac_p99,
            d.held_mean_blocks,
            d.held_p99_blocks,
            100.0 * d.lost_frac_mean,
            100.0 * d.lost_frac_p99,
        ));
    }
    s
}

/// The JSON document of `--json`.
pub fn to_json(r: &ClockReport) -> Value {
    let c = &r.config;
    json!({
        "schema": "kvwire.clock/1",
        "scenario": c.scenario.name(),
        "transport": r.transport,
        "requests": r.requests,
        "seed": c.seed,
        "verified": r.all_verified(),
        "workload": {
            "mean_prompt_tokens": r.mean_prompt_tokens,
            "mean_uncached_tokens": r.mean_uncached_tokens,
        },
        "config": {
            "layers": c.layers,
            "block_tokens": c.block_tokens,
            "model_bytes_per_token": c.model_bytes_per_token,
            "wire_bytes_per_token": c.wire_bytes_per_token,
            "transfer_scale": c.transfer_scale,
            "p_pool_blocks": c.p_pool_blocks,
            "d_pool_blocks": c.d_pool_blocks,
            "p_step_base_ms": c.p_step_base as f64 / 1e6,
            "p_step_per_token_us": c.p_step_per_token as f64 / 1e3,
            "p_token_budget": c.p_token_budget,
            "d_step_base_ms": c.d_step_base as f64 / 1e6,
            "d_step_per_running_ms": c.d_step_per_running as f64 / 1e6,
            "msg_latency_us": c.msg_latency as f64 / 1e3,
            "link_speed": c.link_speed.name(),
            "frozen_wire_gbps": r.frozen_ns_per_byte.filter(|&v| v > 0.0).map(|v| 1.0 / v),
            "fixed_batch_cost_us": r.fixed_batch_cost.as_secs_f64() * 1e6,
            "clock": "virtual for step loops and control messages; transfers measured on the wall clock and stretched by transfer_scale",
        },
        "cells": r.summaries,
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

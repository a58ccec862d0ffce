//! The table `kvwire-bench clock` prints: the clock and its decomposition, the pools held by
//! kv_both, D as an engine (TTFT, TPOT, preemptions, prefix cache) and, for the study preset,
//! its assumptions and the comparison with what the study measured.

use std::fmt::Write as _;

use super::config::STUDY_MOONCAKE;
use super::report::ClockReport;

fn opt_pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{:.1}", 100.0 * x))
}

fn opt_pp(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:+.2}"))
}

/// The table printed on stdout.
pub fn table(r: &ClockReport) -> String {
    let c = &r.config;
    let mut s = format!(
        "kvwire clock: preset {}, scenario {}, transport {}, {} P/D requests/cell (prompt mean {:.0} tok, prefilled mean {:.0} tok) and {} local, \
         {} layers, {} B/token on the wire for {} B/token modelled (transfer time: {:.1} us fixed + {} x{:.0}), D pool {} blocks of {} tokens, \
         landing pool {}, prefill {}, D prefix cache for P/D {}\n",
        c.preset.name(),
        c.scenario.name(),
        r.transport,
        r.requests,
        r.mean_prompt_tokens,
        r.mean_uncached_tokens,
        r.local_requests,
        c.layers,
        c.wire_bytes_per_token,
        c.model_bytes_per_token,
        r.fixed_batch_cost.as_secs_f64() * 1e6,
        match c.link_gbps {
            Some(g) => format!("bytes at {g} GB/s"),
            None => "measured rest".into(),
        },
        c.transfer_scale,
        c.d_pool_blocks,
        c.block_tokens,
        c.land_pool_blocks,
        if c.chunk_tokens > 0 {
            format!("in chunks of {} tokens", c.chunk_tokens)
        } else {
            "whole prompts".into()
        },
        if c.d_prefix_cache { "on" } else { "off" },
    );
    s.push_str(
        "decode_sent->first_token (ms)           | mean of the decomposition (ms)                        |\n",
    );
    let _ = writeln!(
        s,
        "{:<6} {:<9} {:>8} {:>8} {:>8} | {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} | {:>9} {:>6} {:>8} {:>9}",
        "policy", "send", "p50", "p90", "p99", "waitP", "resv", "xfer", "report", "promo", "step",
        "D blk*s", "stalls", "wr/req", "verified"
    );
    for x in &r.summaries {
        let m = |k: &str| x.decomposition_ms.get(k).map_or(0.0, |q| q.mean);
        let _ = writeln!(
            s,
            "{:<6} {:<9} {:>8.1} {:>8.1} {:>8.1} | {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>7.1} | {:>9.1} {:>6} {:>8.1} {:>4}/{:<4}",
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
        );
    }
    let _ = writeln!(
        s,
        "block pool held by kv_both (time-weighted; P: prefill done -> KV sent, pool {} blocks; D: reserved -> running, pool {} blocks)",
        c.p_pool_blocks, c.d_pool_blocks
    );
    let _ = writeln!(
        s,
        "{:<6} {:<9} | {:>10} {:>8} {:>8} {:>8} | {:>10} {:>8} {:>8} {:>8} | {:>9} {:>8}",
        "policy",
        "send",
        "P mean blk",
        "P p99",
        "P mean%",
        "P p99%",
        "D mean blk",
        "D p99",
        "D mean%",
        "D p99%",
        "land mean",
        "land p99"
    );
    for x in &r.summaries {
        let (p, d, l) = (&x.pool.p, &x.pool.d, &x.pool.land);
        let _ = writeln!(
            s,
            "{:<6} {:<9} | {:>10.1} {:>8} {:>7.2}% {:>7.2}% | {:>10.1} {:>8} {:>7.2}% {:>7.2}% | {:>9.1} {:>8}",
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
            l.held_mean_blocks,
            l.held_p99_blocks,
        );
    }
    d_engine_table(r, &mut s);
    study_section(r, &mut s);
    s
}

/// D as an engine: every request it serves, the prefix cache, the tail after P's last
/// chunk, `land`'s fallbacks, the wire bytes.
fn d_engine_table(r: &ClockReport, s: &mut String) {
    let _ = writeln!(
        s,
        "D as an engine (TTFT/TPOT of every request D serves, P/D and local; tail: P's last layer ready -> last byte on D; ms; APC: D's prefix-cache hit rate)"
    );
    let _ = writeln!(
        s,
        "{:<6} {:<9} | {:>7} {:>7} | {:>8} {:>8} {:>7} {:>7} | {:>7} {:>9} | {:>7} {:>7} {:>7} | {:>6} {:>8} {:>6}",
        "policy",
        "send",
        "tail50",
        "tail90",
        "TTFT50",
        "TTFT90",
        "TPOT50",
        "TPOT90",
        "preempt",
        "recomp tk",
        "APCloc%",
        "dAPC pp",
        "APCpd%",
        "landfb",
        "wire GB",
        "wire%"
    );
    for x in &r.summaries {
        let _ = writeln!(
            s,
            "{:<6} {:<9} | {:>7.1} {:>7.1} | {:>8.1} {:>8.1} {:>7.1} {:>7.1} | {:>7} {:>9} | {:>7} {:>7} {:>7} | {:>6} {:>8.3} {:>5.1}%",
            x.policy,
            x.send_mode,
            x.tail_ms.p50,
            x.tail_ms.p90,
            x.served.ttft_ms.p50,
            x.served.ttft_ms.p90,
            x.served.tpot_ms.p50,
            x.served.tpot_ms.p90,
            x.preemptions,
            x.recompute_tokens,
            opt_pct(x.apc_local),
            opt_pp(r.apc_delta_pp(x)),
            opt_pct(x.apc_pd),
            x.land_fallbacks,
            x.wire_bytes as f64 / 1e9,
            100.0 * x.wire_bytes as f64 / (x.context_wire_bytes.max(1)) as f64,
        );
    }
    if let Some(b) = &r.baseline_summary {
        let l = &b.served_local;
        let _ = writeln!(
            s,
            "plain vLLM (D serving its {} local requests alone): TTFT p50 {:.1} p90 {:.1}, TPOT p50 {:.1} p90 {:.1}, preemptions {}, APC {}% (dAPC: the local requests' APC in a cell minus this)",
            l.requests,
            l.ttft_ms.p50,
            l.ttft_ms.p90,
            l.tpot_ms.p50,
            l.tpot_ms.p90,
            b.preemptions,
            opt_pct(b.apc_local)
        );
    }
}

/// The study preset: its assumptions, and its cells next to what the study measured.
fn study_section(r: &ClockReport, s: &mut String) {
    let a = r.config.assumptions();
    if a.is_empty() {
        return;
    }
    let _ = writeln!(s, "study preset: parameters not in the seeds");
    for (k, v, why) in &a {
        let _ = writeln!(s, "  {k:<24} {v:<48} {why}");
    }
    let Some(base) = r.cell("eager", "whole") else {
        return;
    };
    let m = STUDY_MOONCAKE;
    let _ = writeln!(
        s,
        "eager/whole (the Mooncake connector's behaviour) vs the study's Mooncake: clock p50 {:.2} s (measured {:.1} s, x{:.2}), p90 {:.2} s (measured {:.1} s, x{:.2}); APC delta vs plain vLLM {} pp (measured kv_both {:+.1} pp)",
        base.clock_ms.p50 / 1e3,
        m.clock_p50_s,
        base.clock_ms.p50 / 1e3 / m.clock_p50_s,
        base.clock_ms.p90 / 1e3,
        m.clock_p90_s,
        base.clock_ms.p90 / 1e3 / m.clock_p90_s,
        opt_pp(r.apc_delta_pp(base)),
        m.apc_delta_pp
    );
    let _ = writeln!(
        s,
        "{:<6} {:<9} | {:>8} {:>8} | {:>9} {:>9} {:>9} | {:>7} {:>8}",
        "policy", "send", "p50 s", "p90 s", "p50/e-w", "p90/e-w", "blk*s/e-w", "preempt", "dAPC pp"
    );
    for x in &r.summaries {
        let _ = writeln!(
            s,
            "{:<6} {:<9} | {:>8.2} {:>8.2} | {:>9.2} {:>9.2} {:>9.2} | {:>7} {:>8}",
            x.policy,
            x.send_mode,
            x.clock_ms.p50 / 1e3,
            x.clock_ms.p90 / 1e3,
            x.clock_ms.p50 / base.clock_ms.p50.max(1e-9),
            x.clock_ms.p90 / base.clock_ms.p90.max(1e-9),
            x.d_block_seconds_waiting / base.d_block_seconds_waiting.max(1e-9),
            x.preemptions,
            opt_pp(r.apc_delta_pp(x)),
        );
    }
}

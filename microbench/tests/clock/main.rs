//! Tests of `kvwire-bench clock`: the decomposition of every request's clock, every byte
//! verified (and corruption caught), every cell in the JSON, a real PNG, the timeline lines,
//! the ordering of block-seconds between policies, the migration scenario and traces.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use kvwire_bench::clock::cli::{
    ClockLinkSpeed, ClockPreset, ClockScenario, ClockTransport, ClockWorkload,
};
use kvwire_bench::clock::datapath::DataPath;
use kvwire_bench::clock::report::parse_timeline_line;
use kvwire_bench::clock::report::PoolSide;
use kvwire_bench::clock::sim::run_cell;
use kvwire_bench::clock::trace::{parse_trace, TraceError};
use kvwire_bench::clock::{
    run_matrix, ClockArgs, ClockConfig, ClockReport, HeldBlocks, LinkSpeed, RequestSpec, Scenario,
};
use kvwire_connector::{Policy, SendMode};

mod engine;

fn tmp(name: &str) -> PathBuf {
    // Cargo's scratch directory for integration tests (inside the target directory).
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kvwire-clock-test");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn args() -> ClockArgs {
    ClockArgs {
        json: None,
        trace: None,
        timeline_out: None,
        png: None,
        requests: None,
        seed: 7,
        transport: ClockTransport::Auto,
        workload: ClockWorkload::Agentic,
        scenario: ClockScenario::Pd,
        rate: None,
        wire_bytes_per_token: None,
        d_pool_blocks: None,
        link_speed: ClockLinkSpeed::Window,
        quick: true,
        preset: ClockPreset::Quick,
        chunk_tokens: None,
        land_pool_blocks: None,
        d_prefix_cache: None,
        local_rate: None,
        prompt_tokens: Vec::new(),
        output_tokens: 32,
        link_gbps: None,
        policies: Vec::new(),
        send_modes: Vec::new(),
        land_copy_gbps: None,
        turn_gap_s: None,
    }
}

struct Quick {
    report: ClockReport,
    json: PathBuf,
    png: PathBuf,
    timeline: PathBuf,
}

/// One quick run of the full matrix with every output, shared by the tests below.
fn quick() -> &'static Quick {
    static Q: OnceLock<Quick> = OnceLock::new();
    Q.get_or_init(|| {
        let mut a = args();
        a.json = Some(tmp("clock.json"));
        a.png = Some(tmp("clock.png"));
        a.timeline_out = Some(tmp("clock.jsonl"));
        let report = kvwire_bench::clock::cli::run(&a).expect("quick clock run");
        Quick {
            report,
            json: a.json.unwrap(),
            png: a.png.unwrap(),
            timeline: a.timeline_out.unwrap(),
        }
    })
}

/// Runs every cell of `cfg` over `specs` as [`run_matrix`] does, but with the link's speed
/// (`ns_per_byte` of wire bytes) and the engine's fixed cost of a batch (`fixed`) given by the
/// test instead of measured. Every layer is still moved through the two engines and checked at
/// both ends; only the virtual timeline stops depending on the host: on a frozen link a
/// layer's virtual duration is `fixed + ns_per_byte × bytes × transfer_scale`, whatever its
/// measured wall time. Tests that compare figures between cells use this, so that a host
/// that slows down while the cells run one after the other cannot reorder them.
fn run_frozen(
    cfg: &ClockConfig,
    specs: &[RequestSpec],
    ns_per_byte: f64,
    fixed: Duration,
) -> ClockReport {
    let mut cfg = cfg.clone();
    cfg.link_speed = LinkSpeed::Frozen;
    let mut dp = DataPath::for_config(&cfg).expect("data path");
    // One recorded layer at exactly this speed is the whole window, so its median; frozen, it
    // is the speed of every layer after.
    dp.clear_speed_window();
    let bytes = 1u64 << 20;
    dp.typical_ns_per_byte(
        Duration::from_nanos((ns_per_byte * bytes as f64) as u64),
        bytes,
    );
    dp.freeze_speed();
    assert_eq!(
        dp.frozen_ns_per_byte(),
        Some(ns_per_byte),
        "pick a speed exact in binary"
    );
    let mut cells = Vec::new();
    for &send_mode in &cfg.send_modes {
        for &policy in &cfg.policies {
            cells.push(
                run_cell(&cfg, specs, &mut dp, fixed, policy, send_mode).expect("frozen cell"),
            );
        }
    }
    let transport = dp.transport().to_string();
    dp.shutdown();
    let mut r = ClockReport::new(&cfg, specs, &transport, fixed, cells);
    r.frozen_ns_per_byte = dp.frozen_ns_per_byte();
    assert!(r.all_verified());
    r
}

/// The quick run's configuration and requests (as `quick()` runs them), on tcp.
fn quick_plan() -> (ClockConfig, Vec<RequestSpec>) {
    let mut a = args();
    a.transport = ClockTransport::Tcp;
    kvwire_bench::clock::cli::plan(&a).expect("quick plan")
}

#[test]
fn decomposition_sums_to_the_clock_of_every_request() {
    let q = quick();
    assert_eq!(q.report.cells.len(), 8);
    for c in &q.report.cells {
        assert_eq!(c.records.len(), q.report.requests);
        for (r, h) in c.records.iter().zip(&c.host) {
            let d = r.decompose().expect("finished record decomposes");
            let clock = r.first_token.unwrap() - r.decode_sent.unwrap();
            assert_eq!(d.segments().iter().sum::<u64>(), clock, "{r:?}");
            assert_eq!(d.total(), clock);
            assert!(clock > 0);
            // The milestones are in order (no clamping was needed).
            let p_done = r.p_last_layer_ready.unwrap();
            let last = r.last_byte.unwrap();
            assert!(p_done <= last, "{r:?}");
            if h.landed {
                // land: the KV lands in the landing pool first, KV blocks are reserved after.
                assert!(last <= r.d_reserved.unwrap(), "{r:?}");
                assert!(r.d_reserved.unwrap() <= r.d_reported_finished.unwrap());
                assert!(h.kv_ready.unwrap() <= r.d_reported_finished.unwrap());
            } else {
                assert!(r.d_reserved.unwrap() <= last, "{r:?}");
            }
            assert!(last <= r.d_reported_finished.unwrap());
            assert!(r.d_reported_finished.unwrap() <= r.d_promoted.unwrap());
        }
    }
}

#[test]
fn every_request_has_every_byte_verified() {
    let q = quick();
    let cfg = &q.report.config;
    for (c, s) in q.report.cells.iter().zip(&q.report.summaries) {
        assert_eq!(c.corrupt_layers, 0);
        assert_eq!(c.verified_requests, q.report.requests);
        assert_eq!(s.finished, q.report.requests);
        // Bytes checked on D = blocks × layers × bytes per block, summed over requests.
        let want: u64 = c
            .records
            .iter()
            .map(|r| u64::from(r.blocks) * u64::from(cfg.layers) * cfg.layer_block_bytes())
            .sum();
        assert_eq!(c.bytes_verified, want);
        assert_eq!(c.wire_bytes, want);
        // Coalescing: fewer writes than ops, at least one per layer.
        assert!(c.writes < c.ops, "writes {} ops {}", c.writes, c.ops);
        assert!(c.writes >= (q.report.requests * cfg.layers as usize) as u64);
    }
    assert!(q.report.all_verified());
}

#[test]
fn corruption_on_d_is_caught() {
    let mut cfg = ClockConfig::quick(3);
    cfg.policies = vec![Policy::Lazy];
    cfg.send_modes = vec![SendMode::Layerwise];
    cfg.fault_corrupt_landing = Some(5);
    let mut mix = kvwire_bench::clock::AgenticMix::standard(8.0);
    mix.max_tokens = 8_000;
    let specs = mix.generate(6, 3);
    let r = run_matrix(&cfg, &specs).unwrap();
    assert_eq!(r.cells[0].corrupt_layers, 1);
    assert_eq!(r.cells[0].verified_requests, specs.len() - 1);
    assert!(!r.all_verified());
}

#[test]
fn json_has_every_cell() {
    let q = quick();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&q.json).unwrap()).unwrap();
    assert_eq!(v["schema"], "kvwire.clock/1");
    assert_eq!(v["verified"], true);
    let cells = v["cells"].as_array().unwrap();
    let mut seen = BTreeSet::new();
    for c in cells {
        seen.insert((
            c["policy"].as_str().unwrap().to_string(),
            c["send_mode"].as_str().unwrap().to_string(),
        ));
        for k in ["p50", "p90", "p99", "mean"] {
            assert!(c["clock_ms"][k].as_f64().unwrap() > 0.0, "{k} in {c}");
        }
        for k in kvwire_bench::clock::report::SEGMENTS {
            assert!(c["decomposition_ms"][k]["mean"].is_number(), "{k} in {c}");
        }
        for k in [
            "d_block_seconds_waiting",
            "admission_stalls",
            "writes_per_request",
        ] {
            assert!(c[k].is_number(), "{k} in {c}");
        }
        assert_eq!(c["verified_requests"], c["requests"]);
        for (side, cap) in [("p", 1024u64), ("d", 400)] {
            let p = &c["pool"][side];
            assert_eq!(p["side"], side, "{c}");
            assert_eq!(p["capacity_blocks"].as_u64(), Some(cap), "{c}");
            let mean = p["held_mean_blocks"].as_f64().unwrap();
            let p99 = p["held_p99_blocks"].as_u64().unwrap();
            // Brief holds can leave the 99th percentile at 0 while the mean is not.
            assert!(mean > 0.0 && mean < cap as f64 && p99 <= cap, "{side}: {p}");
            assert_eq!(p["lost_frac_mean"].as_f64(), Some(mean / cap as f64));
            assert_eq!(p["lost_frac_p99"].as_f64(), Some(p99 as f64 / cap as f64));
        }
    }
    let mut want = BTreeSet::new();
    for p in ["eager", "lazy", "jit", "land"] {
        for m in ["whole", "layerwise"] {
            want.insert((p.to_string(), m.to_string()));
        }
    }
    assert_eq!(seen, want);
    assert_eq!(cells.len(), 8);
}

#[test]
fn png_is_a_real_png() {
    let q = quick();
    let b = std::fs::read(&q.png).unwrap();
    assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&b[12..16], b"IHDR");
    let w = u32::from_be_bytes(b[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(b[20..24].try_into().unwrap());
    assert_eq!((w, h), kvwire_bench::clock::plot::SIZE);
    assert!(b.len() > 20_000, "PNG of {} bytes", b.len());
    assert_eq!(&b[b.len() - 8..b.len() - 4], b"IEND");
}

#[test]
fn timeline_lines_parse_and_carry_the_load() {
    let q = quick();
    let text = std::fs::read_to_string(&q.timeline).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 8 * q.report.requests);
    for l in lines {
        let r = parse_timeline_line(l).unwrap();
        assert!(r.decompose().is_some());
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v["dst_waiting"].is_u64() && v["dst_running"].is_u64());
        // What a router knows of the source: the request's own prefill is its uncached part.
        for k in [
            "src_waiting",
            "src_queued_tokens",
            "src_running",
            "src_running_tokens",
            "src_pending_bytes",
        ] {
            assert!(v[k].is_u64(), "{k} in {l}");
        }
        let (pf, cached) = (
            v["prefill_tokens"].as_u64().unwrap(),
            v["cached_tokens"].as_u64().unwrap(),
        );
        assert_eq!(pf + cached, u64::from(r.tokens), "{l}");
        assert!(pf > 0, "pd: P prefills at least the new turn");
        if v["src_waiting"].as_u64() == Some(0) {
            assert_eq!(v["src_queued_tokens"].as_u64(), Some(0));
        }
        assert!(r.policy.is_some() && r.send_mode.is_some());
        assert!(r.bytes > 0 && r.layers == 8);
    }
}

/// The ordering comes from the policies, not from the host: every cell runs on one frozen link
/// speed given by the test (a cell run on a measured speed would see the host's speed of the
/// moment, and a host slowed down by other work while the lazy cell runs could push lazy's
/// block-seconds past eager's). Checked at the speed measured on loopback tcp on the 2-core
/// development host (`kvwire-bench clock --quick --seed 7 --transport tcp --link-speed
/// frozen`: 0.40 GB/s on the wire, 53 µs per batch, rounded to 2.5 ns/B and 50 µs) and on a
/// link ten times slower.
#[test]
fn lazy_and_jit_hold_fewer_block_seconds_than_eager() {
    let (cfg, specs) = quick_plan();
    for (ns_per_byte, fixed_us) in [(2.5, 50), (25.0, 500)] {
        let r = run_frozen(&cfg, &specs, ns_per_byte, Duration::from_micros(fixed_us));
        let bs = |p: &str, m: &str| {
            r.summaries
                .iter()
                .find(|s| s.policy == p && s.send_mode == m)
                .unwrap()
                .d_block_seconds_waiting
        };
        for m in ["whole", "layerwise"] {
            let eager = bs("eager", m);
            assert!(eager > 0.0);
            let (lazy, jit) = (bs("lazy", m), bs("jit", m));
            let at = format!("{m} at {ns_per_byte} ns/B");
            assert!(lazy < eager, "{at}: lazy {lazy} eager {eager}");
            assert!(jit < eager, "{at}: jit {jit} eager {eager}");
        }
    }
}

/// What makes the test above independent of the host: on a frozen link given by the test, a
/// cell's virtual timeline is the same in every run, although every layer is moved and timed
/// for real each time.
#[test]
fn a_frozen_link_gives_the_same_timeline_in_every_run() {
    let (mut cfg, specs) = quick_plan();
    cfg.policies = vec![Policy::Lazy];
    cfg.send_modes = vec![SendMode::Layerwise];
    let a = run_frozen(&cfg, &specs, 2.5, Duration::from_micros(50));
    let b = run_frozen(&cfg, &specs, 2.5, Duration::from_micros(50));
    assert_eq!(a.cells[0].records, b.cells[0].records);
    assert_eq!(a.cells[0].virtual_end, b.cells[0].virtual_end);
    assert_eq!(
        a.summaries[0].d_block_seconds_waiting,
        b.summaries[0].d_block_seconds_waiting
    );
    // A faster link changes it: the link speed reaches the timeline.
    let c = run_frozen(&cfg, &specs, 0.5, Duration::from_micros(50));
    assert_ne!(a.cells[0].records, c.cells[0].records);
}

#[test]
fn migration_sends_decode_after_prefill() {
    let mut a = args();
    a.scenario = ClockScenario::Migration;
    a.requests = Some(10);
    a.transport = ClockTransport::Tcp;
    a.link_speed = ClockLinkSpeed::Frozen;
    let r = kvwire_bench::clock::cli::run(&a).unwrap();
    assert_eq!(r.config.scenario, Scenario::Migration);
    assert_eq!(r.transport, "tcp");
    assert!(r.frozen_ns_per_byte.is_some_and(|v| v > 0.0));
    assert!(r.all_verified());
    for c in &r.cells {
        // The KV is on the source already: nothing left to prefill at decode_sent.
        assert_eq!(c.src_at_arrival.len(), c.records.len());
        for (src, rec) in c.src_at_arrival.iter().zip(&c.records) {
            assert_eq!(src.prefill_tokens, 0);
            assert_eq!(src.cached_tokens, rec.tokens);
        }
        for rec in &c.records {
            assert!(rec.p_last_layer_ready.unwrap() <= rec.decode_sent.unwrap());
            assert_eq!(rec.decompose().unwrap().wait_for_p, 0);
        }
    }
    // With the KV ready before decode_sent and one frozen link speed, no policy that
    // reserves KV blocks before the KV lands, nor the send mode, can change anything: those
    // cells have the same clock for every request. `land` reserves its KV blocks only after
    // the KV landed (at the next D step), so it is the same in both send modes and slower on
    // the whole (one request can gain a little: the batch it decodes in changes).
    let clocks = |i: usize| -> Vec<u64> {
        r.cells[i]
            .records
            .iter()
            .map(|x| x.decompose().unwrap().total())
            .collect()
    };
    let is_land = |i: usize| r.cells[i].policy == Policy::Land;
    let (first, first_land) = (
        (0..r.cells.len()).find(|&i| !is_land(i)).unwrap(),
        (0..r.cells.len()).find(|&i| is_land(i)).unwrap(),
    );
    for i in 0..r.cells.len() {
        if is_land(i) {
            assert_eq!(clocks(i), clocks(first_land), "cell {i}");
            let (l, o): (u64, u64) = (clocks(i).iter().sum(), clocks(first).iter().sum());
            assert!(l > o, "cell {i}: land {l} <= {o}");
        } else {
            assert_eq!(clocks(i), clocks(first), "cell {i}");
        }
    }
}

#[test]
fn trace_workload_runs_and_bad_traces_are_typed_errors() {
    let jsonl = "{\"arrival_s\": 0.0, \"prompt_tokens\": 3000, \"cached_tokens\": 2000, \"output_tokens\": 10}\n\
                 \n\
                 {\"arrival_s\": 0.05, \"prompt_tokens\": 1200, \"output_tokens\": 5}\n";
    let v = parse_trace(jsonl).unwrap();
    assert_eq!(v.len(), 2);
    assert_eq!(v[0].uncached(), 1000);
    assert_eq!(v[1].cached_tokens, 0);
    assert_eq!(v[1].arrival, 50_000_000);
    let csv = "arrival_s,prompt_tokens,cached_tokens,output_tokens\n1.0,500,0,4\n0.5,900,100,8\n";
    let v = parse_trace(csv).unwrap();
    assert_eq!(v[0].prompt_tokens, 900, "sorted by arrival");
    assert_eq!(v[0].arrival, 0, "shifted to start at 0");
    let line_of = |t: &str| match parse_trace(t) {
        Err(TraceError::Line { line, .. }) => line,
        other => panic!("expected a line error, got {other:?}"),
    };
    assert_eq!(line_of("0,100,0,4\n0,100,200,4\n"), 2);
    assert_eq!(line_of("0,100,0\n"), 1);
    assert_eq!(line_of("0,100,0,4\n{\"arrival_s\": 1}\n"), 2);
    assert_eq!(line_of("{not json\n"), 1);
    assert_eq!(line_of("0,-5,0,4\n"), 1);
    assert_eq!(line_of("0,1e12,0,4\n"), 1);
    assert!(matches!(
        parse_trace("# only a comment\n"),
        Err(TraceError::Empty)
    ));

    let path = tmp("trace.jsonl");
    let mut t = String::new();
    for i in 0..8 {
        t.push_str(&format!(
            "{{\"arrival_s\": {}, \"prompt_tokens\": {}, \"cached_tokens\": {}, \"output_tokens\": 6}}\n",
            i as f64 * 0.1,
            2000 + 500 * i,
            1000
        ));
    }
    std::fs::write(&path, t).unwrap();
    let mut a = args();
    a.trace = Some(path);
    a.workload = ClockWorkload::Trace;
    a.link_speed = ClockLinkSpeed::Raw;
    let r = kvwire_bench::clock::cli::run(&a).unwrap();
    assert_eq!(r.requests, 8);
    assert!(r.all_verified());
    let mut a = args();
    a.workload = ClockWorkload::Trace;
    assert!(
        kvwire_bench::clock::cli::run(&a).is_err(),
        "trace workload without a file"
    );
    let mut a = args();
    a.trace = Some(tmp("does-not-exist.jsonl"));
    assert!(matches!(
        kvwire_bench::clock::cli::run(&a),
        Err(kvwire_bench::clock::ClockError::Trace(
            TraceError::Io { .. }
        ))
    ));
}

#[test]
fn held_blocks_are_time_weighted_by_hand() {
    // 4 blocks held on [0, 10), 2 more on [5, 20), closed at 40:
    // level 4 for 5, 6 for 5, 2 for 10, 0 for 20.
    let mut h = HeldBlocks::new(100);
    h.hold(0, 4);
    h.hold(5, 2);
    h.release(10, 4);
    h.release(20, 2);
    h.close(40);
    assert_eq!(h.mean(), (4.0 * 5.0 + 6.0 * 5.0 + 2.0 * 10.0) / 40.0);
    assert_eq!(h.quantile(0.5), 0, "half the time nothing is held");
    assert_eq!(h.quantile(0.75), 2);
    assert_eq!(h.quantile(0.8), 4);
    assert_eq!(h.quantile(0.99), 6);
    let p = PoolSide::of(&h, "d");
    assert_eq!(p.capacity_blocks, 100);
    assert_eq!(p.held_mean_blocks, 1.75);
    assert_eq!(p.held_p99_blocks, 6);
    assert_eq!(p.lost_frac_mean, 0.0175);
    assert_eq!(p.lost_frac_p99, 0.06);
    // Nothing held, or an empty interval: zero, not NaN.
    let mut e = HeldBlocks::new(8);
    assert_eq!((e.mean(), e.quantile(0.99)), (0.0, 0));
    e.close(100);
    assert_eq!((e.mean(), e.quantile(0.99)), (0.0, 0));
}

#[test]
fn pool_figures_of_one_request_match_its_milestones() {
    // One request alone: D holds its blocks from reservation to promotion, P from the end of
    // its prefill to the settlement of its last layer (D's last byte + one control-message
    // latency); nothing else is held, so the figures follow from the record's timestamps.
    for policy in [Policy::Eager, Policy::Jit] {
        let mut cfg = ClockConfig::quick(5);
        cfg.policies = vec![policy];
        cfg.send_modes = vec![SendMode::Whole];
        cfg.transport = kvwire_transfer::TransportKind::Tcp;
        // P holds its blocks for the transfer (measured, so as short as the host is fast) plus
        // one control-message latency: a 5 ms latency keeps that above 1% of the run on any
        // host, so the 99th percentile below is the whole request by construction.
        cfg.msg_latency = 5 * kvwire_connector::MS;
        let specs = vec![RequestSpec::new(0, 3_000, 1_000, 2)];
        let r = run_matrix(&cfg, &specs).unwrap();
        assert!(r.all_verified());
        let c = &r.cells[0];
        let rec = &c.records[0];
        let blocks = 3_000u64.div_ceil(u64::from(cfg.block_tokens));
        assert_eq!(u64::from(rec.blocks), blocks);
        let end = c.virtual_end;
        let d_held = rec.d_promoted.unwrap() - rec.d_reserved.unwrap();
        let p_held = rec.last_byte.unwrap() + cfg.msg_latency - rec.p_last_layer_ready.unwrap();
        let s = &r.summaries[0].pool;
        assert_eq!(s.d.capacity_blocks, cfg.d_pool_blocks);
        assert_eq!(s.p.capacity_blocks, cfg.p_pool_blocks);
        let mean = |held: u64| (u128::from(blocks) * u128::from(held)) as f64 / end as f64;
        assert_eq!(s.d.held_mean_blocks, mean(d_held), "{policy:?}");
        assert_eq!(s.p.held_mean_blocks, mean(p_held), "{policy:?}");
        // Held more than 1% of the run: the 99th percentile is the whole request.
        assert!(
            d_held * 100 > end && p_held * 100 > end,
            "{d_held} {p_held} {end}"
        );
        assert_eq!(s.d.held_p99_blocks, blocks);
        assert_eq!(s.p.held_p99_blocks, blocks);
        assert_eq!(
            s.d.lost_frac_p99,
            blocks as f64 / f64::from(cfg.d_pool_blocks)
        );
        assert_eq!(
            s.d.lost_frac_mean,
            mean(d_held) / f64::from(cfg.d_pool_blocks)
        );
        assert!(r.summaries[0].d_block_seconds_waiting > 0.0);
        assert_eq!(
            r.summaries[0].d_block_seconds_waiting,
            (u128::from(blocks) * u128::from(d_held)) as f64 / 1e9
        );
    }
}

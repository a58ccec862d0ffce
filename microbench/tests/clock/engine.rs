//! D as an engine (KV growth, local requests, preemption, prefix cache), chunked prefill with
//! layerwise streaming, policy `land`, and the old cells' timeline on an unconstrained pool.
//! Every comparison between cells runs on a frozen link given by the test, so nothing here
//! depends on the host's speed; every request is still moved and checked byte for byte.

use std::time::Duration;

use kvwire_bench::clock::cli::{plan, ClockPreset};
use kvwire_bench::clock::report::CellSummary;
use kvwire_bench::clock::sim::run_cell;
use kvwire_bench::clock::workload::fixed_prompts;
use kvwire_bench::clock::{ClockConfig, ClockReport, RequestSpec};
use kvwire_connector::{Policy, SendMode, MS, SEC};
use kvwire_transfer::TransportKind;

use crate::{args, run_frozen};

fn cell<'a>(r: &'a ClockReport, p: &str, m: &str) -> &'a CellSummary {
    r.cell(p, m).unwrap_or_else(|| panic!("no cell {p}/{m}"))
}

/// The quick run's requests on a D pool no request ever waits for (8192 blocks), chunking,
/// D's prefix cache and local requests off, on a frozen link of 2.5 ns/B with a 50 µs batch
/// cost: the timeline of every old cell (eager, lazy, jit × whole, layerwise) is the one the
/// bench produced before D became an engine (KV growing per token, preemption, prefix cache,
/// local requests), chunked prefill and `land` existed. The values were computed with the
/// same requests and link on the commit before that change (a0339f9): per cell, the sum of
/// `decode_sent → first_token`, the D block-nanoseconds, the virtual end and an FNV-1a hash
/// of every milestone of every record.
#[test]
fn an_unconstrained_pool_keeps_the_timeline_of_the_old_cells() {
    const BEFORE: [(Policy, SendMode, u64, u128, u64, u64); 6] = [
        (
            Policy::Eager,
            SendMode::Whole,
            15986657774,
            803267500000,
            11723500000,
            0x247e861aa2b0597d,
        ),
        (
            Policy::Lazy,
            SendMode::Whole,
            15986657774,
            641692500000,
            11723500000,
            0xfcd391a82a4c9efd,
        ),
        (
            Policy::Jit,
            SendMode::Whole,
            16042157774,
            33027100000,
            11723500000,
            0xed0cf4dd15942dd9,
        ),
        (
            Policy::Eager,
            SendMode::Layerwise,
            15634957774,
            781955100000,
            11716500000,
            0x8d2676541eeb6f1d,
        ),
        (
            Policy::Lazy,
            SendMode::Layerwise,
            15663157774,
            622413700000,
            11716500000,
            0xfe29a13d9cbdabfd,
        ),
        (
            Policy::Jit,
            SendMode::Layerwise,
            16042157774,
            33027100000,
            11723500000,
            0xed0cf4dd15942dd9,
        ),
    ];
    let mut a = args();
    a.transport = kvwire_bench::clock::cli::ClockTransport::Tcp;
    a.link_speed = kvwire_bench::clock::cli::ClockLinkSpeed::Frozen;
    a.d_pool_blocks = Some(8192);
    let (cfg, specs) = plan(&a).expect("plan");
    assert!(!cfg.d_prefix_cache && cfg.chunk_tokens == 0 && specs.iter().all(|s| !s.local));
    let mut dp = kvwire_bench::clock::datapath::DataPath::for_config(&cfg).expect("data path");
    dp.freeze_speed_at(2.5);
    for (policy, mode, clock_sum, block_ns, end, hash) in BEFORE {
        let c = run_cell(
            &cfg,
            &specs,
            &mut dp,
            Duration::from_micros(50),
            policy,
            mode,
        )
        .expect("cell");
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let (mut clock, mut bns) = (0u64, 0u128);
        for r in &c.records {
            for v in [
                r.decode_sent,
                r.p_scheduled,
                r.p_first_layer_ready,
                r.p_last_layer_ready,
                r.d_reserved,
                r.blocks_to_p,
                r.first_byte,
                r.last_byte,
                r.d_reported_finished,
                r.d_promoted,
                r.first_token,
            ] {
                h = (h ^ v.unwrap_or(u64::MAX)).wrapping_mul(0x0100_0000_01b3);
            }
            clock += r.first_token.unwrap() - r.decode_sent.unwrap();
            bns += r.d_block_ns_waiting();
        }
        let at = format!("{}/{}", policy.name(), mode.name());
        assert_eq!(c.preemptions, 0, "{at}");
        assert_eq!(c.verified_requests, specs.len(), "{at}");
        assert_eq!(
            (clock, bns, c.virtual_end),
            (clock_sum, block_ns, end),
            "{at}"
        );
        assert_eq!(h, hash, "{at}: a milestone moved");
    }
    dp.shutdown();
}

/// Eight local requests decode 2000 tokens each from t = 0 (their KV grows one block per 16
/// tokens); D's pool holds their final KV plus 64 blocks. P/D requests of 2048 tokens arrive
/// every 0.5 s, faster than P prefills them (0.82 s each), so they queue on P. A reservation
/// taken while the locals grow leaves them short of blocks: the longer a policy holds its
/// reservation before the KV lands (eager: from arrival, through P's queue; lazy: from P's
/// start; jit: from the end of prefill), the more running requests D preempts. The same
/// ordering as the block-seconds, at two link speeds.
#[test]
fn policies_that_hold_blocks_longer_preempt_more() {
    let mut cfg = ClockConfig::quick(7);
    cfg.transport = TransportKind::Tcp;
    cfg.block_tokens = 16;
    cfg.policies = vec![Policy::Eager, Policy::Lazy, Policy::Jit];
    cfg.send_modes = vec![SendMode::Whole];
    let locals = 8u32;
    cfg.d_pool_blocks = locals * (512 + 2000u32).div_ceil(16) + 64;
    cfg.land_pool_blocks = cfg.d_pool_blocks;
    cfg.p_pool_blocks = 8192;
    cfg.p_step_per_token = 400_000;
    let mut specs: Vec<RequestSpec> = (0..locals)
        .map(|i| {
            let mut s = RequestSpec::new(u64::from(i) * MS, 512, 0, 2000);
            s.local = true;
            s
        })
        .collect();
    specs.extend((0..42u64).map(|k| RequestSpec::new(SEC / 2 + k * SEC / 2, 2048, 0, 2)));
    specs.sort_by_key(|s| (s.arrival, s.local));
    for (ns_per_byte, fixed_us) in [(2.5, 50), (25.0, 500)] {
        let r = run_frozen(&cfg, &specs, ns_per_byte, Duration::from_micros(fixed_us));
        let (e, l, j) = (
            cell(&r, "eager", "whole"),
            cell(&r, "lazy", "whole"),
            cell(&r, "jit", "whole"),
        );
        let at = format!("at {ns_per_byte} ns/B");
        assert!(
            e.d_block_seconds_waiting > l.d_block_seconds_waiting
                && l.d_block_seconds_waiting > j.d_block_seconds_waiting,
            "{at}: block-seconds {} {} {}",
            e.d_block_seconds_waiting,
            l.d_block_seconds_waiting,
            j.d_block_seconds_waiting
        );
        assert!(
            e.preemptions >= l.preemptions && l.preemptions >= j.preemptions,
            "{at}: preemptions eager {} lazy {} jit {}",
            e.preemptions,
            l.preemptions,
            j.preemptions
        );
        assert!(e.preemptions > j.preemptions, "{at}");
        // Every local request was served, and a preempted one recomputed its prompt.
        for x in [e, l, j] {
            assert_eq!(x.served_local.requests, locals as usize);
            assert_eq!(x.served.preemptions, x.preemptions);
            assert_eq!(x.recompute_tokens > 0, x.preemptions > 0);
        }
    }
}

/// Fixed prompts of 20k tokens computed in 4k-token chunks, one at a time.
fn chunked() -> (ClockConfig, Vec<RequestSpec>) {
    let mut cfg = ClockConfig::quick(11);
    cfg.transport = TransportKind::Tcp;
    cfg.chunk_tokens = 4096;
    cfg.d_pool_blocks = 1024;
    cfg.land_pool_blocks = 1024;
    let specs = fixed_prompts(&[20_000], 4, 0.5, 8);
    (cfg, specs)
}

/// Chunked layerwise: once P's last chunk passed the last layer, all that is left to send is
/// that chunk's blocks of the last layer, so the exposed tail is that batch's virtual
/// duration (plus the fixed cost and a control latency: at most 1 ms); and for `lazy` and
/// `land` (D's destination known from P's start) layer 0 of chunk 0 lands on D before P's
/// last chunk is done. Whole sends everything after the last chunk.
#[test]
fn chunked_layerwise_exposes_only_the_last_chunks_last_layer() {
    let (cfg, specs) = chunked();
    let r = run_frozen(&cfg, &specs, 2.5, Duration::from_micros(50));
    for c in &r.cells {
        let at = format!("{}/{}", c.policy.name(), c.send_mode.name());
        for (rec, h) in c.records.iter().zip(&c.host) {
            assert_eq!(h.chunks, 20_000u32.div_ceil(4096), "{at}");
            let p_done = rec.p_last_layer_ready.unwrap();
            let tail = rec.last_byte.unwrap() - p_done;
            if c.send_mode == SendMode::Whole {
                // Every layer after the last chunk: at least eight batches' worth.
                assert!(
                    tail >= 8 * h.last_batch_ns,
                    "{at}: {tail} {}",
                    h.last_batch_ns
                );
                continue;
            }
            if c.policy != Policy::Jit {
                assert!(
                    tail <= h.last_batch_ns + MS,
                    "{at}: tail {tail} last batch {}",
                    h.last_batch_ns
                );
                // Streamed: one batch per chunk and layer.
                assert_eq!(h.batches, h.chunks * u32::from(cfg.layers), "{at}");
            }
            if matches!(c.policy, Policy::Lazy | Policy::Land) {
                let first = h.first_layer0_landed.unwrap();
                assert!(
                    first < p_done,
                    "{at}: layer 0 of chunk 0 at {first}, P done {p_done}"
                );
                assert!(rec.p_scheduled.unwrap() < first);
            }
        }
    }
}

/// `land` on the chunked workload: KV blocks are held only from when the KV is complete (the
/// copy from the landing slots, then promotion), so its D block-seconds are at most 1.2 ×
/// jit's; and it streams like lazy (slots known from P's start), so its exposed tail is at
/// most 1.1 × lazy layerwise's. Every landed layer was checked in the slots and again in the
/// KV blocks after the copy.
#[test]
fn land_holds_jit_block_seconds_with_a_lazy_layerwise_tail() {
    let (cfg, specs) = chunked();
    let r = run_frozen(&cfg, &specs, 2.5, Duration::from_micros(50));
    let jit = cell(&r, "jit", "layerwise").d_block_seconds_waiting;
    let lazy_tail = cell(&r, "lazy", "layerwise").tail_ms.mean;
    for m in ["whole", "layerwise"] {
        let land = cell(&r, "land", m);
        assert_eq!(
            (land.land_fallbacks, land.landings),
            (0, specs.len() as u64)
        );
        assert!(
            land.d_block_seconds_waiting <= 1.2 * jit,
            "{m}: land {} jit {jit}",
            land.d_block_seconds_waiting
        );
        assert_eq!(land.copy_bytes_verified, land.bytes_verified);
        assert!(land.land_copy_ms.mean > 0.0);
        assert!(land.pool.land.held_mean_blocks > 0.0);
    }
    let land = cell(&r, "land", "layerwise");
    assert!(
        land.tail_ms.mean <= 1.1 * lazy_tail,
        "land tail {} lazy {lazy_tail}",
        land.tail_ms.mean
    );
    assert!(land.d_block_seconds_waiting < cell(&r, "lazy", "layerwise").d_block_seconds_waiting);
}

/// Two turns of one conversation: the second's first 90% (72 of 80 blocks) is the first
/// turn's prompt and output, cached on D. D reports the hit, P sends only the other 8
/// blocks: the wire bytes of the second turn are at most 0.11 × its whole context, in every
/// cell, whole and chunked, and every byte sent is checked.
#[test]
fn a_90_percent_prefix_hit_sends_a_tenth_of_the_context() {
    for chunk in [0u32, 512] {
        let mut cfg = ClockConfig::quick(5);
        cfg.transport = TransportKind::Tcp;
        cfg.d_prefix_cache = true;
        cfg.chunk_tokens = chunk;
        let mut first = RequestSpec::new(0, 72 * 128 - 1, 0, 2);
        first.context = Some(42);
        let mut second = RequestSpec::new(5 * SEC, 80 * 128, 72 * 128 - 1, 4);
        second.context = Some(42);
        let r = run_frozen(&cfg, &[first, second], 2.5, Duration::from_micros(50));
        for (c, s) in r.cells.iter().zip(&r.summaries) {
            let at = format!("chunk {chunk} {}/{}", c.policy.name(), c.send_mode.name());
            let h = &c.host[1];
            assert_eq!(c.records[1].prefix_blocks, 72, "{at}");
            assert_eq!(h.prefix_tokens, 72 * 128, "{at}");
            assert!(
                h.wire_bytes as f64 <= 0.11 * h.context_wire_bytes as f64,
                "{at}: {} of {}",
                h.wire_bytes,
                h.context_wire_bytes
            );
            assert_eq!(h.wire_bytes * 10, h.context_wire_bytes, "{at}");
            assert_eq!(c.host[0].wire_bytes, c.host[0].context_wire_bytes, "{at}");
            assert!(s.apc_pd.is_some_and(|a| a > 0.4), "{at}");
            assert_eq!(s.verified_requests, 2, "{at}");
        }
    }
}

/// Local requests next to the P/D ones (the command line's --local-rate, chunked prefill and
/// D's prefix cache on): every one is served, its TTFT and TPOT counted, D's prefix cache
/// hit rate reported next to plain vLLM's (D serving the local requests alone), and every
/// P/D request still verified.
#[test]
fn local_requests_are_served_next_to_the_pd_ones() {
    let mut a = args();
    a.transport = kvwire_bench::clock::cli::ClockTransport::Tcp;
    a.link_speed = kvwire_bench::clock::cli::ClockLinkSpeed::Frozen;
    a.requests = Some(16);
    a.local_rate = Some(2.0);
    a.chunk_tokens = Some(2048);
    a.d_prefix_cache = Some(kvwire_bench::clock::cli::OnOff::On);
    a.policies = vec![Policy::Eager, Policy::Land];
    a.send_modes = vec![SendMode::Layerwise];
    let r = kvwire_bench::clock::cli::run(&a).expect("run");
    assert!(r.all_verified());
    assert!(r.local_requests > 0);
    let base = r.baseline_summary.as_ref().expect("plain vLLM");
    assert_eq!(base.served.requests, r.local_requests);
    assert_eq!(base.served_local.requests, r.local_requests);
    assert!(base.apc_local.is_some());
    for s in &r.summaries {
        assert_eq!(s.served.requests, r.requests + r.local_requests);
        assert_eq!(s.served_local.requests, r.local_requests);
        assert!(s.served.ttft_ms.p50 > 0.0 && s.served.tpot_ms.p50 > 0.0);
        assert!(s.apc_local.is_some() && s.apc_pd.is_some() && r.apc_delta_pp(s).is_some());
    }
    let t = kvwire_bench::clock::table::table(&r);
    assert!(t.contains("plain vLLM") && t.contains("TTFT50"), "{t}");
}

/// The study preset's workload has the seeds' statistics: 48 layers of 96 KiB/token, one
/// engine's share of 274 sessions and 1214 requests as D's local requests (a quarter of it as
/// P/D ones), contexts near 53.3M / 1214 tokens, 93% reuse in later turns, closed-loop turns.
#[test]
fn the_study_preset_has_the_seeds_statistics() {
    let mut a = args();
    a.quick = false;
    a.preset = ClockPreset::Study;
    let (cfg, specs) = plan(&a).expect("study plan");
    assert_eq!((cfg.layers, cfg.model_bytes_per_token), (48, 96 * 1024));
    assert_eq!(cfg.chunk_tokens, 8192);
    assert!(cfg.d_prefix_cache && cfg.link_gbps == Some(2.7));
    assert!(!cfg.assumptions().is_empty());
    let sessions = |local: bool| -> std::collections::BTreeSet<u64> {
        specs
            .iter()
            .filter(|s| s.local == local)
            .filter_map(|s| s.session)
            .collect()
    };
    // 274 / 8 = 34 sessions (1214 / 8 = 152 requests) per engine; P/D: a quarter of that.
    assert_eq!(sessions(true).len(), 34);
    assert_eq!(sessions(false).len(), 9);
    let local = specs.iter().filter(|s| s.local).count();
    assert!((90..=260).contains(&local), "{local}");
    let mean = specs
        .iter()
        .map(|s| f64::from(s.prompt_tokens))
        .sum::<f64>()
        / specs.len() as f64;
    assert!((30_000.0..60_000.0).contains(&mean), "mean context {mean}");
    let later: Vec<&RequestSpec> = specs.iter().filter(|s| s.cached_tokens > 0).collect();
    let reuse = later
        .iter()
        .map(|s| f64::from(s.cached_tokens))
        .sum::<f64>()
        / later
            .iter()
            .map(|s| f64::from(s.prompt_tokens))
            .sum::<f64>();
    assert!((0.9..0.95).contains(&reuse), "reuse {reuse}");
    // Later turns are sent closed loop, after a think time.
    assert!(specs.iter().filter(|s| s.think.is_some()).count() > local / 2);
}

//! The cost model and its calibration: known terms are recovered from synthetic records, the
//! error is measured on held-out records only, bad input gets typed errors, and the calibrated
//! model beats the seed model where D-side queueing dominates.

use std::collections::HashSet;
use std::io::Cursor;

use kvwire_bench::calibrate::{
    calibrate, is_train, parse_timeline, rel_error, split, BadLines, CalibrateError,
    CalibrateOptions, LineError, Sample, NO_SOURCE_NOTE,
};
use kvwire_bench::costmodel::{CostModel, Inputs, Quantile, Terms};
use kvwire_testkit::rng::Rng;

mod costmodel;
mod production;

const TRUE: Terms = Terms {
    fixed_s: 0.05,
    bytes_per_s: 5e9,
    per_layer_tail_s: 0.002,
    d_step_s: 0.004,
    d_queue_s_per_waiting: 0.25,
    prefill_s_per_token: 0.0,
    src_s_per_queued_token: 0.0,
    src_s_per_running_token: 0.0,
    src_s_per_waiting: 0.0,
    src_s_per_pending_byte: 0.0,
};

/// `n` timeline lines (connector field names plus the D load fields) whose clock is
/// `terms.predict(..) · (1 + sigma · N(0,1))`.
fn synthetic_lines(n: usize, terms: &Terms, sigma: f64, seed: u64) -> String {
    let mut rng = Rng::new(seed);
    let layer_choices = [2u32, 12, 24, 48, 96];
    let mut s = String::new();
    for i in 0..n {
        let layers = layer_choices[(rng.next_u64() % 5) as usize];
        let tokens = rng.range(256, 50_000);
        // 96 KiB per token (the seed model's KV), drawn independently of the layer count so the
        // per-layer and per-byte terms can be told apart.
        let bytes = tokens * 98_304;
        let running = rng.range(0, 128) as u32;
        let waiting = if rng.f64() < 0.5 {
            0
        } else {
            rng.range(1, 20) as u32
        };
        let t = terms.predict(bytes, layers, waiting, running) * (1.0 + sigma * rng.normal());
        let start = 1_000_000_000u64 + i as u64 * 1_000;
        let end = start + (t.max(1e-6) * 1e9).round() as u64;
        s.push_str(&format!(
            "{{\"req\":{i},\"side\":\"d\",\"decode_sent\":{start},\"first_token\":{end},\
             \"bytes\":{bytes},\"layers\":{layers},\"blocks\":{},\"tokens\":{tokens},\
             \"transport\":\"rdma\",\"policy\":\"lazy\",\"outcome\":\"finished\",\
             \"dst_waiting\":{waiting},\"dst_running\":{running}}}\n",
            tokens.div_ceil(16)
        ));
    }
    s
}

fn samples_of(text: &str) -> Vec<Sample> {
    parse_timeline(Cursor::new(text), BadLines::Fail)
        .expect("synthetic lines parse")
        .samples
}

fn opts() -> CalibrateOptions {
    CalibrateOptions {
        transport: None,
        send_mode: None,
        source: "synthetic".into(),
    }
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

fn term_errors(fit: &Terms, want: &Terms) -> [f64; 5] {
    [
        rel(fit.fixed_s, want.fixed_s),
        rel(fit.bytes_per_s, want.bytes_per_s),
        rel(fit.per_layer_tail_s, want.per_layer_tail_s),
        rel(fit.d_step_s, want.d_step_s),
        rel(fit.d_queue_s_per_waiting, want.d_queue_s_per_waiting),
    ]
}

fn scaled(t: &Terms, k: f64) -> Terms {
    Terms {
        fixed_s: t.fixed_s * k,
        bytes_per_s: t.bytes_per_s / k,
        per_layer_tail_s: t.per_layer_tail_s * k,
        d_step_s: t.d_step_s * k,
        d_queue_s_per_waiting: t.d_queue_s_per_waiting * k,
        prefill_s_per_token: t.prefill_s_per_token * k,
        src_s_per_queued_token: t.src_s_per_queued_token * k,
        src_s_per_running_token: t.src_s_per_running_token * k,
        src_s_per_waiting: t.src_s_per_waiting * k,
        src_s_per_pending_byte: t.src_s_per_pending_byte * k,
    }
}

/// Per-term tolerance (fixed_s, bytes_per_s, per_layer_tail_s, d_step_s, d_queue_s_per_waiting).
/// With 5% multiplicative noise on 4,000 records (≈3,200 for fitting), seeds 1–8 of the
/// testkit's generator gave largest relative errors over the mean/p50/p90 fits of 8.0%
/// (fixed_s), 0.7% (bytes_per_s), 3.6% (per_layer_tail_s), 1.2% (d_step_s) and 0.6% (d_queue):
/// fixed_s and the per-layer term share most of their signal with each other. Tolerances are
/// about twice those spreads or more; a term attributed to the wrong feature, or a unit slip,
/// is off by far more.
const TERM_TOL: [f64; 5] = [0.16, 0.03, 0.07, 0.03, 0.02];

#[test]
fn calibration_recovers_known_terms() {
    let sigma = 0.05;
    let recs = samples_of(&synthetic_lines(4000, &TRUE, sigma, 7));
    let c = calibrate(&recs, &opts()).expect("fit");
    eprintln!("{}", c.table());
    let m = &c.model;
    for (name, fit, want) in [
        ("mean", &m.terms, TRUE),
        ("p50", &m.quantiles.p50, TRUE),
        // Multiplicative noise: the conditional 90th percentile is every term × (1 + 1.2816 σ).
        ("p90", &m.quantiles.p90, scaled(&TRUE, 1.0 + 1.2816 * sigma)),
    ] {
        let e = term_errors(fit, &want);
        eprintln!("{name}: fitted {fit:?}\n      relative errors {e:?}");
        for (i, v) in e.iter().enumerate() {
            assert!(
                *v < TERM_TOL[i],
                "{name} term {i} off by {v:.4} (fit {fit:?}, want {want:?})"
            );
        }
    }
    // The p90 model covers about 90% of held-out clocks; the p50 model is close on most.
    assert!(
        (0.85..=0.95).contains(&c.p90_coverage),
        "p90 coverage {}",
        c.p90_coverage
    );
    assert!(
        c.p50.p50 < 0.05,
        "held-out p50 relative error {}",
        c.p50.p50
    );
    // Destination-only records: the one note says the source terms were not fitted.
    assert_eq!(c.notes.len(), 1, "unexpected notes: {:?}", c.notes);
    assert!(c.notes[0].starts_with(NO_SOURCE_NOTE), "{:?}", c.notes);
    for t in [&m.terms, &m.quantiles.p50, &m.quantiles.p90] {
        assert_eq!(t.prefill_s_per_token, 0.0);
        assert_eq!(t.src_s_per_pending_byte, 0.0);
    }
}

/// The source side: P's own prefill, the queue ahead on P, the step P is running and the KV P
/// sends first, drawn independently of each other and of the bytes.
const TRUE_SRC: Terms = Terms {
    fixed_s: 0.03,
    bytes_per_s: 6e9,
    per_layer_tail_s: 0.0,
    d_step_s: 0.0,
    d_queue_s_per_waiting: 0.0,
    prefill_s_per_token: 8e-5,
    src_s_per_queued_token: 7e-5,
    src_s_per_running_token: 4e-5,
    src_s_per_waiting: 0.005,
    src_s_per_pending_byte: 1.5e-10,
};

fn source_lines(n: usize, terms: &Terms, sigma: f64, seed: u64) -> String {
    let mut rng = Rng::new(seed);
    let mut s = String::new();
    for i in 0..n {
        let tokens = rng.range(1_000, 50_000);
        let bytes = tokens * 98_304;
        let prefill = if rng.f64() < 0.3 {
            tokens
        } else {
            rng.range(0, 4_000)
        };
        let waiting = if rng.f64() < 0.5 {
            0
        } else {
            rng.range(1, 6) as u32
        };
        let queued = u64::from(waiting) * rng.range(500, 8_000);
        let running = if rng.f64() < 0.3 {
            0
        } else {
            rng.range(100, 16_384)
        };
        let pending = if rng.f64() < 0.4 {
            0
        } else {
            rng.range(1, 40) * 100_000_000
        };
        let x = Inputs {
            bytes,
            layers: 8,
            prefill_tokens: prefill,
            src_waiting: waiting,
            src_queued_tokens: queued,
            src_running_tokens: running,
            src_pending_bytes: pending,
            ..Inputs::default()
        };
        let t = terms.predict_inputs(&x) * (1.0 + sigma * rng.normal());
        let start = 1_000_000_000u64 + i as u64 * 1_000;
        let end = start + (t.max(1e-6) * 1e9).round() as u64;
        let mode = if i % 2 == 0 { "whole" } else { "layerwise" };
        s.push_str(&format!(
            "{{\"req\":{i},\"decode_sent\":{start},\"first_token\":{end},\"bytes\":{bytes},\
             \"layers\":8,\"tokens\":{tokens},\"transport\":\"shm\",\"send_mode\":\"{mode}\",\
             \"outcome\":\"finished\",\"prefill_tokens\":{prefill},\"src_waiting\":{waiting},\
             \"src_queued_tokens\":{queued},\"src_running_tokens\":{running},\
             \"src_pending_bytes\":{pending}}}\n"
        ));
    }
    s
}

#[test]
fn calibration_recovers_source_side_terms() {
    let recs = samples_of(&source_lines(4000, &TRUE_SRC, 0.05, 31));
    assert!(recs.iter().all(|s| s.has_src && s.prefill_tokens <= 50_000));
    let c = calibrate(&recs, &opts()).expect("fit");
    eprintln!("{}", c.table());
    let m = &c.model.quantiles.p50;
    let pairs = [
        ("bytes_per_s", m.bytes_per_s, TRUE_SRC.bytes_per_s),
        (
            "prefill_s_per_token",
            m.prefill_s_per_token,
            TRUE_SRC.prefill_s_per_token,
        ),
        (
            "src_s_per_queued_token",
            m.src_s_per_queued_token,
            TRUE_SRC.src_s_per_queued_token,
        ),
        (
            "src_s_per_running_token",
            m.src_s_per_running_token,
            TRUE_SRC.src_s_per_running_token,
        ),
        (
            "src_s_per_pending_byte",
            m.src_s_per_pending_byte,
            TRUE_SRC.src_s_per_pending_byte,
        ),
    ];
    for (name, fit, want) in pairs {
        // 5% noise on ~3,200 fitting records: each of these is pinned to a few percent.
        assert!(rel(fit, want) < 0.05, "{name}: fit {fit} want {want}");
    }
    // The small per-request term shares its signal with queued tokens: looser.
    assert!(
        rel(m.src_s_per_waiting, TRUE_SRC.src_s_per_waiting) < 0.5,
        "{m:?}"
    );
    assert!(c.p50.p90 < 0.15, "held-out p90 |rel| {}", c.p50.p90);
    // Both send modes present: one model per mode, each measured on its own held-out part.
    assert_eq!(c.per_send_mode.len(), 2);
    for (mode, mc) in &c.per_send_mode {
        assert_eq!(mc.model.send_mode.as_deref(), Some(mode.as_str()));
        assert!(mc.held_out_ids.len() + mc.train_ids.len() == 2000, "{mode}");
        assert!(mc.per_send_mode.is_empty());
    }
    assert_eq!(c.model.send_mode, None);
    // Restricting to one mode keeps only its records.
    let o = CalibrateOptions {
        send_mode: Some("layerwise".into()),
        ..opts()
    };
    let l = calibrate(&recs, &o).expect("fit layerwise");
    assert_eq!(l.train_ids.len() + l.held_out_ids.len(), 2000);
    assert!(l
        .train_ids
        .iter()
        .all(|id| id.parse::<u64>().unwrap() % 2 == 1));
}

#[test]
fn error_is_measured_on_held_out_records_only() {
    let recs = samples_of(&synthetic_lines(1000, &TRUE, 0.05, 11));
    let c = calibrate(&recs, &opts()).expect("fit");
    let train: HashSet<&String> = c.train_ids.iter().collect();
    let held: HashSet<&String> = c.held_out_ids.iter().collect();
    assert!(train.is_disjoint(&held), "a request is on both sides");
    let all: HashSet<&String> = recs.iter().map(|s| &s.id).collect();
    let union: HashSet<&String> = train.union(&held).copied().collect();
    assert_eq!(union, all);
    let frac = c.train_ids.len() as f64 / recs.len() as f64;
    assert!((0.75..=0.85).contains(&frac), "train fraction {frac}");
    assert_eq!(c.model.fitted_on.records, c.train_ids.len() as u64);
    assert_eq!(c.model.error.held_out, Some(c.held_out_ids.len() as u64));

    // The error block is the p50 model's error on exactly the held-out records.
    let (_, held_samples) = split(&recs);
    let t = c.model.quantiles.p50;
    let e = rel_error(&held_samples, |s| {
        t.predict(s.bytes, s.layers, s.dst_waiting, s.dst_running)
    });
    assert_eq!(e.p50, c.model.error.p50_rel);
    assert_eq!(e.p90, c.model.error.p90_rel);

    // Wrecking the held-out clocks changes the error but not a single fitted bit.
    let wrecked: Vec<Sample> = recs
        .iter()
        .map(|s| {
            let mut s = s.clone();
            if !is_train(&s.id) {
                s.seconds *= 10.0;
            }
            s
        })
        .collect();
    let c2 = calibrate(&wrecked, &opts()).expect("fit");
    assert_eq!(c2.model.terms, c.model.terms);
    assert_eq!(c2.model.quantiles, c.model.quantiles);
    assert!(c2.model.error.p50_rel > 5.0 * c.model.error.p50_rel);
}

#[test]
fn split_depends_only_on_the_request_id() {
    let ids: Vec<String> = (0..2000).map(|i| format!("cmpl-{i}")).collect();
    let a: Vec<bool> = ids.iter().map(|i| is_train(i)).collect();
    let b: Vec<bool> = ids.iter().map(|i| is_train(i)).collect();
    assert_eq!(a, b);
    let n = a.iter().filter(|x| **x).count();
    assert!((1500..=1700).contains(&n), "{n} of 2000 in training");
    // Numeric ids from the connector hash their decimal text.
    let line = |req: &str| {
        format!("{{\"req\":{req},\"decode_sent\":1,\"first_token\":2,\"bytes\":1,\"layers\":1}}")
    };
    let t = parse_timeline(Cursor::new(line("42")), BadLines::Fail).expect("parse");
    assert_eq!(t.samples[0].id, "42");
    let t = parse_timeline(Cursor::new(line("\"42\"")), BadLines::Fail).expect("parse");
    assert_eq!(t.samples[0].id, "42");
}

#[test]
fn malformed_lines_are_typed_errors_with_line_numbers() {
    let good = "{\"req\":1,\"decode_sent\":100,\"first_token\":200,\"bytes\":10,\"layers\":2}";
    let text = [
        good,
        "this is not json",
        "{\"req\":2,\"decode_sent\":100,\"first_token\":200,\"layers\":2}",
        "{\"req\":3,\"decode_sent\":300,\"first_token\":200,\"bytes\":10,\"layers\":2}",
        "{\"req\":4,\"decode_sent\":100,\"first_token\":200,\"bytes\":\"ten\",\"layers\":2}",
        "",
        "{\"req\":5,\"decode_sent\":100,\"first_token\":200,\"bytes\":10,\"layers\":2,\"outcome\":\"failed\"}",
        "{\"req\":6,\"side\":\"p\",\"p_scheduled\":100,\"bytes\":10,\"layers\":2}",
        "{\"decode_sent\":100,\"first_token\":200,\"bytes\":10,\"layers\":2}",
        good,
    ]
    .join("\n");

    match parse_timeline(Cursor::new(&text), BadLines::Fail) {
        Err(CalibrateError::Line {
            line: 2,
            error: LineError::Json(_),
        }) => {}
        other => panic!("expected a JSON error on line 2, got {other:?}"),
    }

    let t = parse_timeline(Cursor::new(&text), BadLines::Skip).expect("skip mode");
    let bad: Vec<usize> = t.bad_lines.iter().map(|(l, _)| *l).collect();
    assert_eq!(bad, vec![2, 3, 4, 5, 9]);
    assert!(matches!(t.bad_lines[0].1, LineError::Json(_)));
    assert!(matches!(t.bad_lines[1].1, LineError::Missing("bytes")));
    assert!(matches!(t.bad_lines[2].1, LineError::Invalid(_)));
    assert!(matches!(t.bad_lines[3].1, LineError::Json(_)));
    assert!(matches!(t.bad_lines[4].1, LineError::Missing("req")));
    // Failed requests and P-side records are not malformed, just not usable.
    assert_eq!(t.skipped_failed, 1);
    assert_eq!(t.skipped_incomplete, 1);
    // The good line appears twice: the exact duplicate is dropped.
    assert_eq!(t.samples.len(), 1);
    assert_eq!(t.skipped_duplicate, 1);
    assert_eq!(t.samples[0].line, 1);
    assert!((t.samples[0].seconds - 100e-9).abs() < 1e-15);
}

#[test]
fn connector_timeline_records_are_accepted() {
    // A D record exactly as `TimelineRecord::to_json_line` writes it (no D load fields).
    let line = "{\"req\":17,\"side\":\"merged\",\"decode_sent\":1000000,\"p_scheduled\":2000000,\
        \"p_first_layer_ready\":3000000,\"p_last_layer_ready\":9000000,\"d_reserved\":2500000,\
        \"blocks_to_p\":2600000,\"first_byte\":3100000,\"last_byte\":9500000,\
        \"d_reported_finished\":9600000,\"d_promoted\":9700000,\"first_token\":10000000,\
        \"d_released\":null,\"bytes\":805306368,\"layers\":48,\"blocks\":512,\"tokens\":8192,\
        \"transport\":\"tcp\",\"policy\":\"lazy\",\"send_mode\":\"layerwise\",\
        \"outcome\":\"finished\",\"fail_reason\":null}";
    let t = parse_timeline(Cursor::new(line), BadLines::Fail).expect("connector line");
    assert_eq!(t.samples.len(), 1);
    let s = &t.samples[0];
    assert_eq!(s.id, "17");
    assert_eq!(s.bytes, 805_306_368);
    assert_eq!(s.layers, 48);
    assert_eq!(s.transport, "tcp");
    assert!(!s.has_load);
    assert_eq!((s.dst_waiting, s.dst_running), (0, 0));
    assert!((s.seconds - 0.009).abs() < 1e-12);
    // The clock cut like the connector's `Decomposition`: blocks reached P before prefill ended,
    // so no reservation wait.
    let seg = s.segments.expect("milestones present");
    let want = [0.008, 0.0, 0.0005, 0.0001, 0.0001, 0.0003];
    for (g, w) in seg.iter().zip(want) {
        assert!((g - w).abs() < 1e-12, "{seg:?}");
    }
    assert!((seg.iter().sum::<f64>() - s.seconds).abs() < 1e-12);
}

#[test]
fn constant_features_are_not_identifiable_and_say_so() {
    // One layer count, no load fields: only fixed_s and bytes_per_s can be fitted.
    let mut rng = Rng::new(3);
    let mut s = String::new();
    for i in 0..400u64 {
        let bytes = rng.range(1 << 20, 5_000_000_000);
        let t = (0.2 + bytes as f64 / 4e9) * (1.0 + 0.02 * rng.normal());
        let end = 1_000 + (t * 1e9) as u64;
        s.push_str(&format!(
            "{{\"req\":{i},\"decode_sent\":1000,\"first_token\":{end},\"bytes\":{bytes},\"layers\":48,\"transport\":\"rdma\"}}\n"
        ));
    }
    let c = calibrate(&samples_of(&s), &opts()).expect("fit");
    let t = c.model.terms;
    assert_eq!(t.per_layer_tail_s, 0.0);
    assert_eq!(t.d_step_s, 0.0);
    assert_eq!(t.d_queue_s_per_waiting, 0.0);
    assert!(rel(t.fixed_s, 0.2) < 0.03, "{t:?}");
    assert!(rel(t.bytes_per_s, 4e9) < 0.03, "{t:?}");
    let notes = c.notes.join("\n");
    for w in [
        "layers",
        "dst_running",
        "dst_waiting",
        "no dst_waiting/dst_running",
        NO_SOURCE_NOTE,
    ] {
        assert!(notes.contains(w), "notes lack {w:?}: {notes}");
    }
}

#[test]
fn seed_model_is_far_worse_under_d_side_queueing() {
    // A destination with a queue: the clock is dominated by D's waiting line and steps, which
    // the seed model `0.3 s + bytes / 2.7 GB/s` cannot see.
    let loaded = Terms {
        fixed_s: 0.02,
        bytes_per_s: 10e9,
        per_layer_tail_s: 0.0005,
        d_step_s: 0.01,
        d_queue_s_per_waiting: 0.4,
        prefill_s_per_token: 0.0,
        src_s_per_queued_token: 0.0,
        src_s_per_running_token: 0.0,
        src_s_per_waiting: 0.0,
        src_s_per_pending_byte: 0.0,
    };
    let recs = samples_of(&synthetic_lines(1500, &loaded, 0.10, 99));
    let c = calibrate(&recs, &opts()).expect("fit");
    eprintln!("{}", c.table());
    assert!(
        c.seed.p50 > 5.0 * c.p50.p50,
        "seed p50 {} vs calibrated {}",
        c.seed.p50,
        c.p50.p50
    );
    assert!(
        c.seed.p90 > 5.0 * c.p50.p90,
        "seed p90 {} vs calibrated {}",
        c.seed.p90,
        c.p50.p90
    );
    // The seed is optimistic on a loaded destination (the study's 10–20× miss).
    assert!(c.seed.median_ratio < 0.8, "{}", c.seed.median_ratio);
    // The error the model reports is its held-out p50 model's.
    assert_eq!(c.model.error.p50_rel, c.p50.p50);
}

#[test]
fn mixed_transports_need_a_choice() {
    let mut s = synthetic_lines(200, &TRUE, 0.05, 5);
    s.push_str(
        &synthetic_lines(200, &TRUE, 0.05, 6)
            .replace("\"rdma\"", "\"tcp\"")
            .replace("\"req\":", "\"req\":1000"),
    );
    let recs = samples_of(&s);
    assert!(matches!(
        calibrate(&recs, &opts()),
        Err(CalibrateError::MixedTransports(_))
    ));
    let o = CalibrateOptions {
        transport: Some("tcp".into()),
        send_mode: None,
        source: "x".into(),
    };
    let c = calibrate(&recs, &o).expect("tcp only");
    assert_eq!(c.model.transport, "tcp");
    assert_eq!(
        c.train_ids.len() + c.held_out_ids.len(),
        200,
        "only tcp records used"
    );
    // Too few records is an error, not a nonsense model.
    assert!(matches!(
        calibrate(&recs[..5], &opts()),
        Err(CalibrateError::TooFew { .. })
    ));
}

fn bench() -> std::process::Command {
    std::process::Command::new(env!("CARGO_BIN_EXE_kvwire-bench"))
}

#[test]
fn cli_fits_writes_the_model_and_reports_bad_lines() {
    let dir = std::env::temp_dir().join(format!("kvwire-calibrate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let timeline = dir.join("timeline.jsonl");
    let out = dir.join("cost.json");
    let grid = dir.join("grid.json");
    std::fs::write(&timeline, synthetic_lines(600, &TRUE, 0.05, 21)).expect("write timeline");
    let o = bench()
        .arg("calibrate")
        .arg("--timeline")
        .arg(&timeline)
        .arg("--out")
        .arg(&out)
        .arg("--predict-grid")
        .arg(&grid)
        .output()
        .expect("run kvwire-bench");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("seed 0.3 s + bytes / 2.7 GB/s"), "{stdout}");
    assert!(stdout.contains("calibrated p50"), "{stdout}");
    let m = CostModel::load(&out).expect("the written model loads");
    assert_eq!(m.transport, "rdma");
    // The CLI's fit is the library's fit on the same records.
    let c = calibrate(
        &samples_of(&synthetic_lines(600, &TRUE, 0.05, 21)),
        &CalibrateOptions {
            transport: None,
            send_mode: None,
            source: timeline.display().to_string(),
        },
    )
    .expect("fit");
    assert_eq!(m.terms, c.model.terms);
    assert_eq!(m.quantiles, c.model.quantiles);
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&grid).expect("grid")).expect("grid json");
    let cases = g["cases"].as_array().expect("cases");
    assert!(!cases.is_empty());
    for case in cases {
        let q = match case["quantile"].as_str() {
            Some("mean") => Quantile::Mean,
            Some("p50") => Quantile::P50,
            Some("p90") => Quantile::P90,
            other => panic!("quantile {other:?}"),
        };
        let field = |k: &str| case[k].as_u64().expect("integer input");
        let want = m.predict_inputs(
            &Inputs {
                bytes: field("bytes"),
                layers: field("layers") as u32,
                dst_waiting: field("dst_waiting") as u32,
                dst_running: field("dst_running") as u32,
                prefill_tokens: field("prefill_tokens"),
                src_waiting: field("src_waiting") as u32,
                src_queued_tokens: field("src_queued_tokens"),
                src_running_tokens: field("src_running_tokens"),
                src_pending_bytes: field("src_pending_bytes"),
            },
            q,
        );
        assert_eq!(case["seconds"].as_f64(), Some(want));
    }

    // A malformed line fails the run with its line number, unless told to skip.
    let mut text = synthetic_lines(100, &TRUE, 0.05, 22);
    text.insert_str(0, "{\"req\": 1, \"bytes\": oops}\n");
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, &text).expect("write");
    let o = bench()
        .args(["calibrate", "--timeline"])
        .arg(&bad)
        .output()
        .expect("run");
    assert!(!o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("line 1"), "{stderr}");
    let o = bench()
        .args(["calibrate", "--skip-bad-lines", "--timeline"])
        .arg(&bad)
        .output()
        .expect("run");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("skipped line 1"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Records whose inputs are all the same, 40% with a 1 s clock and 60% with a 2 s clock: each
/// fit's objective has a known answer, and they differ. The p50 terms minimise the mean
/// relative error `Σ |pred − actual| / actual` (the docs): the 1 s records weigh 0.4 · 1/1,
/// the 2 s ones 0.6 · 1/2, so 1 s. An absolute median (unweighted check loss) would give 2 s,
/// the p90 quantile is 2 s, and the least-squares mean is 1.6 s.
#[test]
fn p50_fit_minimises_mean_relative_error_not_absolute_error() {
    let mut text = String::new();
    for i in 0..1000u64 {
        let secs: u64 = if i % 5 < 2 { 1 } else { 2 };
        let start = 1_000_000_000u64 + i * 1_000;
        let end = start + secs * 1_000_000_000;
        text.push_str(&format!(
            "{{\"req\":{i},\"decode_sent\":{start},\"first_token\":{end},\"bytes\":1000000,\
             \"layers\":8,\"transport\":\"shm\"}}\n"
        ));
    }
    let recs = samples_of(&text);
    let (train, _) = split(&recs);
    let ones = train.iter().filter(|s| s.seconds < 1.5).count() as f64 / train.len() as f64;
    // The hash split keeps the 40/60 mix close enough that 1 s stays the weighted median
    // (needs ones / 1 > (1 − ones) / 2, i.e. ones > 1/3) and 2 s the plain one (ones < 1/2).
    assert!(
        (0.36..0.46).contains(&ones),
        "training share of 1 s clocks {ones}"
    );
    let c = calibrate(&recs, &opts()).expect("fit");
    let m = &c.model;
    eprintln!("{}", c.table());
    assert!(
        rel(m.quantiles.p50.fixed_s, 1.0) < 1e-3,
        "{:?}",
        m.quantiles.p50
    );
    assert!(
        rel(m.quantiles.p90.fixed_s, 2.0) < 1e-3,
        "{:?}",
        m.quantiles.p90
    );
    let mean = 2.0 - ones;
    assert!(rel(m.terms.fixed_s, mean) < 1e-9, "{:?} vs {mean}", m.terms);
    // It is the minimum: moving the p50 prediction either way raises the training records'
    // mean relative error.
    let mre = |p: f64| {
        train
            .iter()
            .map(|s| (p - s.seconds).abs() / s.seconds)
            .sum::<f64>()
    };
    let p = m.quantiles.p50.fixed_s;
    assert!(mre(p) < mre(p * 1.05) && mre(p) < mre(p * 0.95));
    assert!(mre(p) < mre(2.0), "the absolute median would do worse");
    // 40% of held-out clocks are at or below a 1 s prediction.
    assert!((0.25..0.55).contains(&c.p50_coverage), "{}", c.p50_coverage);
}

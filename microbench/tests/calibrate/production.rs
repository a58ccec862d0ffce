//! Production timelines: P and D records on two clocks, joined onto D's and fitted as the same
//! records on one clock; a missing P file; malformed lines by file and line; rotated files;
//! router loads; P's prefix-cache hits as the prefill input; router records read from another
//! directory.

use std::path::{Path, PathBuf};

use kvwire_bench::calibrate::{
    calibrate, parse_timeline, production_files, read_production, read_production_files, BadLines,
    CalibrateError, Production, ProductionOptions, Sample,
};
use kvwire_connector::{Policy, RequestId, SendMode, Side, TimelineRecord};
use kvwire_testkit::rng::Rng;
use serde_json::{json, Value};

use super::{bench, opts, TRUE};

/// P's monotonic clock minus D's: P's timestamps are 3 s later than D's for the same instant.
const OFFSET: i64 = 3_000_000_000;

/// One request as both sides saw it, P's record on D's clock.
struct Req {
    key: String,
    d: TimelineRecord,
    p: TimelineRecord,
    d_waiting: u32,
    d_running: u32,
    p_waiting: u32,
    p_queued_tokens: u64,
}

fn requests(n: usize, seed: u64) -> Vec<Req> {
    let mut rng = Rng::new(seed);
    let layer_choices = [2u16, 12, 24, 48, 96];
    (0..n)
        .map(|i| {
            let layers = layer_choices[(rng.next_u64() % 5) as usize];
            let tokens = rng.range(256, 50_000);
            let bytes = tokens * 98_304;
            let d_running = rng.range(0, 128) as u32;
            let d_waiting = if rng.f64() < 0.5 {
                0
            } else {
                rng.range(1, 20) as u32
            };
            let t = TRUE.predict(bytes, u32::from(layers), d_waiting, d_running)
                * (1.0 + 0.05 * rng.normal());
            let start = 10_000_000_000 + i as u64 * 1_000_000;
            let span = (t.max(1e-6) * 1e9).round() as u64;
            let at = |tenths: u64| start + span * tenths / 10;
            let mut d = TimelineRecord::new(RequestId(i as u64), Side::D, "rdma");
            d.decode_sent = Some(start);
            // D learns of P's milestones a little after they happen.
            d.p_scheduled = Some(at(1) + 700_000);
            d.p_last_layer_ready = Some(at(5) + 900_000);
            d.d_reserved = Some(at(2));
            d.blocks_to_p = Some(at(3));
            d.last_byte = Some(at(7));
            d.d_reported_finished = Some(at(8));
            d.d_promoted = Some(at(9));
            d.first_token = Some(start + span);
            d.bytes = bytes;
            d.layers = layers;
            d.blocks = tokens.div_ceil(16) as u32;
            d.tokens = tokens as u32;
            d.policy = Some(Policy::Lazy);
            let mut p = TimelineRecord::new(RequestId(50_000 + i as u64), Side::P, "rdma");
            p.p_scheduled = Some(at(1));
            p.p_first_layer_ready = Some(at(2));
            p.p_last_layer_ready = Some(at(5));
            p.first_byte = Some(at(2) + 1_000);
            p.last_byte = Some(at(7) - 500);
            p.bytes = bytes;
            p.layers = layers;
            p.blocks = d.blocks;
            p.tokens = d.tokens;
            p.send_mode = Some(SendMode::Layerwise);
            Req {
                key: format!("tx-{i:05}"),
                d,
                p,
                d_waiting,
                d_running,
                p_waiting: rng.range(0, 8) as u32,
                p_queued_tokens: rng.range(0, 40_000),
            }
        })
        .collect()
}

/// A record as a JSON line with `extra` fields added.
fn line(rec: &TimelineRecord, extra: Value) -> String {
    let mut v = serde_json::to_value(rec).expect("record");
    let o = v.as_object_mut().expect("object");
    for (k, x) in extra.as_object().expect("extra fields") {
        o.insert(k.clone(), x.clone());
    }
    v.to_string()
}

/// `rec` with its P timestamps on P's clock.
fn on_p_clock(rec: &TimelineRecord) -> TimelineRecord {
    let mut p = rec.clone();
    for t in [
        &mut p.p_scheduled,
        &mut p.p_first_layer_ready,
        &mut p.p_last_layer_ready,
        &mut p.first_byte,
        &mut p.last_byte,
    ] {
        *t = t.map(|t| t.checked_add_signed(OFFSET).expect("on P's clock"));
    }
    p
}

/// The records as one merged timeline on one clock (what the join should produce).
fn one_clock(reqs: &[Req]) -> String {
    reqs.iter()
        .map(|r| {
            let m = TimelineRecord::merge(&r.d, &r.p);
            line(
                &m,
                json!({
                    "req": r.key, "dst_waiting": r.d_waiting, "dst_running": r.d_running,
                    "src_waiting": r.p_waiting, "src_queued_tokens": r.p_queued_tokens,
                }),
            ) + "\n"
        })
        .collect()
}

fn d_line(r: &Req, i: usize) -> String {
    // Every 5th D record lacks the offset (P's record has its own, of the other sign); every
    // 7th has an uncertain one.
    let (off, err) = match i {
        i if i % 5 == 0 => (Value::Null, Value::Null),
        i if i % 7 == 0 => (json!(OFFSET), json!(9_000_000)),
        _ => (json!(OFFSET), json!(150_000)),
    };
    line(
        &r.d,
        json!({
            "role": "d", "engine_id": "d0", "transfer_id": r.key, "peer_engine_id": "p0",
            "d_waiting": r.d_waiting, "d_running": r.d_running,
            "clock_offset_ns": off, "clock_error_ns": err, "vllm_request_id": "unknown field",
        }),
    )
}

fn p_line(r: &Req) -> String {
    line(
        &on_p_clock(&r.p),
        json!({
            "role": "p", "engine_id": "p0", "transfer_id": r.key, "peer_engine_id": "d0",
            "p_waiting": r.p_waiting, "p_running": 3, "p_queued_tokens": r.p_queued_tokens,
            "clock_offset_ns": -OFFSET, "clock_error_ns": 150_000,
            "p_first_write": r.p.first_byte.map(|t| t + OFFSET as u64),
        }),
    )
}

fn tmp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvwire-prod-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("p")).expect("tmp dir");
    dir
}

fn write(path: &Path, lines: &[String]) {
    std::fs::write(path, lines.join("\n") + "\n").expect("write timeline");
}

/// Writes D's records into a rotated file (the older half) and the live file, P's (unless
/// `with_p` is false) into a subdirectory.
fn write_production(dir: &Path, reqs: &[Req], with_p: bool) {
    let d: Vec<String> = reqs.iter().enumerate().map(|(i, r)| d_line(r, i)).collect();
    let half = d.len() / 2;
    write(&dir.join("d0-d-11.jsonl.1"), &d[..half]);
    write(&dir.join("d0-d-11.jsonl"), &d[half..]);
    if with_p {
        // P wrote in its own order.
        let p: Vec<String> = reqs.iter().rev().map(p_line).collect();
        write(&dir.join("p").join("p0-p-7.jsonl"), &p);
    }
}

fn no_lines(samples: &[Sample]) -> Vec<Sample> {
    samples
        .iter()
        .cloned()
        .map(|mut s| {
            s.line = 0;
            s
        })
        .collect()
}

fn read(dir: &Path, bad: BadLines) -> Production {
    let o = ProductionOptions {
        bad,
        ..ProductionOptions::default()
    };
    read_production(dir, &o).expect("production timelines")
}

#[test]
fn p_and_d_records_on_two_clocks_fit_as_on_one() {
    let reqs = requests(800, 41);
    let dir = tmp_dir("join");
    write_production(&dir, &reqs, true);
    let prod = read(&dir, BadLines::Fail);
    assert_eq!(prod.files.len(), 3);
    assert_eq!((prod.d_records, prod.p_records), (800, 800));
    assert_eq!((prod.joined, prod.d_only, prod.p_unmatched), (800, 0, 0));
    assert_eq!(prod.clock_unknown, 0, "P's own offset stands in for D's");
    let uncertain = (0..800).filter(|i| i % 5 != 0 && i % 7 == 0).count();
    assert_eq!(prod.clock_over_bound, uncertain, "kept and counted");
    assert!(prod.bad_lines.is_empty());

    let single =
        parse_timeline(std::io::Cursor::new(one_clock(&reqs)), BadLines::Fail).expect("one clock");
    assert_eq!(single.samples.len(), 800);
    assert_eq!(no_lines(&prod.timeline.samples), no_lines(&single.samples));
    let a = calibrate(&prod.timeline.samples, &opts()).expect("fit production");
    let b = calibrate(&single.samples, &opts()).expect("fit one clock");
    assert_eq!(a.model, b.model);
    assert_eq!((a.p50, a.seed), (b.p50, b.seed));
    assert!(a.p50.p50 < a.seed.p50, "calibrated beats the seed model");

    // Without the shift P's milestones would sit 3 s late: the segments show it.
    let s = &prod.timeline.samples[1];
    let seg = s.segments.expect("milestones");
    assert!((seg.iter().sum::<f64>() - s.seconds).abs() < 1e-9);
    assert!(seg[0] < s.seconds, "wait for P within the clock: {seg:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_p_file_still_fits_d_records() {
    let reqs = requests(300, 42);
    let dir = tmp_dir("no-p");
    write_production(&dir, &reqs, false);
    let prod = read(&dir, BadLines::Fail);
    assert_eq!((prod.d_records, prod.p_records), (300, 0));
    assert_eq!((prod.joined, prod.d_only), (0, 300));
    let t = &prod.timeline;
    assert_eq!(t.samples.len(), 300);
    assert!(t.samples.iter().all(|s| s.has_load && !s.has_src));
    assert!(t.samples.iter().all(|s| s.send_mode.is_none()));
    let c = calibrate(&t.samples, &opts()).expect("D records alone fit");
    assert!(c.p50.p50 < c.seed.p50);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn malformed_lines_are_counted_and_skipped_with_file_and_line() {
    let reqs = requests(60, 43);
    let dir = tmp_dir("bad");
    write_production(&dir, &reqs, true);
    let live = dir.join("d0-d-11.jsonl");
    let mut text = std::fs::read_to_string(&live).expect("read");
    text.insert_str(
        0,
        "{\"role\": \"d\", oops\n\n{\"role\": \"x\", \"req\": 1}\n",
    );
    std::fs::write(&live, text).expect("write");
    let p = dir.join("p").join("p0-p-7.jsonl");
    let mut text = std::fs::read_to_string(&p).expect("read");
    text.push_str("{\"role\": \"p\", \"req\": 7}\n");
    std::fs::write(&p, text).expect("write");

    let prod = read(&dir, BadLines::Skip);
    let where_: Vec<String> = prod.bad_lines.iter().map(|b| b.to_string()).collect();
    assert_eq!(where_.len(), 3, "{where_:?}");
    assert!(
        where_[0].starts_with(&format!("{}:1: ", live.display())),
        "{where_:?}"
    );
    assert!(
        where_[1].starts_with(&format!("{}:3: ", live.display())),
        "{where_:?}"
    );
    assert!(
        where_[2].starts_with(&format!("{}:61: ", p.display())),
        "{where_:?}"
    );
    assert_eq!(
        prod.timeline.samples.len(),
        60,
        "the good lines are all used"
    );

    match read_production(&dir, &ProductionOptions::default()) {
        Err(CalibrateError::FileLine { file, line: 1, .. }) => {
            assert_eq!(file, live.display().to_string())
        }
        other => panic!("expected the first bad line, got {other:?}"),
    }

    // The CLI lists them by file and line and reports the join.
    let o = bench()
        .args([
            "calibrate",
            "--skip-bad-lines",
            "--max-clock-error-ms",
            "0.1",
        ])
        .arg("--timeline")
        .arg(&dir)
        .output()
        .expect("run kvwire-bench");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!("skipped {}:3: ", live.display())),
        "{stderr}"
    );
    assert!(stdout.contains("3 malformed"), "{stdout}");
    assert!(stdout.contains("60 joined"), "{stdout}");
    // Every offset is uncertain by 150 µs or more: over a 0.1 ms bound, all kept.
    assert!(
        stdout.contains("60 with a clock error over 0.1 ms"),
        "{stdout}"
    );
    assert!(stdout.contains("seed 0.3 s + bytes / 2.7 GB/s"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rotated_files_are_read_oldest_first() {
    let dir = tmp_dir("files");
    std::fs::create_dir_all(dir.join("sub")).expect("sub");
    let names = [
        "a.jsonl",
        "a.jsonl.1",
        "a.jsonl.12",
        "a.jsonl.2",
        "a.jsonl.old",
        "b.jsonl",
        "notes.txt",
        "a.jsonl.tmp",
        "router-0.jsonl",
        "sub/c.jsonl.1",
        "sub/c.jsonl",
    ];
    for n in names {
        std::fs::write(dir.join(n), "").expect("touch");
    }
    let found: Vec<String> = production_files(&dir)
        .expect("list")
        .iter()
        .map(|p| {
            p.strip_prefix(&dir)
                .expect("under dir")
                .display()
                .to_string()
        })
        .collect();
    assert_eq!(
        found,
        [
            "a.jsonl.old",
            "a.jsonl.12",
            "a.jsonl.2",
            "a.jsonl.1",
            "a.jsonl",
            "b.jsonl",
            "router-0.jsonl",
            "sub/c.jsonl.1",
            "sub/c.jsonl",
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn router_loads_stand_in_for_missing_connector_loads() {
    let reqs = requests(40, 44);
    let dir = tmp_dir("router");
    let mut d = Vec::new();
    let mut p = Vec::new();
    let mut router = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        // The connector's records carry no loads; the router's do.
        d.push(line(
            &r.d,
            json!({"role": "d", "transfer_id": r.key, "clock_offset_ns": OFFSET,
                   "clock_error_ns": 1000}),
        ));
        p.push(line(
            &on_p_clock(&r.p),
            json!({"role": "p", "transfer_id": r.key}),
        ));
        let d_load = if i % 2 == 0 {
            json!({"waiting": r.d_waiting, "running": r.d_running})
        } else {
            json!(r.d_running)
        };
        router.push(
            json!({"kind": "router", "transfer_id": r.key, "decode_sent_ns": 5, "first_token_ns": 9,
                   "last_token_ns": 12, "p": "p0", "d": "d0", "p_load": r.p_waiting,
                   "d_load": d_load})
            .to_string(),
        );
    }
    write(&dir.join("d0-d-1.jsonl"), &d);
    write(&dir.join("p").join("p0-p-1.jsonl"), &p);
    write(&dir.join("router-0.jsonl"), &router);
    let prod = read(&dir, BadLines::Fail);
    assert_eq!((prod.router_records, prod.router_joined), (40, 40));
    assert_eq!((prod.router_loads, prod.joined), (40, 40));
    for (i, (s, r)) in prod.timeline.samples.iter().zip(&reqs).enumerate() {
        assert_eq!(s.id, r.key);
        assert!(s.has_load && s.has_src);
        assert_eq!(s.dst_running, r.d_running);
        let want_waiting = if i % 2 == 0 { r.d_waiting } else { 0 };
        assert_eq!(s.dst_waiting, want_waiting);
        assert_eq!(s.src_waiting, r.p_waiting);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn p_cached_tokens_give_the_prefill_and_routers_may_be_read_from_elsewhere() {
    let reqs = requests(30, 45);
    let dir = tmp_dir("cached");
    let routers = dir.join("arm");
    std::fs::create_dir_all(&routers).expect("router dir");
    let mut d = Vec::new();
    let mut p = Vec::new();
    let mut router = Vec::new();
    // What P's prefix cache held: none, a third of the prompt, or (every 5th) not said.
    let cached = |i: usize, r: &Req| match i % 5 {
        4 => None,
        k => Some(u64::from(r.p.tokens) * k as u64 / 12),
    };
    for (i, r) in reqs.iter().enumerate() {
        d.push(d_line(r, i));
        let mut v: Value = serde_json::from_str(&p_line(r)).expect("P line");
        if let Some(c) = cached(i, r) {
            v["p_cached_tokens"] = json!(c);
        }
        p.push(v.to_string());
        router.push(
            json!({"kind": "router", "transfer_id": r.key, "p": "p0", "d": "d0",
                   "p_load": 99, "d_load": 99})
            .to_string(),
        );
    }
    write(&dir.join("d0-d-1.jsonl"), &d);
    write(&dir.join("p").join("p0-p-1.jsonl"), &p);
    write(&routers.join("router-3.jsonl"), &router);
    let mut files = production_files(&dir.join("p")).expect("P files");
    files.push(dir.join("d0-d-1.jsonl"));
    files.push(routers.join("router-3.jsonl"));
    let prod = read_production_files(files, &ProductionOptions::default()).expect("read");
    assert_eq!((prod.joined, prod.router_joined), (30, 30));
    assert_eq!(prod.router_loads, 0, "the connectors' own loads win");
    let by_id: std::collections::HashMap<&str, &Sample> = prod
        .timeline
        .samples
        .iter()
        .map(|s| (s.id.as_str(), s))
        .collect();
    for (i, r) in reqs.iter().enumerate() {
        let s = by_id[r.key.as_str()];
        let want = cached(i, r).map_or(0, |c| u64::from(r.p.tokens) - c);
        assert_eq!(s.prefill_tokens, want, "request {i}");
        assert_eq!(
            (s.src_waiting, s.src_queued_tokens),
            (r.p_waiting, r.p_queued_tokens)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

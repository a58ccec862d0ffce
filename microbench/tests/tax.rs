//! `kvwire-bench tax`: the JSON carries every field with sane numbers; the vLLM parts are
//! SKIPPED loudly when the interpreter is missing (the Rust parts still run), and with a vLLM
//! venv present a quick run measures all four connectors. No timed assertions.

use std::path::{Path, PathBuf};
use std::process::Command;

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvwire-tax-test-{}-{name}", std::process::id()))
}

fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn num(v: &serde_json::Value, what: &str) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"))
}

fn check_rust_parts(j: &serde_json::Value) {
    assert_eq!(j["schema"], "kvwire.tax/1");
    let core = j["core"]["results"].as_array().expect("core results");
    assert_eq!(core.len(), 8, "d and p at 1k/1M cached x 10/1000 live");
    for cached in [1_000u64, 1_000_000] {
        for live in [10u64, 1_000] {
            for side in ["d", "p"] {
                let c = core
                    .iter()
                    .find(|c| {
                        c["side"] == side && c["cached_blocks"] == cached && c["live"] == live
                    })
                    .unwrap_or_else(|| panic!("no core result {side} {cached} {live}"));
                assert!(num(&c["median_ns"], "median_ns") > 0.0);
                assert!(num(&c["p99_ns"], "p99_ns") >= num(&c["median_ns"], "median_ns"));
                assert!(c["steps"].as_u64().unwrap_or(0) >= 10);
                assert_eq!(
                    c["live_end"], live,
                    "the core bench keeps its live set: {c}"
                );
            }
        }
    }
    let e = &j["engine_idle"];
    assert_eq!(e["engines"], 2);
    assert!(
        e["threads"].as_u64().unwrap_or(0) > 0,
        "engines start threads: {e}"
    );
    assert!(num(&e["cpu_ms"], "cpu_ms") >= 0.0);
    assert!(num(&e["interval_s"], "interval_s") > 0.0);
    assert_eq!(j["install"], "bash tests/python/setup.sh");
    assert!(j["target"]["checks"].is_array());
}

#[test]
fn tax_without_vllm_is_skipped_loudly_and_rust_parts_run() {
    let json = tmp("skip.json");
    let clock = tmp("clock.json");
    // A clock result with one cell's pool object, as the clock bench writes it.
    let side = |s: &str, f: f64| {
        serde_json::json!({"capacity_blocks": 1000, "held_mean_blocks": f * 1000.0,
                           "held_p99_blocks": (f * 2000.0) as u64, "lost_frac_mean": f,
                           "lost_frac_p99": f * 2.0, "side": s})
    };
    let clock_v = serde_json::json!({"cells": [
        {"policy": "lazy", "send_mode": "whole", "pool": {"p": side("p", 0.01), "d": side("d", 0.02)}},
        {"policy": "eager", "send_mode": "layerwise", "pool": {"p": side("p", 0.03), "d": side("d", 0.04)}},
    ]});
    std::fs::write(&clock, clock_v.to_string()).expect("write clock json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire-bench"))
        .args([
            "tax",
            "--quick",
            "--no-progress",
            "--python",
            "/nonexistent/bin/python",
            "--json",
        ])
        .arg(&json)
        .arg("--clock-json")
        .arg(&clock)
        .output()
        .expect("run kvwire-bench tax");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "tax exited with {}: {stderr}",
        out.status
    );
    assert!(stderr.contains("SKIPPED"), "no SKIPPED on stderr: {stderr}");
    assert!(
        stdout.contains("SKIPPED"),
        "no SKIPPED in the table: {stdout}"
    );
    assert!(
        stdout.contains("bash tests/python/setup.sh"),
        "no install hint: {stdout}"
    );
    let j = read_json(&json);
    check_rust_parts(&j);
    let v = j["vllm"].as_array().expect("vllm array");
    assert_eq!(v.len(), 1);
    assert_eq!(v[0]["status"], "SKIPPED");
    assert!(v[0]["reason"]
        .as_str()
        .is_some_and(|r| r.contains("/nonexistent/bin/python")));
    assert!(!j["skipped"].as_array().expect("skipped").is_empty());
    // The block-pool figures come from the clock JSON.
    assert_eq!(j["pool"]["status"], "measured");
    let cells = j["pool"]["cells"].as_array().expect("pool cells");
    assert_eq!(cells.len(), 2);
    assert_eq!(cells[1]["policy"], "eager");
    assert_eq!(cells[1]["pool"]["d"]["lost_frac_mean"], 0.04);
    assert!(stdout.contains("Block pool"), "{stdout}");
    assert!(
        stdout.contains("4.00%"),
        "D's lost fraction of the eager cell: {stdout}"
    );
    let _ = std::fs::remove_file(&json);

    // Without a clock result the pool is "not measured".
    std::fs::write(&clock, r#"{"cells": [{"policy": "lazy"}]}"#).expect("write clock json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire-bench"))
        .args(["tax", "--quick", "--no-progress", "--no-vllm", "--json"])
        .arg(&json)
        .arg("--clock-json")
        .arg(&clock)
        .output()
        .expect("run kvwire-bench tax");
    assert!(out.status.success());
    let j = read_json(&json);
    check_rust_parts(&j);
    assert_eq!(j["pool"]["status"], "not measured");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("Block pool: not measured"), "{stdout}");
    assert!(
        stdout.contains("SKIPPED: vLLM parts: --no-vllm"),
        "{stdout}"
    );
    let _ = std::fs::remove_file(&json);
    let _ = std::fs::remove_file(&clock);
}

/// The first vLLM venv of `tests/python/setup.sh`, if any.
fn venv_python() -> Option<PathBuf> {
    let cache = std::env::var_os("KVWIRE_PY_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/kvwire-py")))?;
    let mut v: Vec<PathBuf> = std::fs::read_dir(cache)
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().to_str()?.to_string();
            name.starts_with("vllm-")
                .then(|| e.path().join("bin/python"))
                .filter(|p| p.exists())
        })
        .collect();
    v.sort();
    v.pop()
}

#[test]
fn tax_quick_with_vllm_measures_all_four_connectors() {
    let Some(py) = venv_python() else {
        eprintln!("SKIPPED: no vLLM venv under ~/.cache/kvwire-py (bash tests/python/setup.sh)");
        assert!(
            std::env::var("KVWIRE_REQUIRE_VLLM").as_deref() != Ok("1"),
            "KVWIRE_REQUIRE_VLLM=1 but no vLLM venv"
        );
        return;
    };
    let json = tmp("vllm.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire-bench"))
        .args(["tax", "--quick", "--no-progress", "--python"])
        .arg(&py)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run kvwire-bench tax");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "tax exited with {}: {stderr}",
        out.status
    );
    let j = read_json(&json);
    check_rust_parts(&j);
    let v = &j["vllm"][0];
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(
        v["mooncake_installed"],
        true,
        "mooncake-transfer-engine-non-cuda missing in {}: run bash tests/python/setup.sh",
        py.display()
    );

    // Scheduler side: every cell has the four connectors, each built as what it claims.
    let s = &v["sched"];
    assert!(
        s["errors"].as_object().is_some_and(|e| e.is_empty()),
        "{}",
        s["errors"]
    );
    for (name, class) in [
        ("noop", "NoOpConnector"),
        ("kvwire", "KvwireConnector"),
        ("mooncake", "MooncakeConnector"),
    ] {
        assert_eq!(s["connectors"][name]["class"], class);
    }
    assert!(
        s["connectors"]["none"]["class"].is_null(),
        "the baseline has no connector"
    );
    let cells = s["cells"].as_array().expect("cells");
    assert_eq!(cells.len(), 4, "decode and churn at two cache sizes");
    for c in cells {
        let r = &c["results"];
        for conn in ["none", "noop", "kvwire", "mooncake"] {
            let x = &r[conn];
            assert!(num(&x["median_us"], "median_us") > 0.0, "{conn} in {c}");
            assert!(num(&x["p90_us"], "p90_us") >= num(&x["median_us"], "median_us"));
            assert!(x["steps"].as_u64().unwrap_or(0) > 0);
            if conn != "none" {
                num(&x["delta_vs_none_us"], "delta_vs_none_us");
            }
        }
        if c["mode"] == "churn" {
            assert!(
                num(&r["kvwire"]["finished_per_step"], "finished") > 0.0,
                "churn churns: {c}"
            );
        }
        // The cache was filled: nearly every block is cached.
        let blocks = c["blocks"].as_u64().expect("blocks");
        assert!(
            r["none"]["cached_blocks_end"].as_u64().unwrap_or(0) * 2 > blocks,
            "{c}"
        );
    }
    assert_eq!(j["target"]["checks"].as_array().map(Vec::len), Some(4));

    // Worker side: each connector idle, kvwire with verified transfers in flight.
    let w = &v["worker"];
    let runs = w["runs"].as_array().expect("worker runs");
    let find = |c: &str, st: &str| {
        runs.iter()
            .find(|r| r["connector"] == c && r["state"] == st)
            .unwrap_or_else(|| panic!("no worker run {c} {st}: {w}"))
    };
    for (c, st) in [
        ("noop", "idle"),
        ("kvwire", "idle"),
        ("kvwire", "inflight"),
        ("mooncake", "idle"),
    ] {
        let r = find(c, st);
        assert!(num(&r["steps_per_s"], "steps_per_s") > 0.0);
        assert!(num(&r["base_steps_per_s"], "base_steps_per_s") > 0.0);
        num(&r["steps_lost_pct"], "steps_lost_pct");
        assert!(num(&r["threads_cpu_pct"], "cpu") >= 0.0);
        assert!(r["gil_probe"]["samples"].as_u64().unwrap_or(0) > 0);
    }
    assert!(
        find("kvwire", "idle")["threads"].as_u64().unwrap_or(0) > 0,
        "kvwire's engine threads"
    );
    let inflight = find("kvwire", "inflight");
    assert_eq!(inflight["verified"], true, "{inflight}");
    assert!(inflight["bytes"].as_u64().unwrap_or(0) > 0);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("scheduler side") && stdout.contains("worker side"),
        "{stdout}"
    );
    let _ = std::fs::remove_file(&json);
}

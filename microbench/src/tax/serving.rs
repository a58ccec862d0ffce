//! `kvwire-bench tax --servers`: the tax at serving level. One request stream (the A/B's agentic
//! trace) against real `vllm serve` processes: one with no connector, one with kv_both
//! MooncakeConnector and one with kv_both KvwireConnector, no transfer firing. It runs
//! `python -m kvwire.ab` with those arms and reads its `ab.json`: TTFT and TPOT p50/p90 from the
//! client, the busy engine-core step interval (the stand-in's step events) and the CPU seconds
//! of every server thread, each next to the no-connector server's in the same run.

use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::{json, Value};

/// The arms, the baseline first.
pub const ARMS: [&str; 3] = ["single", "kv_both-mooncake", "kv_both-kvwire"];

/// How `python -m kvwire.ab` is run.
pub struct ServingOpts<'a> {
    /// The venv's interpreter.
    pub python: &'a Path,
    /// Where ab.json and the servers' logs go.
    pub out: &'a Path,
    /// The A/B's 12-request trace.
    pub quick: bool,
    /// A real model (GPUs) instead of the stand-in.
    pub model: Option<&'a str>,
    /// Tensor parallel size with `model`.
    pub tensor_parallel_size: u32,
}

/// Runs the servers and summarizes; a failed run is a `"status": "failed"` object.
pub fn run(o: &ServingOpts) -> Value {
    let mut cmd = Command::new(o.python);
    cmd.args(["-m", "kvwire.ab", "--out"]).arg(o.out);
    cmd.arg("--arms").args(&ARMS[1..]);
    if o.quick {
        cmd.arg("--quick");
    }
    if let Some(m) = o.model {
        cmd.args(["--model", m]);
        cmd.args([
            "--tensor-parallel-size",
            &o.tensor_parallel_size.to_string(),
        ]);
    }
    let status = cmd
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .status();
    let ab_json = o.out.join("ab.json");
    let ab = std::fs::read_to_string(&ab_json)
        .map_err(|e| format!("{}: {e}", ab_json.display()))
        .and_then(|t| {
            serde_json::from_str::<Value>(&t).map_err(|e| format!("{}: {e}", ab_json.display()))
        });
    match (status, ab) {
        (Ok(s), Ok(ab)) => {
            let mut v = summarize(&ab);
            v["ab_exit"] = json!(s.code());
            v["ab_json"] = json!(ab_json);
            if !s.success() {
                v["status"] = json!("failed");
            }
            v
        }
        (Err(e), _) => {
            json!({"status": "failed", "error": format!("cannot run {}: {e}", o.python.display())})
        }
        (Ok(s), Err(e)) => {
            json!({"status": "failed", "error": format!("python -m kvwire.ab exited with {s}: {e}")})
        }
    }
}

fn ms(v: &Value) -> Option<f64> {
    v.as_f64().map(|s| s * 1e3)
}

/// One arm's figures (ms and CPU seconds), or its status when it did not run.
fn arm_row(a: &Value) -> Value {
    if a["status"] != "ran" {
        return json!({"arm": a["arm"], "status": a["status"], "error": a["error"]});
    }
    let o = &a["replay"]["overall"];
    let e = &a["engine"]["main"];
    let equal = &a["outputs_equal_single"];
    json!({
        "arm": a["arm"], "status": "ran",
        "requests": o["requests"], "errors": o["errors"],
        "outputs_equal_single": equal["equal"] == equal["of"] && equal["reference"] == true,
        "ttft_p50_ms": ms(&o["ttft_s"]["p50"]), "ttft_p90_ms": ms(&o["ttft_s"]["p90"]),
        "tpot_p50_ms": ms(&o["tpot_s"]["p50"]), "tpot_p90_ms": ms(&o["tpot_s"]["p90"]),
        "step_p50_ms": ms(&e["steps"]["p50_s"]), "step_p90_ms": ms(&e["steps"]["p90_s"]),
        "busy_steps": e["steps"]["count"],
        "cpu_s": e["cpu"]["total_s"], "threads": e["cpu"]["threads"],
        "top_threads": e["cpu"]["by_thread"].as_array().map(|t| t.iter().take(4).cloned().collect::<Vec<_>>()),
    })
}

const COMPARED: [&str; 7] = [
    "ttft_p50_ms",
    "ttft_p90_ms",
    "tpot_p50_ms",
    "tpot_p90_ms",
    "step_p50_ms",
    "step_p90_ms",
    "cpu_s",
];

/// The serving tax from an `ab.json`: each kv_both arm's figures, and their differences and
/// ratios to the no-connector arm's of the same run.
pub fn summarize(ab: &Value) -> Value {
    let arms = ab["arms"].as_array().cloned().unwrap_or_default();
    let find = |name: &str| arms.iter().find(|a| a["arm"] == name).map(arm_row);
    let Some(base) = find(ARMS[0]).filter(|b| b["status"] == "ran") else {
        return json!({"status": "failed", "error": "the no-connector arm did not run"});
    };
    let mut rows = vec![base.clone()];
    for name in &ARMS[1..] {
        let Some(mut r) = find(name) else {
            rows.push(json!({"arm": name, "status": "missing"}));
            continue;
        };
        if r["status"] == "ran" {
            let mut delta = serde_json::Map::new();
            let mut ratio = serde_json::Map::new();
            for k in COMPARED {
                if let (Some(x), Some(b)) = (r[k].as_f64(), base[k].as_f64()) {
                    delta.insert(k.into(), json!(x - b));
                    if b > 0.0 {
                        ratio.insert(k.into(), json!(x / b));
                    }
                }
            }
            r["minus_single"] = Value::Object(delta);
            r["over_single"] = Value::Object(ratio);
        }
        rows.push(r);
    }
    json!({
        "status": "ok", "requests": ab["requests"], "model": ab["model"], "quick": ab["quick"],
        "method": "one agentic trace replayed (python -m kvwire.replay) against each server in turn, \
                   no transfer firing; TTFT/TPOT from the client; step = interval between consecutive \
                   busy engine-core steps (stand-in step events); CPU = every thread of the server's \
                   process group during the replay (/proc)",
        "arms": rows,
    })
}

fn cell(v: &Value) -> String {
    v.as_f64().map_or("-".into(), |x| format!("{x:.2}"))
}

fn signed(v: &Value) -> String {
    v.as_f64().map_or("-".into(), |x| format!("{x:+.2}"))
}

/// The table of [`summarize`]'s result.
pub fn table(s: &Value) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    if s["status"] != "ok" {
        let _ = writeln!(
            out,
            "\nServing tax (real vllm serve): FAILED: {}",
            s["error"].as_str().unwrap_or("see above")
        );
        return out;
    }
    let _ = writeln!(
        out,
        "\nServing tax: real `vllm serve` processes, {} requests each, model {}; no transfer firing \
         (ms; CPU = s of every server thread; [kv_both - single, kv_both / single])",
        s["requests"],
        s["model"].as_str().unwrap_or("?")
    );
    let _ = writeln!(
        out,
        "  {:<17} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>6}",
        "arm", "TTFT50", "TTFT90", "TPOT50", "TPOT90", "step50", "step90", "CPU s", "thr"
    );
    for r in s["arms"].as_array().into_iter().flatten() {
        let arm = r["arm"].as_str().unwrap_or("?");
        if r["status"] != "ran" {
            let _ = writeln!(
                out,
                "  {arm:<17} {}: {}",
                r["status"].as_str().unwrap_or("?").to_uppercase(),
                r["error"].as_str().unwrap_or("")
            );
            continue;
        }
        let _ = writeln!(
            out,
            "  {:<17} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>6}{}",
            arm,
            cell(&r["ttft_p50_ms"]),
            cell(&r["ttft_p90_ms"]),
            cell(&r["tpot_p50_ms"]),
            cell(&r["tpot_p90_ms"]),
            cell(&r["step_p50_ms"]),
            cell(&r["step_p90_ms"]),
            cell(&r["cpu_s"]),
            r["threads"],
            if r["outputs_equal_single"] == true && r["errors"] == 0 {
                ""
            } else {
                "  (errors or outputs unlike single's)"
            }
        );
        if r.get("minus_single").is_some() {
            let d = |k: &str| {
                format!(
                    "{} x{}",
                    signed(&r["minus_single"][k]),
                    cell(&r["over_single"][k])
                )
            };
            let _ = writeln!(
                out,
                "    vs single: TTFT p50 {}, p90 {}; TPOT p50 {}, p90 {}; step p50 {}, p90 {}; CPU {}",
                d("ttft_p50_ms"),
                d("ttft_p90_ms"),
                d("tpot_p50_ms"),
                d("tpot_p90_ms"),
                d("step_p50_ms"),
                d("step_p90_ms"),
                d("cpu_s")
            );
        }
        let top: Vec<String> = r["top_threads"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                format!(
                    "{} {} ({})",
                    t["name"].as_str().unwrap_or("?"),
                    cell(&t["cpu_s"]),
                    t["threads"]
                )
            })
            .collect();
        if !top.is_empty() {
            let _ = writeln!(out, "    top threads (CPU s): {}", top.join(", "));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arm(name: &str, ttft: f64, step: f64, cpu: f64) -> Value {
        json!({
            "arm": name, "status": "ran",
            "replay": {"overall": {"requests": 12, "errors": 0,
                "ttft_s": {"p50": ttft, "p90": 2.0 * ttft}, "tpot_s": {"p50": 0.01, "p90": 0.02}}},
            "engine": {"main": {"steps": {"p50_s": step, "p90_s": 2.0 * step, "count": 100},
                                "cpu": {"total_s": cpu, "threads": 9,
                                        "by_thread": [{"name": "VLLM::EngineCor/VLLM::EngineCor", "cpu_s": cpu, "threads": 1}]}}},
            "outputs_equal_single": {"equal": 12, "of": 12, "reference": true},
        })
    }

    #[test]
    fn deltas_and_ratios_are_against_the_no_connector_arm() {
        let ab = json!({"requests": 12, "model": "stand-in", "quick": true, "arms": [
            arm("single", 0.100, 0.002, 4.0),
            arm("kv_both-mooncake", 0.150, 0.003, 6.0),
            arm("kv_both-kvwire", 0.110, 0.0025, 5.0),
        ]});
        let s = summarize(&ab);
        assert_eq!(s["status"], "ok");
        let rows = s["arms"].as_array().unwrap();
        assert_eq!(rows.len(), 3);
        assert!(rows[0].get("minus_single").is_none());
        let kv = &rows[2];
        assert_eq!(kv["arm"], "kv_both-kvwire");
        assert!((kv["minus_single"]["ttft_p50_ms"].as_f64().unwrap() - 10.0).abs() < 1e-9);
        assert!((kv["over_single"]["ttft_p90_ms"].as_f64().unwrap() - 1.1).abs() < 1e-9);
        assert!((kv["over_single"]["step_p50_ms"].as_f64().unwrap() - 1.25).abs() < 1e-9);
        assert!((kv["minus_single"]["cpu_s"].as_f64().unwrap() - 1.0).abs() < 1e-9);
        let t = table(&s);
        assert!(
            t.contains("kv_both-mooncake") && t.contains("+10.00 x1.10"),
            "{t}"
        );
    }

    #[test]
    fn a_skipped_arm_is_said_and_a_missing_baseline_fails() {
        let ab = json!({"requests": 12, "model": "stand-in", "quick": true, "arms": [
            arm("single", 0.1, 0.002, 4.0),
            {"arm": "kv_both-mooncake", "status": "SKIPPED", "error": "not installed"},
            arm("kv_both-kvwire", 0.1, 0.002, 4.0),
        ]});
        let t = table(&summarize(&ab));
        assert!(t.contains("SKIPPED: not installed"), "{t}");
        let none = summarize(&json!({"arms": [arm("kv_both-kvwire", 0.1, 0.002, 4.0)]}));
        assert_eq!(none["status"], "failed");
        assert!(table(&none).contains("FAILED"));
    }
}

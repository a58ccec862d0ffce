//! `kvwire-bench tax`: the always-on kv_both overhead with no transfer pending, each figure next
//! to its baseline.
//!
//! * **Rust level** (runs anywhere): the connector core's per-step cost at 1k and 1M cached
//!   blocks ([`core`]) and the CPU used by idle kvwire engines ([`idle`]).
//! * **vLLM level** (needs the Python venvs of `tests/python/setup.sh`): for every
//!   interpreter given with `--python` (default: the venvs under `~/.cache/kvwire-py`), the
//!   scheduler side (`tax_sched.py`: vLLM's real v1 scheduler on CPU with no connector, an inert
//!   connector, KvwireConnector and MooncakeConnector) and the worker side (`tax_worker.py`: a CPU
//!   stand-in for the model runner with each connector's worker half, idle and with transfers in
//!   flight for other requests). The scripts are compiled into this binary and written to a
//!   temporary directory at run time. Without a usable interpreter these parts are SKIPPED,
//!   loudly (stderr, JSON and table), and the Rust parts still run.
//! * **Block pool**: the capacity held by kv_both under the agentic mix is measured by the clock
//!   bench; `--clock-json` reads it from that bench's JSON (each cell's `pool` object).
//! * **Serving level** (`--servers`, minutes): real `vllm serve` processes with no connector,
//!   kv_both MooncakeConnector and kv_both KvwireConnector under one request stream ([`serving`]).

pub mod core;
pub mod idle;
pub mod serving;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

const SCRIPTS: [(&str, &str); 4] = [
    ("tax_noop.py", include_str!("../../python/tax_noop.py")),
    ("tax_sched.py", include_str!("../../python/tax_sched.py")),
    ("tax_worker.py", include_str!("../../python/tax_worker.py")),
    ("tax_peer.py", include_str!("../../python/tax_peer.py")),
];

/// What to run when vLLM is missing.
pub use kvwire_bench::venvs::{default_pythons, INSTALL_HINT};
/// The scheduler-side target: kvwire costs no more than the inert connector plus this, µs/step.
pub const TARGET_OVER_NOOP_US: f64 = 2.0;
/// A Python part is killed after this long.
const CHILD_DEADLINE: Duration = Duration::from_secs(900);

/// Options of `kvwire-bench tax`.
#[derive(Args, Debug, Clone)]
pub struct TaxArgs {
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// A short run (tens of seconds; figures are noisier): fewer steps, 1k and 16k cached blocks
    /// in vLLM instead of 1k and 1M, and only the first venv found when --python is not given.
    #[arg(long)]
    pub quick: bool,
    /// Python interpreter of a venv with vLLM and kvwire (repeatable) [default: the venvs under
    /// $KVWIRE_PY_CACHE or ~/.cache/kvwire-py].
    #[arg(long, value_name = "PATH")]
    pub python: Vec<PathBuf>,
    /// The clock bench's JSON, for the block-pool figures (each cell's `pool` object).
    #[arg(long, value_name = "FILE")]
    pub clock_json: Option<PathBuf>,
    /// Skip the vLLM scheduler and worker parts (the Rust parts only, and --servers if given).
    #[arg(long)]
    pub no_vllm: bool,
    /// Do not draw a progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Also measure the tax at serving level: one request stream against real `vllm serve`
    /// processes with no connector, kv_both MooncakeConnector and kv_both KvwireConnector
    /// (`python -m kvwire.ab`, in the first venv; minutes).
    #[arg(long)]
    pub servers: bool,
    /// Directory for the serving part's ab.json and server logs.
    #[arg(long, default_value = "kvwire-tax-servers")]
    pub servers_out: PathBuf,
    /// A real model for the serving part (GPUs) instead of the CPU stand-in.
    #[arg(long)]
    pub model: Option<String>,
    /// Tensor parallel size of the serving part's servers (with --model).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: u32,
}

/// A child Python run: stderr lines starting with `[tax` go to the progress bar; the whole
/// stderr is kept for failures.
fn run_child(py: &Path, args: &[String], dir: &Path, bar: &ProgressBar) -> Result<(), String> {
    let mut child = Command::new(py)
        .args(args)
        .current_dir(dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("GLOG_minloglevel", "2")
        .env("TOKENIZERS_PARALLELISM", "false")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", py.display()))?;
    let log = Arc::new(Mutex::new(Vec::<String>::new()));
    let reader = child.stderr.take().map(|err| {
        let log = Arc::clone(&log);
        let bar = bar.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if let Some(msg) = line.strip_prefix("[tax ") {
                    bar.set_message(msg.to_string());
                    bar.suspend(|| eprintln!("  [tax {msg}"));
                }
                if let Ok(mut l) = log.lock() {
                    l.push(line);
                }
            }
        })
    });
    let t0 = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Ok(s),
            Ok(None) if t0.elapsed() > CHILD_DEADLINE => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!("killed after {} s", CHILD_DEADLINE.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => break Err(format!("wait: {e}")),
        }
    };
    if let Some(r) = reader {
        let _ = r.join();
    }
    let tail = || {
        let l = log.lock().map(|l| l.clone()).unwrap_or_default();
        let n = l.len().saturating_sub(25);
        l[n..].join("\n")
    };
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("{} exited with {s}:\n{}", args[0], tail())),
        Err(e) => Err(format!("{}: {e}:\n{}", args[0], tail())),
    }
}

/// `python -c "import vllm, kvwire"`: the vLLM version, or why this interpreter cannot be used.
fn probe_python(py: &Path) -> Result<(String, bool), String> {
    let code = "import vllm, kvwire\ntry:\n    import mooncake.engine\n    m = 1\nexcept Exception:\n    m = 0\nprint(vllm.__version__, m)";
    let out = Command::new(py)
        .args(["-c", code])
        .env("GLOG_minloglevel", "2")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", py.display()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("").to_string();
        return Err(format!(
            "{}: import vllm, kvwire failed: {last}",
            py.display()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or("").to_string();
    let mut it = line.split_whitespace();
    let ver = it.next().unwrap_or("?").to_string();
    Ok((ver, it.next() == Some("1")))
}

fn read_json(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The vLLM parts for one interpreter.
fn run_vllm(py: &Path, dir: &Path, quick: bool, bar: &ProgressBar) -> Value {
    let (version, has_mooncake) = match probe_python(py) {
        Ok(v) => v,
        Err(reason) => {
            eprintln!(
                "SKIPPED: vLLM tax with {}: {reason} (install: {INSTALL_HINT})",
                py.display()
            );
            return json!({"python": py, "status": "SKIPPED", "reason": reason,
                          "install": INSTALL_HINT});
        }
    };
    let mut notes = Vec::new();
    if !has_mooncake {
        let n = format!(
            "SKIPPED: MooncakeConnector with vLLM {version}: mooncake-transfer-engine-non-cuda is \
             not installed in this venv (install: {INSTALL_HINT})"
        );
        eprintln!("{n}");
        notes.push(n);
    }
    let sched_out = dir.join(format!("sched-{version}.json"));
    let worker_out = dir.join(format!("worker-{version}.json"));
    let mut sched_args: Vec<String> = vec!["tax_sched.py".into(), "--out".into()];
    sched_args.push(sched_out.to_string_lossy().into_owned());
    let conns = if has_mooncake {
        "none,noop,kvwire,mooncake"
    } else {
        "none,noop,kvwire"
    };
    sched_args.extend(["--connectors".into(), conns.into()]);
    // Quick: tens of seconds. Full: 1k and 1M cached blocks, enough rounds for paired deltas.
    let (sched_opts, worker_opts) = if quick {
        (
            "--blocks 1000,16000 --rounds 3 --round-steps 20 --warmup 10",
            "--rounds 2 --chunk-steps 5 --probe-s 0.2 --step-us 2000",
        )
    } else {
        (
            "--blocks 1000,1000000 --rounds 6 --round-steps 50 --warmup 20",
            "--rounds 8 --chunk-steps 10 --probe-s 0.5",
        )
    };
    sched_args.extend(sched_opts.split(' ').map(String::from));
    let mut worker_args: Vec<String> = vec!["tax_worker.py".into(), "--out".into()];
    worker_args.push(worker_out.to_string_lossy().into_owned());
    worker_args.extend(worker_opts.split(' ').map(String::from));
    bar.set_message(format!("vLLM {version}: scheduler side"));
    let sched = run_child(py, &sched_args, dir, bar).and_then(|()| read_json(&sched_out));
    bar.inc(1);
    bar.set_message(format!("vLLM {version}: worker side"));
    let worker = run_child(py, &worker_args, dir, bar).and_then(|()| read_json(&worker_out));
    bar.inc(1);
    let mut failed = false;
    let mut part = |r: Result<Value, String>, what: &str| match r {
        Ok(v) => v,
        Err(e) => {
            eprintln!("kvwire-bench tax: vLLM {version} {what} side failed: {e}");
            failed = true;
            json!({"status": "failed", "error": e})
        }
    };
    let sched = part(sched, "scheduler");
    let worker = part(worker, "worker");
    json!({
        "python": py, "vllm": version, "status": if failed { "failed" } else { "ok" },
        "mooncake_installed": has_mooncake, "notes": notes,
        "sched": sched, "worker": worker,
    })
}

/// Every object with a `pool` object inside the clock JSON, labelled by its policy/send mode
/// (and the scenario of an enclosing object when there is one).
fn pool_cells(v: &Value, scenario: Option<&str>, out: &mut Vec<Value>) {
    match v {
        Value::Object(m) => {
            let scen = m
                .get("scenario")
                .and_then(Value::as_str)
                .or(scenario)
                .map(str::to_string);
            if let Some(pool) = m.get("pool").filter(|p| p.is_object()) {
                out.push(json!({
                    "scenario": scen, "policy": m.get("policy"), "send_mode": m.get("send_mode"),
                    "pool": pool,
                }));
            }
            for (k, x) in m {
                if k != "pool" {
                    pool_cells(x, scen.as_deref(), out);
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| pool_cells(x, scenario, out)),
        _ => {}
    }
}

fn pool_section(clock: Option<&Path>) -> Value {
    let Some(path) = clock else {
        return json!({"status": "not measured", "reason": "no --clock-json given"});
    };
    match read_json(path) {
        Ok(v) => {
            let mut cells = Vec::new();
            pool_cells(&v, None, &mut cells);
            if cells.is_empty() {
                json!({"status": "not measured", "source": path,
                       "reason": "the clock JSON has no per-cell pool object"})
            } else {
                json!({"status": "measured", "source": path, "baseline": "no connector: 0 blocks held",
                       "cells": cells})
            }
        }
        Err(e) => json!({"status": "not measured", "source": path, "reason": e}),
    }
}

/// Checks of the scheduler-side target: kvwire − noop ≤ [`TARGET_OVER_NOOP_US`] per cell.
fn target_checks(vllm: &[Value]) -> Vec<Value> {
    let mut out = Vec::new();
    for v in vllm {
        let Some(cells) = v["sched"]["cells"].as_array() else {
            continue;
        };
        for c in cells {
            if let Some(d) = c["results"]["kvwire"]["delta_vs_noop_us"].as_f64() {
                out.push(json!({
                    "vllm": v["vllm"], "mode": c["mode"], "live": c["live"], "blocks": c["blocks"],
                    "kvwire_minus_noop_us": d, "met": d <= TARGET_OVER_NOOP_US,
                }));
            }
        }
    }
    out
}

fn fmt_delta(r: &Value, key: &str) -> String {
    match (
        r[format!("delta_{key}_us")].as_f64(),
        r[format!("delta_{key}_min_us")].as_f64(),
        r[format!("delta_{key}_max_us")].as_f64(),
    ) {
        (Some(d), Some(lo), Some(hi)) => format!("{d:+.1} [{lo:+.1}..{hi:+.1}]"),
        _ => "-".into(),
    }
}

fn blocks_label(b: u64) -> String {
    if b >= 1_000_000 && b % 1_000_000 == 0 {
        format!("{}M", b / 1_000_000)
    } else if b >= 1000 && b % 1000 == 0 {
        format!("{}k", b / 1000)
    } else {
        b.to_string()
    }
}

/// The human-readable tables of a result.
pub fn table(r: &Value) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "kv_both tax (no transfer pending unless said; each figure next to its baseline)\n"
    );
    let _ = writeln!(
        s,
        "Connector core, per step (Rust, in-process Instant timing; target <= 50 us, flat in cached blocks):"
    );
    let _ = writeln!(s, "  side  cached   live   median ns   p99 ns");
    for c in r["core"]["results"].as_array().into_iter().flatten() {
        let _ = writeln!(
            s,
            "  {:<4}  {:>6}  {:>5}  {:>10.0}  {:>7.0}",
            c["side"].as_str().unwrap_or("?"),
            blocks_label(c["cached_blocks"].as_u64().unwrap_or(0)),
            c["live"].to_string(),
            c["median_ns"].as_f64().unwrap_or(0.0),
            c["p99_ns"].as_f64().unwrap_or(0.0)
        );
    }
    let e = &r["engine_idle"];
    if e["cpu_ms"].is_number() {
        let _ = writeln!(
            s,
            "\nIdle kvwire engines ({} engines, {} connected, 1 MiB region each): {} threads used {:.2} ms CPU \
             in {:.1} s ({:.3}% of a core; baseline: no engine, 0)",
            e["engines"],
            e["transport"].as_str().unwrap_or("?"),
            e["threads"],
            e["cpu_ms"].as_f64().unwrap_or(0.0),
            e["interval_s"].as_f64().unwrap_or(0.0),
            e["cpu_pct"].as_f64().unwrap_or(0.0)
        );
    } else {
        let _ = writeln!(s, "\nIdle kvwire engines: FAILED: {}", e["error"]);
    }
    if r["vllm"].as_array().is_none_or(Vec::is_empty) {
        for m in r["skipped"].as_array().into_iter().flatten() {
            let _ = writeln!(s, "\nSKIPPED: {}", m.as_str().unwrap_or("?"));
        }
    }
    for v in r["vllm"].as_array().into_iter().flatten() {
        if v["status"] == "SKIPPED" {
            let _ = writeln!(
                s,
                "\nvLLM ({}): SKIPPED: {} (install: {INSTALL_HINT})",
                v["python"].as_str().unwrap_or("?"),
                v["reason"].as_str().unwrap_or("?")
            );
            continue;
        }
        let ver = v["vllm"].as_str().unwrap_or("?");
        for n in v["notes"].as_array().into_iter().flatten() {
            let _ = writeln!(s, "\n{}", n.as_str().unwrap_or(""));
        }
        if let Some(cells) = v["sched"]["cells"].as_array() {
            let _ = writeln!(
                s,
                "\nvLLM {ver} scheduler side, us per step (schedule()+update_from_output(), median over steps; \
                 delta vs none = paired per-round medians, median [min..max] over rounds):"
            );
            let _ = writeln!(
                s,
                "  {:<18} {:>8} {:>24} {:>24} {:>24} {:>24}",
                "cell", "none", "noop - none", "kvwire - none", "mooncake - none", "kvwire - noop"
            );
            for c in cells {
                let res = &c["results"];
                let label = format!(
                    "{} {} @ {}",
                    c["mode"].as_str().unwrap_or("?"),
                    c["live"],
                    blocks_label(c["blocks"].as_u64().unwrap_or(0))
                );
                let none = res["none"]["median_us"]
                    .as_f64()
                    .map_or("-".into(), |x| format!("{x:.1}"));
                let _ = writeln!(
                    s,
                    "  {:<18} {:>8} {:>24} {:>24} {:>24} {:>24}",
                    label,
                    none,
                    fmt_delta(&res["noop"], "vs_none"),
                    fmt_delta(&res["kvwire"], "vs_none"),
                    fmt_delta(&res["mooncake"], "vs_none"),
                    fmt_delta(&res["kvwire"], "vs_noop")
                );
            }
            for (k, e) in v["sched"]["errors"].as_object().into_iter().flatten() {
                let _ = writeln!(
                    s,
                    "  {k}: could not be built: {}",
                    e.as_str().unwrap_or("?")
                );
            }
        } else {
            let _ = writeln!(
                s,
                "\nvLLM {ver} scheduler side: FAILED: {}",
                v["sched"]["error"]
            );
        }
        if let Some(runs) = v["worker"]["runs"].as_array() {
            let w = &v["worker"];
            let _ = writeln!(
                s,
                "\nvLLM {ver} worker side (CPU stand-in, {} layers, ~{} us GIL-holding work per step; base = \
                 same loop without connector hooks, interleaved; in flight = {} MB/s offered of real writes to \
                 another process on loopback):",
                w["layers"],
                w["step_work_us"],
                w["inflight_offered_mb_s"]
            );
            let _ = writeln!(
                s,
                "  {:<9} {:<9} {:>10} {:>10} {:>18} {:>8} {:>9} {:>10} {:>14}",
                "connector",
                "state",
                "steps/s",
                "base",
                "lost % [min..max]",
                "threads",
                "CPU %",
                "driver %",
                "GIL p50/p99 us"
            );
            for x in runs {
                let _ = writeln!(
                    s,
                    "  {:<9} {:<9} {:>10.1} {:>10.1} {:>18} {:>8} {:>9.3} {:>10} {:>14}{}",
                    x["connector"].as_str().unwrap_or("?"),
                    x["state"].as_str().unwrap_or("?"),
                    x["steps_per_s"].as_f64().unwrap_or(0.0),
                    x["base_steps_per_s"].as_f64().unwrap_or(0.0),
                    format!(
                        "{:+.1} [{:+.0}..{:+.0}]",
                        x["steps_lost_pct"].as_f64().unwrap_or(0.0),
                        x["steps_lost_min_pct"].as_f64().unwrap_or(0.0),
                        x["steps_lost_max_pct"].as_f64().unwrap_or(0.0)
                    ),
                    x["threads"],
                    x["threads_cpu_pct"].as_f64().unwrap_or(0.0),
                    x["driver_cpu_pct"]
                        .as_f64()
                        .map_or("-".into(), |d| format!("{d:.2}")),
                    format!(
                        "{:.0}/{:.0}",
                        x["gil_probe"]["p50_us"].as_f64().unwrap_or(0.0),
                        x["gil_probe"]["p99_us"].as_f64().unwrap_or(0.0)
                    ),
                    match x["verified"].as_bool() {
                        Some(true) => format!(
                            "  ({:.0} MB/s moved, bytes verified)",
                            x["moved_mb_s"].as_f64().unwrap_or(0.0)
                        ),
                        Some(false) => "  (bytes NOT verified)".into(),
                        None => String::new(),
                    }
                );
            }
            let _ = writeln!(
                s,
                "  GIL probe (wake-up lateness of a thread sleeping 1 ms, main thread asleep), no \
                 connector: p50 {:.0} us, p99 {:.0} us",
                w["gil_probe_none"]["p50_us"].as_f64().unwrap_or(0.0),
                w["gil_probe_none"]["p99_us"].as_f64().unwrap_or(0.0)
            );
            for n in w["notes"].as_array().into_iter().flatten() {
                let _ = writeln!(s, "  note: {}", n.as_str().unwrap_or(""));
            }
        } else {
            let _ = writeln!(
                s,
                "\nvLLM {ver} worker side: FAILED: {}",
                v["worker"]["error"]
            );
        }
    }
    let checks = r["target"]["checks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if !checks.is_empty() {
        let met = checks.iter().filter(|c| c["met"] == true).count();
        let _ = writeln!(
            s,
            "\nTarget kvwire <= noop + {TARGET_OVER_NOOP_US} us per step: met in {met} of {} cells{}",
            checks.len(),
            checks
                .iter()
                .filter(|c| c["met"] != true)
                .map(|c| format!(
                    "; NOT met: vLLM {} {} {} @ {} ({:+.1} us)",
                    c["vllm"].as_str().unwrap_or("?"),
                    c["mode"].as_str().unwrap_or("?"),
                    c["live"],
                    blocks_label(c["blocks"].as_u64().unwrap_or(0)),
                    c["kvwire_minus_noop_us"].as_f64().unwrap_or(0.0)
                ))
                .collect::<String>()
        );
    }
    let p = &r["pool"];
    if p["status"] == "measured" {
        let _ = writeln!(
            s,
            "\nBlock pool (clock bench, agentic mix): capacity held by kv_both, time-weighted mean (p99) \
             fraction of the pool; baseline: no connector, 0"
        );
        for c in p["cells"].as_array().into_iter().flatten() {
            let side = |k: &str| {
                format!(
                    "{:.2}% ({:.2}%)",
                    100.0 * c["pool"][k]["lost_frac_mean"].as_f64().unwrap_or(0.0),
                    100.0 * c["pool"][k]["lost_frac_p99"].as_f64().unwrap_or(0.0)
                )
            };
            let _ = writeln!(
                s,
                "  {:<10} {:<6} {:<10}  P {:>18}  D {:>18}",
                c["scenario"].as_str().unwrap_or(""),
                c["policy"].as_str().unwrap_or("?"),
                c["send_mode"].as_str().unwrap_or("?"),
                side("p"),
                side("d")
            );
        }
    } else {
        let _ = writeln!(
            s,
            "\nBlock pool: not measured ({})",
            p["reason"].as_str().unwrap_or("?")
        );
    }
    s
}

/// Runs the bench; prints the tables; writes the JSON.
pub fn run(a: &TaxArgs) -> ExitCode {
    let pythons = if a.no_vllm {
        Vec::new()
    } else if a.python.is_empty() {
        let mut d = default_pythons();
        if a.quick {
            d.truncate(1);
        }
        d
    } else {
        a.python.clone()
    };
    let mut skipped = Vec::new();
    if a.no_vllm {
        skipped.push("vLLM parts: --no-vllm".to_string());
    } else if pythons.is_empty() {
        let m = format!(
            "vLLM parts: no venv found under ~/.cache/kvwire-py (install: {INSTALL_HINT}, or give --python)"
        );
        eprintln!("SKIPPED: {m}");
        skipped.push(m);
    }
    let bar = if a.no_progress {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(2 + 2 * pythons.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("tax [{bar:20}] {pos}/{len} {elapsed} {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut ok = true;

    bar.set_message("idle kvwire engines");
    let idle_s = if a.quick { 1.0 } else { 5.0 };
    let engine_idle = match idle::run(Duration::from_secs_f64(idle_s)) {
        Ok(e) => serde_json::to_value(e).unwrap_or(Value::Null),
        Err(e) => {
            eprintln!("kvwire-bench tax: idle engines: {e}");
            ok = false;
            json!({"error": e})
        }
    };
    bar.inc(1);

    bar.set_message("connector core step");
    let steps = if a.quick { 2_000 } else { 20_000 };
    let core = core::run(&[1_000, 1_000_000], &[10, 1_000], steps);
    bar.inc(1);

    let dir = std::env::temp_dir().join(format!("kvwire-tax-{}", std::process::id()));
    let mut vllm = Vec::new();
    if !pythons.is_empty() {
        let written = std::fs::create_dir_all(&dir).and_then(|()| {
            SCRIPTS
                .iter()
                .try_for_each(|(n, text)| std::fs::write(dir.join(n), text))
        });
        match written {
            Err(e) => {
                eprintln!(
                    "kvwire-bench tax: cannot write the scripts to {}: {e}",
                    dir.display()
                );
                ok = false;
            }
            Ok(()) => {
                for py in &pythons {
                    let v = run_vllm(py, &dir, a.quick, &bar);
                    if v["status"] == "failed" {
                        ok = false;
                    }
                    if v["status"] == "SKIPPED" {
                        skipped.push(format!(
                            "vLLM parts with {}: {}",
                            py.display(),
                            v["reason"].as_str().unwrap_or("?")
                        ));
                        bar.inc(2);
                    }
                    vllm.push(v);
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    bar.finish_and_clear();
    // The serving part runs with --no-vllm too (that flag skips the scheduler and worker parts).
    let serving_py = a
        .python
        .first()
        .cloned()
        .or_else(|| default_pythons().into_iter().next());
    let servers = match (a.servers, serving_py.as_ref()) {
        (false, _) => json!({"status": "not measured", "reason": "no --servers given"}),
        (true, None) => json!({"status": "SKIPPED", "reason": "no vLLM venv (see above)"}),
        (true, Some(py)) => {
            eprintln!(
                "kvwire-bench tax: serving level with {} (logs under {})",
                py.display(),
                a.servers_out.display()
            );
            let v = serving::run(&serving::ServingOpts {
                python: py,
                out: &a.servers_out,
                quick: a.quick,
                model: a.model.as_deref(),
                tensor_parallel_size: a.tensor_parallel_size,
            });
            ok &= v["status"] == "ok";
            v
        }
    };
    let checks = target_checks(&vllm);
    let result = json!({
        "schema": "kvwire.tax/1",
        "quick": a.quick,
        "host": {
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "loadavg": std::fs::read_to_string("/proc/loadavg").map(|s| s.trim().to_string()).unwrap_or_default(),
        },
        "core": {
            "method": "connector core (kvwire-connector DSide/PSide) driven as the glue drives it per engine step; \
                       each step timed with Instant in-process; 4 requests change state per step",
            "target_us": 50.0,
            "results": core,
        },
        "engine_idle": engine_idle,
        "vllm": vllm,
        "skipped": skipped,
        "install": INSTALL_HINT,
        "target": {"kvwire_minus_noop_max_us": TARGET_OVER_NOOP_US, "checks": checks},
        "pool": pool_section(a.clock_json.as_deref()),
        "servers": servers,
    });
    print!("{}", table(&result));
    match result["servers"]["status"].as_str() {
        Some("ok" | "failed") => print!("{}", serving::table(&result["servers"])),
        Some("SKIPPED") => {
            println!("\nServing tax: SKIPPED: no vLLM venv (install: {INSTALL_HINT})")
        }
        _ => {}
    }
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&result).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("kvwire-bench tax: cannot write {}: {e}", path.display());
            return ExitCode::from(1);
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

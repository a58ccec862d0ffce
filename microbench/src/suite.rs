//! `kvwire-bench report`: the loopback A/B report in one command.
//!
//! Runs, in this order, each as a child process of this same binary so every bench keeps its
//! own target processes, progress bar and exit code:
//!
//! 1. `transfer` — the engine on loopback (serial, batch, KV-layer, read-back; every byte
//!    verified), JSON in `transfer.json`;
//! 2. `layerwise` — exposed tail of `whole` vs `layerwise` layer streams, `layerwise.json`;
//! 3. `clock` — the decode_sent → first_token clock for eager|lazy|jit|land ×
//!    whole|layerwise, with D as an engine (TTFT/TPOT, preemptions, prefix cache), `clock.json`,
//!    `clock.png` and the timeline records `timeline.jsonl`;
//! 4. `calibrate` — the router cost model fitted on that timeline, `cost.json`, with its
//!    held-out error next to the seed model's;
//! 5. `tax` — the always-on kv_both tax (connector core per step, idle engine CPU, vLLM's
//!    scheduler and worker sides per connector, the block-pool figures read from
//!    `clock.json`), `tax.json`; report.md's "kv_both tax" section;
//! 6. `ab --quick` — the users' A/B with real `vllm serve` processes on CPU (stand-in model):
//!    single instance, kv_both MooncakeConnector and KvwireConnector, 1P1D per policy × send
//!    mode, one trace replayed against each; `ab/ab.json`, `ab/ab.md`, `ab/ab.png`, and the
//!    cost model fitted on its P/D arms' timelines, `ab/cost.json` and `ab/calibration.txt`.
//!
//! The vLLM parts (tax's and ab) need the venvs of `tests/python/setup.sh`: when there are
//! none they are installed first (announced with their size; `--no-vllm` skips those parts,
//! and report.md says SKIPPED for them). `report.md` collects what each step printed (its
//! tables) and lists the files. A step that fails is reported as failed in `report.md` and
//! makes the command exit non-zero; the other steps still run. Nothing here needs RDMA, a GPU
//! or a service.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use clap::Args;

/// Options of `kvwire-bench report`.
#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// Directory for report.md and every JSON/PNG/JSONL file (created if missing).
    #[arg(long, default_value = "kvwire-report")]
    pub out: PathBuf,
    /// Shorter runs of every step (figures are noisier).
    #[arg(long)]
    pub quick: bool,
    /// Skip the vLLM parts (tax's vLLM figures and ab): nothing is installed.
    #[arg(long)]
    pub no_vllm: bool,
}

/// One step of the report: a subcommand of this binary and the files it writes.
struct Step {
    name: &'static str,
    args: Vec<String>,
    files: Vec<&'static str>,
}

fn steps(out: &Path, quick: bool, no_vllm: bool) -> Vec<Step> {
    let p = |f: &str| out.join(f).to_string_lossy().into_owned();
    let mut transfer = vec!["transfer".into(), "--json".into(), p("transfer.json")];
    let mut layerwise = vec!["layerwise".into(), "--json".into(), p("layerwise.json")];
    let mut clock = vec![
        "clock".into(),
        "--json".into(),
        p("clock.json"),
        "--png".into(),
        p("clock.png"),
        "--timeline-out".into(),
        p("timeline.jsonl"),
    ];
    let mut tax = vec![
        "tax".into(),
        "--json".into(),
        p("tax.json"),
        "--clock-json".into(),
        p("clock.json"),
    ];
    if no_vllm {
        tax.push("--no-vllm".into());
    }
    if quick {
        tax.push("--quick".into());
        transfer.push("--quick".into());
        layerwise.extend(["--rounds".into(), "2".into()]);
        clock.push("--quick".into());
    }
    vec![
        Step {
            name: "transfer",
            args: transfer,
            files: vec!["transfer.json"],
        },
        Step {
            name: "layerwise",
            args: layerwise,
            files: vec!["layerwise.json"],
        },
        Step {
            name: "clock",
            args: clock,
            files: vec!["clock.json", "clock.png", "timeline.jsonl"],
        },
        Step {
            name: "calibrate",
            args: vec![
                "calibrate".into(),
                "--timeline".into(),
                p("timeline.jsonl"),
                "--out".into(),
                p("cost.json"),
            ],
            files: vec!["cost.json"],
        },
        Step {
            name: "kv_both tax",
            args: tax,
            files: vec!["tax.json"],
        },
        Step {
            name: "ab",
            args: vec!["ab".into(), "--quick".into(), "--out".into(), p("ab")],
            files: vec![
                "ab/ab.json",
                "ab/ab.md",
                "ab/ab.png",
                "ab/cost.json",
                "ab/calibration.txt",
            ],
        },
    ]
}

/// Runs every step and writes `report.md`; the exit code is 0 only when every step passed.
pub fn run(a: &ReportArgs) -> ExitCode {
    if let Err(e) = std::fs::create_dir_all(&a.out) {
        eprintln!(
            "kvwire-bench report: cannot create {}: {e}",
            a.out.display()
        );
        return ExitCode::from(1);
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kvwire-bench report: cannot find this binary: {e}");
            return ExitCode::from(1);
        }
    };
    let mut md = String::new();
    let _ = writeln!(md, "# kvwire loopback A/B report\n");
    let _ = writeln!(
        md,
        "Host: {} cores; load average at start: {}. Every figure below was measured in this \
         run, on loopback (no RDMA, no GPU). GB/s = 1e9 bytes/s.\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/loadavg")
            .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_else(|_| "unknown".into())
    );
    let mut failed = Vec::new();
    let vllm = if a.no_vllm {
        Err("--no-vllm".to_string())
    } else {
        crate::venvs::ensure_pythons("kvwire-bench report").map(|_| ())
    };
    let all = steps(&a.out, a.quick, vllm.is_err());
    let n = all.len();
    for (i, s) in all.into_iter().enumerate() {
        if let (Err(why), "ab") = (&vllm, s.name) {
            let _ = writeln!(
                md,
                "## {}\n\nSKIPPED: it runs vLLM servers, and there is no vLLM venv ({why}; install: {}).\n",
                s.name,
                crate::venvs::INSTALL_HINT
            );
            eprintln!(
                "== report step {}/{n}: {}: SKIPPED ({why}) ==",
                i + 1,
                s.name
            );
            continue;
        }
        eprintln!("== report step {}/{n}: {} ==", i + 1, s.name);
        let t0 = Instant::now();
        // stdout is captured for report.md (and echoed); stderr (progress bars) goes through.
        let res = Command::new(&exe)
            .args(&s.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .output();
        let secs = t0.elapsed().as_secs_f64();
        let _ = writeln!(md, "## {}\n", s.name);
        let _ = writeln!(md, "`kvwire-bench {}` — {secs:.1} s\n", s.args.join(" "));
        match res {
            Ok(o) => {
                let text = String::from_utf8_lossy(&o.stdout);
                print!("{text}");
                let _ = writeln!(md, "```\n{}\n```\n", text.trim_end());
                if !o.status.success() {
                    failed.push(s.name);
                    let _ = writeln!(md, "**FAILED** ({}).\n", o.status);
                }
            }
            Err(e) => {
                failed.push(s.name);
                let _ = writeln!(md, "**FAILED**: could not start: {e}\n");
            }
        }
        for f in &s.files {
            let path = a.out.join(f);
            let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            if size == 0 {
                let _ = writeln!(md, "- `{f}`: missing");
            } else if f.ends_with(".png") {
                let _ = writeln!(md, "- `{f}` ({size} bytes)\n\n![{f}]({f})");
            } else {
                let _ = writeln!(md, "- `{f}` ({size} bytes)");
            }
        }
        md.push('\n');
    }
    let _ = writeln!(
        md,
        "## Not in this report\n\n- RDMA and CUDA figures need hardware.\n"
    );
    let report = a.out.join("report.md");
    if let Err(e) = std::fs::write(&report, md) {
        eprintln!(
            "kvwire-bench report: cannot write {}: {e}",
            report.display()
        );
        return ExitCode::from(1);
    }
    eprintln!("report: {}", report.display());
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("report: failed steps: {}", failed.join(", "));
        ExitCode::from(1)
    }
}

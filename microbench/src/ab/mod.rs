//! `kvwire-bench ab`: the users' A/B in one command.
//!
//! Runs `python -m kvwire.ab` (see its docs: the arms single, kv_both-mooncake,
//! kv_both-kvwire and 1P1D per reservation policy × send mode, each serving the same agentic
//! trace through real `vllm serve` processes) in the newest vLLM venv of
//! `tests/python/setup.sh` — installed first when there is none — and draws `ab.png` from the
//! `ab.json` it wrote. On this CPU machine the servers run kvwire's stand-in model; `--model` and
//! `--tensor-parallel-size` run a real model on GPUs. Then fits the router cost model on the P/D
//! arms' production timelines (`calibration`): `cost.json`, `calibration.txt`, and its held-out
//! error in `ab.json` and `ab.md`.

mod calibration;
mod plot;

use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};

use clap::Args;

pub use plot::render_png;

/// Options of `kvwire-bench ab`.
#[derive(Args, Debug, Clone)]
pub struct AbArgs {
    /// Directory for ab.json, ab.md, ab.png and the servers' logs.
    #[arg(long, default_value = "kvwire-ab")]
    pub out: PathBuf,
    /// A 12-request trace (every arm still runs; a few minutes on 2 cores).
    #[arg(long)]
    pub quick: bool,
    /// The interpreter of a venv with vLLM and kvwire [default: the newest under
    /// ~/.cache/kvwire-py, installed when there is none].
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,
    /// A trace in kvwire.replay's format [default: generated].
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Only these arms (single always runs: it is the reference).
    #[arg(long, num_args = 1.., value_name = "ARM")]
    pub arms: Vec<String>,
    /// A real model to serve (GPUs) instead of the CPU stand-in.
    #[arg(long)]
    pub model: Option<String>,
    /// Tensor parallel size of every server (with --model).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: u32,
    /// More `vllm serve` flags for every server, as one string.
    #[arg(long, value_name = "FLAGS", allow_hyphen_values = true)]
    pub server_args: Option<String>,
    /// The stand-in model's compute per layer and per token, in microseconds (0: none), so
    /// that a prefill takes time in proportion to the tokens it computes, as a real model's
    /// does.
    #[arg(long, value_name = "US", default_value_t = 0.0)]
    pub standin_token_us: f64,
}

/// Runs the A/B; the exit code is the Python side's (0: every arm ran, no error, every output
/// equal to the single instance's), or 1 when the figure cannot be drawn.
pub fn run(a: &AbArgs) -> ExitCode {
    let python = match &a.python {
        Some(p) => p.clone(),
        None => match crate::venvs::ensure_pythons("kvwire-bench ab") {
            Ok(found) => found[0].clone(),
            Err(e) => {
                eprintln!(
                    "kvwire-bench ab: {e} (install: {})",
                    crate::venvs::INSTALL_HINT
                );
                return ExitCode::from(2);
            }
        },
    };
    let mut cmd = Command::new(&python);
    cmd.args(["-m", "kvwire.ab", "--out"]).arg(&a.out);
    if a.quick {
        cmd.arg("--quick");
    }
    if let Some(t) = &a.trace {
        cmd.arg("--trace").arg(t);
    }
    if !a.arms.is_empty() {
        cmd.arg("--arms").args(&a.arms);
    }
    if let Some(m) = &a.model {
        cmd.args(["--model", m]);
        cmd.args([
            "--tensor-parallel-size",
            &a.tensor_parallel_size.to_string(),
        ]);
    }
    if let Some(s) = &a.server_args {
        cmd.args(["--server-args", s]);
    }
    if a.standin_token_us > 0.0 {
        cmd.args(["--standin-token-us", &a.standin_token_us.to_string()]);
    }
    cmd.arg("--python").arg(&python);
    eprintln!(
        "kvwire-bench ab: {} -m kvwire.ab (servers' logs under {})",
        python.display(),
        a.out.display()
    );
    let status = match cmd.stdin(Stdio::null()).status() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvwire-bench ab: cannot start {}: {e}", python.display());
            return ExitCode::from(2);
        }
    };
    let json = a.out.join("ab.json");
    let png = a.out.join("ab.png");
    match std::fs::read_to_string(&json)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).map_err(|e| e.to_string()))
        .and_then(|mut v| {
            add_calibration(&a.out, &mut v)?;
            render_png(&v, &png).map_err(|e| e.to_string())
        }) {
        Ok(()) => eprintln!("kvwire-bench ab: {}", png.display()),
        Err(e) => {
            eprintln!("kvwire-bench ab: no figure from {}: {e}", json.display());
            return ExitCode::from(1);
        }
    }
    match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
        None => ExitCode::from(1),
    }
}

/// Fits the cost model on the P/D arms' timelines and adds it to `ab.json` (as `calibration`)
/// and `ab.md`; a fit that fails is said there and on stderr, and fails nothing else.
fn add_calibration(out: &std::path::Path, ab: &mut serde_json::Value) -> Result<(), String> {
    let (summary, md) = match calibration::fit(out) {
        Ok(None) => return Ok(()),
        Ok(Some(f)) => {
            eprintln!("kvwire-bench ab: {}", f.markdown.trim_end());
            (f.summary, f.markdown)
        }
        Err(e) => {
            eprintln!("kvwire-bench ab: NO COST MODEL from the P/D arms' timelines: {e}");
            (
                serde_json::json!({ "error": e }),
                format!("**No cost model from the P/D arms' timelines:** {e}\n"),
            )
        }
    };
    if let Some(m) = ab.as_object_mut() {
        m.insert("calibration".into(), summary);
    }
    let path = out.join("ab.json");
    let text = serde_json::to_string_pretty(ab).map_err(|e| e.to_string())?;
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    let md_path = out.join("ab.md");
    let mut text = std::fs::read_to_string(&md_path).unwrap_or_default();
    text.push('\n');
    text.push_str(&md);
    std::fs::write(&md_path, text).map_err(|e| format!("{}: {e}", md_path.display()))
}

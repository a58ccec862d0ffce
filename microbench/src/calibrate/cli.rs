//! `kvwire-bench calibrate`: arguments, the run, its output.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::costmodel::CostModel;

use super::calibration::{calibrate, CalibrateOptions};
use super::error::BadLines;
use super::grid::predict_grid;
use super::production::{read_production, ProductionOptions};

/// Arguments of `kvwire-bench calibrate`.
#[derive(Debug, clap::Args)]
pub struct CalibrateArgs {
    /// Timeline records (JSON lines) to fit on: a file, or a directory of production timelines
    /// (`*.jsonl` and rotated `*.jsonl.N` of the vLLM connector's P and D engines, router
    /// records in `router*.jsonl`, subdirectories included) whose P and D records are joined
    /// onto D's clock.
    #[arg(long, value_name = "PATH", required_unless_present = "predict_grid")]
    pub timeline: Option<PathBuf>,
    /// Joined P and D records whose clock offset estimate is less certain than this are kept
    /// and counted.
    #[arg(long, value_name = "MS", default_value_t = 5.0)]
    pub max_clock_error_ms: f64,
    /// Write the fitted cost model (JSON, schema kvwire.cost/1) here.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Only use records of this transport (needed when the file mixes transports).
    #[arg(long)]
    pub transport: Option<String>,
    /// Only use records of this send mode (whole, layerwise); the model is for that mode.
    #[arg(long)]
    pub send_mode: Option<String>,
    /// Skip malformed lines (listed on stderr) instead of failing on the first one.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Text for fitted_on.source [default: the timeline's path].
    #[arg(long)]
    pub source: Option<String>,
    /// Write the model's predictions over a fixed input grid (JSON) here, for cross-language
    /// checks. With --model, no fitting is done.
    #[arg(long, value_name = "FILE")]
    pub predict_grid: Option<PathBuf>,
    /// With --predict-grid: the model to evaluate instead of fitting one.
    #[arg(
        long,
        value_name = "FILE",
        requires = "predict_grid",
        conflicts_with = "timeline"
    )]
    pub model: Option<PathBuf>,
}

/// Writes to stdout, ignoring a closed pipe (`kvwire-bench calibrate ... | head`).
fn say(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

fn write_grid(model: &CostModel, path: &Path) -> Result<(), String> {
    let text = serde_json::to_string(&predict_grid(model)).map_err(|e| e.to_string())?;
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Runs `kvwire-bench calibrate`: prints the table, writes the model; exit 1 on any error.
pub fn run_cli(a: &CalibrateArgs) -> ExitCode {
    match run_cli_inner(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvwire-bench calibrate: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_cli_inner(a: &CalibrateArgs) -> Result<(), String> {
    if let Some(mpath) = &a.model {
        let model = CostModel::load(mpath).map_err(|e| e.to_string())?;
        if let Some(g) = &a.predict_grid {
            write_grid(&model, g)?;
        }
        return Ok(());
    }
    let Some(tpath) = &a.timeline else {
        return Err("--timeline PATH is required (or --model with --predict-grid)".into());
    };
    let ms = a.max_clock_error_ms;
    if !(ms.is_finite() && ms >= 0.0) {
        return Err(format!("--max-clock-error-ms must be >= 0, got {ms}"));
    }
    let popts = ProductionOptions {
        bad: if a.skip_bad_lines {
            BadLines::Skip
        } else {
            BadLines::Fail
        },
        max_clock_error_ns: (ms * 1e6) as u64,
    };
    let p = read_production(tpath, &popts).map_err(|e| e.to_string())?;
    for b in &p.bad_lines {
        eprintln!("skipped {b}");
    }
    let t = &p.timeline;
    say(&format!(
        "timeline {}: {} usable records; skipped {} malformed, {} failed, {} incomplete \
         (no decode_sent/first_token), {} zero clock, {} duplicate\n",
        tpath.display(),
        t.samples.len(),
        p.bad_lines.len(),
        t.skipped_failed,
        t.skipped_incomplete,
        t.skipped_zero,
        t.skipped_duplicate
    ));
    if tpath.is_dir() || p.has_production_records() {
        say(&format!("{}\n", p.summary(popts.max_clock_error_ns)));
    }
    let opts = CalibrateOptions {
        transport: a.transport.clone(),
        send_mode: a.send_mode.clone(),
        source: a
            .source
            .clone()
            .unwrap_or_else(|| tpath.display().to_string()),
    };
    let c = calibrate(&t.samples, &opts).map_err(|e| e.to_string())?;
    say(&c.table());
    if let Some(out) = &a.out {
        c.model.save(out).map_err(|e| e.to_string())?;
        say(&format!("wrote {}\n", out.display()));
    }
    if let Some(g) = &a.predict_grid {
        write_grid(&c.model, g)?;
    }
    Ok(())
}

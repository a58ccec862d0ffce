//! Command line of `kvwire-bench clock`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use kvwire_transfer::TransportKind;

use super::workload::{read_trace, AgenticMix};
use super::{plot, report, run_matrix, ClockConfig, ClockError, ClockReport, LinkSpeed, Scenario};

/// Transport of the data path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ClockTransport {
    /// shm (both engines are in this process, so on one host)
    Auto,
    /// TCP over loopback
    Tcp,
    /// shared memory
    Shm,
}

/// Request mix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ClockWorkload {
    /// synthetic agentic sessions: contexts 1k–50k tokens, 93% prefix reuse
    Agentic,
    /// the requests of --trace
    Trace,
}

/// Scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ClockScenario {
    /// request sent to P and D together
    Pd,
    /// PD-sep migration: KV already cached on the source, decode_sent after prefill
    Migration,
}

/// Link speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ClockLinkSpeed {
    /// each layer's own measured time
    Raw,
    /// median speed of the last 64 measured layers (filters preemptions)
    Window,
    /// median speed of the warm-up cell, the same for every cell (cells differ by policy only)
    Frozen,
}

/// Arguments of `kvwire-bench clock`.
#[derive(Args, Debug, Clone)]
pub struct ClockArgs {
    /// Write the per-cell figures as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Trace of requests (JSON lines or CSV: arrival_s, prompt_tokens, cached_tokens,
    /// output_tokens); implies --workload trace.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Write every request's timeline record (JSON lines, for `calibrate`) to FILE.
    #[arg(long, value_name = "FILE")]
    pub timeline_out: Option<PathBuf>,
    /// Draw the figure (PNG) to FILE.
    #[arg(long, value_name = "FILE")]
    pub png: Option<PathBuf>,
    /// Requests per cell (agentic workload; a trace is cut to this many when given).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Seed of the workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Transport of the data path.
    #[arg(long, value_enum, default_value_t = ClockTransport::Auto)]
    pub transport: ClockTransport,
    /// Request mix.
    #[arg(long, value_enum, default_value_t = ClockWorkload::Agentic)]
    pub workload: ClockWorkload,
    /// Scenario.
    #[arg(long, value_enum, default_value_t = ClockScenario::Pd)]
    pub scenario: ClockScenario,
    /// Arrival rate of the agentic mix, requests per second.
    #[arg(long)]
    pub rate: Option<f64>,
    /// KV bytes per token moved on the wire (the modelled model has 96 KiB; the transfer
    /// time is stretched by the ratio).
    #[arg(long)]
    pub wire_bytes_per_token: Option<u64>,
    /// Blocks in D's pool.
    #[arg(long)]
    pub d_pool_blocks: Option<u32>,
    /// Measured speed that sets a layer's virtual transfer time.
    #[arg(long, value_enum, default_value_t = ClockLinkSpeed::Frozen)]
    pub link_speed: ClockLinkSpeed,
    /// A run of seconds: 30 requests of at most 16k tokens, 64 B/token on the wire.
    #[arg(long)]
    pub quick: bool,
}

/// Default arrival rate of the agentic mix (requests/s). With the default step times P is
/// busy about 70% of the time (mean prefill of the mix ≈ 230 ms), and the measured shm link,
/// stretched to the modelled bytes, about half of the time.
pub const DEFAULT_RATE: f64 = 3.0;

/// Builds the configuration and the requests of a run from the arguments.
pub fn plan(a: &ClockArgs) -> Result<(ClockConfig, Vec<super::RequestSpec>), ClockError> {
    let mut cfg = if a.quick {
        ClockConfig::quick(a.seed)
    } else {
        ClockConfig::full(a.seed)
    };
    cfg.transport = match a.transport {
        ClockTransport::Auto => TransportKind::Auto,
        ClockTransport::Tcp => TransportKind::Tcp,
        ClockTransport::Shm => TransportKind::Shm,
    };
    cfg.scenario = match a.scenario {
        ClockScenario::Pd => Scenario::Pd,
        ClockScenario::Migration => Scenario::Migration,
    };
    if let Some(w) = a.wire_bytes_per_token {
        if w == 0 || w > cfg.model_bytes_per_token {
            return Err(ClockError::Config(format!(
                "--wire-bytes-per-token must be in 1..={}",
                cfg.model_bytes_per_token
            )));
        }
        cfg.wire_bytes_per_token = w;
        cfg.transfer_scale = cfg.model_bytes_per_token as f64 / w as f64;
    }
    cfg.link_speed = match a.link_speed {
        ClockLinkSpeed::Raw => LinkSpeed::Raw,
        ClockLinkSpeed::Window => LinkSpeed::Window,
        ClockLinkSpeed::Frozen => LinkSpeed::Frozen,
    };
    if let Some(d) = a.d_pool_blocks {
        cfg.d_pool_blocks = d;
    }
    let trace = a.trace.is_some() || a.workload == ClockWorkload::Trace;
    let specs = if trace {
        let path = a
            .trace
            .as_ref()
            .ok_or_else(|| ClockError::Config("--workload trace needs --trace FILE".into()))?;
        let mut v = read_trace(path)?;
        if let Some(n) = a.requests {
            v.truncate(n.max(1));
        }
        v
    } else {
        let rate = a.rate.unwrap_or(DEFAULT_RATE);
        if !(rate.is_finite() && rate > 0.0) {
            return Err(ClockError::Config("--rate must be positive".into()));
        }
        let mut mix = AgenticMix::standard(rate);
        let n = a.requests.unwrap_or(if a.quick { 30 } else { 200 });
        if a.quick {
            mix.max_tokens = 16_000;
            mix.sessions = 16;
            mix.output_tokens = (8, 48);
        }
        mix.generate(n.max(1), a.seed)
    };
    Ok((cfg, specs))
}

/// Runs the bench and writes what was asked for.
pub fn run(a: &ClockArgs) -> Result<ClockReport, ClockError> {
    let (cfg, specs) = plan(a)?;
    let r = run_matrix(&cfg, &specs)?;
    let write = |path: &PathBuf, data: &[u8]| {
        std::fs::write(path, data).map_err(|source| ClockError::Output {
            path: path.display().to_string(),
            source,
        })
    };
    if let Some(p) = &a.json {
        let s = serde_json::to_string_pretty(&report::to_json(&r)).unwrap_or_default();
        write(p, s.as_bytes())?;
    }
    if let Some(p) = &a.timeline_out {
        write(p, report::timeline_lines(&r).as_bytes())?;
    }
    if let Some(p) = &a.png {
        plot::render_png(&r, p)?;
    }
    Ok(r)
}

/// Entry point of the subcommand: prints the table; exit 0, 2 when a byte did not verify, 1
/// on an error.
pub fn cli_main(a: &ClockArgs) -> ExitCode {
    match run(a) {
        Ok(r) => {
            print!("{}", report::table(&r));
            if r.all_verified() {
                ExitCode::SUCCESS
            } else {
                eprintln!("kvwire-bench clock: VERIFICATION FAILED (see the verified column)");
                ExitCode::from(2)
            }
        }
        Err(e) => {
            eprintln!("kvwire-bench clock: error: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                eprintln!("  caused by: {s}");
                src = s.source();
            }
            ExitCode::from(1)
        }
    }
}

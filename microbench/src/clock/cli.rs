//! Command line of `kvwire-bench clock`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use kvwire_transfer::TransportKind;

use kvwire_connector::{Policy, SendMode};

use super::config::{STUDY_PD_RATE, STUDY_RATE};
use super::trace::read_trace;
use super::workload::{fixed_prompts, merge, AgenticMix, SessionMix};
use super::{
    plot, report, run_matrix, table, ClockConfig, ClockError, ClockReport, LinkSpeed, Scenario,
};

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
    /// synthetic agentic sessions: contexts 1k–50k tokens, 93% prefix reuse (with --preset
    /// study: the study's sessions of turns)
    Agentic,
    /// the requests of --trace
    Trace,
    /// fixed prompt lengths (--prompt-tokens), none cached on P, evenly spaced
    Fixed,
}

/// Configuration preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ClockPreset {
    /// the full run (8 layers, whole-prompt steps, no local requests)
    Full,
    /// a run of seconds (as --quick)
    Quick,
    /// the seed study's setup: 48 layers, 96 KiB/token, chunked prefill, D with its own local
    /// requests and prefix cache, one engine's share of the w600 trace statistics
    Study,
}

/// On or off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    /// on
    On,
    /// off
    Off,
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
    /// Configuration preset (--quick is --preset quick).
    #[arg(long, value_enum, default_value_t = ClockPreset::Full)]
    pub preset: ClockPreset,
    /// Chunked prefill: P computes at most this many tokens a step (vLLM-like: 8192; 0:
    /// whole-prompt steps, the default except with --preset study).
    #[arg(long)]
    pub chunk_tokens: Option<u32>,
    /// Slots of D's landing pool for policy land (default: a quarter of D's pool).
    #[arg(long)]
    pub land_pool_blocks: Option<u32>,
    /// D's prefix cache for P/D requests: a later turn finds its session's previous context
    /// on D and P sends only the rest (default off, on with --preset study).
    #[arg(long, value_enum)]
    pub d_prefix_cache: Option<OnOff>,
    /// Local requests per second arriving on D next to the P/D ones (kv_both: D computes
    /// their prompts); default 0, one engine's share of the trace with --preset study.
    #[arg(long)]
    pub local_rate: Option<f64>,
    /// Fixed prompt lengths (comma-separated; implies --workload fixed).
    #[arg(long, value_delimiter = ',')]
    pub prompt_tokens: Vec<u32>,
    /// Output tokens of each request of --workload fixed.
    #[arg(long, default_value_t = 32)]
    pub output_tokens: u32,
    /// A link of this speed (GB/s of modelled bytes, plus the measured fixed cost per batch)
    /// instead of the measured one (default: measured; 2.7 with --preset study).
    #[arg(long)]
    pub link_gbps: Option<f64>,
    /// Modelled speed of `land`'s local copy from the landing slots into KV blocks, GB/s
    /// (default 54: host memory to HBM on an H20; a landing pool in HBM copies far faster).
    #[arg(long)]
    pub land_copy_gbps: Option<f64>,
    /// Mean think time between a turn's last token and the session's next turn, seconds
    /// (--preset study's closed-loop sessions).
    #[arg(long)]
    pub turn_gap_s: Option<f64>,
    /// Policies to run (comma-separated; default all).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<Policy>,
    /// Send modes to run (comma-separated; default whole,layerwise).
    #[arg(long, value_delimiter = ',')]
    pub send_modes: Vec<SendMode>,
}

/// Default arrival rate of the agentic mix (requests/s). With the default step times P is
/// busy about 70% of the time (mean prefill of the mix ≈ 230 ms), and the measured shm link,
/// stretched to the modelled bytes, about half of the time.
pub const DEFAULT_RATE: f64 = 3.0;

/// Default arrival rate of `--workload fixed` (requests/s): one request at a time for the
/// default step times (a 50k prompt's prefill is about 4 s).
pub const DEFAULT_FIXED_RATE: f64 = 0.1;

/// Builds the configuration and the requests of a run from the arguments.
pub fn plan(a: &ClockArgs) -> Result<(ClockConfig, Vec<super::RequestSpec>), ClockError> {
    let preset = if a.quick {
        ClockPreset::Quick
    } else {
        a.preset
    };
    let mut cfg = match preset {
        ClockPreset::Full => ClockConfig::full(a.seed),
        ClockPreset::Quick => ClockConfig::quick(a.seed),
        ClockPreset::Study => ClockConfig::study(a.seed),
    };
    let study = preset == ClockPreset::Study;
    let quick = preset == ClockPreset::Quick;
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
        cfg.land_pool_blocks = d / 4;
    }
    if let Some(l) = a.land_pool_blocks {
        cfg.land_pool_blocks = l;
    }
    if let Some(c) = a.chunk_tokens {
        cfg.chunk_tokens = c;
    }
    if let Some(g) = a.land_copy_gbps {
        if !(g.is_finite() && g > 0.0) {
            return Err(ClockError::Config(
                "--land-copy-gbps must be positive".into(),
            ));
        }
        cfg.land_copy_bytes_per_s = g * 1e9;
    }
    if let Some(p) = a.d_prefix_cache {
        cfg.d_prefix_cache = p == OnOff::On;
    }
    if let Some(g) = a.link_gbps {
        if !(g.is_finite() && g > 0.0) {
            return Err(ClockError::Config("--link-gbps must be positive".into()));
        }
        cfg.link_gbps = Some(g);
    }
    if !a.policies.is_empty() {
        cfg.policies = a.policies.clone();
    }
    if !a.send_modes.is_empty() {
        cfg.send_modes = a.send_modes.clone();
    }
    let local_rate = a.local_rate.unwrap_or(cfg.local_rate);
    if !(local_rate.is_finite() && local_rate >= 0.0) {
        return Err(ClockError::Config("--local-rate must be at least 0".into()));
    }
    cfg.local_rate = local_rate;
    let trace = a.trace.is_some() || a.workload == ClockWorkload::Trace;
    let fixed = !a.prompt_tokens.is_empty() || a.workload == ClockWorkload::Fixed;
    let rate = a.rate.unwrap_or(if fixed {
        DEFAULT_FIXED_RATE
    } else if study {
        STUDY_PD_RATE
    } else {
        DEFAULT_RATE
    });
    if !(rate.is_finite() && rate > 0.0) {
        return Err(ClockError::Config("--rate must be positive".into()));
    }
    let mut mix = AgenticMix::standard(rate);
    if quick {
        mix.max_tokens = 16_000;
        mix.sessions = 16;
        mix.output_tokens = (8, 48);
    }
    let pd = if trace {
        let path = a
            .trace
            .as_ref()
            .ok_or_else(|| ClockError::Config("--workload trace needs --trace FILE".into()))?;
        let mut v = read_trace(path)?;
        if let Some(n) = a.requests {
            v.truncate(n.max(1));
        }
        v
    } else if fixed {
        if a.prompt_tokens.is_empty() {
            return Err(ClockError::Config(
                "--workload fixed needs --prompt-tokens N[,N...]".into(),
            ));
        }
        let n = a.requests.unwrap_or(if quick { 6 } else { 20 });
        fixed_prompts(&a.prompt_tokens, n.max(1), rate, a.output_tokens)
    } else if study {
        let mut v = study_mix(a, a.rate.unwrap_or(STUDY_PD_RATE))?.generate(a.seed, false);
        if let Some(n) = a.requests {
            v.truncate(n.max(1));
        }
        v
    } else {
        let n = a.requests.unwrap_or(if quick { 30 } else { 200 });
        mix.generate(n.max(1), a.seed)
    };
    let until = pd.last().map_or(0, |s| s.arrival);
    let local = if local_rate <= 0.0 {
        Vec::new()
    } else if study {
        // D's own requests: the study's sessions, as many as the rate asks for, started over
        // the same window as the P/D ones.
        study_mix(a, local_rate)?.generate(a.seed ^ 0x10CA1, true)
    } else {
        let mut m = mix.clone();
        m.arrival_rate = local_rate;
        m.generate_local(until, a.seed ^ 0x10CA1)
    };
    Ok((cfg, merge(pd, local)))
}

/// The study's sessions at `rate` requests/s (one engine's whole share is
/// [`STUDY_RATE`] with [`SessionMix::study`]'s 34 sessions).
fn study_mix(a: &ClockArgs, rate: f64) -> Result<SessionMix, ClockError> {
    let mut m = SessionMix::study();
    m.sessions = ((m.sessions as f64) * rate / STUDY_RATE).round().max(1.0) as usize;
    if let Some(g) = a.turn_gap_s {
        if !(g.is_finite() && g > 0.0) {
            return Err(ClockError::Config("--turn-gap-s must be positive".into()));
        }
        m.gap_s = g;
    }
    Ok(m)
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
            print!("{}", table::table(&r));
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

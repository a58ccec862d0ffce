//! `kvwire-bench`: the kvwire microbench CLI.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvwire_bench::initiator::transport_name;
use kvwire_bench::plan::parse_size;
use kvwire_bench::spawn::{LocalTarget, READY_PREFIX, SECRET_ENV};
use kvwire_bench::{BenchError, Plan, RunConfig, ServeConfig, Target};
use kvwire_transfer::TransportKind;

mod cuda_ipc;
mod layerwise;
mod slice_ab;
mod tax;
mod wr_cost;

#[derive(Parser)]
#[command(name = "kvwire-bench", version, about = "kvwire microbenches")]
struct Cli {
    /// Serve the run's engine metrics (Prometheus text, `GET /metrics`) on ADDR while it runs:
    /// the initiator engine of `transfer` and `layerwise` (port 0: a free port, printed).
    #[arg(long, global = true, value_name = "ADDR")]
    metrics_addr: Option<SocketAddr>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Transfer engine: serial writes, batches, the KV-layer pattern and read-backs between
    /// two processes, every byte verified. With neither --target nor --serve, starts its
    /// own target process on 127.0.0.1.
    Transfer(TransferArgs),
    /// Layer streams: exposed transfer tail after the last layer, `whole` vs `layerwise`,
    /// and writes per request, against a target process on 127.0.0.1.
    Layerwise(layerwise::LayerwiseArgs),
    /// CUDA IPC: device-to-device copies into another process's GPU memory next to copies
    /// within one process, same bytes and GPU, every byte checked (needs a CUDA device).
    CudaIpc(cuda_ipc::CudaIpcArgs),
    /// Fit the router cost model (kvwire.cost/1) from timeline records (JSON lines) and
    /// report its held-out error next to the seed model's.
    Calibrate(kvwire_bench::calibrate::CalibrateArgs),
    /// The decode_sent → first_token clock: P and D step loops around the connector core,
    /// real transfers through the engine, per reservation policy × send mode.
    Clock(kvwire_bench::clock::ClockArgs),
    /// The loopback A/B report: transfer, layerwise, clock and calibrate in one run, into
    /// report.md with the JSON, PNG, timeline and cost.json files.
    Report(kvwire_bench::suite::ReportArgs),
    /// The always-on kv_both tax with no transfer pending: connector core per-step cost, idle
    /// engine CPU, and in vLLM (when a venv is found) the scheduler and worker sides per
    /// connector, each figure next to its baseline.
    Tax(tax::TaxArgs),
    /// The users' A/B with real vLLM servers: single instance, kv_both MooncakeConnector and
    /// KvwireConnector, 1P1D per reservation policy × send mode, one agentic trace replayed
    /// against each; ab.json, ab.md, ab.png.
    Ab(kvwire_bench::ab::AbArgs),
    /// CPU per RDMA work request without a NIC: the engine's posting and completion paths on
    /// the in-process software device (kvwire-verbs-loopback), next to the verbs layer's floor
    /// and the request rates 200 and 400 Gb/s need per slice size.
    WrCost(wr_cost::WrCostArgs),
    /// The RDMA adaptive slice size against a fixed one on the in-process software device:
    /// GB/s of each, their ratio per round, and the slice the adaptive peer settled on.
    SliceAb(slice_ab::SliceAbArgs),
    /// Print a new random shared secret (256 bits, 64 hex digits) for `--secret` and
    /// `EngineConfig::secret`: `SECRET=$(kvwire-bench secret)`.
    Secret,
}

#[derive(Clone, Copy, ValueEnum)]
enum TransportArg {
    /// shm when both processes share a host, tcp otherwise
    Auto,
    /// TCP (multi-lane)
    Tcp,
    /// shared memory (same host only)
    Shm,
    /// RDMA verbs (device: $KVWIRE_RDMA_DEVICE, else the first usable one)
    Rdma,
}

impl From<TransportArg> for TransportKind {
    fn from(t: TransportArg) -> TransportKind {
        match t {
            TransportArg::Auto => TransportKind::Auto,
            TransportArg::Tcp => TransportKind::Tcp,
            TransportArg::Shm => TransportKind::Shm,
            TransportArg::Rdma => TransportKind::Rdma,
        }
    }
}

#[derive(Args)]
struct TransferArgs {
    /// Transport to use.
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    transport: TransportArg,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Measure against a target started elsewhere with --serve (HOST:PORT).
    #[arg(long, value_name = "ADDR", conflicts_with = "serve")]
    target: Option<String>,
    /// Serve as the target for an initiator on another host (or namespace).
    #[arg(long)]
    serve: bool,
    /// Address this side's engine listens on [--serve: 127.0.0.1:7000; otherwise port 0].
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// Shared secret; both sides must use the same one.
    #[arg(long, env = SECRET_ENV, hide_env_values = true)]
    secret: Option<String>,
    /// A short run (about a second): small sizes, few operations, a small KV pattern.
    #[arg(long)]
    quick: bool,
    /// Write sizes, comma separated (e.g. 4K,64K,1M).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    sizes: Option<Vec<u64>>,
    /// Timed KV rounds (after one warm-up round).
    #[arg(long)]
    rounds: Option<usize>,
    /// Wall-clock bound per size and phase, seconds.
    #[arg(long)]
    max_secs: Option<f64>,
    /// KV pattern: place blocks on the target so that no two writes can be coalesced.
    #[arg(long)]
    kv_scatter: bool,
    /// --serve: bytes of the data region offered to initiators [default: what the full
    /// plan needs, 512 MiB].
    #[arg(long, value_parser = parse_size)]
    region_size: Option<u64>,
    /// --serve: exit after this many seconds.
    #[arg(long, default_value_t = 3600)]
    serve_secs: u64,
    /// --serve: exit when stdin closes (used for the local target process).
    #[arg(long, hide = true)]
    exit_on_stdin_eof: bool,
    /// --serve, tests only: flip one byte of the N-th measured batch before checking it,
    /// to show that corruption is detected.
    #[arg(long, hide = true, value_name = "N")]
    fault_corrupt_nth: Option<u64>,
    /// TCP connections per peer [default: the engine's].
    #[arg(long)]
    lanes: Option<usize>,
    /// Largest slice of a write, e.g. 256K [default: the engine's].
    #[arg(long, value_parser = parse_size)]
    slice_size: Option<u64>,
    /// Do not draw a progress bar.
    #[arg(long)]
    no_progress: bool,
}

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let metrics_addr = cli.metrics_addr;
    let result = match cli.cmd {
        _ if metrics_addr.is_some() && !serves_metrics(&cli.cmd) => Err(BenchError::Plan(
            "--metrics-addr is supported by `transfer` (initiator side) and `layerwise`".into(),
        )),
        Cmd::Transfer(a) if a.serve => serve(&a),
        Cmd::Transfer(a) => transfer(&a, metrics_addr),
        Cmd::Layerwise(mut a) => {
            a.metrics_addr = metrics_addr;
            layerwise::run(a)
        }
        Cmd::CudaIpc(a) => cuda_ipc::run(&a),
        Cmd::Calibrate(a) => Ok(kvwire_bench::calibrate::run_cli(&a)),
        Cmd::Clock(a) => Ok(kvwire_bench::clock::cli_main(&a)),
        Cmd::Report(a) => Ok(kvwire_bench::suite::run(&a)),
        Cmd::Tax(a) => Ok(tax::run(&a)),
        Cmd::Ab(a) => Ok(kvwire_bench::ab::run(&a)),
        Cmd::WrCost(a) => wr_cost::run(&a),
        Cmd::SliceAb(a) => slice_ab::run(&a),
        Cmd::Secret => {
            println!("{}", kvwire_transfer::new_secret());
            Ok(ExitCode::SUCCESS)
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvwire-bench: error: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                eprintln!("  caused by: {s}");
                src = s.source();
            }
            ExitCode::from(1)
        }
    }
}

fn plan_of(a: &TransferArgs) -> Plan {
    let mut p = if a.quick { Plan::quick() } else { Plan::full() };
    if let Some(s) = &a.sizes {
        p.sizes = s.clone();
    }
    if let Some(r) = a.rounds {
        p.kv_rounds = r;
    }
    if let Some(s) = a.max_secs {
        p.max_secs = s;
        p.read_max_secs = s;
    }
    p.kv_scatter = a.kv_scatter;
    p
}

fn serve(a: &TransferArgs) -> Result<ExitCode, BenchError> {
    let listen = a
        .listen
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 7000)));
    let region_len = a
        .region_size
        .unwrap_or_else(|| Plan::full().data_region_len());
    let target = Target::start(ServeConfig {
        listen,
        secret: a.secret.as_ref().map(|s| s.as_bytes().to_vec()),
        transport: a.transport.into(),
        region_len,
        fault: a
            .fault_corrupt_nth
            .map(|nth| kvwire_bench::target::TargetFault::CorruptBeforeVerify { nth }),
    })?;
    let addr = target.addr();
    println!("{READY_PREFIX}{addr}");
    if !a.exit_on_stdin_eof {
        eprintln!(
        "kvwire-bench: serving on {addr} (data region {region_len} bytes, one initiator at a time; exits after {} s)",
            a.serve_secs
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    if a.exit_on_stdin_eof {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
            stop.store(true, Ordering::SeqCst);
        });
    }
    let t0 = Instant::now();
    let limit = Duration::from_secs(a.serve_secs);
    while !stop.load(Ordering::SeqCst) && t0.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(50));
    }
    let v = target.verdict();
    tracing::info!(?v, "target exiting");
    target.stop();
    Ok(ExitCode::SUCCESS)
}

/// Whether the subcommand's engine can serve `--metrics-addr`.
fn serves_metrics(cmd: &Cmd) -> bool {
    match cmd {
        Cmd::Transfer(a) => !a.serve,
        Cmd::Layerwise(a) => !a.serve_child,
        _ => false,
    }
}

fn transfer(a: &TransferArgs, metrics_addr: Option<SocketAddr>) -> Result<ExitCode, BenchError> {
    let plan = plan_of(a);
    plan.validate().map_err(BenchError::Plan)?;
    let transport: TransportKind = a.transport.into();
    let mut local = None;
    let target = match &a.target {
        Some(t) => t
            .to_socket_addrs()
            .map_err(|e| BenchError::Plan(format!("cannot resolve --target {t:?}: {e}")))?
            .next()
            .ok_or_else(|| BenchError::Plan(format!("--target {t:?} resolves to nothing")))?,
        None => {
            let exe = std::env::current_exe()?;
            let lt = LocalTarget::spawn(
                &exe,
                &transport_name(transport),
                plan.data_region_len(),
                a.secret.as_deref(),
            )?;
            let addr = lt.addr();
            local = Some(lt);
            addr
        }
    };
    let listen = a.listen.unwrap_or_else(|| {
        if target.ip().is_loopback() {
            SocketAddr::from(([127, 0, 0, 1], 0))
        } else if target.is_ipv4() {
            SocketAddr::from(([0, 0, 0, 0], 0))
        } else {
            SocketAddr::from(([0u16; 8], 0))
        }
    });
    let report = kvwire_bench::run(&RunConfig {
        target,
        secret: a.secret.as_ref().map(|s| s.as_bytes().to_vec()),
        transport,
        listen,
        plan,
        progress: !a.no_progress,
        lanes: a.lanes,
        slice_size: a.slice_size.map(|s| s as usize),
        metrics_addr,
    })?;
    print!("{}", report.table());
    if let Some(path) = &a.json {
        let f = std::fs::File::create(path)?;
        serde_json::to_writer_pretty(std::io::BufWriter::new(f), &report)?;
    }
    if let Some(lt) = local {
        lt.finish()?;
    }
    if report.verified {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("kvwire-bench: VERIFICATION FAILED (see the table and the log above)");
        Ok(ExitCode::from(2))
    }
}

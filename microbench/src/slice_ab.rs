//! `kvwire-bench slice-ab`: the adaptive slice size against a fixed one, without a NIC. Two
//! engine pairs of this process on the in-process software device (`kvwire-verbs-loopback`,
//! which copies every request's bytes on the posting thread: a per-request cost plus a
//! memcpy, so small slices are limited by the request rate and large ones by the copy), one
//! pair cutting at a fixed `slice_size` (`rdma_slice_max` = `slice_size`) and one adapting
//! (`rdma_slice_max`, default 16 × the slice). Per slice size: warm-up batches first (the
//! adaptive pair finds its size), then `--rounds` rounds of `--batches` batches on each pair
//! in turn, wall-clock timed; GB/s per arm, their ratio, and the slice the adaptive pair
//! settled on (from its batches' work-request counts). Every timed batch writes one of four
//! windows of the target's region, cleared before the timed rounds; every byte of the four is
//! checked against the source afterwards.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use kvwire_bench::plan::{fmt_size, parse_size};
use kvwire_bench::BenchError;
use kvwire_transfer::{Access, Engine, EngineConfig, Op, Peer, RegionHandle, TransportKind};
use serde_json::json;

use crate::wr_cost::{connect_rdma, plan, use_loopback};

#[derive(Args)]
pub struct SliceAbArgs {
    /// The loopback device's library [default: libkvwire_verbs_loopback.so next to this
    /// binary].
    #[arg(long, value_name = "PATH")]
    verbs: Option<PathBuf>,
    /// Configured slice sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "4K,16K,64K", value_parser = parse_size)]
    slices: Vec<u64>,
    /// Bytes per batch (one contiguous write).
    #[arg(long, default_value = "4M", value_parser = parse_size)]
    size: u64,
    /// The adaptive pair's largest slice [default: 16 × the slice, the engine's default].
    #[arg(long, value_parser = parse_size)]
    max: Option<u64>,
    /// Timed batches per arm per round.
    #[arg(long, default_value_t = 64)]
    batches: usize,
    /// Rounds (fixed, adaptive, fixed, adaptive, ...).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Untimed batches on each pair before the first round.
    #[arg(long, default_value_t = 96)]
    warmup: usize,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// Windows of the target's region the timed batches write in turn.
const WINDOWS: u64 = 4;

/// One engine pair and its regions.
struct Arm {
    target: Engine,
    init: Engine,
    peer: Peer,
    src: RegionHandle,
    dst: RegionHandle,
    size: u64,
    next: u64,
}

impl Arm {
    fn new(slice: u64, max: u64, size: u64, data: &[u8]) -> Result<Arm, BenchError> {
        let cfg = EngineConfig {
            transport: TransportKind::Rdma,
            rdma_devices: vec!["loop0".into()],
            slice_size: slice as usize,
            rdma_slice_max: Some(max),
            wait_spin: Some(Duration::ZERO),
            ..EngineConfig::from_env()
        };
        let target = Engine::new(cfg.clone()).map_err(|e| plan(format!("target engine: {e}")))?;
        let init = Engine::new(cfg).map_err(|e| plan(format!("initiator engine: {e}")))?;
        let dst = target
            .alloc_region((size * WINDOWS) as usize, Access::WriteOnly)
            .map_err(|e| plan(format!("target region: {e}")))?;
        let src = init
            .alloc_region(size as usize, Access::Local)
            .map_err(|e| plan(format!("source region: {e}")))?;
        init.local_write(src, 0, data)
            .map_err(|e| plan(format!("fill: {e}")))?;
        let peer = connect_rdma(&init, &target)?;
        Ok(Arm {
            target,
            init,
            peer,
            src,
            dst,
            size,
            next: 0,
        })
    }

    /// `n` batches, one after the other; returns the wall time and the last batch's work
    /// requests.
    fn run(&mut self, n: usize) -> Result<(Duration, usize), BenchError> {
        let t0 = Instant::now();
        let mut wrs = 0;
        for _ in 0..n {
            let op = Op {
                local: self.src,
                local_offset: 0,
                remote: self.target.region_id(self.dst),
                remote_offset: self.next % WINDOWS * self.size,
                len: self.size,
            };
            self.next += 1;
            wrs = self
                .init
                .write(&self.peer, &[op], None, None)
                .and_then(|b| b.wait())
                .map_err(|e| plan(format!("batch: {e}")))?
                .slices;
        }
        Ok((t0.elapsed(), wrs))
    }

    fn clear(&self) -> Result<(), BenchError> {
        self.target
            .local_write(self.dst, 0, &vec![0u8; (self.size * WINDOWS) as usize])
            .map_err(|e| plan(format!("clear: {e}")))
    }

    /// Every byte of the target's windows equals the source.
    fn verify(&self, data: &[u8]) -> Result<(), BenchError> {
        let mut got = vec![0u8; self.size as usize];
        for w in 0..WINDOWS {
            self.target
                .local_read(self.dst, w * self.size, &mut got)
                .map_err(|e| plan(format!("read back: {e}")))?;
            if got != data {
                return Err(plan(format!(
                    "window {w}: the target's bytes differ from the source"
                )));
            }
        }
        Ok(())
    }
}

pub fn run(a: &SliceAbArgs) -> Result<ExitCode, BenchError> {
    if a.batches < WINDOWS as usize || a.rounds == 0 || a.size == 0 {
        return Err(plan(format!(
            "--batches must be at least {WINDOWS}, --rounds and --size at least 1"
        )));
    }
    use_loopback(a.verbs.as_deref())?;
    println!(
        "# kvwire-bench slice-ab: fixed against adaptive slices on the loopback device ({} \
         batches of one {} write per arm per round, {} rounds, {} warm-up batches)",
        a.batches,
        fmt_size(a.size),
        a.rounds,
        a.warmup
    );
    println!();
    println!(
        "| slice | adaptive up to | fixed GB/s | adaptive GB/s | adaptive / fixed | per round | \
         adaptive slice reached |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut js = Vec::new();
    for &slice in &a.slices {
        let (_, max) = EngineConfig {
            slice_size: slice as usize,
            rdma_slice_max: a.max,
            ..EngineConfig::default()
        }
        .rdma_slices();
        let data = kvwire_testkit::pattern::bytes(slice, 0, a.size as usize);
        let mut fixed = Arm::new(slice, slice, a.size, &data)?;
        let mut adaptive = Arm::new(slice, max, a.size, &data)?;
        fixed.run(a.warmup)?;
        adaptive.run(a.warmup)?;
        fixed.clear()?;
        adaptive.clear()?;
        let (mut tf, mut ta) = (Duration::ZERO, Duration::ZERO);
        let mut ratios = Vec::new();
        let mut reached = 0;
        for _ in 0..a.rounds {
            let (f, _) = fixed.run(a.batches)?;
            let (d, wrs) = adaptive.run(a.batches)?;
            tf += f;
            ta += d;
            ratios.push(f.as_secs_f64() / d.as_secs_f64());
            reached = a.size.div_ceil(wrs.max(1) as u64);
        }
        fixed.verify(&data)?;
        adaptive.verify(&data)?;
        let bytes = (a.size * (a.batches * a.rounds) as u64) as f64;
        let (gf, ga) = (
            bytes / tf.as_secs_f64() / 1e9,
            bytes / ta.as_secs_f64() / 1e9,
        );
        let per_round: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
        println!(
            "| {} | {} | {gf:.3} | {ga:.3} | {:.2} | {} | {} |",
            fmt_size(slice),
            fmt_size(max),
            ga / gf,
            per_round.join(" "),
            fmt_size(reached)
        );
        js.push(json!({
            "slice": slice,
            "max": max,
            "fixed_gbps": gf,
            "adaptive_gbps": ga,
            "ratio": ga / gf,
            "ratio_per_round": ratios,
            "adaptive_slice_reached": reached,
        }));
    }
    println!();
    println!(
        "every byte of the targets' windows verified after the timed rounds; GB/s = 1e9 B/s of \
         wall clock, one batch in flight; the ratio per round is fixed time / adaptive time"
    );
    if let Some(p) = &a.json {
        let doc = json!({"bench": "slice-ab", "size": a.size, "rows": js});
        std::fs::write(p, serde_json::to_vec_pretty(&doc).unwrap_or_default())
            .map_err(|e| plan(format!("{}: {e}", p.display())))?;
    }
    Ok(ExitCode::SUCCESS)
}

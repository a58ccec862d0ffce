//! `kvwire-bench layerwise`: how much transfer stays exposed after the last layer is computed,
//! sending the KV cache layer by layer (`layerwise`) versus after the whole prefill (`whole`).
//!
//! Setup: this process is P (initiator); a target process (this binary re-executed as
//! `layerwise --serve-child`, on 127.0.0.1) is D and offers one read-write region holding its
//! KV cache. A request has `--layers` layers of `--layer-bytes` each (K and V together, in
//! 16 KiB blocks per part as vLLM lays them out for a 16-token block of a 2 KiB/token/layer
//! model); P's blocks come from a used pool (random runs), D's from a fresh pool (mostly
//! contiguous), as [`synthetic_block_tables`] draws them. Compute is simulated with a timer
//! (`--compute-us` per layer, `thread::sleep`, no spinning).
//!
//! Per round: D's destination blocks are zeroed (not timed), then the request is computed
//! and streamed; `exposed tail` = time from the moment the last layer is ready (on P) to the
//! moment D's engine delivered the stream's notification, which it does only after every byte
//! landed (D prints its wall-clock arrival time; both processes read the same host clock);
//! `acked tail` = the same, up to P seeing the stream complete (acks back); `total` = from the
//! first layer's compute start to completion on P. Afterwards the destination blocks are read back and
//! compared with the source, byte for byte (not timed). `whole` makes every layer ready at
//! the end; `layerwise` makes each ready when its compute ends.
//!
//! With a CUDA device the same runs are repeated with the KV cache in device memory (uploaded
//! once with cudarc; each layer announced by a CUDA event recorded on a compute stream when
//! its simulated compute ends; staged through pinned buffers); without one the report says
//! "skipped: no CUDA device". (Needs kvwire-transfer's default `cuda` feature.)

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use kvwire_bench::BenchError;
use kvwire_transfer::layer::{
    synthetic_block_tables, BlockLists, Extent, Immediate, KvLayout, KvOrder, KvPlacement,
    LayerError, LayerStream, SrcSpace, StreamOptions, StreamStats,
};
use kvwire_transfer::{Access, Engine, EngineConfig, Op, Peer, RegionHandle, TransportKind};
use serde_json::json;

const READY: &str = "KVWIRE_LAYERWISE_READY ";
/// Line the target prints for each notification: tag and wall-clock arrival time (ns).
const NOTE: &str = "KVWIRE_LAYERWISE_NOTE ";
/// Seed of the source image (the testkit's byte pattern), checked byte for byte after a send.
const IMAGE_SEED: u64 = 0x4c41_5945_5257_4953;

/// Wall-clock nanoseconds (CLOCK_REALTIME: one clock for both processes on this host).
fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Which transports to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LwTransport {
    /// TCP (multi-lane).
    Tcp,
    /// Shared memory.
    Shm,
    /// Both, one after the other.
    Both,
}

/// Arguments of `kvwire-bench layerwise`.
#[derive(Args, Debug, Clone)]
pub struct LayerwiseArgs {
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Transport(s) to measure.
    #[arg(long, value_enum, default_value_t = LwTransport::Both)]
    pub transport: LwTransport,
    /// Layers per request.
    #[arg(long, default_value_t = 32)]
    pub layers: usize,
    /// Simulated compute per layer, microseconds [default: 2 × the measured per-layer
    /// transfer time (the slower of one layer alone and all layers back to back / layers), at
    /// least 500].
    #[arg(long)]
    pub compute_us: Option<u64>,
    /// KV bytes per layer (K and V together; 4 MiB = 2048 tokens at 2 KiB per token and layer);
    /// rounded down to whole blocks.
    #[arg(long, default_value_t = 4 << 20)]
    pub layer_bytes: u64,
    /// Bytes of one block of one part (K or V) [16 KiB: 16 tokens × 4 heads × 128 × 2 B].
    #[arg(long, default_value_t = 16 << 10)]
    pub block_bytes: u64,
    /// Timed rounds per mode.
    #[arg(long, default_value_t = 7)]
    pub rounds: usize,
    /// Internal: serve as the target process.
    #[arg(long, hide = true)]
    pub serve_child: bool,
    /// Internal: region size of the target process.
    #[arg(long, hide = true, default_value_t = 0)]
    pub region_bytes: u64,
    /// The initiator engine serves its Prometheus metrics here (`kvwire-bench --metrics-addr`;
    /// bound once per transport measured, one after the other).
    #[arg(skip)]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

fn eng<T>(r: Result<T, kvwire_transfer::Error>, what: &str) -> Result<T, BenchError> {
    r.map_err(|source| BenchError::Engine {
        context: what.to_string(),
        source,
    })
}

fn lay<T>(r: Result<T, LayerError>, what: &str) -> Result<T, BenchError> {
    r.map_err(|e| match e {
        LayerError::Engine(source) => BenchError::Engine {
            context: what.to_string(),
            source,
        },
        e => BenchError::Plan(format!("{what}: {e}")),
    })
}

/// Runs the subcommand.
pub fn run(a: LayerwiseArgs) -> Result<ExitCode, BenchError> {
    if a.serve_child {
        return serve_child(&a);
    }
    let transports: Vec<TransportKind> = match a.transport {
        LwTransport::Tcp => vec![TransportKind::Tcp],
        LwTransport::Shm => vec![TransportKind::Shm],
        LwTransport::Both => vec![TransportKind::Tcp, TransportKind::Shm],
    };
    let geo = Geometry::new(&a)?;
    println!(
        "layerwise: {} layers × {} B/layer ({} blocks × 2 parts × {} B); P blocks: runs of 1..={SRC_MAX_RUN} in a pool of {}; D blocks: fresh pool of {}, a break every ~{DST_RUN}; target = child process on 127.0.0.1; {} rounds per mode",
        geo.layers,
        geo.layer_bytes(),
        geo.blocks,
        geo.bb,
        geo.src_pool,
        geo.dst_pool,
        a.rounds
    );
    let coalescing = coalescing_table(&geo)?;
    let mut results = Vec::new();
    let mut summaries = Vec::new();
    for t in transports {
        let r = run_transport(&a, &geo, t)?;
        summaries.push(r.0);
        results.extend(r.1);
    }
    let cuda = cuda_note();
    eprintln!("cuda: {cuda}");
    if let Some(path) = &a.json {
        let doc = json!({
            "bench": "layerwise",
            "engine": "kvwire",
            "target": "child process, 127.0.0.1",
            "layers": geo.layers,
            "layer_bytes": geo.layer_bytes(),
            "block_bytes": geo.bb,
            "blocks_per_request": geo.blocks,
            "naive_writes_per_request": geo.naive_writes(),
            "transports": summaries,
            "results": results,
            "cuda": cuda,
            "coalescing": coalescing,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
        println!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn cuda_note() -> String {
    match kvwire_transfer::cuda::device_count() {
        Ok(n) if n > 0 => {
            format!("{n} CUDA device(s): device-memory rows (memory = cuda) measured on device 0")
        }
        Ok(_) => "skipped: no CUDA device".to_string(),
        Err(e) => format!("skipped: no CUDA device ({e})"),
    }
}

/// Writes per request after coalescing, planned (no transfer) for prompts of several lengths
/// with the same block-table generator, 48 layers (Qwen3-30B-A3B), 16-token blocks.
fn coalescing_table(geo: &Geometry) -> Result<Vec<serde_json::Value>, BenchError> {
    let layers = 48;
    let mut rows = Vec::new();
    println!("coalescing (planned, {layers} layers, 16-token blocks, same table generator):");
    println!(
        "  {:>7} {:>7} {:>10} {:>9} {:>7}",
        "tokens", "blocks", "naive", "writes", "ratio"
    );
    for tokens in [1024u64, 2048, 8192, 20_000, 50_000] {
        let blocks = tokens.div_ceil(16) as usize;
        let sp = (blocks * 4 + 8) as u32;
        let dp = (blocks + blocks / 8 + 8) as u32;
        let fake = kvwire_transfer::RegionId {
            index: 0,
            generation: 0,
        };
        let s = lay(
            KvPlacement::packed(SrcSpace::Device(0), 0, layers, sp, geo.bb, KvOrder::KvMajor),
            "placement",
        )?;
        let d = lay(
            KvPlacement::packed(fake, 0, layers, dp, geo.bb, KvOrder::KvMajor),
            "placement",
        )?;
        let l = lay(KvLayout::new(s, d, geo.bb), "layout")?;
        let (sb, db) = synthetic_block_tables(blocks, sp, SRC_MAX_RUN, dp, DST_RUN, 7)
            .ok_or_else(|| BenchError::Plan("cannot draw block tables".into()))?;
        let writes: usize = lay(l.request_extents(&sb, &db), "planning")?
            .iter()
            .map(Vec::len)
            .sum();
        let naive = blocks * layers * 2;
        let ratio = naive as f64 / writes.max(1) as f64;
        println!("  {tokens:>7} {blocks:>7} {naive:>10} {writes:>9} {ratio:>6.1}x");
        rows.push(json!({"tokens": tokens, "layers": layers, "blocks": blocks,
            "naive_writes": naive, "writes": writes, "ratio": ratio}));
    }
    Ok(rows)
}

struct Geometry {
    layers: usize,
    bb: u64,
    blocks: usize,
    /// P's pool: 4 × the request, half of it in use by others, so runs are cut.
    src_pool: u32,
    /// D's pool: fresh, a little larger than the request.
    dst_pool: u32,
}

/// Longest run of contiguous blocks P hands out (runs are uniform in 1..=this).
const SRC_MAX_RUN: u32 = 32;
/// D's contiguous runs break every this many blocks on average.
const DST_RUN: u32 = 256;

impl Geometry {
    fn new(a: &LayerwiseArgs) -> Result<Self, BenchError> {
        if a.layers == 0 || a.block_bytes == 0 || a.rounds == 0 {
            return Err(BenchError::Plan(
                "layers, block bytes and rounds must be positive".into(),
            ));
        }
        let blocks = (a.layer_bytes / (2 * a.block_bytes)) as usize;
        if blocks == 0 {
            return Err(BenchError::Plan(
                "--layer-bytes smaller than one block of K and V".into(),
            ));
        }
        let too_many = |_| BenchError::Plan("too many blocks".into());
        let src_pool = u32::try_from(blocks * 4 + 8).map_err(too_many)?;
        let dst_pool = u32::try_from(blocks + blocks / 8 + 8).map_err(too_many)?;
        Ok(Geometry {
            layers: a.layers,
            bb: a.block_bytes,
            blocks,
            src_pool,
            dst_pool,
        })
    }
    fn layer_bytes(&self) -> u64 {
        self.blocks as u64 * 2 * self.bb
    }
    fn src_len(&self) -> u64 {
        KvPlacement::<u32>::packed_len(self.layers, self.src_pool, self.bb).unwrap_or(u64::MAX)
    }
    fn dst_len(&self) -> u64 {
        KvPlacement::<u32>::packed_len(self.layers, self.dst_pool, self.bb).unwrap_or(u64::MAX)
    }
    fn naive_writes(&self) -> usize {
        self.blocks * self.layers * 2
    }
}

struct ChildTarget {
    child: Child,
    stdin: Option<ChildStdin>,
    addr: SocketAddr,
    notes: Option<std::sync::mpsc::Receiver<(String, u128)>>,
}

impl ChildTarget {
    fn spawn(t: TransportKind, region: u64) -> Result<Self, BenchError> {
        let exe = std::env::current_exe()?;
        let name = if t == TransportKind::Shm {
            "shm"
        } else {
            "tcp"
        };
        let mut child = Command::new(exe)
            .args([
                "layerwise",
                "--serve-child",
                "--transport",
                name,
                "--region-bytes",
                &region.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| BenchError::Spawn(e.to_string()))?;
        let stdin = child.stdin.take();
        let Some(out) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(BenchError::Spawn("no stdout".into()));
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let (ntx, nrx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Some(a) = line.strip_prefix(READY) {
                    let _ = tx.send(a.trim().to_string());
                } else if let Some(n) = line.strip_prefix(NOTE) {
                    let mut w = n.split_whitespace();
                    if let (Some(tag), Some(Ok(ns))) = (w.next(), w.next().map(str::parse)) {
                        let _ = ntx.send((tag.to_string(), ns));
                    }
                }
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a
                .parse()
                .map_err(|_| BenchError::Spawn(format!("bad ready line {a:?}"))),
            Err(_) => Err(BenchError::Timeout("the target process to start".into())),
        };
        match addr {
            Ok(addr) => Ok(ChildTarget {
                child,
                stdin,
                addr,
                notes: Some(nrx),
            }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }
}

impl Drop for ChildTarget {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve_child(a: &LayerwiseArgs) -> Result<ExitCode, BenchError> {
    let transport = match a.transport {
        LwTransport::Shm => TransportKind::Shm,
        _ => TransportKind::Tcp,
    };
    let e = eng(
        Engine::new(EngineConfig {
            transport,
            ..EngineConfig::from_env()
        }),
        "starting the target engine",
    )?;
    let len =
        usize::try_from(a.region_bytes).map_err(|_| BenchError::Plan("region too large".into()))?;
    let _r = eng(
        e.alloc_region(len, Access::ReadWrite),
        "allocating the target region",
    )?;
    // report each notification's arrival (tag, wall-clock ns) to the initiator
    let notes = e.notifications();
    std::thread::spawn(move || loop {
        match notes.recv_timeout(Duration::from_secs(1)) {
            Ok(n) => println!("{NOTE}{} {}", String::from_utf8_lossy(&n.tag), now_ns()),
            Err(kvwire_transfer::Error::Timeout) => continue,
            Err(_) => break,
        }
    });
    println!("{READY}{}", e.listen_addr());
    std::io::stdout().flush()?;
    // serve until the parent closes our stdin
    let mut sink = String::new();
    let stdin = std::io::stdin();
    let mut lock = stdin.lock();
    while lock.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
        sink.clear();
    }
    e.shutdown();
    Ok(ExitCode::SUCCESS)
}

struct Side {
    engine: Engine,
    peer: Peer,
    src: RegionHandle,
    scratch: RegionHandle,
    img: Vec<u8>,
    notes: std::sync::mpsc::Receiver<(String, u128)>,
}

fn ops_of(local: RegionHandle, layers: &[Vec<Extent>]) -> Vec<Op> {
    layers
        .iter()
        .flatten()
        .map(|e| Op {
            local,
            local_offset: e.src_offset,
            remote: e.dst,
            remote_offset: e.dst_offset,
            len: e.len,
        })
        .collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

fn run_transport(
    a: &LayerwiseArgs,
    geo: &Geometry,
    t: TransportKind,
) -> Result<(serde_json::Value, Vec<serde_json::Value>), BenchError> {
    let tname = if t == TransportKind::Shm {
        "shm"
    } else {
        "tcp"
    };
    let len = geo.src_len();
    let mut target = ChildTarget::spawn(t, geo.dst_len())?;
    let engine = eng(
        Engine::new(EngineConfig {
            transport: t,
            metrics_addr: a.metrics_addr,
            ..EngineConfig::from_env()
        }),
        "starting the initiator engine",
    )?;
    if let Some(m) = engine.metrics_addr() {
        eprintln!(
            "{}http://{m}/metrics",
            kvwire_bench::initiator::METRICS_PREFIX
        );
    }
    let peer = eng(engine.connect(target.addr), "connecting to the target")?;
    let dst = peer
        .regions()
        .first()
        .map(|r| r.id)
        .ok_or_else(|| BenchError::Target("the target offers no region".into()))?;
    let ulen = usize::try_from(len).map_err(|_| BenchError::Plan("region too large".into()))?;
    let src = eng(
        engine.alloc_region(ulen, Access::Local),
        "allocating the source",
    )?;
    let scratch = eng(
        engine.alloc_region(ulen, Access::Local),
        "allocating scratch",
    )?;
    let img = kvwire_testkit::pattern::bytes(IMAGE_SEED, 0, ulen);
    eng(engine.local_write(src, 0, &img), "filling the source")?;
    let notes = target
        .notes
        .take()
        .ok_or_else(|| BenchError::Spawn("no notification channel".into()))?;
    let side = Side {
        engine,
        peer,
        src,
        scratch,
        img,
        notes,
    };
    let s_place = lay(
        KvPlacement::packed(
            SrcSpace::Region(src),
            0,
            geo.layers,
            geo.src_pool,
            geo.bb,
            KvOrder::KvMajor,
        ),
        "source placement",
    )?;
    let d_place = lay(
        KvPlacement::packed(dst, 0, geo.layers, geo.dst_pool, geo.bb, KvOrder::KvMajor),
        "destination placement",
    )?;
    let layout = Arc::new(lay(KvLayout::new(s_place, d_place, geo.bb), "layout")?);

    // Touch every destination page once (zeroes from scratch), so no round pays first-touch
    // page faults on the target.
    let dlen = geo.dst_len();
    let chunk = (8u64 << 20).min(len);
    let prefault: Vec<Op> = (0..dlen.div_ceil(chunk))
        .map(|i| Op {
            local: side.scratch,
            local_offset: 0,
            remote: dst,
            remote_offset: i * chunk,
            len: chunk.min(dlen - i * chunk),
        })
        .collect();
    let b = eng(
        side.engine.write(&side.peer, &prefault, None, None),
        "prefaulting",
    )?;
    eng(b.wait(), "prefaulting")?;
    // One layer's transfer time: each of the request's layers sent alone, one after the
    // other (median), with the same coalesced writes; and all layers posted at once (median of
    // 5), what `whole` has to send after the last layer.
    let (s0, d0) = tables(geo, 1)?;
    let plan0 = lay(layout.request_extents(&s0, &d0), "planning")?;
    let mut one = Vec::new();
    for layer in plan0.iter().take(geo.layers.min(16)) {
        let ops = ops_of(side.src, std::slice::from_ref(layer));
        let t0 = Instant::now();
        let b = eng(
            side.engine.write(&side.peer, &ops, None, None),
            "posting one layer",
        )?;
        eng(b.wait(), "one layer")?;
        one.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    let layer_us = median(&mut one);
    let mut all = Vec::new();
    let all_ops = ops_of(side.src, &plan0);
    for _ in 0..5 {
        let t0 = Instant::now();
        let b = eng(
            side.engine.write(&side.peer, &all_ops, None, None),
            "posting all layers",
        )?;
        eng(b.wait(), "all layers")?;
        all.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    let all_us = median(&mut all);
    println!(
        "[{tname}] transfer alone: one layer {:.0} us ({:.2} GB/s), all {} layers {:.0} us ({:.2} GB/s)",
        layer_us,
        geo.layer_bytes() as f64 / layer_us / 1e3,
        geo.layers,
        all_us,
        (geo.layer_bytes() * geo.layers as u64) as f64 / all_us / 1e3,
    );
    // A layer's transfer time, for the pipelining condition: the slower of one layer alone
    // and the sustained per-layer time of all layers back to back.
    let per_layer_us = layer_us.max(all_us / geo.layers as f64);
    let compute_us = a
        .compute_us
        .unwrap_or(((2.0 * per_layer_us) as u64).max(500));
    println!(
        "[{tname}] per-layer transfer time {per_layer_us:.0} us; compute per layer: {compute_us} us{}{}",
        if a.compute_us.is_none() {
            " (auto: 2 × per-layer transfer)"
        } else {
            ""
        },
        if (compute_us as f64) < per_layer_us {
            " — below the transfer time: layers queue up"
        } else {
            ""
        }
    );

    let mut out = Vec::new();
    let mut table = Vec::new();
    let host = Memory::Host;
    run_modes(
        a, geo, &side, &layout, &host, tname, layer_us, compute_us, &mut out, &mut table,
    )?;
    if let Some(cuda) = cuda_memory(&side, geo)? {
        let s_dev = lay(
            KvPlacement::packed(
                cuda.space,
                0,
                geo.layers,
                geo.src_pool,
                geo.bb,
                KvOrder::KvMajor,
            ),
            "device placement",
        )?;
        let d_place = layout.dst().clone();
        let dl = Arc::new(lay(KvLayout::new(s_dev, d_place, geo.bb), "layout")?);
        let mem = Memory::Cuda(cuda);
        let mut t2 = Vec::new();
        run_modes(
            a, geo, &side, &dl, &mem, tname, layer_us, compute_us, &mut out, &mut t2,
        )?;
        table.extend(t2);
    }
    println!(
        "[{tname}] {:<16} {:>12} {:>12} {:>13} {:>13} {:>7} {:>7}",
        "memory/mode",
        "tail_p50_us",
        "tail_max_us",
        "acked_p50_us",
        "total_p50_us",
        "writes",
        "naive"
    );
    for (mode, tp, tm, ack, tot, w) in &table {
        println!(
            "[{tname}] {mode:<16} {tp:>12.0} {tm:>12.0} {ack:>13.0} {tot:>13.0} {w:>7} {:>7}",
            geo.naive_writes()
        );
    }
    let lw = table
        .iter()
        .find(|r| r.0 == "host/layerwise")
        .map(|r| r.1)
        .unwrap_or(0.0);
    let wh = table
        .iter()
        .find(|r| r.0 == "host/whole")
        .map(|r| r.1)
        .unwrap_or(0.0);
    println!(
        "[{tname}] layerwise tail p50 {:.0} us vs per-layer transfer + 1 ms = {:.0} us ({}); whole tail p50 {:.0} us vs all layers alone {:.0} us; all rounds verified byte for byte",
        lw,
        per_layer_us + 1000.0,
        if lw <= per_layer_us + 1000.0 { "within" } else { "ABOVE" },
        wh,
        all_us
    );
    let summary = json!({"transport": tname, "one_layer_us": layer_us, "all_layers_us": all_us, "per_layer_us": per_layer_us, "compute_us": compute_us,
        "layerwise_tail_within_one_layer_plus_1ms": lw <= per_layer_us + 1000.0});
    Ok((summary, out))
}

fn tables(geo: &Geometry, seed: u64) -> Result<(Vec<u32>, Vec<u32>), BenchError> {
    synthetic_block_tables(
        geo.blocks,
        geo.src_pool,
        SRC_MAX_RUN,
        geo.dst_pool,
        DST_RUN,
        seed,
    )
    .ok_or_else(|| BenchError::Plan("cannot draw block tables".into()))
}

/// Zeroes the request's destination blocks on the target (not timed).
fn clear(side: &Side, plan: &[Vec<Extent>]) -> Result<(), BenchError> {
    eng(
        side.engine
            .local_write(side.scratch, 0, &vec![0u8; side.img.len()]),
        "zeroing scratch",
    )?;
    let ops = ops_of(side.scratch, plan);
    eng(
        eng(side.engine.write(&side.peer, &ops, None, None), "clearing")?.wait(),
        "clearing",
    )?;
    Ok(())
}

/// Reads the destination blocks back and compares them with the source (not timed).
fn verify(side: &Side, plan: &[Vec<Extent>]) -> Result<(), BenchError> {
    let ops = ops_of(side.scratch, plan);
    eng(
        eng(side.engine.read(&side.peer, &ops, None), "reading back")?.wait(),
        "reading back",
    )?;
    let mut buf = Vec::new();
    for op in &ops {
        buf.resize(op.len as usize, 0);
        eng(
            side.engine
                .local_read(side.scratch, op.local_offset, &mut buf),
            "reading scratch",
        )?;
        let s = op.local_offset as usize;
        if buf[..] != side.img[s..s + op.len as usize] {
            return Err(BenchError::Target(format!(
                "destination bytes at region offset {} ({} bytes) differ from the source",
                op.remote_offset, op.len
            )));
        }
    }
    Ok(())
}

/// One request's figures.
struct Timing {
    /// Last layer ready → the target saw the notification (all bytes landed).
    tail_us: f64,
    /// Last layer ready → the initiator saw the stream complete (acks back).
    acked_tail_us: f64,
    /// First layer's compute start → stream complete.
    total_us: f64,
    stats: StreamStats,
}

/// Where the request's KV cache lives on P.
enum Memory {
    /// Host memory registered with the engine.
    Host,
    /// CUDA device memory, staged through pinned buffers.
    Cuda(CudaMem),
}

impl Memory {
    fn name(&self) -> &'static str {
        match self {
            Memory::Host => "host",
            Memory::Cuda(_) => "cuda",
        }
    }
}

struct CudaMem {
    ctx: Arc<kvwire_transfer::cuda::driver_api::CudaContext>,
    compute: Arc<kvwire_transfer::cuda::driver_api::CudaStream>,
    stager: Arc<kvwire_transfer::cuda::CudaStager>,
    space: SrcSpace,
}

/// The source image uploaded to device 0, and a stager for it; `None` (with a loud line)
/// when there is no CUDA device.
fn cuda_memory(side: &Side, geo: &Geometry) -> Result<Option<CudaMem>, BenchError> {
    use kvwire_transfer::cuda;
    let ctx = match cuda::device_count() {
        Ok(n) if n > 0 => cuda::context(0).map_err(|e| BenchError::Plan(format!("cuda: {e}")))?,
        _ => {
            eprintln!("cuda memory: skipped: no CUDA device");
            return Ok(None);
        }
    };
    let ce = |e: kvwire_transfer::cuda::driver_api::DriverError| {
        BenchError::Plan(format!("cuda: {e:?}"))
    };
    let compute = ctx.new_stream().map_err(ce)?;
    let kv = compute.clone_htod(&side.img).map_err(ce)?;
    compute.synchronize().map_err(ce)?;
    let buf = geo.layer_bytes().min(8 << 20) as usize;
    let stager = cuda::CudaStager::new(&side.engine, ctx.clone(), 4, buf)
        .map_err(|e| BenchError::Plan(format!("cuda stager: {e}")))?;
    let space = stager
        .register_owned(kv, &compute)
        .map_err(|e| BenchError::Plan(format!("cuda: {e}")))?;
    Ok(Some(CudaMem {
        ctx,
        compute,
        stager,
        space,
    }))
}

#[allow(clippy::too_many_arguments)]
fn run_modes(
    a: &LayerwiseArgs,
    geo: &Geometry,
    side: &Side,
    layout: &Arc<KvLayout>,
    mem: &Memory,
    tname: &str,
    layer_us: f64,
    compute_us: u64,
    out: &mut Vec<serde_json::Value>,
    table: &mut Vec<(String, f64, f64, f64, f64, usize)>,
) -> Result<(), BenchError> {
    for mode in ["whole", "layerwise"] {
        let (mut tails, mut totals, mut acked) = (Vec::new(), Vec::new(), Vec::new());
        let mut stats = StreamStats::default();
        for round in 0..a.rounds + 1 {
            let (sb, db) = tables(geo, 1000 + round as u64)?;
            let plan = lay(layout.request_extents(&sb, &db), "planning")?;
            let t = one_request(
                side,
                layout,
                geo,
                (&sb, &db, &plan),
                compute_us,
                mode == "layerwise",
                round,
                mem,
            )?;
            if round > 0 {
                // round 0 warms up
                tails.push(t.tail_us);
                acked.push(t.acked_tail_us);
                totals.push(t.total_us);
                stats = t.stats;
            }
        }
        let tail_p50 = median(&mut tails);
        let total_p50 = median(&mut totals);
        let acked_p50 = median(&mut acked);
        let tail_max = tails.iter().cloned().fold(0.0, f64::max);
        table.push((
            format!("{}/{mode}", mem.name()),
            tail_p50,
            tail_max,
            acked_p50,
            total_p50,
            stats.writes,
        ));
        out.push(json!({
            "transport": tname,
            "memory": mem.name(),
            "mode": mode,
            "layers": geo.layers,
            "layer_bytes": geo.layer_bytes(),
            "compute_us": compute_us,
            "one_layer_us": layer_us,
            "exposed_tail_us_p50": tail_p50,
            "exposed_tail_us_max": tail_max,
            "exposed_tail_us": tails,
            "acked_tail_us_p50": acked_p50,
            "total_us_p50": total_p50,
            "writes_per_request": stats.writes,
            "naive_writes_per_request": geo.naive_writes(),
            "batches_per_request": stats.batches,
            "separate_notify": stats.separate_notify,
            "verified": true,
        }));
    }
    Ok(())
}

/// One request: D's blocks zeroed (not timed), layers computed and streamed (timed), the
/// destination read back and compared (not timed).
#[allow(clippy::too_many_arguments)]
fn one_request(
    side: &Side,
    layout: &Arc<KvLayout>,
    geo: &Geometry,
    (sb, db, plan): (&[u32], &[u32], &[Vec<Extent>]),
    compute_us: u64,
    layerwise: bool,
    round: usize,
    mem: &Memory,
) -> Result<Timing, BenchError> {
    clear(side, plan)?;
    let tag = format!(
        "lw-{}-{}-{round}",
        mem.name(),
        if layerwise { "lw" } else { "whole" }
    );
    let stager: Option<Arc<dyn kvwire_transfer::layer::Stager>> = match mem {
        Memory::Host => None,
        Memory::Cuda(c) => Some(c.stager.clone()),
    };
    let stream = lay(
        LayerStream::open(
            &side.engine,
            &side.peer,
            layout.clone(),
            BlockLists::Shared(sb.to_vec()),
            Some(BlockLists::Shared(db.to_vec())),
            StreamOptions {
                tag: Some(tag.clone().into_bytes()),
                deadline: Duration::from_secs(120),
                stager,
            },
        ),
        "opening the stream",
    )?;
    let ready = |l: usize| -> Result<(), BenchError> {
        match mem {
            Memory::Host => lay(stream.layer_ready(l, Immediate), "layer_ready"),
            Memory::Cuda(c) => {
                let ev = kvwire_transfer::cuda::EventReadiness::record_on_stream(
                    c.ctx.clone(),
                    c.stager.waiter(),
                    &c.compute,
                )
                .map_err(|e| BenchError::Plan(format!("cuda event: {e}")))?;
                lay(stream.layer_ready(l, ev), "layer_ready")
            }
        }
    };
    let t0 = Instant::now();
    let step = Duration::from_micros(compute_us);
    let mut next = t0;
    for l in 0..geo.layers {
        // simulated compute: sleep until this layer's end time (no drift accumulation)
        next += step;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
        if layerwise {
            ready(l)?;
        }
    }
    let t_last = Instant::now();
    let t_last_ns = now_ns();
    if !layerwise {
        for l in 0..geo.layers {
            ready(l)?;
        }
    }
    let st = lay(stream.wait(), "streaming the request")?;
    let t_done = Instant::now();
    // when the target saw the notification (after every byte landed)
    let landed_ns = loop {
        match side.notes.recv_timeout(Duration::from_secs(10)) {
            Ok((t, ns)) if t == tag => break ns,
            Ok(_) => continue,
            Err(_) => {
                return Err(BenchError::Timeout(format!(
                    "the target's notification {tag}"
                )))
            }
        }
    };
    verify(side, plan)?;
    Ok(Timing {
        tail_us: landed_ns.saturating_sub(t_last_ns) as f64 / 1e3,
        acked_tail_us: (t_done - t_last).as_secs_f64() * 1e6,
        total_us: (t_done - t0).as_secs_f64() * 1e6,
        stats: st,
    })
}

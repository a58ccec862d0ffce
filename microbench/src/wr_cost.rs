//! `kvwire-bench wr-cost`: the CPU the engine's RDMA path spends per work request, without a
//! NIC. Two engines of this process talk over the in-process software device
//! (`kvwire-verbs-loopback`, loaded in place of libibverbs), which checks every request
//! against its regions as a NIC does and then, for the timed rounds, moves no byte: what is
//! left is the engine's own cost and the device's table lookups.
//!
//! Per slice size × signalling interval: one verified batch first (the bytes moved and checked
//! at the target), then `--rounds` batches of `--wrs` work requests of one slice each, timed
//! by CPU clocks: the submitting thread's inside `write()` (cut into work requests, the
//! signalling plan, posting; the device executes the request inside the post), the completion
//! thread's (`rdma-cq-loop0`: polling, retiring requests, finishing batches) and the whole
//! process's. Next to it, the floor: the same chains posted and polled on one queue pair
//! through the verbs layer alone, no engine. From the per-request costs, the rate one core
//! sustains, next to what 200 and 400 Gb/s need at that slice size.
//!
//! Then KV-shaped batches (`--blocks`): blocks scattered in the initiator's memory and bound
//! for consecutive bytes at the target (a P cache writing into a run of D's blocks), which
//! coalescing cannot merge, with one block per work request (`rdma_max_sge` 1) and with the
//! engine's scatter-gather lists (default): CPU per *block*, both measured in one run.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use kvwire_bench::plan::parse_size;
use kvwire_bench::{cpu, BenchError};
use kvwire_transfer::verbs::{
    find_loopback, Access as VAccess, ConnectParams, Cq, Loopback, Mtu, Qp, QpCaps, SendOp,
    SendRequest, Verbs,
};
use kvwire_transfer::{Access, Engine, EngineConfig, Op, Peer, TransportKind};
use serde_json::json;

#[derive(Args)]
pub struct WrCostArgs {
    /// The loopback device's library [default: libkvwire_verbs_loopback.so next to this
    /// binary, which `cargo build -p kvwire-bench` builds with it].
    #[arg(long, value_name = "PATH")]
    verbs: Option<PathBuf>,
    /// Slice sizes (one work request each), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "4K,16K,64K,256K,1M", value_parser = parse_size)]
    slices: Vec<u64>,
    /// Signal one work request in this many (the engine's `rdma_signal_every`), comma
    /// separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    signal_every: Vec<u64>,
    /// Work requests per batch (at most what the queue pairs hold, so that the submitting
    /// thread posts them all).
    #[arg(long, default_value_t = 256)]
    wrs: usize,
    /// KV block sizes for the scatter-gather rows (`--wrs` blocks per batch, 1 MiB slices),
    /// comma separated; 0: none.
    #[arg(long, value_delimiter = ',', default_value = "16K,64K", value_parser = parse_size)]
    blocks: Vec<u64>,
    /// Timed batches per row.
    #[arg(long, default_value_t = 200)]
    rounds: usize,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// `init` connected to `target` over rdma (an error if the pair chose another transport).
pub fn connect_rdma(init: &Engine, target: &Engine) -> Result<Peer, BenchError> {
    let peer = init
        .connect(target.listen_addr())
        .map_err(|e| plan(format!("connect: {e}")))?;
    if peer.transport() != TransportKind::Rdma {
        return Err(plan(format!(
            "the pair chose {:?}, not rdma",
            peer.transport()
        )));
    }
    Ok(peer)
}

/// A plan error from a message (also `slice-ab`'s).
pub fn plan(m: impl std::fmt::Display) -> BenchError {
    BenchError::Plan(m.to_string())
}

fn ns_per(d: Option<Duration>, n: u64) -> Option<f64> {
    d.map(|d| d.as_nanos() as f64 / n.max(1) as f64)
}

fn since(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    Some(b?.saturating_sub(a?))
}

/// What one row's batches look like.
struct Shape {
    /// Bytes per op.
    unit: u64,
    slice_size: u64,
    signal_every: u64,
    /// Ops scattered in the initiator's memory, consecutive at the target.
    scattered: bool,
    max_sge: Option<u64>,
}

struct Row {
    slice: u64,
    signal_every: u64,
    /// Ops timed (one work request each in the slice rows).
    wrs: u64,
    /// Work requests posted per batch.
    wrs_per_batch: f64,
    post_ns: Option<f64>,
    completion_ns: Option<f64>,
    process_ns: Option<f64>,
    completions_per_wr: f64,
    wall_wr_per_s: f64,
}

/// One row through the engine: returns its per-op figures.
fn engine_row(lo: &Loopback, sh: &Shape, a: &WrCostArgs) -> Result<Row, BenchError> {
    let (slice, signal_every) = (sh.unit, sh.signal_every);
    let cfg = EngineConfig {
        transport: TransportKind::Rdma,
        rdma_devices: vec!["loop0".into()],
        slice_size: sh.slice_size as usize,
        // Every work request of a row at the row's slice size (no adaptive growth).
        rdma_slice_max: Some(sh.slice_size),
        rdma_signal_every: Some(signal_every),
        rdma_max_sge: sh.max_sge,
        wait_spin: Some(Duration::ZERO),
        ..EngineConfig::from_env()
    };
    let target = Engine::new(cfg.clone()).map_err(|e| plan(format!("target engine: {e}")))?;
    let init = Engine::new(cfg).map_err(|e| plan(format!("initiator engine: {e}")))?;
    let len = slice as usize * a.wrs;
    let dst = target
        .alloc_region(len, Access::WriteOnly)
        .map_err(|e| plan(format!("target region: {e}")))?;
    let src = init
        .alloc_region(len, Access::Local)
        .map_err(|e| plan(format!("source region: {e}")))?;
    let peer = connect_rdma(&init, &target)?;
    // One op per slice, in reverse order (coalesced back into one transfer, cut into a work
    // request per slice); scattered: local slots reversed against the remote ones, so that
    // nothing coalesces.
    let n_ops = a.wrs as u64;
    let ops: Vec<Op> = (0..n_ops)
        .rev()
        .map(|i| Op {
            local: src,
            local_offset: if sh.scattered { n_ops - 1 - i } else { i } * slice,
            remote: target.region_id(dst),
            remote_offset: i * slice,
            len: slice,
        })
        .collect();
    // Verified batch: the bytes move and are checked at the target.
    lo.set_copy(true);
    let data = kvwire_testkit::pattern::bytes(slice ^ signal_every, 0, len);
    init.local_write(src, 0, &data)
        .map_err(|e| plan(format!("fill: {e}")))?;
    let st = init
        .write(&peer, &ops, None, None)
        .and_then(|b| b.wait())
        .map_err(|e| plan(format!("verified batch: {e}")))?;
    let mut got = vec![0u8; len];
    target
        .local_read(dst, 0, &mut got)
        .map_err(|e| plan(format!("read back: {e}")))?;
    let want = |i: u64| {
        let at = ops[(n_ops - 1 - i) as usize].local_offset as usize;
        &data[at..at + slice as usize]
    };
    if (0..n_ops).any(|i| &got[(i * slice) as usize..((i + 1) * slice) as usize] != want(i)) {
        return Err(plan(format!(
            "op size {slice}: the verified batch's bytes differ at the target"
        )));
    }
    // Timed batches: checked by the device, no byte moved.
    lo.set_copy(false);
    let warm = init.write(&peer, &ops, None, None).and_then(|b| b.wait());
    warm.map_err(|e| plan(format!("warm-up batch: {e}")))?;
    let (_, polled0) = lo.counters();
    let cq0 = cpu::threads_named("rdma-cq-");
    let proc0 = cpu::process();
    let t0 = Instant::now();
    let mut post = Duration::ZERO;
    let mut post_ok = true;
    for _ in 0..a.rounds {
        let c0 = cpu::thread();
        let b = init
            .write(&peer, &ops, None, None)
            .map_err(|e| plan(format!("submit: {e}")))?;
        match (c0, cpu::thread()) {
            (Some(x), Some(y)) => post += y.saturating_sub(x),
            _ => post_ok = false,
        }
        b.wait().map_err(|e| plan(format!("batch: {e}")))?;
    }
    let wall = t0.elapsed();
    let proc1 = cpu::process();
    let cq1 = cpu::threads_named("rdma-cq-");
    let (_, polled1) = lo.counters();
    lo.set_copy(true);
    let n = (a.rounds * a.wrs) as u64;
    Ok(Row {
        slice,
        signal_every,
        wrs: n,
        wrs_per_batch: st.slices as f64,
        post_ns: post_ok.then(|| post.as_nanos() as f64 / n as f64),
        completion_ns: ns_per(since(cq0, cq1), n),
        process_ns: ns_per(since(proc0, proc1), n),
        completions_per_wr: polled1.saturating_sub(polled0) as f64 / n as f64,
        wall_wr_per_s: n as f64 / wall.as_secs_f64(),
    })
}

/// Two connected queue pairs on `loop0` and a registered buffer, through the verbs layer.
struct Floor {
    a: Qp,
    /// The responder: never posted on, kept so that the device keeps `a`'s partner.
    _b: Qp,
    scq: Cq,
    buf: kvwire_transfer::verbs::RegisteredBuffer,
}

fn floor_setup(path: &std::path::Path, len: usize, depth: u32) -> Result<Floor, BenchError> {
    let v = |e: kvwire_transfer::verbs::VerbsError| plan(format!("verbs floor: {e}"));
    let verbs = Verbs::load_from(&path.display().to_string()).map_err(v)?;
    let ctx = verbs.open("loop0").map_err(v)?;
    let port = ctx.query_port(1).map_err(v)?;
    let gid = ctx.select_gid(1).map_err(v)?;
    let pd = ctx.alloc_pd().map_err(v)?;
    let scq = ctx.create_cq(depth * 2).map_err(v)?;
    let rcq = ctx.create_cq(16).map_err(v)?;
    let caps = QpCaps {
        max_send_wr: depth,
        ..QpCaps::default()
    };
    let a = pd.create_rc_qp(&scq, &rcq, caps).map_err(v)?;
    let b = pd.create_rc_qp(&scq, &rcq, caps).map_err(v)?;
    let ea = a.endpoint(gid.gid, port.lid, 1);
    let eb = b.endpoint(gid.gid, port.lid, 2);
    a.connect(&ConnectParams::new(1, gid.index, Mtu::M4096, eb, 1))
        .map_err(v)?;
    b.connect(&ConnectParams::new(1, gid.index, Mtu::M4096, ea, 2))
        .map_err(v)?;
    let buf = pd.register_buffer(len, VAccess::all_rdma()).map_err(v)?;
    Ok(Floor { a, _b: b, scq, buf })
}

/// The floor: chains of `wrs` requests posted on one queue pair and their completions polled,
/// on this thread, through the verbs layer alone (ns per request, all of it on this thread).
fn floor_row(
    path: &std::path::Path,
    slice: u64,
    signal_every: u64,
    a: &WrCostArgs,
) -> Result<f64, BenchError> {
    let v = |e: kvwire_transfer::verbs::VerbsError| plan(format!("verbs floor: {e}"));
    let len = (slice as usize) * 2;
    let f = floor_setup(path, len, a.wrs as u32)?;
    let local = f.buf.mr().sge(0, slice as usize).map_err(v)?;
    let remote = f
        .buf
        .mr()
        .remote(slice as usize, slice as usize)
        .map_err(v)?;
    let locals = [local];
    let every = signal_every.max(1) as usize;
    let reqs: Vec<SendRequest<'_>> = (0..a.wrs)
        .map(|i| SendRequest {
            wr_id: i as u64,
            op: SendOp::Write,
            local: &locals,
            remote,
            signaled: (i + 1) % every == 0 || i + 1 == a.wrs,
        })
        .collect();
    let want = reqs.iter().filter(|r| r.signaled).count();
    let mut out = Vec::with_capacity(want);
    let c0 = cpu::thread();
    for _ in 0..a.rounds {
        f.a.post_send(&reqs).map_err(v)?;
        let mut got = 0;
        while got < want {
            out.clear();
            got += f.scq.poll(&mut out, want).map_err(v)?;
            if out.iter().any(|c| c.result.is_err()) {
                return Err(plan("verbs floor: a request failed on the loopback device"));
            }
        }
    }
    let c1 = cpu::thread();
    ns_per(since(c0, c1), (a.rounds * a.wrs) as u64)
        .ok_or_else(|| plan("verbs floor: no thread CPU clock"))
}

/// Gb/s on the wire → work requests per second at `slice` bytes each.
fn needed(gbps: f64, slice: u64) -> f64 {
    gbps * 1e9 / 8.0 / slice as f64
}

fn fmt(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.0}"))
}

/// Makes engines of this process load the loopback device (`verbs`, or the library next to this
/// binary) as their verbs library, with one device; returns its path.
pub fn use_loopback(verbs: Option<&std::path::Path>) -> Result<PathBuf, BenchError> {
    let exe = std::env::current_exe().map_err(|e| plan(format!("this binary's path: {e}")))?;
    let path = match verbs {
        Some(p) => p.to_path_buf(),
        None => find_loopback(&exe).ok_or_else(|| {
            plan(format!(
                "no libkvwire_verbs_loopback.so next to {} (build it: cargo build --release \
                 -p kvwire-bench, or name it with --verbs)",
                exe.display()
            ))
        })?,
    };
    std::env::set_var(kvwire_transfer::verbs::LIBRARY_ENV, &path);
    std::env::set_var("KVWIRE_LOOPBACK_DEVICES", "1");
    Ok(path)
}

pub fn run(a: &WrCostArgs) -> Result<ExitCode, BenchError> {
    let path = use_loopback(a.verbs.as_deref())?;
    if a.wrs == 0 || a.rounds == 0 {
        return Err(plan("--wrs and --rounds must be at least 1"));
    }
    let lo = Loopback::load(&path).map_err(|e| plan(format!("loopback device: {e}")))?;
    // Holds the device open for the whole run, so that every row measures the same completion
    // thread (one per device per process; it ends when its last engine is gone).
    let _anchor = Engine::new(EngineConfig {
        transport: TransportKind::Rdma,
        rdma_devices: vec!["loop0".into()],
        ..EngineConfig::from_env()
    })
    .map_err(|e| plan(format!("engine on the loopback device: {e}")))?;
    let mut rows = Vec::new();
    let mut floors = Vec::new();
    for &slice in &a.slices {
        for &every in &a.signal_every {
            let sh = Shape {
                unit: slice,
                slice_size: slice,
                signal_every: every,
                scattered: false,
                max_sge: None,
            };
            rows.push(engine_row(&lo, &sh, a)?);
            lo.set_copy(false);
            let fl = floor_row(&path, slice, every, a);
            lo.set_copy(true);
            floors.push(fl?);
        }
    }
    let mut gathered = Vec::new();
    for &block in a.blocks.iter().filter(|&&b| b > 0) {
        for max_sge in [Some(1), None] {
            let sh = Shape {
                unit: block,
                slice_size: 1 << 20,
                signal_every: 16,
                scattered: true,
                max_sge,
            };
            gathered.push((max_sge, engine_row(&lo, &sh, a)?));
        }
    }
    println!(
        "# kvwire-bench wr-cost: CPU per RDMA work request on the loopback device ({} per \
         batch, {} batches per row; the device checks each request, moves no byte)",
        a.wrs, a.rounds
    );
    println!();
    println!(
        "| slice | signal 1 in | post ns/WR | completion ns/WR | engine ns/WR | process ns/WR | \
         verbs floor ns/WR | completions/WR | WR/s per core | needed at 200 / 400 Gb/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut js = Vec::new();
    for (r, fl) in rows.iter().zip(&floors) {
        let engine = match (r.post_ns, r.completion_ns) {
            (Some(p), Some(c)) => Some(p + c),
            _ => None,
        };
        let per_core = engine.map(|e| 1e9 / e);
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.0} | {:.3} | {} | {:.0}k / {:.0}k |",
            kvwire_bench::plan::fmt_size(r.slice),
            r.signal_every,
            fmt(r.post_ns),
            fmt(r.completion_ns),
            fmt(engine),
            fmt(r.process_ns),
            fl,
            r.completions_per_wr,
            per_core.map_or("-".into(), |x| format!("{:.0}k", x / 1e3)),
            needed(200.0, r.slice) / 1e3,
            needed(400.0, r.slice) / 1e3,
        );
        js.push(json!({
            "slice": r.slice,
            "signal_every": r.signal_every,
            "wrs": r.wrs,
            "post_ns_per_wr": r.post_ns,
            "completion_ns_per_wr": r.completion_ns,
            "engine_ns_per_wr": engine,
            "process_ns_per_wr": r.process_ns,
            "verbs_floor_ns_per_wr": fl,
            "completions_per_wr": r.completions_per_wr,
            "wr_per_s_per_core": per_core,
            "wall_wr_per_s": r.wall_wr_per_s,
            "needed_wr_per_s_200g": needed(200.0, r.slice),
            "needed_wr_per_s_400g": needed(400.0, r.slice),
        }));
    }
    println!();
    println!(
        "post: the submitting thread inside write(); completion: the completion thread; engine = \
         post + completion; process: every thread of this process (target side and waits \
         included); floor: the same chains posted and polled through the verbs layer alone."
    );
    let gjs = print_gathered(&gathered, a);
    if let Some(p) = &a.json {
        let doc = json!({
            "bench": "wr-cost",
            "library": path.display().to_string(),
            "rows": js,
            "gather_rows": gjs,
        });
        std::fs::write(p, serde_json::to_vec_pretty(&doc).unwrap_or_default())
            .map_err(|e| plan(format!("{}: {e}", p.display())))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The scatter-gather rows (pairs: one block per work request, then gathered), as a table and
/// as JSON.
fn print_gathered(rows: &[(Option<u64>, Row)], a: &WrCostArgs) -> Vec<serde_json::Value> {
    if rows.is_empty() {
        return Vec::new();
    }
    println!();
    println!(
        "## KV blocks scattered locally, consecutive at the target ({} per batch, 1 MiB slices, \
         signal 1 in 16): CPU per block",
        a.wrs
    );
    println!();
    println!(
        "| block | pieces per WR | WRs per batch | post ns/block | completion ns/block | \
         engine ns/block | blocks/s per core | engine vs 1 piece per WR |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let engine = |r: &Row| match (r.post_ns, r.completion_ns) {
        (Some(p), Some(c)) => Some(p + c),
        _ => None,
    };
    let mut js = Vec::new();
    let mut single: Option<f64> = None;
    for (max_sge, r) in rows {
        let e = engine(r);
        if *max_sge == Some(1) {
            single = e;
        }
        let ratio = match (max_sge, e, single) {
            (None, Some(x), Some(y)) if y > 0.0 => Some(x / y),
            _ => None,
        };
        let pieces = max_sge.map_or("default (16)".to_string(), |n| n.to_string());
        println!(
            "| {} | {pieces} | {:.0} | {} | {} | {} | {} | {} |",
            kvwire_bench::plan::fmt_size(r.slice),
            r.wrs_per_batch,
            fmt(r.post_ns),
            fmt(r.completion_ns),
            fmt(e),
            e.map_or("-".into(), |x| format!("{:.0}k", 1e6 / x)),
            ratio.map_or("-".into(), |x| format!("{x:.2}")),
        );
        js.push(json!({
            "block": r.slice,
            "max_sge": max_sge,
            "blocks": r.wrs,
            "wrs_per_batch": r.wrs_per_batch,
            "post_ns_per_block": r.post_ns,
            "completion_ns_per_block": r.completion_ns,
            "engine_ns_per_block": e,
            "process_ns_per_block": r.process_ns,
            "completions_per_block": r.completions_per_wr,
            "engine_vs_single": ratio,
        }));
    }
    js
}

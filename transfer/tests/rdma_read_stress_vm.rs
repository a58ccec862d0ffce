//! READ stress inside the SoftRoCE VM (`tests/vm/run.sh`), for diagnosing batches that
//! complete with a slice not landed: many READ batches of 1 MiB and 5 MiB (+3) into ONE local
//! region at shifting offsets (like `reads_of_many_sizes` in `rdma_engine_vm.rs`), every byte
//! verified after every batch.
//!
//! On a mismatch it prints, per wrong 64 KiB slice of the op: its byte range, the lane (queue
//! pair) and local device the striping put it on (exact while no work request was re-posted,
//! which the re-post counter tells), whether the wrong bytes are the buffer's previous content
//! (a slice that did not land, or a late landing of the previous batch), whether the wrong range
//! follows this op's slice boundaries (this batch's slice missing) or the previous op's (a ghost
//! of the previous batch); then it re-checks the buffer after 50 ms and 500 ms (data appearing
//! late: the batch completed early; flipping to other data: a ghost landing; unchanged: lost)
//! and prints the engine's counters (work requests per lane, re-posts, lanes re-established)
//! and every rxe hw_counter that moved during the batch. The test fails if any byte was wrong.
//!
//! Knobs (environment, passed into the guest): `KVWIRE_STRESS_ITERS` (rounds of 1 MiB + 5 MiB,
//! default 150), `KVWIRE_STRESS_LANES` (queue pairs per device pair, default 4),
//! `KVWIRE_STRESS_DEVICES` (1: target on rxe0, initiator on rxe1; 2 (default): target on
//! [rxe0, rxe1], initiator on [rxe1, rxe0], as in the `multi_device` part of the engine suite),
//! `KVWIRE_STRESS_TRACE=0` (do not record the engine's per-work-request trace events),
//! `KVWIRE_STRESS_BACKLOG=<n>` (set the guest's `net.core.netdev_max_backlog` first; the guest
//! boots with 100000, which removes the packet drops: `KVWIRE_STRESS_BACKLOG=1000`, the kernel's
//! default, brings back the drops that make rxe lose READs).
//!
//! Not part of the CI VM stage (it runs for minutes); run it with
//! `KVWIRE_VM_TESTS=1 cargo test -p kvwire-transfer --test rdma_read_stress_vm -- --nocapture`,
//! or build it and pass the binary to `tests/vm/run.sh <binary> read_stress_in_softroce_vm
//! --exact --nocapture`. On the host without `KVWIRE_VM_TESTS=1` it prints `SKIPPED`.

mod vm_common;
use vm_common::pattern;

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvwire_transfer::{Access, Engine, EngineConfig, Op, TransportKind};

const NAME: &str = "read_stress_in_softroce_vm";
const REGION: usize = 16 << 20;
const SLICE: usize = 64 << 10;

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn engine(devs: &[&str], lanes: usize) -> Engine {
    let (rdma_device, rdma_devices) = match devs {
        [one] => (Some(one.to_string()), Vec::new()),
        many => (None, many.iter().map(|d| d.to_string()).collect()),
    };
    Engine::new(EngineConfig {
        transport: TransportKind::Rdma,
        lanes,
        slice_size: SLICE,
        // Fixed slices: the mismatch report maps slices to lanes by index.
        rdma_slice_max: Some(SLICE as u64),
        rdma_device,
        rdma_devices,
        default_deadline: Duration::from_secs(120),
        // The run's knobs (signalling, poll window) from the environment.
        ..EngineConfig::from_env()
    })
    .unwrap_or_else(|e| panic!("engine on {devs:?}: {e}"))
}

/// Every rxe hw_counter of a device (`/sys/class/infiniband/<dev>/ports/1/hw_counters`).
fn hw_counters(dev: &str) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    let dir = format!("/sys/class/infiniband/{dev}/ports/1/hw_counters");
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(v) = std::fs::read_to_string(e.path())
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                m.insert(name, v);
            }
        }
    }
    m
}

fn counter_delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> String {
    let v: Vec<String> = after
        .iter()
        .filter_map(|(k, a)| {
            let b = before.get(k).copied().unwrap_or(0);
            (*a != b).then(|| format!("{k}+{}", a.wrapping_sub(b)))
        })
        .collect();
    v.join(" ")
}

/// Ranges `[start, end)` where `got` and `want` differ (gaps under 64 bytes bridged).
fn bad_ranges(got: &[u8], want: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < got.len() {
        if got[i] != want[i] {
            let s = i;
            let mut end = i + 1;
            // wrong bytes less than 64 apart are one range (stale data matches by chance)
            while i < got.len() && i < end + 64 {
                if got[i] != want[i] {
                    end = i + 1;
                }
                i += 1;
            }
            i = end;
            out.push((s, end));
        } else {
            i += 1;
        }
    }
    out
}

/// Wrong bytes of one slice of the op.
struct BadSlice {
    slice: usize,
    first: usize,
    last: usize,
    bad: usize,
    /// Of the wrong bytes, those equal to the buffer's content before the batch.
    old: usize,
}

fn bad_slices(got: &[u8], want: &[u8], before: &[u8]) -> Vec<BadSlice> {
    let mut by: BTreeMap<usize, BadSlice> = BTreeMap::new();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g != w {
            let s = by.entry(i / SLICE).or_insert(BadSlice {
                slice: i / SLICE,
                first: i,
                last: i,
                bad: 0,
                old: 0,
            });
            s.last = i;
            s.bad += 1;
            if *g == before[i] {
                s.old += 1;
            }
        }
    }
    by.into_values().collect()
}

/// The engine's per-work-request trace events (target `kvwire::rdma::wr`) since the start of
/// the current batch.
static TRACE: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct TraceWriter;

impl Write for TraceWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        TRACE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn install_trace() {
    use tracing_subscriber::layer::SubscriberExt;
    let sub = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer(|| TraceWriter),
        )
        .with(
            tracing_subscriber::filter::Targets::new()
                .with_target("kvwire::rdma::wr", tracing::Level::TRACE),
        );
    tracing::subscriber::set_global_default(sub).expect("trace subscriber");
}

/// Engine events seen over the run: flushes the provider caused with no error completion,
/// WRs posted again because of one, and those whose batch had already completed.
static PROVIDER_FLUSHES: AtomicU64 = AtomicU64::new(0);
static SUSPECTS_REPOSTED: AtomicU64 = AtomicU64::new(0);
static SUSPECTS_TOO_LATE: AtomicU64 = AtomicU64::new(0);

fn take_trace() -> String {
    let v = std::mem::take(&mut *TRACE.lock().unwrap_or_else(|e| e.into_inner()));
    let s = String::from_utf8_lossy(&v).into_owned();
    for l in s.lines() {
        if l.contains("without an error completion") {
            PROVIDER_FLUSHES.fetch_add(1, Ordering::Relaxed);
        } else if l.contains("posting a suspect WR again") {
            SUSPECTS_REPOSTED.fetch_add(1, Ordering::Relaxed);
        } else if l.contains("already completed") {
            SUSPECTS_TOO_LATE.fetch_add(1, Ordering::Relaxed);
        }
    }
    s
}

/// Trace lines of work request `wr`, of every other work request's completion reported by a
/// queue pair it was posted on, and every lane break / re-establishment.
fn trace_of(trace: &str, wr: u64) -> Vec<&str> {
    let key = format!("wr={wr} ");
    let qpns: Vec<String> = trace
        .lines()
        .filter(|l| l.contains(&key) && l.contains(" posted "))
        .filter_map(|l| l.split("qpn=").nth(1))
        .map(|q| format!("qpn={} ", q.trim()))
        .collect();
    trace
        .lines()
        .filter(|l| {
            l.contains(&key)
                || l.contains("lane broken")
                || l.contains("re-established")
                || (l.contains("completion") && qpns.iter().any(|q| l.contains(q.as_str())))
        })
        .collect()
}

struct Prev {
    lo: usize,
    n: usize,
}

#[derive(Default)]
struct Tally {
    batches: u64,
    bytes: u64,
    mismatched_batches: u64,
    bad_slices: u64,
    errors: u64,
    late: u64,
    flipped: u64,
    stayed: u64,
    aligned_current: u64,
    aligned_previous: u64,
    followed_by_flush: u64,
}

fn in_guest() {
    let d0 = std::env::var("KVWIRE_RXE_DEV0").unwrap_or_else(|_| "rxe0".into());
    let d1 = std::env::var("KVWIRE_RXE_DEV1").unwrap_or_else(|_| "rxe1".into());
    let (d0, d1) = (d0.as_str(), d1.as_str());
    let iters = knob("KVWIRE_STRESS_ITERS", 150);
    let lanes = knob("KVWIRE_STRESS_LANES", 4).max(1);
    let ndev = knob("KVWIRE_STRESS_DEVICES", 2).clamp(1, 2);
    let (tdevs, idevs): (Vec<&str>, Vec<&str>) = if ndev == 2 {
        (vec![d0, d1], vec![d1, d0])
    } else {
        (vec![d0], vec![d1])
    };
    for k in ["KVWIRE_RDMA_SIGNAL_EVERY", "KVWIRE_RDMA_POLL_US"] {
        println!(
            "{k}={}",
            std::env::var(k).unwrap_or_else(|_| "(default)".into())
        );
    }
    println!(
        "read stress: {iters} rounds of 1 MiB + 5 MiB READs, {lanes} QPs per device pair, target \
         {tdevs:?}, initiator {idevs:?}"
    );
    // The guest's veth pair drops packets when a CPU's input backlog is full (rxe counts
    // them as send_err): `KVWIRE_STRESS_BACKLOG=<n>` sets net.core.netdev_max_backlog (the
    // guest boots with 100000; 1000, the kernel default, reproduces the drops).
    if let Ok(b) = std::env::var("KVWIRE_STRESS_BACKLOG") {
        match std::fs::write("/proc/sys/net/core/netdev_max_backlog", &b) {
            Ok(()) => println!("net.core.netdev_max_backlog={b}"),
            Err(e) => println!("cannot set net.core.netdev_max_backlog: {e}"),
        }
    }
    let trace = std::env::var("KVWIRE_STRESS_TRACE").map_or(true, |v| v != "0");
    if trace {
        install_trace();
    }
    let target = engine(&tdevs, lanes);
    let init = engine(&idevs, lanes);
    let remote = target
        .alloc_region(REGION, Access::ReadWrite)
        .expect("target region");
    let whole = pattern(777, REGION);
    target.local_write(remote, 0, &whole).expect("fill target");
    let local = init.alloc_region(REGION, Access::Local).expect("local");
    let peer = init.connect(target.listen_addr()).expect("connect");
    assert_eq!(peer.transport(), TransportKind::Rdma);
    let nlanes = peer.lane_counters().len();
    assert_eq!(nlanes, lanes * ndev, "lanes towards the peer");
    let rid = target.region_id(remote);
    // What the local buffer holds (verified), to tell old data from new.
    let mut shadow = vec![0u8; REGION];
    // Slices striped so far towards the peer (the round-robin start of the next batch).
    let mut striped: u64 = 0;
    let mut prev: Option<Prev> = None;
    let mut t = Tally::default();
    let hw0 = [hw_counters(d0), hw_counters(d1)];
    let t0 = Instant::now();
    let sizes = [1usize << 20, (5 << 20) + 3];
    for it in 0..iters {
        for (j, &n) in sizes.iter().enumerate() {
            let lo = (it * 4099 + j * 3 + 12) % (REGION - n - 1);
            let ro = (12_345 + it * 7919 + j * 7) % (REGION - n - 1);
            let op = Op {
                local,
                local_offset: lo as u64,
                remote: rid,
                remote_offset: ro as u64,
                len: n as u64,
            };
            let lc0 = peer.lane_counters();
            let m0 = init.metrics();
            let re0 = peer.lanes_reestablished();
            let hw_b = [hw_counters(d0), hw_counters(d1)];
            take_trace();
            let r = init.read(&peer, &[op], None).and_then(|b| b.wait());
            let events = take_trace();
            let slices = n.div_ceil(SLICE) as u64;
            let start = striped;
            striped += slices;
            t.batches += 1;
            let mut got = vec![0u8; n];
            init.local_read(local, lo as u64, &mut got)
                .expect("local_read");
            let want = &whole[ro..ro + n];
            if let Err(e) = &r {
                t.errors += 1;
                println!("round {it} read {n} (local {lo}, remote {ro}): error {e}");
            } else {
                t.bytes += n as u64;
            }
            if r.is_ok() && got != want {
                t.mismatched_batches += 1;
                let before = &shadow[lo..lo + n];
                let bad = bad_slices(&got, want, before);
                let ranges = bad_ranges(&got, want);
                let lc1 = peer.lane_counters();
                let m1 = init.metrics();
                let re1 = peer.lanes_reestablished();
                let hw_a = [hw_counters(d0), hw_counters(d1)];
                println!(
                    "MISMATCH round {it} read {n} (local {lo}, remote {ro}, {slices} slices, \
                     striping start {start}, after {:?}): {} wrong byte ranges, {} slices",
                    t0.elapsed(),
                    ranges.len(),
                    bad.len()
                );
                for (s, e) in ranges.iter().take(8) {
                    let cur = s % SLICE == 0 && (e % SLICE == 0 || *e == n);
                    let pv = prev.as_ref().map(|p| {
                        // the wrong range, in the previous op's coordinates
                        let ps = (lo + s) as i64 - p.lo as i64;
                        let pe = (lo + e) as i64 - p.lo as i64;
                        let al = |x: i64| x >= 0 && (x as usize % SLICE == 0 || x as usize == p.n);
                        (ps, pe, al(ps) && al(pe))
                    });
                    if cur {
                        t.aligned_current += 1;
                    }
                    if pv.is_some_and(|p| p.2) {
                        t.aligned_previous += 1;
                    }
                    println!(
                        "  wrong bytes [{s}, {e}) of the op ({} bytes): on this op's slice \
                         boundaries: {cur}; in the previous op's coordinates {pv:?} (start, end, \
                         on its slice boundaries)",
                        e - s
                    );
                }
                for b in &bad {
                    let lane = ((start + b.slice as u64) % nlanes as u64) as usize;
                    let dev = idevs[lane % ndev];
                    println!(
                        "  slice {} [{}, {}): {} wrong bytes (first {}, last {}), {} of them \
                         the old content; striped to lane {lane} (device {dev})",
                        b.slice,
                        b.slice * SLICE,
                        ((b.slice + 1) * SLICE).min(n),
                        b.bad,
                        b.first,
                        b.last,
                        b.old
                    );
                    // Work request ids of a peer are numbered from 1, one per slice, in order.
                    let wr = 1 + start + b.slice as u64;
                    for l in trace_of(&events, wr) {
                        println!("    trace: {l}");
                    }
                }
                println!(
                    "  work requests per lane this batch: {:?}; reposts +{}; lanes \
                     re-established +{}",
                    lc1.iter().zip(&lc0).map(|(a, b)| a - b).collect::<Vec<_>>(),
                    m1.reposts - m0.reposts,
                    re1 - re0
                );
                for (k, dev) in [d0, d1].iter().enumerate() {
                    println!(
                        "  {dev} hw_counters during the batch: {}",
                        counter_delta(&hw_b[k], &hw_a[k])
                    );
                }
                let mut last = got.clone();
                for wait_ms in [50u64, 500] {
                    std::thread::sleep(Duration::from_millis(wait_ms));
                    let mut again = vec![0u8; n];
                    init.local_read(local, lo as u64, &mut again)
                        .expect("local_read");
                    for b in &bad {
                        let r = b.slice * SLICE..((b.slice + 1) * SLICE).min(n);
                        let now_ok = again[r.clone()] == want[r.clone()];
                        let same = again[r.clone()] == got[r.clone()];
                        let changed_since = again[r.clone()] != last[r.clone()];
                        let what = if now_ok {
                            "now correct (landed late: the batch completed early)"
                        } else if same {
                            "unchanged (never landed: lost)"
                        } else {
                            "changed to other data (a late landing of something else: ghost)"
                        };
                        println!(
                            "  after +{wait_ms} ms slice {}: {what}{}",
                            b.slice,
                            if changed_since {
                                " [changed since last look]"
                            } else {
                                ""
                            }
                        );
                        if wait_ms == 500 {
                            if now_ok {
                                t.late += 1;
                            } else if same {
                                t.stayed += 1;
                            } else {
                                t.flipped += 1;
                            }
                        }
                    }
                    last = again;
                }
                // Per wrong slice: what its queue pair reported next. A flush with no error
                // completion before it and no break of ours means the provider moved the queue
                // pair to the error state itself, right after reporting this READ successful.
                for b in &bad {
                    let wr = 1 + start + b.slice as u64;
                    let key = format!("wr={wr} ");
                    let Some(pos) = events
                        .lines()
                        .position(|l| l.contains(&key) && l.contains("completion"))
                    else {
                        println!("  slice {}: no completion traced for wr {wr}", b.slice);
                        continue;
                    };
                    let line = events.lines().nth(pos).unwrap_or_default();
                    let lane = line
                        .split("lane=")
                        .nth(1)
                        .and_then(|x| x.split(' ').next())
                        .unwrap_or("?")
                        .to_string();
                    let next = events.lines().skip(pos + 1).find(|l| {
                        l.contains(&format!("lane={lane} "))
                            && (l.contains("completion") || l.contains("lane broken"))
                    });
                    let spontaneous = next.is_some_and(|l| l.contains("WrFlush"));
                    if spontaneous {
                        t.followed_by_flush += 1;
                    }
                    println!(
                        "  slice {} (wr {wr}, lane {lane}): next on that lane: {} => {}",
                        b.slice,
                        next.unwrap_or("(nothing traced)"),
                        if spontaneous {
                            "a flush the engine did not cause: the provider errored the queue \
                             pair right after reporting this READ successful"
                        } else {
                            "no provider-side error right after"
                        }
                    );
                }
                if let Ok(o) = std::process::Command::new("dmesg").output() {
                    let d = String::from_utf8_lossy(&o.stdout);
                    // the provider's kernel warnings (where and why), then the latest lines
                    let mut shown = 0;
                    for l in d.lines() {
                        if shown < 12
                            && (l.contains("WARNING") || l.contains("RIP:") || l.contains("rxe_"))
                            && !l.contains("Failed sending")
                        {
                            println!("  dmesg: {l}");
                            shown += 1;
                        }
                    }
                    let tail: Vec<&str> = d.lines().rev().take(4).collect();
                    for l in tail.iter().rev() {
                        println!("  dmesg: {l}");
                    }
                }
                let late_events = take_trace();
                for b in &bad {
                    let wr = 1 + start + b.slice as u64;
                    for l in trace_of(&late_events, wr) {
                        println!("    trace after the batch (slice {}): {l}", b.slice);
                    }
                }
                t.bad_slices += bad.len() as u64;
                println!(
                    "  rxe hw_counters since the start: {d0}: {} | {d1}: {}",
                    counter_delta(&hw0[0], &hw_counters(d0)),
                    counter_delta(&hw0[1], &hw_counters(d1))
                );
            }
            // The model follows the buffer from here (verified, or as found).
            let mut now = vec![0u8; n];
            init.local_read(local, lo as u64, &mut now)
                .expect("local_read");
            shadow[lo..lo + n].copy_from_slice(&now);
            prev = Some(Prev { lo, n });
        }
        if (it + 1) % 25 == 0 {
            println!(
                "progress: {} rounds, {} batches, {} mismatched, {} errors, {:.1} s, reposts {}, \
                 lanes re-established {}",
                it + 1,
                t.batches,
                t.mismatched_batches,
                t.errors,
                t0.elapsed().as_secs_f64(),
                init.metrics().reposts,
                peer.lanes_reestablished()
            );
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    take_trace();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "engine: {} queue pairs failed by the provider with no error completion; {} WRs it had \
         reported successful posted again; {} such WRs of batches already completed",
        PROVIDER_FLUSHES.load(Ordering::Relaxed),
        SUSPECTS_REPOSTED.load(Ordering::Relaxed),
        SUSPECTS_TOO_LATE.load(Ordering::Relaxed)
    );
    println!(
        "rxe hw_counters over the run: {d0}: {} | {d1}: {}",
        counter_delta(&hw0[0], &hw_counters(d0)),
        counter_delta(&hw0[1], &hw_counters(d1))
    );
    println!("work requests per lane: {:?}", peer.lane_counters());
    println!(
        "STRESS-SUMMARY devices={ndev} lanes_per_pair={lanes} batches={} bytes={} \
         mismatched_batches={} bad_slices={} (at +500 ms: late={} lost={} ghost={}; wrong ranges \
         on this op's slice boundaries {}, on the previous op's {}; followed by a flush the engine did not cause {}) errors={} \
         reposts={} \
         lanes_reestablished={} secs={secs:.1} MB/s={:.1}",
        t.batches,
        t.bytes,
        t.mismatched_batches,
        t.bad_slices,
        t.late,
        t.stayed,
        t.flipped,
        t.aligned_current,
        t.aligned_previous,
        t.followed_by_flush,
        t.errors,
        init.metrics().reposts,
        peer.lanes_reestablished(),
        t.bytes as f64 / secs / 1e6
    );
    assert_eq!(t.errors, 0, "READ batches failed");
    assert_eq!(
        t.mismatched_batches, 0,
        "READ batches completed with wrong bytes"
    );
    println!("READ-STRESS-OK");
}

#[test]
fn read_stress_in_softroce_vm() {
    if let vm_common::Vm::Guest = vm_common::run_in_vm(NAME, "READ-STRESS-OK") {
        in_guest();
    }
}

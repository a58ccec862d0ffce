//! Overhead of engine metrics on the write path: 4 KiB writes (submit + wait) over loopback tcp
//! and shm, with `EngineConfig::metrics` on and off, in one binary.
//!
//! `cargo bench -p kvwire-transfer --bench metrics` runs criterion's groups (each variant
//! measured on its own) and then an interleaved comparison (blocks of writes alternating off/on
//! in one process) that prints the on/off ratio of the medians and the median of the per-round
//! ratios. Rounds and block sizes of the interleaved runs: `KVWIRE_BENCH_SHM_ROUNDS`,
//! `KVWIRE_BENCH_SHM_BLOCK`, `KVWIRE_BENCH_TCP_ROUNDS`, `KVWIRE_BENCH_TCP_BLOCK`.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kvwire_transfer::{Access, Engine, EngineConfig, Op, Peer, TransportKind};

const LEN: u64 = 4096;

struct Pair {
    _target: Engine,
    init: Engine,
    peer: Peer,
    op: Op,
}

fn pair(kind: TransportKind, metrics: bool) -> Pair {
    let cfg = EngineConfig {
        transport: kind,
        metrics,
        ..Default::default()
    };
    let target = Engine::new(cfg.clone()).expect("target engine");
    let dst = target
        .alloc_region(LEN as usize, Access::WriteOnly)
        .expect("dst");
    let init = Engine::new(cfg).expect("initiator engine");
    let src = init.alloc_region(LEN as usize, Access::Local).expect("src");
    init.local_write(src, 0, &[0x5a; LEN as usize])
        .expect("fill");
    let peer = init.connect(target.listen_addr()).expect("connect");
    assert_eq!(peer.transport(), kind);
    let op = Op {
        local: src,
        local_offset: 0,
        remote: target.region_id(dst),
        remote_offset: 0,
        len: LEN,
    };
    Pair {
        _target: target,
        init,
        peer,
        op,
    }
}

fn bench(c: &mut Criterion) {
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        let mut g = c.benchmark_group(format!("write_4KiB_{kind:?}").to_lowercase());
        for metrics in [false, true] {
            let p = pair(kind, metrics);
            p.init
                .write(&p.peer, &[p.op], None, None)
                .expect("submit")
                .wait()
                .expect("write");
            let counted = p
                .init
                .metrics()
                .transport(kind)
                .expect("series")
                .write_batches;
            assert_eq!(counted, u64::from(metrics), "metrics recorded only when on");
            g.bench_function(if metrics { "metrics_on" } else { "metrics_off" }, |b| {
                b.iter(|| {
                    p.init
                        .write(&p.peer, &[p.op], None, None)
                        .expect("submit")
                        .wait()
                        .expect("write")
                })
            });
        }
        g.finish();
    }
}

/// Metrics off and on alternated in blocks (order flipped every round) in one process, so load
/// changes on a shared machine hit both alike; prints the medians and their ratio.
fn interleaved(kind: TransportKind, rounds: usize, block: usize) {
    let pairs = [pair(kind, false), pair(kind, true)];
    let mut per: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for r in 0..rounds {
        for k in 0..2 {
            let which = if r % 2 == 0 { k } else { 1 - k };
            let p = &pairs[which];
            let t = Instant::now();
            for _ in 0..block {
                p.init
                    .write(&p.peer, &[p.op], None, None)
                    .expect("submit")
                    .wait()
                    .expect("write");
            }
            per[which].push(t.elapsed().as_nanos() as f64 / block as f64);
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    // Paired: each round's on/off ratio (its two blocks ran back to back), then the median.
    let mut paired: Vec<f64> = per[1]
        .iter()
        .zip(per[0].iter())
        .map(|(a, b)| a / b)
        .collect();
    let (off, on) = (med(&mut per[0]), med(&mut per[1]));
    let pr = med(&mut paired);
    println!(
        "interleaved write_4KiB {kind:?}: metrics off {off:.0} ns/write, on {on:.0} ns/write, \
         on/off = {:.4}, median of per-round on/off = {pr:.4} (medians of {rounds} blocks of \
         {block} writes each)",
        on / off
    );
}

/// `KVWIRE_BENCH_<NAME>` as a count, else `default`.
fn env_count(name: &str, default: usize) -> usize {
    std::env::var(format!("KVWIRE_BENCH_{name}"))
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(default)
}

fn bench_interleaved(_c: &mut Criterion) {
    interleaved(
        TransportKind::Shm,
        env_count("SHM_ROUNDS", 41),
        env_count("SHM_BLOCK", 20_000),
    );
    interleaved(
        TransportKind::Tcp,
        env_count("TCP_ROUNDS", 41),
        env_count("TCP_BLOCK", 400),
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bench, bench_interleaved
}
criterion_main!(benches);

//! Overhead of engine metrics on the write path: 4 KiB writes (submit + wait) over loopback tcp
//! and shm, with `EngineConfig::metrics` on and off, in one binary.
//!
//! `cargo bench -p kvwire-transfer --bench metrics` runs criterion's groups (each variant
//! measured on its own) and then an interleaved comparison (blocks of writes alternating off/on
//! in one process) that prints the on/off ratio of the medians.

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
    let (off, on) = (med(&mut per[0]), med(&mut per[1]));
    println!(
        "interleaved write_4KiB {kind:?}: metrics off {off:.0} ns/write, on {on:.0} ns/write, \
         on/off = {:.4} (medians of {rounds} blocks of {block} writes each)",
        on / off
    );
}

fn bench_interleaved(_c: &mut Criterion) {
    interleaved(TransportKind::Shm, 41, 20_000);
    interleaved(TransportKind::Tcp, 41, 400);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bench, bench_interleaved
}
criterion_main!(benches);

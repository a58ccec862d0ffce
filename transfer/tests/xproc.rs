//! Cross-process tests: the target engine runs in a child process, real sockets/shm in between,
//! every byte checked at both ends (the child checks what landed; the parent reads it back).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{mismatch, pattern, Target};
use kvwire_transfer::{
    Access, Engine, EngineConfig, Error, Op, Peer, RegionHandle, RemoteRegion, TransportKind,
};

#[test]
fn child_main() {
    common::child_entry();
}

fn spawn(regions: &str) -> Target {
    Target::spawn("child_main", regions, None)
}

fn engine(kind: TransportKind) -> Engine {
    Engine::new(EngineConfig {
        transport: kind,
        ..Default::default()
    })
    .expect("engine")
}

fn region(p: &Peer, i: usize) -> RemoteRegion {
    p.regions()[i]
}

/// Reads back `[off, off+len)` of remote region `r` and checks it against `seed`.
fn read_back(e: &Engine, p: &Peer, r: RemoteRegion, off: u64, len: usize, seed: u64) {
    let dst = e.alloc_region(len, Access::Local).expect("alloc");
    let op = Op {
        local: dst,
        local_offset: 0,
        remote: r.id,
        remote_offset: off,
        len: len as u64,
    };
    e.read(p, &[op], None)
        .expect("read")
        .wait()
        .expect("read wait");
    let mut got = vec![0u8; len];
    e.local_read(dst, 0, &mut got).expect("local read");
    assert_eq!(mismatch(seed, off, &got), None, "read-back mismatch");
    e.unregister(dst).expect("unregister");
}

#[test]
fn concurrent_batches_over_several_peers_with_notifications() {
    const REGION: usize = 8 << 20;
    const THREADS: usize = 4;
    const BATCHES: usize = 16;
    const AREA: usize = REGION / (THREADS * BATCHES); // 128 KiB per batch
    let mut targets: Vec<Target> = (0..3).map(|_| spawn(&format!("{REGION}:rw"))).collect();
    // One engine forced to TCP (4 lanes), one on Auto (shm on this host).
    let tcp = engine(TransportKind::Tcp);
    let auto = engine(TransportKind::Auto);
    let mut peers = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        let e = if i == 2 { &auto } else { &tcp };
        let p = e.connect(t.addr).expect("connect");
        assert_eq!(
            p.transport(),
            if i == 2 {
                TransportKind::Shm
            } else {
                TransportKind::Tcp
            }
        );
        peers.push((e.clone(), p));
    }
    let peers = Arc::new(peers);
    for t in targets.iter_mut() {
        assert_eq!(t.cmd(&format!("watch {} 20000", THREADS * BATCHES)), "OK");
    }
    let mut handles = Vec::new();
    for th in 0..THREADS {
        let peers = peers.clone();
        handles.push(std::thread::spawn(move || {
            let mut sent = Vec::new();
            // Each local engine needs its own source region.
            let srcs: Vec<RegionHandle> = peers
                .iter()
                .map(|(e, _)| e.alloc_region(REGION, Access::Local).expect("alloc"))
                .collect();
            for b in 0..BATCHES {
                for (pi, (e, p)) in peers.iter().enumerate() {
                    let area = ((th * BATCHES + b) * AREA) as u64;
                    let seed = (pi * 100_000 + th * 1000 + b) as u64 + 1;
                    e.local_write(srcs[pi], area, &pattern(seed, area, AREA))
                        .expect("fill");
                    // 8 blocks of 16 KiB, submitted in reverse order (coalescing sorts them).
                    let ops: Vec<Op> = (0..8u64)
                        .rev()
                        .map(|k| Op {
                            local: srcs[pi],
                            local_offset: area + k * 16384,
                            remote: region(p, 0).id,
                            remote_offset: area + k * 16384,
                            len: 16384,
                        })
                        .collect();
                    let tag = format!("0 {area} {AREA} {seed}");
                    let st = e
                        .write(p, &ops, Some(tag.as_bytes()), None)
                        .expect("submit")
                        .wait()
                        .expect("batch");
                    assert_eq!(st.ops, 8);
                    assert_eq!(st.writes, 1);
                    assert_eq!(st.bytes, AREA as u64);
                    sent.push((pi, area, seed));
                }
            }
            sent
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.join().expect("thread"));
    }
    assert_eq!(all.len(), THREADS * BATCHES * 3);
    // The target checked every batch's bytes when it saw its notification.
    for t in targets.iter_mut() {
        let r = t.cmd("watch_result");
        assert_eq!(r, format!("NOTIFIED {} 0", THREADS * BATCHES));
    }
    // And the initiator reads every area back.
    for (pi, area, seed) in all {
        let (e, p) = &peers[pi];
        read_back(e, p, region(p, 0), area, AREA, seed);
    }
}

#[test]
fn notification_follows_data_striped_over_lanes() {
    const SLOT: usize = 4 << 20;
    const N: usize = 12;
    let mut t = spawn(&format!("{}:rw", SLOT * N));
    let e = Engine::new(EngineConfig {
        transport: TransportKind::Tcp,
        lanes: 4,
        slice_size: 256 << 10,
        ..Default::default()
    })
    .expect("engine");
    let src = e.alloc_region(SLOT * N, Access::Local).expect("alloc");
    let p = e.connect(t.addr).expect("connect");
    for i in 0..N {
        let off = (i * SLOT) as u64;
        e.local_write(src, off, &pattern(7000 + i as u64, off, SLOT))
            .expect("fill");
    }
    // The target checks each batch's bytes the moment its tag arrives, while we transfer.
    assert_eq!(t.cmd(&format!("watch {N} 20000")), "OK");
    let mut batches = Vec::new();
    for i in 0..N {
        let off = (i * SLOT) as u64;
        let seed = 7000 + i as u64;
        let op = Op {
            local: src,
            local_offset: off,
            remote: region(&p, 0).id,
            remote_offset: off,
            len: SLOT as u64,
        };
        let tag = format!("0 {off} {SLOT} {seed}");
        // All batches in flight at once: slices of different batches interleave on the lanes.
        batches.push(
            e.write(&p, &[op], Some(tag.as_bytes()), None)
                .expect("submit"),
        );
    }
    for b in &batches {
        let st = b.wait().expect("batch");
        assert_eq!(st.slices, SLOT / (256 << 10));
    }
    assert_eq!(t.cmd("watch_result"), format!("NOTIFIED {N} 0"));
}

#[test]
fn reads_return_target_bytes_tcp_and_shm() {
    let mut t = spawn("2097152:rw,1048576:r:raw");
    assert_eq!(t.cmd("fill 0 0 2097152 41"), "OK");
    assert_eq!(t.cmd("fill 1 0 1048576 42"), "OK");
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let e = engine(kind);
        let p = e.connect(t.addr).expect("connect");
        assert_eq!(p.transport(), kind);
        read_back(&e, &p, region(&p, 0), 0, 2 << 20, 41);
        read_back(&e, &p, region(&p, 0), 12345, 100_000, 41);
        read_back(&e, &p, region(&p, 1), 0, 1 << 20, 42); // raw memory (CMA on shm)
        read_back(&e, &p, region(&p, 1), 4097, 3, 42);
    }
}

#[test]
fn coalescing_sends_fewer_larger_writes() {
    const BLOCK: u64 = 16384;
    let mut t = spawn("4194304:rw");
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let e = engine(kind);
        let src = e.alloc_region(4 << 20, Access::Local).expect("alloc");
        let p = e.connect(t.addr).expect("connect");
        let seed = 99 + kind as u64;
        e.local_write(src, 0, &pattern(seed, 0, 4 << 20))
            .expect("fill");
        // 64 adjacent blocks, shuffled: one write.
        let mut ops: Vec<Op> = (0..64u64)
            .map(|k| Op {
                local: src,
                local_offset: k * BLOCK,
                remote: region(&p, 0).id,
                remote_offset: k * BLOCK,
                len: BLOCK,
            })
            .collect();
        ops.reverse();
        ops.swap(3, 40);
        let st = e
            .write(&p, &ops, None, None)
            .expect("submit")
            .wait()
            .expect("batch");
        assert_eq!(st.ops, 64);
        assert_eq!(st.writes, 1);
        assert!(st.writes < st.ops);
        assert_eq!(st.bytes, 64 * BLOCK);
        assert_eq!(t.cmd(&format!("check 0 0 {} {seed}", 64 * BLOCK)), "OK");
        // Every other block: nothing adjacent, one write per block.
        let ops: Vec<Op> = (0..32u64)
            .map(|k| Op {
                local: src,
                local_offset: (64 + 2 * k) * BLOCK,
                remote: region(&p, 0).id,
                remote_offset: (64 + 2 * k) * BLOCK,
                len: BLOCK,
            })
            .collect();
        let st = e
            .write(&p, &ops, None, None)
            .expect("submit")
            .wait()
            .expect("batch");
        assert_eq!(st.writes, 32);
        for k in 0..32u64 {
            let off = (64 + 2 * k) * BLOCK;
            assert_eq!(t.cmd(&format!("check 0 {off} {BLOCK} {seed}")), "OK");
        }
        // Two runs of 16 adjacent blocks: two writes.
        let ops: Vec<Op> = (0..32u64)
            .map(|k| {
                let base = if k < 16 { 160 } else { 200 };
                let kk = k % 16;
                Op {
                    local: src,
                    local_offset: (base + kk) * BLOCK,
                    remote: region(&p, 0).id,
                    remote_offset: (base + kk) * BLOCK,
                    len: BLOCK,
                }
            })
            .collect();
        let st = e
            .write(&p, &ops, None, None)
            .expect("submit")
            .wait()
            .expect("batch");
        assert_eq!(st.writes, 2);
        assert_eq!(
            t.cmd(&format!("check 0 {} {} {seed}", 160 * BLOCK, 16 * BLOCK)),
            "OK"
        );
        assert_eq!(
            t.cmd(&format!("check 0 {} {} {seed}", 200 * BLOCK, 16 * BLOCK)),
            "OK"
        );
    }
}

#[test]
fn shm_chosen_on_one_host_tcp_when_forced() {
    let mut t = spawn("1048576:rw,1048576:w:raw");
    for (kind, want) in [
        (TransportKind::Auto, TransportKind::Shm),
        (TransportKind::Shm, TransportKind::Shm),
        (TransportKind::Tcp, TransportKind::Tcp),
    ] {
        let e = engine(kind);
        let p = e.connect(t.addr).expect("connect");
        assert_eq!(p.transport(), want, "config {kind:?}");
        let src = e.alloc_region(1 << 20, Access::Local).expect("alloc");
        let seed = 500 + kind as u64;
        e.local_write(src, 0, &pattern(seed, 0, 1 << 20))
            .expect("fill");
        for r in 0..2 {
            let op = Op {
                local: src,
                local_offset: 0,
                remote: region(&p, r).id,
                remote_offset: 0,
                len: 1 << 20,
            };
            let st = e
                .write(
                    &p,
                    &[op],
                    Some(format!("{r} 0 1048576 {seed}").as_bytes()),
                    None,
                )
                .expect("submit")
                .wait()
                .expect("batch");
            assert_eq!(st.transport, want);
            assert_eq!(t.cmd(&format!("check {r} 0 1048576 {seed}")), "OK");
            assert_eq!(t.cmd("notify 1 5000"), "NOTIFIED 1 0");
        }
    }
}

#[test]
fn killed_target_fails_batch_and_engine_keeps_serving() {
    const R: usize = 16 << 20;
    let mut doomed = spawn(&format!("{R}:rw"));
    let mut other = spawn("1048576:rw");
    let e = engine(TransportKind::Tcp);
    let src = e.alloc_region(R, Access::Local).expect("alloc");
    let p = e.connect(doomed.addr).expect("connect");
    let q = e.connect(other.addr).expect("connect");
    // 1 GiB in one batch (64 writes of 16 MiB) to a target that is stopped (SIGSTOP, every
    // thread) before the batch is submitted: it takes no byte, so the batch cannot complete
    // (loopback buffers hold a few MiB) and is in flight when the target dies, however long
    // this thread waits between submitting and killing.
    doomed.stop();
    let ops: Vec<Op> = (0..64)
        .map(|_| Op {
            local: src,
            local_offset: 0,
            remote: region(&p, 0).id,
            remote_offset: 0,
            len: R as u64,
        })
        .collect();
    let deadline = Duration::from_secs(30);
    let b = e
        .write(&p, &ops, Some(b"never"), Some(deadline))
        .expect("submit");
    doomed.kill();
    match b.wait() {
        Err(Error::PeerDead(_)) => {}
        other => panic!("expected PeerDead, got {other:?}"),
    }
    assert!(!p.is_alive());
    match e.write(&p, &ops[..1], None, None) {
        Err(Error::PeerDead(_)) => {}
        other => panic!("expected PeerDead for a new batch, got {other:?}"),
    }
    // The engine keeps serving the other peer.
    e.local_write(src, 0, &pattern(3, 0, 1 << 20))
        .expect("fill");
    let op = Op {
        local: src,
        local_offset: 0,
        remote: region(&q, 0).id,
        remote_offset: 0,
        len: 1 << 20,
    };
    e.write(&q, &[op], None, None)
        .expect("submit")
        .wait()
        .expect("batch");
    assert_eq!(other.cmd("check 0 0 1048576 3"), "OK");
}

#[test]
fn stopped_target_times_out_at_the_deadline() {
    let mut stuck = spawn("1048576:rw");
    let e = engine(TransportKind::Tcp);
    let src = e.alloc_region(1 << 20, Access::Local).expect("alloc");
    let p = e.connect(stuck.addr).expect("connect");
    stuck.stop(); // SIGSTOP, and wait until every thread is stopped
    let op = Op {
        local: src,
        local_offset: 0,
        remote: region(&p, 0).id,
        remote_offset: 0,
        len: 4096,
    };
    let b = e
        .write(&p, &[op], None, Some(Duration::from_millis(300)))
        .expect("submit");
    match b.wait() {
        Err(Error::Timeout) => {}
        other => panic!("expected Timeout, got {other:?}"),
    }
    // poll() after the deadline reports the same, at once.
    assert!(matches!(b.poll(), Some(Err(Error::Timeout))));
    stuck.signal(18); // SIGCONT
    stuck.kill();
}

#[test]
fn regions_follow_the_target_after_connect() {
    let mut t = spawn("65536:rw");
    let e = engine(TransportKind::Tcp);
    let src = e.alloc_region(1 << 20, Access::Local).expect("alloc");
    e.local_write(src, 0, &pattern(77, 0, 1 << 20))
        .expect("fill");
    let p = e.connect(t.addr).expect("connect");
    assert_eq!(p.regions().len(), 1);
    let reply = t.cmd("alloc 1048576");
    let idx: u32 = reply
        .split_whitespace()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .expect("index");
    // Bounds a hang only: the update is one control message.
    let until = Instant::now() + Duration::from_secs(60);
    let newr = loop {
        if let Some(r) = p.regions().into_iter().find(|r| r.id.index == idx) {
            break r;
        }
        assert!(Instant::now() < until, "new region never became visible");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(newr.len, 1 << 20);
    let op = Op {
        local: src,
        local_offset: 0,
        remote: newr.id,
        remote_offset: 0,
        len: 1 << 20,
    };
    e.write(&p, &[op], None, None)
        .expect("submit")
        .wait()
        .expect("batch");
    assert_eq!(t.cmd("check 1 0 1048576 77"), "OK");
    // Unregistered on the target: the initiator refuses the stale id before sending.
    assert_eq!(t.cmd("unregister 1"), "OK");
    let until = Instant::now() + Duration::from_secs(60);
    while p.regions().iter().any(|r| r.id == newr.id) {
        assert!(Instant::now() < until, "removal never propagated");
        std::thread::sleep(Duration::from_millis(5));
    }
    match e.write(&p, &[op], None, None) {
        Err(Error::StaleRegion(id)) => assert_eq!(id, newr.id),
        other => panic!("expected StaleRegion, got {other:?}"),
    }
}

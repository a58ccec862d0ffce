//! The data path in many shapes, every byte verified at the receiving end: writes and reads of
//! many sizes, scattered writes with notifications, scatter-gather lists, traffic over every
//! queue pair, concurrent submitters, and a throughput comparison with tcp.

use super::*;

pub fn writes_of_many_sizes(p: &Pair) {
    let sizes: [usize; 10] = [
        1,
        7,
        4096,
        65_535,
        65_536,
        65_537,
        200_000,
        1 << 20,
        (3 << 20) + 5,
        8 << 20,
    ];
    for (i, &n) in sizes.iter().enumerate() {
        let data = pattern(100 + i as u64, n);
        let (lo, ro) = (13 * i as u64, 4099 * i as u64);
        p.init.local_write(p.src, lo, &data).expect("fill src");
        let op = Op {
            local: p.src,
            local_offset: lo,
            remote: p.target.region_id(p.dst),
            remote_offset: ro,
            len: n as u64,
        };
        let st = p
            .init
            .write(&p.peer, &[op], None, None)
            .expect("submit")
            .wait()
            .unwrap_or_else(|e| panic!("write of {n} bytes: {e}"));
        assert_eq!(st.transport, TransportKind::Rdma);
        assert_eq!(st.bytes, n as u64);
        check_eq(
            &format!("write {n}"),
            &read_back(&p.target, p.dst, ro, n),
            &data,
        );
    }
    println!("writes of {} sizes: every byte verified", sizes.len());
}

/// A batch of `k` ops of varied sizes, scattered on both sides (no two adjacent, so nothing
/// coalesces), with a notification; the target verifies its memory when the tag arrives.
pub fn sg_writes_with_notifications(p: &Pair) {
    let notes = p.target.notifications();
    for round in 0..12u64 {
        let k = 1 + (round as usize * 7) % 48;
        let mut ops = Vec::new();
        let mut expect = Vec::new();
        let (mut lo, mut ro) = (round * 31, round * 17 + 4096);
        for j in 0..k {
            let n = 1 + ((j * 7919 + round as usize * 104_729) % 300_000);
            let data = pattern(round * 1000 + j as u64, n);
            p.init.local_write(p.src, lo, &data).expect("fill");
            ops.push(Op {
                local: p.src,
                local_offset: lo,
                remote: p.target.region_id(p.dst),
                remote_offset: ro,
                len: n as u64,
            });
            expect.push((ro, data));
            lo += n as u64 + 3;
            ro += n as u64 + 11;
        }
        assert!(ro < REGION as u64 && lo < REGION as u64);
        let tag = format!("sg-{round}").into_bytes();
        let b = p
            .init
            .write(&p.peer, &ops, Some(&tag), None)
            .expect("submit");
        // Notification first (as a decode engine would see it), then the bytes must be there.
        let n = match notes.recv_timeout(Duration::from_secs(60)) {
            Ok(n) => n,
            Err(e) => panic!(
                "round {round}: no notification ({e}); batch: {:?}",
                b.poll()
            ),
        };
        assert_eq!(n.tag, tag, "notifications in order");
        for (ro, data) in &expect {
            check_eq(
                &format!("sg round {round} at {ro}"),
                &read_back(&p.target, p.dst, *ro, data.len()),
                data,
            );
        }
        let st = b.wait().expect("sg batch");
        assert_eq!(st.ops, k);
        assert_eq!(st.writes, k, "scattered ops must not coalesce");
    }
    assert!(notes.try_recv().is_none(), "no stray notification");
    println!("12 scatter-gather batches with notifications: data verified at notification time");
}

/// Scatter-gather entries per work request the engine gathers by default (the loopback
/// device and rxe both allow at least as many).
pub const SGE: usize = 16;

/// KV-shaped batches: blocks scattered in the initiator's memory (every third block slot,
/// backwards) and a run of consecutive blocks at the target, as a P cache writing into a run of
/// D's blocks. Coalescing cannot merge them; scatter-gather lists can: `slices` (the work
/// requests posted) is what one WR per `min(slice, max_sge blocks)` gives, for the default
/// and for `rdma_max_sge` 4 and 1 (no gathering). Written, then read back into other
/// scattered blocks, every byte checked at both ends; then pieces that do not divide the
/// slice, and a gap at the target that starts a new request.
pub fn gathered_writes_and_reads(dev_t: &str, dev_i: &str) {
    const BLOCK: usize = 16 << 10;
    const BLOCKS: usize = 64;
    for (slice, max_sge) in [
        (64usize << 10, None),
        (1 << 20, None),
        (1 << 20, Some(4)),
        (1 << 20, Some(1)),
    ] {
        let base = EngineConfig {
            rdma_max_sge: max_sge,
            ..EngineConfig::from_env()
        };
        let sge = max_sge.map_or(SGE, |n| n as usize);
        let p = pair_cfg(&[dev_t], &[dev_i], TransportKind::Rdma, slice, base);
        let rid = p.target.region_id(p.dst);
        let per_wr = sge.min(slice / BLOCK);
        let want_wrs = BLOCKS.div_ceil(per_wr);
        let slot = |b: usize, shift: usize| ((BLOCKS - 1 - b) * 3 + shift) * BLOCK;
        let mut ops = Vec::new();
        for b in 0..BLOCKS {
            p.init
                .local_write(p.src, slot(b, 0) as u64, &pattern(900 + b as u64, BLOCK))
                .expect("fill block");
            ops.push(Op {
                local: p.src,
                local_offset: slot(b, 0) as u64,
                remote: rid,
                remote_offset: (4096 + b * BLOCK) as u64,
                len: BLOCK as u64,
            });
        }
        let st = p
            .init
            .write(&p.peer, &ops, None, None)
            .expect("submit gathered write")
            .wait()
            .expect("gathered write");
        assert_eq!((st.ops, st.writes), (BLOCKS, BLOCKS), "nothing coalesces");
        assert_eq!(
            st.slices, want_wrs,
            "slice {slice}: {BLOCKS} blocks of {BLOCK} B in WRs of {per_wr}"
        );
        for b in 0..BLOCKS {
            check_eq(
                &format!("gathered write, slice {slice}, block {b}"),
                &read_back(&p.target, p.dst, (4096 + b * BLOCK) as u64, BLOCK),
                &pattern(900 + b as u64, BLOCK),
            );
        }
        // READ the run back into other scattered slots (one past each written slot).
        let reads: Vec<Op> = ops
            .iter()
            .enumerate()
            .map(|(b, o)| Op {
                local_offset: slot(b, 1) as u64,
                ..*o
            })
            .collect();
        let st = p
            .init
            .read(&p.peer, &reads, None)
            .expect("submit scattered read")
            .wait()
            .expect("scattered read");
        assert_eq!(st.slices, want_wrs, "slice {slice}: READ scatter lists");
        for b in 0..BLOCKS {
            check_eq(
                &format!("scattered read, slice {slice}, block {b}"),
                &read_back(&p.init, p.src, slot(b, 1) as u64, BLOCK),
                &pattern(900 + b as u64, BLOCK),
            );
        }
        // 40 pieces of 10,000 B, scattered locally: 6 fit a 64 KiB slice; the 21st lands
        // one byte after the 20th ends (a gap at the target starts a new request).
        let mut ops = Vec::new();
        let mut ro = 2 << 20;
        for j in 0..40usize {
            if j == 20 {
                ro += 1;
            }
            let lo = (8 << 20) + ((40 - j) * 3 * 10_000) as u64;
            p.init
                .local_write(p.src, lo, &pattern(5000 + j as u64, 10_000))
                .expect("fill piece");
            ops.push(Op {
                local: p.src,
                local_offset: lo,
                remote: rid,
                remote_offset: ro as u64,
                len: 10_000,
            });
            ro += 10_000;
        }
        let st = p
            .init
            .write(&p.peer, &ops, None, None)
            .expect("submit pieces")
            .wait()
            .expect("pieces");
        let per_wr = sge.min(slice / 10_000);
        assert_eq!(
            st.slices,
            2 * 20usize.div_ceil(per_wr),
            "slice {slice}: pieces"
        );
        for (j, o) in ops.iter().enumerate() {
            check_eq(
                &format!("piece {j} at {}", o.remote_offset),
                &read_back(&p.target, p.dst, o.remote_offset, 10_000),
                &pattern(5000 + j as u64, 10_000),
            );
        }
        println!(
            "slice {slice}, {sge} pieces per request: {BLOCKS} scattered blocks in {want_wrs} \
             work requests each way, 40 pieces in {}: every byte verified",
            st.slices
        );
    }
}

pub fn reads_of_many_sizes(p: &Pair) {
    // The target fills its region; the initiator reads shapes back into its own memory.
    let whole = pattern(777, REGION);
    p.target.local_write(p.dst, 0, &whole).expect("fill target");
    let dst_local = p
        .init
        .alloc_region(REGION, Access::Local)
        .expect("read dst");
    for (i, &n) in [1usize, 4095, 65_536, 65_537, 1 << 20, (5 << 20) + 3]
        .iter()
        .enumerate()
    {
        let ro = 7 * i as u64 + 12_345;
        let lo = 3 * i as u64;
        let op = Op {
            local: dst_local,
            local_offset: lo,
            remote: p.target.region_id(p.dst),
            remote_offset: ro,
            len: n as u64,
        };
        let st = p
            .init
            .read(&p.peer, &[op], None)
            .expect("submit read")
            .wait()
            .unwrap_or_else(|e| panic!("read of {n}: {e}"));
        assert_eq!(st.transport, TransportKind::Rdma);
        check_eq(
            &format!("read {n}"),
            &read_back(&p.init, dst_local, lo, n),
            &whole[ro as usize..ro as usize + n],
        );
    }
    // scattered multi-op read
    let mut ops = Vec::new();
    let (mut lo, mut ro) = (0u64, 100u64);
    for j in 0..40u64 {
        let n = 1 + (j * 10_007) % 200_000;
        ops.push(Op {
            local: dst_local,
            local_offset: lo,
            remote: p.target.region_id(p.dst),
            remote_offset: ro,
            len: n,
        });
        lo += n + 5;
        ro += n + 9;
    }
    p.init
        .read(&p.peer, &ops, None)
        .expect("submit sg read")
        .wait()
        .expect("sg read");
    for op in &ops {
        check_eq(
            "sg read",
            &read_back(&p.init, dst_local, op.local_offset, op.len as usize),
            &whole[op.remote_offset as usize..(op.remote_offset + op.len) as usize],
        );
    }
    println!("reads of 6 sizes and a 40-op scattered read: every byte verified");
}

pub fn spread_over_queue_pairs(p: &Pair, lanes: usize) {
    let c = p.peer.lane_counters();
    println!("work requests per queue pair: {c:?}");
    assert_eq!(c.len(), lanes, "{lanes} lanes expected");
    let total: u64 = c.iter().sum();
    assert!(total > 100, "work requests were posted");
    for (i, n) in c.iter().enumerate() {
        assert!(
            *n * 2 * lanes as u64 >= total,
            "lane {i} carried {n} of {total} work requests: traffic not spread"
        );
    }
}

pub fn good_write(p: &Pair, seed: u64) {
    let data = pattern(seed, 300_000);
    p.init.local_write(p.src, 0, &data).expect("fill");
    let op = Op {
        local: p.src,
        local_offset: 0,
        remote: p.target.region_id(p.dst),
        remote_offset: 1000,
        len: data.len() as u64,
    };
    p.init
        .write(&p.peer, &[op], Some(b"after-error"), None)
        .expect("submit")
        .wait()
        .expect("good write after an error");
    let n = p
        .target
        .notifications()
        .recv_timeout(Duration::from_secs(30))
        .expect("notification");
    assert_eq!(n.tag, b"after-error");
    check_eq(
        "write after error",
        &read_back(&p.target, p.dst, 1000, data.len()),
        &data,
    );
}

/// Writes `data` from `off` of the initiator's region to `off` of the target's, waits, and
/// checks every byte at the target; returns the batch's stats.
fn write_verified(p: &Pair, off: usize, data: &[u8], what: &str) -> kvwire_transfer::BatchStats {
    p.init.local_write(p.src, off as u64, data).expect("fill");
    let op = Op {
        local: p.src,
        local_offset: off as u64,
        remote: p.target.region_id(p.dst),
        remote_offset: off as u64,
        len: data.len() as u64,
    };
    let st = p
        .init
        .write(&p.peer, &[op], None, None)
        .expect("submit")
        .wait()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    check_eq(
        what,
        &read_back(&p.target, p.dst, off as u64, data.len()),
        data,
    );
    st
}

/// Four threads submitting at once, 4 KiB slices: more work requests than the queue pairs hold
/// (the lanes' backlogs are drained by the completion thread); every byte verified.
pub fn concurrent_submitters(dev_t: &[&str], dev_i: &[&str]) {
    let p = pair_sliced(dev_t, dev_i, TransportKind::Rdma, 4096);
    let chunk = 2usize << 20; // per thread: its own 2 MiB window on both sides
    std::thread::scope(|s| {
        for t in 0..4usize {
            let p = &p;
            s.spawn(move || {
                for round in 0..6u64 {
                    let data = pattern(t as u64 * 100 + round, chunk);
                    let what = format!("thread {t} round {round}");
                    let st = write_verified(p, t * chunk, &data, &what);
                    assert_eq!(st.slices, chunk / 4096);
                }
            });
        }
    });
    println!(
        "4 concurrent submitters x 6 batches of 512 work requests: every byte verified; per lane \
         {:?}",
        p.peer.lane_counters()
    );
}

pub fn throughput(kind: TransportKind, dev_t: &[&str], dev_i: &[&str]) -> f64 {
    let p = pair(dev_t, dev_i, kind);
    let data = pattern(5, 8 << 20);
    p.init.local_write(p.src, 0, &data).expect("fill");
    let op = Op {
        local: p.src,
        local_offset: 0,
        remote: p.target.region_id(p.dst),
        remote_offset: 0,
        len: data.len() as u64,
    };
    let iters = 16;
    let t0 = Instant::now();
    for _ in 0..iters {
        p.init
            .write(&p.peer, &[op], None, None)
            .expect("submit")
            .wait()
            .expect("bw write");
    }
    let secs = t0.elapsed().as_secs_f64();
    check_eq("bw", &read_back(&p.target, p.dst, 0, data.len()), &data);
    (iters * data.len()) as f64 / secs / 1e6
}

/// Slices that adapt (4 KiB at first, up to 64 KiB): writes and reads of 2 MiB, every byte
/// verified at both ends whatever size each batch was cut with, and every batch cut into
/// slices of one of the sizes the sizer may pick (4 KiB doubled 0 to 4 times); then small
/// batches, one configured slice per lane whatever the large ones grew to.
pub fn adaptive_slices(dev_t: &[&str], dev_i: &[&str]) {
    let base = EngineConfig {
        rdma_slice_max: Some(64 << 10),
        ..EngineConfig::from_env()
    };
    let p = pair_cfg(dev_t, dev_i, TransportKind::Rdma, 4096, base);
    let len = 2usize << 20;
    let allowed: Vec<usize> = (0..5).map(|k| len / (4096 << k)).collect();
    let (mut writes, mut reads) = (Vec::new(), Vec::new());
    // The peer reports the slice its next large batch is cut with (the sizer has seen every
    // completed batch before its waiter returns).
    let reported = |dir: usize| {
        p.peer
            .slice_sizes()
            .expect("an rdma peer reports its slices")[dir]
    };
    for round in 0..40u64 {
        let off = round as usize % 4 * len;
        let data = pattern(7000 + round, len);
        let before = reported(0);
        let st = write_verified(&p, off, &data, &format!("adaptive write {round}"));
        assert!(
            allowed.contains(&st.slices),
            "write {round}: {} WRs",
            st.slices
        );
        assert_eq!(
            len / st.slices,
            before as usize,
            "write {round}: the reported slice"
        );
        writes.push(len / st.slices);
        // Read it back into another window of the initiator's region.
        p.init
            .local_write(p.src, (off + 4 * len) as u64, &vec![0u8; len])
            .expect("clear");
        let before = reported(1);
        let rop = Op {
            local: p.src,
            local_offset: (off + 4 * len) as u64,
            remote: p.target.region_id(p.dst),
            remote_offset: off as u64,
            len: len as u64,
        };
        let st = p
            .init
            .read(&p.peer, &[rop], None)
            .expect("submit")
            .wait()
            .expect("adaptive read");
        check_eq(
            &format!("adaptive read {round}"),
            &read_back(&p.init, p.src, (off + 4 * len) as u64, len),
            &data,
        );
        assert!(
            allowed.contains(&st.slices),
            "read {round}: {} WRs",
            st.slices
        );
        assert_eq!(
            len / st.slices,
            before as usize,
            "read {round}: the reported slice"
        );
        reads.push(len / st.slices);
    }
    // The same sizes in the metrics and their Prometheus text.
    let m = p.init.metrics();
    let snap = m
        .peers
        .iter()
        .find(|x| x.id == p.peer.id().0)
        .expect("the peer in the metrics");
    assert_eq!(snap.slice_sizes, Some([reported(0), reported(1)]));
    let line = format!(
        "kvwire_peer_slice_bytes{{peer=\"{}\",remote=\"{}\",transport=\"rdma\",dir=\"write\"}} {}",
        snap.id,
        snap.remote_addr,
        reported(0)
    );
    assert!(
        m.to_prometheus_text().lines().any(|l| l == line),
        "{line} in the exposition"
    );
    // A batch under one grown slice per lane still goes out on every lane (4), one configured
    // slice each: 16 KiB is four 4 KiB slices, whatever size the large batches grew to.
    let small = 16usize << 10;
    for round in 0..4u64 {
        let data = pattern(7100 + round, small);
        let st = write_verified(&p, 0, &data, &format!("small write {round}"));
        assert_eq!(st.slices, 4, "small write {round}: one WR per lane");
    }
    println!("adaptive slices, 40 writes and 40 reads of 2 MiB, every byte verified; slice sizes: writes {writes:?}, reads {reads:?}");
}

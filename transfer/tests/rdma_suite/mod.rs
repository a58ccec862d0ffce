//! The engine's `rdma` transport suite, shared by the SoftRoCE VM test (`rdma_engine_vm.rs`)
//! and the loopback-device test (`rdma_engine_loopback.rs`): two engines in one process,
//! forced to RDMA, the target on one device and the initiator on the other.
//!
//! Checks, every byte verified at the receiving end: writes and reads of many sizes and
//! scatter-gather shapes; notifications never delivered before their data (the target checks
//! its memory when the notification arrives); traffic spread over every queue pair (per-lane
//! work-request counters); typed errors for bad regions (out of bounds, unknown, stale, and a
//! region withdrawn under the initiator's feet, which the device refuses) and a good batch
//! after each; READs that miss their deadline; several devices per engine and devices shared
//! by engines; a peer fenced while it writes (`Engine::fence`: the region unchanged once it
//! returned); a small RDMA-vs-TCP throughput comparison (printed, not asserted).

// Each including test binary runs the suite on one kind of device.
#![allow(dead_code)]

use std::process::Command;
use std::time::{Duration, Instant};

use kvwire_transfer::verbs::Loopback;
use kvwire_transfer::{Access, Engine, EngineConfig, Error, Op, Peer, RegionHandle, TransportKind};

/// `len` bytes of the seeded pattern (the data the suite writes and reads back).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    kvwire_testkit::pattern::bytes(seed, 0, len)
}

pub fn check_eq(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first mismatch at byte {i} of {} (got {:#04x}, want {:#04x})",
            got.len(),
            got[i],
            want[i]
        );
    }
}

pub fn engine(dev: &str, kind: TransportKind, lanes: usize) -> Engine {
    engine_sliced(&[dev], kind, lanes, 64 << 10)
}

/// One device: the single-device setting (`rdma_device`); several: `rdma_devices`.
pub fn engine_sliced(
    devs: &[&str],
    kind: TransportKind,
    lanes: usize,
    slice_size: usize,
) -> Engine {
    engine_cfg(devs, kind, lanes, slice_size, EngineConfig::from_env())
}

/// [`engine_sliced`] from `base` (the run's knobs, or some set by a test).
pub fn engine_cfg(
    devs: &[&str],
    kind: TransportKind,
    lanes: usize,
    slice_size: usize,
    base: EngineConfig,
) -> Engine {
    let (rdma_device, rdma_devices) = match devs {
        [one] => (Some(one.to_string()), Vec::new()),
        many => (None, many.iter().map(|d| d.to_string()).collect()),
    };
    Engine::new(EngineConfig {
        transport: kind,
        lanes,
        slice_size,
        rdma_device,
        rdma_devices,
        default_deadline: Duration::from_secs(60),
        // The run's knobs (signalling, poll window; KVWIRE_PREFER_RDMA where set below).
        ..base
    })
    .unwrap_or_else(|e| panic!("engine on {devs:?}: {e}"))
}

pub fn read_back(e: &Engine, r: RegionHandle, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    e.local_read(r, off, &mut v).expect("local_read");
    v
}

pub struct Pair {
    pub target: Engine,
    pub init: Engine,
    pub peer: Peer,
    pub dst: RegionHandle, // on target, ReadWrite, 16 MiB
    pub src: RegionHandle, // on init, Local, 16 MiB
}

pub const REGION: usize = 16 << 20;

pub fn pair(dev_t: &[&str], dev_i: &[&str], kind: TransportKind) -> Pair {
    pair_sliced(dev_t, dev_i, kind, 64 << 10)
}

pub fn pair_sliced(dev_t: &[&str], dev_i: &[&str], kind: TransportKind, slice: usize) -> Pair {
    pair_cfg(dev_t, dev_i, kind, slice, EngineConfig::from_env())
}

pub fn pair_cfg(
    dev_t: &[&str],
    dev_i: &[&str],
    kind: TransportKind,
    slice: usize,
    base: EngineConfig,
) -> Pair {
    let target = engine_cfg(dev_t, kind, 4, slice, base.clone());
    let dst = target
        .alloc_region(REGION, Access::ReadWrite)
        .expect("target region");
    let init = engine_cfg(dev_i, kind, 4, slice, base);
    let src = init
        .alloc_region(REGION, Access::Local)
        .expect("src region");
    let peer = init.connect(target.listen_addr()).expect("connect");
    Pair {
        target,
        init,
        peer,
        dst,
        src,
    }
}

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

/// The device the suite runs on, and how it holds work requests in flight.
pub enum Nic {
    /// SoftRoCE in the VM (`tests/vm/run.sh`): rxe devices over a veth pair.
    SoftRoce,
    /// The in-process software device (`kvwire-verbs-loopback`), held and released exactly.
    Loopback(Loopback),
}

impl Nic {
    /// Keeps the READs posted from now on from completing: on SoftRoCE the target's replies
    /// are black-holed (its neighbour entry for the initiator points at a MAC nobody has); on
    /// the loopback device, work requests wait unexecuted.
    fn stall(&self) {
        match self {
            Nic::SoftRoce => neigh(Some("02:00:00:de:ad:01")),
            Nic::Loopback(l) => l.hold(),
        }
    }

    /// Undoes [`Nic::stall`].
    fn unstall(&self) {
        match self {
            Nic::SoftRoce => neigh(None),
            Nic::Loopback(l) => l.release(),
        }
    }

    /// Holds work requests posted from now on where the device can (loopback), so that what
    /// the test does next happens while they are in flight; SoftRoCE's own latency does that
    /// only by chance.
    fn hold(&self) {
        if let Nic::Loopback(l) = self {
            l.hold();
        }
    }

    /// Undoes [`Nic::hold`].
    fn release(&self) {
        if let Nic::Loopback(l) = self {
            l.release();
        }
    }
}

/// Points the target's neighbour entry for the initiator at `mac` (`None`: its real MAC).
fn neigh(mac: Option<&str>) {
    let ip1 = std::env::var("KVWIRE_RXE_IP1").unwrap_or_else(|_| "10.0.0.2".into());
    let real = std::fs::read_to_string("/sys/class/net/veth1/address")
        .expect("veth1 address")
        .trim()
        .to_string();
    let args = [
        "neigh",
        "replace",
        &ip1,
        "lladdr",
        mac.unwrap_or(&real),
        "dev",
        "veth0",
        "nud",
        "permanent",
    ];
    let st = Command::new("ip")
        .args(args)
        .status()
        .unwrap_or_else(|e| panic!("ip {args:?}: {e}"));
    assert!(st.success(), "ip {args:?} failed");
}

/// A READ batch that misses its deadline: the device is stalled ([`Nic::stall`]), so the READs
/// stay in flight; once
/// `wait` reports `Timeout`, nothing of them lands in the local buffer any more (their queue
/// pairs were broken and flushed first), even after the path is restored; the next read works
/// on re-established queue pairs.
pub fn read_deadline(p: &Pair, nic: &Nic) {
    let whole = pattern(4242, REGION);
    p.target.local_write(p.dst, 0, &whole).expect("fill target");
    let local = p.init.alloc_region(REGION, Access::Local).expect("local");
    let before_re = p.peer.lanes_reestablished();
    for round in 0..2 {
        p.init
            .local_write(local, 0, &vec![0u8; REGION])
            .expect("clear local");
        let op = Op {
            local,
            local_offset: 0,
            remote: p.target.region_id(p.dst),
            remote_offset: 0,
            len: REGION as u64,
        };
        nic.stall();
        let t0 = Instant::now();
        let b = p
            .init
            .read(&p.peer, &[op], Some(Duration::from_millis(50)))
            .expect("submit");
        let t_post = t0.elapsed();
        let r = b.wait();
        println!(
            "round {round}: read() returned after {t_post:?}, wait() after {:?}: {r:?}",
            t0.elapsed()
        );
        let before = read_back(&p.init, local, 0, REGION);
        nic.unstall();
        match r {
            Err(Error::Timeout) => {}
            other => {
                panic!("round {round}: expected Timeout with the device stalled, got {other:?}")
            }
        }
        std::thread::sleep(Duration::from_millis(500));
        let after = read_back(&p.init, local, 0, REGION);
        assert!(
            before == after,
            "round {round}: READ data landed after the batch reported Timeout"
        );
        let n = 1 << 20;
        let op = Op {
            local,
            local_offset: 0,
            remote: p.target.region_id(p.dst),
            remote_offset: 333,
            len: n as u64,
        };
        p.init
            .read(&p.peer, &[op], None)
            .expect("submit")
            .wait()
            .expect("read after a timed-out read");
        check_eq(
            "read after timeout",
            &read_back(&p.init, local, 0, n),
            &whole[333..333 + n],
        );
    }
    let re = p.peer.lanes_reestablished() - before_re;
    assert!(
        re >= 1,
        "timed-out READs must have broken (and re-established) lanes"
    );
    println!(
        "read deadlines (device stalled): 2 of 2 Timeout, nothing landed afterwards, \
         {re} lanes re-established, next read verified"
    );
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
                    let off = (t * chunk) as u64;
                    p.init.local_write(p.src, off, &data).expect("fill");
                    let op = Op {
                        local: p.src,
                        local_offset: off,
                        remote: p.target.region_id(p.dst),
                        remote_offset: off,
                        len: chunk as u64,
                    };
                    let st = p
                        .init
                        .write(&p.peer, &[op], None, None)
                        .expect("submit")
                        .wait()
                        .expect("concurrent write");
                    assert_eq!(st.slices, chunk / 4096);
                    check_eq(
                        &format!("thread {t} round {round}"),
                        &read_back(&p.target, p.dst, off, chunk),
                        &data,
                    );
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

/// The target engine shuts down: the initiator's next batch fails with `PeerDead`.
pub fn dead_peer(dev_t: &[&str], dev_i: &[&str]) {
    let p = pair(dev_t, dev_i, TransportKind::Rdma);
    p.target.shutdown();
    let op = Op {
        local: p.src,
        local_offset: 0,
        remote: p.target.region_id(p.dst),
        remote_offset: 0,
        len: 1 << 20,
    };
    match p
        .init
        .write(&p.peer, &[op], None, None)
        .and_then(|b| b.wait())
    {
        Err(Error::PeerDead(m)) => println!("dead peer: PeerDead ({m})"),
        other => panic!("expected PeerDead after the target shut down, got {other:?}"),
    }
}

/// The target fences the initiator while it writes in a loop over RDMA: once `fence` returned
/// the target region stays the same (its queue pairs are in the error state: the NIC refuses
/// the initiator's writes) and every later attempt fails with a typed error.
pub fn fenced_peer(dev_t: &[&str], dev_i: &[&str]) {
    let p = pair(dev_t, dev_i, TransportKind::Rdma);
    assert_eq!(p.peer.transport(), TransportKind::Rdma);
    let fencing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (init, peer, src, rid) = (
        p.init.clone(),
        p.peer.clone(),
        p.src,
        p.target.region_id(p.dst),
    );
    let taddr = p.target.listen_addr();
    let (f2, d2) = (fencing.clone(), done.clone());
    let writer = std::thread::spawn(move || {
        let mut peer = Some(peer);
        let mut errors = Vec::new();
        let mut k = 0u64;
        while errors.len() < 100 {
            k += 1;
            let op = Op {
                local: src,
                local_offset: 0,
                remote: rid,
                remote_offset: (k % 8) * (1 << 20),
                len: 1 << 20,
            };
            let r = match &peer {
                Some(pp) => init
                    .write(pp, &[op], None, None)
                    .and_then(|b| b.wait().map(|_| ())),
                None => init.connect(taddr).map(|np| peer = Some(np)),
            };
            match r {
                Ok(()) => {
                    d2.fetch_add(1, std::sync::atomic::Ordering::Release);
                }
                Err(e) => {
                    assert!(
                        f2.load(std::sync::atomic::Ordering::Acquire),
                        "before the fence: {e}"
                    );
                    peer = None;
                    errors.push(e);
                }
            }
        }
        errors
    });
    while done.load(std::sync::atomic::Ordering::Acquire) < 10 {
        std::thread::sleep(Duration::from_millis(1));
    }
    fencing.store(true, std::sync::atomic::Ordering::Release);
    p.target.fence(p.init.listen_addr()).expect("fence");
    let frozen = read_back(&p.target, p.dst, 0, 8 << 20);
    let errors = writer.join().expect("writer");
    for e in &errors {
        assert!(
            matches!(
                e,
                Error::PeerDead(_)
                    | Error::Fenced { .. }
                    | Error::StaleRegion(_)
                    | Error::UnknownRegion(_)
            ),
            "untyped failure after the fence: {e}"
        );
    }
    assert!(errors.iter().any(|e| matches!(e, Error::Fenced { .. })));
    check_eq(
        "fenced region",
        &read_back(&p.target, p.dst, 0, 8 << 20),
        &frozen,
    );
    println!("fenced peer: its rdma writes refused, the region unchanged");
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

pub fn bad_regions(p: &Pair, nic: &Nic) {
    let dst = p.target.region_id(p.dst);
    let op = |remote, remote_offset, len| Op {
        local: p.src,
        local_offset: 0,
        remote,
        remote_offset,
        len,
    };
    match p
        .init
        .write(&p.peer, &[op(dst, REGION as u64 - 10, 11)], None, None)
    {
        Err(Error::OutOfBounds { .. }) => {}
        other => panic!("expected OutOfBounds, got {other:?}"),
    }
    good_write(p, 1);
    let mut unknown = dst;
    unknown.index += 1000;
    match p.init.write(&p.peer, &[op(unknown, 0, 8)], None, None) {
        Err(Error::UnknownRegion(_)) => {}
        other => panic!("expected UnknownRegion, got {other:?}"),
    }
    good_write(p, 2);
    // A region withdrawn by the target while an 8 MiB write into it is in flight (128 work
    // requests over every queue pair): the NIC refuses the deregistered rkey, the batch fails
    // with AccessDenied, every queue pair that carried it breaks and is re-established over
    // the control connection, and the next batches succeed on the same peer.
    let mut nic_refusals = 0;
    let big = 8usize << 20;
    let data = pattern(99, big);
    p.init.local_write(p.src, 0, &data).expect("fill");
    for round in 0..4u64 {
        let extra = p
            .target
            .alloc_region(big, Access::WriteOnly)
            .expect("extra region");
        let id = p.target.region_id(extra);
        let t0 = Instant::now();
        while !p.peer.regions().iter().any(|r| r.id == id) {
            assert!(t0.elapsed() < Duration::from_secs(10), "region announced");
            std::thread::sleep(Duration::from_millis(1));
        }
        nic.hold();
        let b = p
            .init
            .write(&p.peer, &[op(id, 0, big as u64)], None, None)
            .expect("submit");
        p.target.unregister(extra).expect("unregister");
        nic.release();
        match b.wait() {
            Ok(_) => println!("round {round}: the write completed before the withdrawal"),
            Err(Error::AccessDenied(r)) => {
                assert_eq!(r, id);
                nic_refusals += 1;
            }
            other => panic!("round {round}: expected Ok or AccessDenied, got {other:?}"),
        }
        good_write(p, 10 + round);
        assert!(p.peer.is_alive());
    }
    // A withdrawn region the initiator already knows about: refused before posting.
    let extra = p
        .target
        .alloc_region(4096, Access::WriteOnly)
        .expect("extra");
    let id = p.target.region_id(extra);
    let t0 = Instant::now();
    while !p.peer.regions().iter().any(|r| r.id == id) {
        assert!(t0.elapsed() < Duration::from_secs(10), "region announced");
        std::thread::sleep(Duration::from_millis(1));
    }
    p.target.unregister(extra).expect("unregister");
    while p.peer.regions().iter().any(|r| r.id == id) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "withdrawal announced"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    match p.init.write(&p.peer, &[op(id, 0, 8)], None, None) {
        Err(Error::StaleRegion(_)) => {}
        other => panic!("expected StaleRegion, got {other:?}"),
    }
    good_write(p, 20);
    println!(
        "bad regions: OutOfBounds, UnknownRegion, StaleRegion before posting; {nic_refusals} of \
         4 in-flight withdrawals refused by the NIC (AccessDenied); a verified good write after \
         each; work requests per lane {:?}; lanes re-established {}",
        p.peer.lane_counters(),
        p.peer.lanes_reestablished()
    );
    assert!(
        nic_refusals >= 1,
        "no in-flight withdrawal reached the NIC: the recovery path was not exercised"
    );
    assert!(
        p.peer.lanes_reestablished() >= 1,
        "the NIC refused a write but no queue pair was re-established"
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

/// A NIC counter of the rxe device (`/sys/class/infiniband/<dev>/ports/1/hw_counters`).
pub fn hw_counter(dev: &str, name: &str) -> Option<u64> {
    std::fs::read_to_string(format!(
        "/sys/class/infiniband/{dev}/ports/1/hw_counters/{name}"
    ))
    .ok()?
    .trim()
    .parse()
    .ok()
}

/// Two engines with both devices each, listed in opposite orders, so the rails pair the
/// target's rxe0 with the initiator's rxe1 and the target's rxe1 with the initiator's rxe0: every
/// byte crosses the veth pair, in both directions. The whole data-path suite runs again (every
/// byte verified, notifications checked against memory when they arrive), then: traffic spread
/// over both devices (the engine's per-device counters and the NICs' own packet counters) and
/// over all 8 queue pairs; the error paths (bad rkey / withdrawn region, read deadline, dead
/// peer) with queue pairs on both devices; and the default (no device named: every active
/// device, same order on both sides).
pub fn multi_device(d0: &str, d1: &str, nic: &Nic) {
    let sent_before = [hw_counter(d0, "sent_pkts"), hw_counter(d1, "sent_pkts")];
    let p = pair(&[d0, d1], &[d1, d0], TransportKind::Rdma);
    assert_eq!(p.peer.transport(), TransportKind::Rdma);
    writes_of_many_sizes(&p);
    sg_writes_with_notifications(&p);
    reads_of_many_sizes(&p);
    spread_over_queue_pairs(&p, 8);
    let dc = p.peer.device_counters();
    println!("work requests per device: {dc:?}");
    assert_eq!(
        dc.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
        vec![d1, d0],
        "the initiator's devices, in its order"
    );
    let total: u64 = dc.iter().map(|(_, n)| n).sum();
    for (name, n) in &dc {
        assert!(
            n * 4 >= total,
            "device {name} carried {n} of {total} work requests: traffic not spread"
        );
    }
    let sent_after = [hw_counter(d0, "sent_pkts"), hw_counter(d1, "sent_pkts")];
    for (i, dev) in [d0, d1].iter().enumerate() {
        match (sent_before[i], sent_after[i]) {
            (Some(a), Some(b)) => {
                println!("{dev}: {} packets sent (NIC counter)", b - a);
                assert!(b - a > 1000, "{dev} sent only {} packets", b - a);
            }
            _ => eprintln!("note: {dev} has no hw_counters/sent_pkts; NIC-side check skipped"),
        }
    }
    bad_regions(&p, nic);
    read_deadline(&p, nic);
    let dc = p.peer.device_counters();
    assert!(dc.iter().all(|(_, n)| *n > 0), "both devices used: {dc:?}");
    drop(p);
    concurrent_submitters(&[d0, d1], &[d1, d0]);
    dead_peer(&[d0, d1], &[d1, d0]);
    // Default: no device named, every active device (both sides list rxe0, rxe1; the pairs are
    // rxe0-rxe0 and rxe1-rxe1, loopback inside each device).
    {
        std::env::remove_var("KVWIRE_RDMA_DEVICE");
        let cfg = EngineConfig {
            transport: TransportKind::Rdma,
            default_deadline: Duration::from_secs(60),
            ..EngineConfig::from_env()
        };
        let t = Engine::new(cfg.clone()).expect("default target engine");
        let i = Engine::new(cfg).expect("default initiator engine");
        let dst = t.alloc_region(4 << 20, Access::WriteOnly).expect("dst");
        let src = i.alloc_region(4 << 20, Access::Local).expect("src");
        let peer = i.connect(t.listen_addr()).expect("connect");
        let notes = t.notifications();
        for round in 0..4u64 {
            let data = pattern(600 + round, (3 << 20) + 17);
            i.local_write(src, 0, &data).expect("fill");
            let op = Op {
                local: src,
                local_offset: 0,
                remote: t.region_id(dst),
                remote_offset: 5,
                len: data.len() as u64,
            };
            let b = i.write(&peer, &[op], Some(b"dflt"), None).expect("submit");
            let n = notes
                .recv_timeout(Duration::from_secs(60))
                .expect("notification");
            assert_eq!(n.tag, b"dflt");
            check_eq("default devices", &read_back(&t, dst, 5, data.len()), &data);
            b.wait().expect("default-device write");
        }
        let dc = peer.device_counters();
        println!("default devices: work requests per device {dc:?}");
        assert_eq!(dc.len(), 2, "both active devices opened by default");
        assert!(dc.iter().all(|(_, n)| *n > 0), "both devices used: {dc:?}");
    }
    println!("MULTI-DEVICE-OK");
}

/// Completion threads of this process, by device name (`rdma-cq-<device>`).
pub fn cq_threads() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .filter(|c| c.starts_with("rdma-cq-"))
        .collect();
    v.sort();
    v
}

/// Waits (bounded) until the completion threads of devices no engine holds any more have
/// ended (each ends at its next wake-up once its last engine is gone).
pub fn settled_cq_threads(want: &[String]) -> Vec<String> {
    settled(want.to_vec(), cq_threads)
}

/// Device contexts open in this process once those of engines that are gone have closed (a
/// device closes after its completion thread ended and the last region or queue pair of a
/// dropped engine let go of it), waiting (bounded) for `want`.
pub fn settled_contexts(want: usize) -> usize {
    settled(want, kvwire_transfer::verbs::contexts_open)
}

/// `now()` once it equals `want`, or after 20 s, whatever it is then.
fn settled<T: PartialEq>(want: T, now: impl Fn() -> T) -> T {
    let t0 = Instant::now();
    loop {
        let v = now();
        if v == want || t0.elapsed() > Duration::from_secs(20) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One process, several engines on the same two devices (as a vLLM instance runs a data
/// engine per worker): each device is opened once (device contexts counted by the verbs
/// layer), one completion thread per device whatever the number of engines, and the engines
/// still move every byte right between each other over the shared devices' queues.
pub fn shared_devices(d0: &str, d1: &str) {
    assert_eq!(settled_contexts(0), 0, "earlier engines' devices closed");
    let first = engine_sliced(&[d0, d1], TransportKind::Rdma, 2, 64 << 10);
    let want = {
        let mut v = vec![format!("rdma-cq-{d0}"), format!("rdma-cq-{d1}")];
        v.sort();
        v
    };
    assert_eq!(
        settled_cq_threads(&want),
        want,
        "one completion thread per device"
    );
    assert_eq!(
        kvwire_transfer::verbs::contexts_open(),
        2,
        "two devices, two contexts"
    );
    let opened = kvwire_transfer::verbs::contexts_opened();
    let more: Vec<Engine> = (0..3)
        .map(|_| engine_sliced(&[d0, d1], TransportKind::Rdma, 2, 64 << 10))
        .collect();
    assert_eq!(
        kvwire_transfer::verbs::contexts_opened(),
        opened,
        "engines 2-4 opened no device context of their own"
    );
    assert_eq!(kvwire_transfer::verbs::contexts_open(), 2);
    assert_eq!(cq_threads(), want, "no completion thread per engine");
    // Traffic between engines that share both devices (completions of both ends on the same
    // queues): a ring of writes, every byte checked at the target.
    let all: Vec<&Engine> = std::iter::once(&first).chain(more.iter()).collect();
    let dsts: Vec<RegionHandle> = all
        .iter()
        .map(|e| e.alloc_region(4 << 20, Access::WriteOnly).expect("dst"))
        .collect();
    for (i, e) in all.iter().enumerate() {
        let j = (i + 1) % all.len();
        let src = e.alloc_region(4 << 20, Access::Local).expect("src");
        let data = pattern(900 + i as u64, (3 << 20) + 11);
        e.local_write(src, 0, &data).expect("fill");
        let peer = e.connect(all[j].listen_addr()).expect("connect");
        assert_eq!(peer.transport(), TransportKind::Rdma);
        let op = Op {
            local: src,
            local_offset: 0,
            remote: all[j].region_id(dsts[j]),
            remote_offset: 3,
            len: data.len() as u64,
        };
        e.write(&peer, &[op], None, None)
            .expect("submit")
            .wait()
            .expect("write between engines sharing devices");
        check_eq(
            &format!("engine {i} -> engine {j}"),
            &read_back(all[j], dsts[j], 3, data.len()),
            &data,
        );
    }
    assert_eq!(kvwire_transfer::verbs::contexts_opened(), opened);
    drop(dsts);
    drop(more);
    drop(first);
    assert_eq!(
        settled_cq_threads(&[]),
        Vec::<String>::new(),
        "threads end with the last engine"
    );
    assert_eq!(
        settled_contexts(0),
        0,
        "devices closed with the last engine"
    );
    println!("SHARED-DEVICES-OK: 4 engines, 2 device contexts, 2 completion threads");
}

/// The whole suite on devices `d0` and `d1` of `nic`, every byte verified: one device per
/// engine (writes, scattered writes with notifications, reads, spread over queue pairs, bad
/// regions, read deadlines), two devices per engine, devices shared by several engines of one
/// process, Auto's choices, concurrent submitters, a dead peer, a fenced peer, and a
/// throughput comparison with tcp (printed, not asserted).
pub fn run(d0: &str, d1: &str, nic: &Nic) {
    // The knobs this run's data path uses.
    for k in ["KVWIRE_RDMA_SIGNAL_EVERY", "KVWIRE_RDMA_POLL_US"] {
        println!(
            "{k}={}",
            std::env::var(k).unwrap_or_else(|_| "(default)".into())
        );
    }
    let p = pair(&[d0], &[d1], TransportKind::Rdma);
    assert_eq!(p.peer.transport(), TransportKind::Rdma);
    writes_of_many_sizes(&p);
    sg_writes_with_notifications(&p);
    reads_of_many_sizes(&p);
    spread_over_queue_pairs(&p, 4);
    assert_eq!(p.peer.device_counters().len(), 1, "one device configured");
    bad_regions(&p, nic);
    read_deadline(&p, nic);
    drop(p);
    gathered_writes_and_reads(d0, d1);
    multi_device(d0, d1, nic);
    shared_devices(d0, d1);
    // Auto between two engines of one host picks shm unless told otherwise.
    {
        let a = engine(d0, TransportKind::Auto, 2);
        let b = engine(d1, TransportKind::Auto, 2);
        let peer = b.connect(a.listen_addr()).expect("auto connect");
        assert_eq!(peer.transport(), TransportKind::Shm);
    }
    concurrent_submitters(&[d0], &[d1]);
    dead_peer(&[d0], &[d1]);
    fenced_peer(&[d0], &[d1]);
    // ... and RDMA with KVWIRE_PREFER_RDMA=1 (set while no other engine runs).
    {
        std::env::set_var("KVWIRE_PREFER_RDMA", "1");
        let a = engine(d0, TransportKind::Auto, 2);
        let b = engine(d1, TransportKind::Auto, 2);
        let dst = a.alloc_region(1 << 20, Access::WriteOnly).expect("dst");
        let src = b.alloc_region(1 << 20, Access::Local).expect("src");
        let peer = b.connect(a.listen_addr()).expect("auto connect");
        std::env::remove_var("KVWIRE_PREFER_RDMA");
        assert_eq!(peer.transport(), TransportKind::Rdma);
        let data = pattern(3, 100_000);
        b.local_write(src, 0, &data).expect("fill");
        let op = Op {
            local: src,
            local_offset: 0,
            remote: a.region_id(dst),
            remote_offset: 7,
            len: data.len() as u64,
        };
        b.write(&peer, &[op], None, None)
            .expect("submit")
            .wait()
            .expect("auto rdma write");
        check_eq("auto rdma", &read_back(&a, dst, 7, data.len()), &data);
        println!("Auto picks shm on one host, rdma with KVWIRE_PREFER_RDMA=1");
    }
    let rdma = throughput(TransportKind::Rdma, &[d0], &[d1]);
    let tcp = throughput(TransportKind::Tcp, &[d0], &[d1]);
    println!(
        "throughput, 16 x 8 MiB writes, one batch at a time: rdma {rdma:.1} MB/s, \
         tcp {tcp:.1} MB/s, ratio {:.2}",
        rdma / tcp
    );
}

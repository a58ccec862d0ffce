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
//!
//! Files: `shapes` (the data path in many shapes), `chunks` (regions registered in chunks),
//! `faults` (errors and the good batch after each), `devices` (several devices per engine,
//! devices shared by engines); here the pairs of engines, the device kinds and [`run`].

// Each including test binary runs the suite on one kind of device.
#![allow(dead_code)]

mod chunks;
mod devices;
mod faults;
mod shapes;

use std::process::Command;
use std::time::{Duration, Instant};

use kvwire_transfer::verbs::Loopback;
use kvwire_transfer::{Access, Engine, EngineConfig, Error, Op, Peer, RegionHandle, TransportKind};

pub use chunks::*;
pub use devices::*;
pub use faults::*;
pub use shapes::*;

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
        // Slices of exactly `slice_size` (tests count work requests), unless a test asks for
        // adaptive slices.
        rdma_slice_max: base.rdma_slice_max.or(Some(slice_size as u64)),
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
    chunked_registrations(d0, d1);
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
    adaptive_slices(&[d0], &[d1]);
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

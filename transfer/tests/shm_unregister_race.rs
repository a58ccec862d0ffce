//! A target unregisters caller memory (`register_raw`) while a same-host peer's shm writes into
//! it are in flight: once `unregister` returns Ok no byte lands in that memory any more (the
//! child overwrites it with a guard pattern at once and checks it after every write ended), and
//! the writer's later batches fail with `Error::StaleRegion`, nothing crashes.

mod common;

use common::op_at;
use common::race::{Racers, RawTarget};
use kvwire_transfer::TransportKind;

#[test]
fn child_main() {
    common::child_entry();
}

const RAW: usize = 16 << 20;
const THREADS: usize = 3;

fn race_once(round: u64) {
    // Region 0: memfd (control), region 1: caller memory.
    let mut rt = RawTarget::start(TransportKind::Auto, TransportKind::Shm, RAW, 100 + round);
    let (e, p, src, raw) = (rt.e.clone(), rt.p.clone(), rt.src, rt.raw);
    let racers = Racers::spawn(THREADS, move |i, th| {
        // Large (copy thread) and small (inline) writes, a few in flight at once.
        let len: u64 = if (i + th) % 3 == 0 { 4 << 20 } else { 64 << 10 };
        let off = ((i as u64 * 1_048_576 + th as u64 * 65536) % (RAW as u64 - len)) & !4095;
        let op = op_at(src, raw, off, len);
        e.write(&p, &[op], None, None)
    });
    // Let writes flow, then unregister under them.
    racers.wait_completed(8);
    let guard = 7_000 + round;
    rt.unregister_guard(guard);
    let outs = racers.stop("writer");
    // StaleRegion seen while submitting (not counting the batches still in flight at the end).
    let stale: u64 = outs.iter().map(|o| o.stale).sum();
    assert!(
        stale >= THREADS as u64,
        "every writer must have seen StaleRegion"
    );
    // No byte of any write landed after unregister returned; the peer and the other region
    // still work, bytes checked at both ends.
    rt.finish(guard);
}

#[test]
fn unregister_of_raw_memory_waits_for_running_shm_copies() {
    for round in 0..3 {
        race_once(round);
    }
}

//! A target unregisters caller memory (`register_raw`) while a same-host peer's shm writes into
//! it are in flight: once `unregister` returns Ok no byte lands in that memory any more (the
//! child overwrites it with a guard pattern at once and checks it after every write ended), and
//! the writer's later batches fail with `Error::StaleRegion`, nothing crashes.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{pattern, Target};
use kvwire_transfer::{Access, Engine, EngineConfig, Error, Op, TransportKind};

#[test]
fn child_main() {
    common::child_entry();
}

const RAW: usize = 16 << 20;
const THREADS: usize = 3;
/// Bound on batches per writer thread.
const MAX_BATCHES: usize = 3000;

fn race_once(round: u64) {
    // Region 0: memfd (control), region 1: caller memory.
    let mut t = Target::spawn("child_main", &format!("1048576:rw,{RAW}:rw:raw"), None);
    let e = Engine::new(EngineConfig {
        transport: TransportKind::Auto,
        ..Default::default()
    })
    .expect("engine");
    let p = e.connect(t.addr).expect("connect");
    assert_eq!(p.transport(), TransportKind::Shm);
    let raw = p.regions()[1].id;
    let src = e.alloc_region(RAW, Access::Local).expect("src");
    let seed = 100 + round;
    e.local_write(src, 0, &pattern(seed, 0, RAW)).expect("fill");
    // Before the race: one verified write of the whole region.
    e.write(
        &p,
        &[Op {
            local: src,
            local_offset: 0,
            remote: raw,
            remote_offset: 0,
            len: RAW as u64,
        }],
        None,
        None,
    )
    .expect("submit")
    .wait()
    .expect("first write");
    assert_eq!(t.cmd(&format!("check 1 0 {RAW} {seed}")), "OK");

    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for th in 0..THREADS {
        let (e, p, stop, done) = (e.clone(), p.clone(), stop.clone(), done.clone());
        handles.push(std::thread::spawn(move || {
            let mut stale = 0u64;
            let mut inflight = Vec::new();
            for i in 0..MAX_BATCHES {
                // Large (copy thread) and small (inline) writes, a few in flight at once.
                let len: u64 = if (i + th) % 3 == 0 { 4 << 20 } else { 64 << 10 };
                let off = ((i as u64 * 1_048_576 + th as u64 * 65536) % (RAW as u64 - len)) & !4095;
                let op = Op {
                    local: src,
                    local_offset: off,
                    remote: raw,
                    remote_offset: off,
                    len,
                };
                match e.write(&p, &[op], None, None) {
                    Ok(b) => inflight.push(b),
                    Err(Error::StaleRegion(_)) => stale += 1,
                    Err(other) => panic!("submit: unexpected {other}"),
                }
                if inflight.len() >= 4 {
                    for b in inflight.drain(..) {
                        match b.wait() {
                            Ok(_) => {
                                done.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(Error::StaleRegion(_)) => stale += 1,
                            Err(other) => panic!("batch: unexpected {other}"),
                        }
                    }
                }
                if stop.load(Ordering::Acquire) && stale > 0 {
                    break;
                }
            }
            for b in inflight {
                match b.wait() {
                    Ok(_) | Err(Error::StaleRegion(_)) => {}
                    Err(other) => panic!("batch: unexpected {other}"),
                }
            }
            stale
        }));
    }
    // Let writes flow, then unregister under them.
    let mut waited = 0;
    while done.load(Ordering::Relaxed) < 8 && waited < 2000 {
        std::thread::sleep(Duration::from_millis(5));
        waited += 1;
    }
    let guard = 7_000 + round;
    assert_eq!(t.cmd(&format!("unregister_guard 1 {guard}")), "OK");
    stop.store(true, Ordering::Release);
    let stale: u64 = handles
        .into_iter()
        .map(|h| h.join().expect("writer thread"))
        .sum();
    assert!(
        stale >= THREADS as u64,
        "every writer must have seen StaleRegion"
    );
    // No byte of any write landed after unregister returned.
    assert_eq!(t.cmd(&format!("check_guard 1 {guard}")), "OK");
    // The peer and the other region still work, bytes checked at both ends.
    let ctl = p.regions()[0].id;
    e.write(
        &p,
        &[Op {
            local: src,
            local_offset: 0,
            remote: ctl,
            remote_offset: 0,
            len: 1 << 20,
        }],
        None,
        None,
    )
    .expect("submit")
    .wait()
    .expect("write after the race");
    assert_eq!(t.cmd(&format!("check 0 0 1048576 {seed}")), "OK");
    assert!(p.is_alive());
}

#[test]
fn unregister_of_raw_memory_waits_for_running_shm_copies() {
    for round in 0..3 {
        race_once(round);
    }
}

//! Notification delivery under load, over shm (`TransportKind::Auto` on one host) and tcp: every
//! notification arrives exactly once, after its batch's bytes, and is already queued at the
//! target when its batch completes at the initiator, so notifications of batches that completed
//! before another was submitted arrive before that one's (the per-peer order the engine
//! promises; see `Engine::write`). Over shm, batches submitted one after the other to a peer
//! are also notified in submission order.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{pattern, Target};
use kvwire_transfer::{Access, Engine, EngineConfig, Op, Peer, RegionHandle, TransportKind};

#[test]
fn child_main() {
    common::child_entry();
}

fn engine(kind: TransportKind) -> Engine {
    Engine::new(EngineConfig {
        transport: kind,
        ..Default::default()
    })
    .expect("engine")
}

/// A completed batch's notification is already queued at the target: checked right after
/// `wait` with `try_recv` (no waiting), for small, empty (control-message) and large batches.
fn completion_implies_delivery(kind: TransportKind, want: TransportKind) {
    let target = engine(TransportKind::Auto);
    let dst = target
        .alloc_region(4 << 20, Access::ReadWrite)
        .expect("dst");
    let init = engine(kind);
    let src = init.alloc_region(4 << 20, Access::Local).expect("src");
    let p = init.connect(target.listen_addr()).expect("connect");
    assert_eq!(p.transport(), want);
    let rid = p.regions()[0].id;
    let notes = target.notifications();
    for i in 0..400u64 {
        // Every 50th batch goes over the copy thread (> 1 MiB); every 3rd has no ops at all.
        let len: u64 = match i {
            _ if i % 50 == 49 => 3 << 19,
            _ if i % 3 == 0 => 0,
            _ => 4096 * (1 + i % 4),
        };
        let off = (i % 2) * (2 << 20);
        let seed = i + 1;
        init.local_write(src, off, &pattern(seed, off, len as usize))
            .expect("fill");
        let ops: Vec<Op> = if len == 0 {
            Vec::new()
        } else {
            vec![Op {
                local: src,
                local_offset: off,
                remote: rid,
                remote_offset: off,
                len,
            }]
        };
        let tag = format!("n{i}");
        init.write(&p, &ops, Some(tag.as_bytes()), None)
            .expect("submit")
            .wait()
            .expect("batch");
        let got = notes.try_recv();
        assert_eq!(
            got.as_ref().map(|n| n.tag.clone()),
            Some(tag.into_bytes()),
            "{kind:?}: batch {i} completed but its notification is not queued at the target"
        );
        let mut buf = vec![0u8; len as usize];
        target.local_read(dst, off, &mut buf).expect("read");
        assert_eq!(
            common::mismatch(seed, off, &buf),
            None,
            "{kind:?}: bytes of batch {i}"
        );
    }
    assert!(notes.try_recv().is_none(), "{kind:?}: a stray notification");
}

#[test]
fn completed_batch_has_its_notification_queued_shm() {
    completion_implies_delivery(TransportKind::Auto, TransportKind::Shm);
}

#[test]
fn completed_batch_has_its_notification_queued_tcp() {
    completion_implies_delivery(TransportKind::Tcp, TransportKind::Tcp);
}

const REGION: usize = 32 << 20;
const THREADS: usize = 4;
const WINDOWS: usize = 6;
/// Layer batches per window (one request: several layers), submitted without waiting.
const LAYERS: usize = 8;
const LARGE: usize = 5 << 18; // 1.25 MiB: over the inline limit, goes to the copy thread

/// Where the bytes of one notified batch went (and the pattern seed they carry).
#[derive(Clone, Copy, Debug)]
struct Sent {
    region: usize,
    off: u64,
    len: usize,
    seed: u64,
}

fn tag(s: &Sent, th: usize, win: usize, idx: usize) -> String {
    format!(
        "{} {} {} {} {th} {win} {idx}",
        s.region, s.off, s.len, s.seed
    )
}

/// Layer batches of several requests from several threads to one child target (a memfd and a
/// raw region, so both shm paths are used), small ones interleaved with large ones and with
/// empty "request done" control batches; the child checks each batch's bytes the moment its
/// notification is delivered and reports the arrival order.
fn layerwise_flow(kind: TransportKind, want: TransportKind) {
    let mut t = Target::spawn("child_main", &format!("{REGION}:rw,{REGION}:rw:raw"), None);
    let e = engine(kind);
    let p = e.connect(t.addr).expect("connect");
    assert_eq!(p.transport(), want);
    let per_thread = WINDOWS * (LAYERS + 1);
    assert_eq!(
        t.cmd(&format!("journal {} 30000", THREADS * per_thread)),
        "OK"
    );
    let regions: Vec<_> = p.regions().iter().map(|r| r.id).collect();
    let shared = Arc::new((e.clone(), p.clone(), regions));
    let mut handles = Vec::new();
    for th in 0..THREADS {
        let shared = shared.clone();
        handles.push(std::thread::spawn(move || {
            let (e, p, regions): &(Engine, Peer, Vec<_>) = &shared;
            let area = (REGION / THREADS) as u64;
            // Source bytes of region r's area at r * area (no two in-flight batches share any).
            let src: RegionHandle = e
                .alloc_region(2 * area as usize, Access::Local)
                .expect("src");
            let mut cursor = [th as u64 * area, th as u64 * area];
            let mut n = 0usize;
            for win in 0..WINDOWS {
                let mut batches = Vec::new();
                for idx in 0..LAYERS {
                    n += 1;
                    let region = n % 2;
                    let len = if n % 16 == 3 || n % 16 == 10 {
                        LARGE
                    } else {
                        4096 * (1 + (n * 7 + th) % 16)
                    };
                    let off = cursor[region];
                    cursor[region] += len as u64;
                    assert!(cursor[region] <= (th as u64 + 1) * area, "area overflow");
                    let s = Sent {
                        region,
                        off,
                        len,
                        seed: (th * 10_000 + n) as u64 + 1,
                    };
                    let soff = region as u64 * area + off - th as u64 * area;
                    e.local_write(src, soff, &pattern(s.seed, off, len))
                        .expect("fill");
                    // Blocks of 4 KiB in reverse order (coalesced back into one transfer).
                    let ops: Vec<Op> = (0..(len / 4096) as u64)
                        .rev()
                        .map(|k| Op {
                            local: src,
                            local_offset: soff + k * 4096,
                            remote: regions[region],
                            remote_offset: off + k * 4096,
                            len: 4096,
                        })
                        .collect();
                    let b = e
                        .write(p, &ops, Some(tag(&s, th, win, idx).as_bytes()), None)
                        .expect("submit");
                    batches.push(b);
                }
                for b in batches {
                    b.wait().expect("layer batch");
                }
                // The request's "done" control message: an empty batch with a notification.
                let done = Sent {
                    region: 0,
                    off: 0,
                    len: 0,
                    seed: 0,
                };
                e.write(p, &[], Some(tag(&done, th, win, LAYERS).as_bytes()), None)
                    .expect("submit done")
                    .wait()
                    .expect("done batch");
            }
            e.unregister(src).expect("unregister src");
        }));
    }
    for h in handles {
        h.join().expect("sender thread");
    }
    let r = t.cmd("journal_result");
    let (head, tags) = r.split_once('|').unwrap_or((&r, ""));
    assert_eq!(
        head,
        format!("JOURNAL {} 0 0", THREADS * per_thread),
        "{kind:?}: delivered/bad/extra"
    );
    // Exactly once, and per thread in the promised order.
    let mut seen: HashMap<(u64, u64, u64), usize> = HashMap::new();
    let mut last: HashMap<u64, (u64, u64)> = HashMap::new(); // thread -> (window, layers seen)
    for (pos, tg) in tags.split('|').enumerate() {
        let f: Vec<u64> = tg
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        assert_eq!(f.len(), 7, "{kind:?}: tag {tg:?}");
        let (th, win, idx) = (f[4], f[5], f[6]);
        if let Some(prev) = seen.insert((th, win, idx), pos) {
            panic!("{kind:?}: {tg:?} delivered twice (at {prev} and {pos})");
        }
        let st = last.entry(th).or_insert((0, 0));
        // Window w's batches all completed before w's done was submitted, which completed
        // before window w+1 was submitted.
        assert_eq!(
            win, st.0,
            "{kind:?}: thread {th}: {tg:?} arrived while window {} was open",
            st.0
        );
        if idx == LAYERS as u64 {
            assert_eq!(
                st.1, LAYERS as u64,
                "{kind:?}: thread {th}: done of window {win} before all its layers"
            );
            *st = (win + 1, 0);
        } else {
            if want == TransportKind::Shm {
                // shm: one after the other from one thread = submission order.
                assert_eq!(
                    idx, st.1,
                    "{kind:?}: thread {th}: layer {idx} of window {win} out of submission order"
                );
            }
            st.1 += 1;
        }
    }
    assert_eq!(seen.len(), THREADS * per_thread);
    for th in 0..THREADS as u64 {
        assert_eq!(last.get(&th), Some(&(WINDOWS as u64, 0)));
    }
    assert_eq!(t.cmd("peers"), "PEERS 1");
    e.shutdown();
}

#[test]
fn layerwise_notifications_exactly_once_after_data_in_order_shm() {
    layerwise_flow(TransportKind::Auto, TransportKind::Shm);
}

#[test]
fn layerwise_notifications_exactly_once_after_data_in_order_tcp() {
    layerwise_flow(TransportKind::Tcp, TransportKind::Tcp);
}

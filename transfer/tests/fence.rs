//! `Engine::fence`: a peer writing in a loop into a region is fenced mid-stream; once `fence`
//! returns the region's contents stay the same while the peer keeps trying (its writes and its
//! reconnections fail with typed errors), a third peer is unaffected, and `unfence` lets the
//! peer in again. Over tcp and shm (RDMA: `tests/rdma_engine_vm.rs`).

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::hostile::{serial, wait_until, LONG};
use common::{mismatch, pattern};
use kvwire_transfer::{Access, Engine, EngineConfig, Error, Op, RegionHandle, TransportKind};

const CHUNK: usize = 256 << 10;

fn engine(kind: TransportKind) -> Engine {
    Engine::new(EngineConfig {
        transport: kind,
        lanes: 2,
        default_deadline: LONG,
        connect_timeout: LONG,
        ..EngineConfig::default()
    })
    .expect("engine")
}

/// A checksum of a whole region (FNV-1a).
fn checksum(t: &Engine, r: RegionHandle) -> u64 {
    let mut buf = vec![0u8; t.region_len(r).expect("len") as usize];
    t.local_read(r, 0, &mut buf).expect("read");
    buf.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// What the fenced writer saw once `fence` had returned.
struct Seen {
    ok_after: u64,
    errors: Vec<Error>,
}

fn fenced_mid_stream(kind: TransportKind) {
    let _g = serial();
    let t = engine(kind);
    let r = t.alloc_region(4 * CHUNK, Access::ReadWrite).expect("alloc");
    let r3 = t.alloc_region(CHUNK, Access::ReadWrite).expect("alloc");
    let taddr = t.listen_addr();
    let p = engine(kind);
    let q = engine(kind);
    let fenced = Arc::new(AtomicBool::new(false));
    let fencing = Arc::new(AtomicBool::new(false));
    let progress = Arc::new(AtomicU64::new(0));
    let stop_q = Arc::new(AtomicBool::new(false));
    let q_after = Arc::new(AtomicU64::new(0));

    // The peer to be fenced: writes chunk after chunk, reconnecting when its peer dies.
    let writer = {
        let (p, fenced, fencing, progress, rid) = (
            p.clone(),
            fenced.clone(),
            fencing.clone(),
            progress.clone(),
            t.region_id(r),
        );
        std::thread::spawn(move || {
            let src = p.alloc_region(CHUNK, Access::Local).expect("alloc");
            let mut peer = Some(p.connect(taddr).expect("connect"));
            let kind_seen = peer.as_ref().map(|x| x.transport());
            let mut seen = Seen {
                ok_after: 0,
                errors: Vec::new(),
            };
            let mut attempts_after = 0;
            for k in 0u64.. {
                let after = fenced.load(Ordering::Acquire);
                if after {
                    attempts_after += 1;
                    if attempts_after > 200 {
                        break;
                    }
                }
                let r = match &peer {
                    Some(pp) => {
                        p.local_write(src, 0, &pattern(k, 0, CHUNK)).expect("fill");
                        let op = Op {
                            local: src,
                            local_offset: 0,
                            remote: rid,
                            remote_offset: (k % 4) * CHUNK as u64,
                            len: CHUNK as u64,
                        };
                        let r = p
                            .write(pp, &[op], None, None)
                            .and_then(|b| b.wait().map(|_| ()));
                        if r.is_err() {
                            peer = None;
                        }
                        r
                    }
                    None => p.connect(taddr).map(|np| peer = Some(np)),
                };
                match r {
                    Ok(()) => {
                        progress.fetch_add(1, Ordering::Release);
                        if after {
                            seen.ok_after += 1;
                        }
                    }
                    Err(e) => {
                        assert!(
                            fencing.load(Ordering::Acquire),
                            "failed before the fence: {e}"
                        );
                        seen.errors.push(e);
                    }
                }
            }
            (seen, kind_seen)
        })
    };
    // A third peer, writing and checking its own region all along.
    let third = {
        let (q, t, stop, after, fenced) = (
            q.clone(),
            t.clone(),
            stop_q.clone(),
            q_after.clone(),
            fenced.clone(),
        );
        std::thread::spawn(move || {
            let src = q.alloc_region(CHUNK, Access::Local).expect("alloc");
            let peer = q.connect(taddr).expect("connect");
            let mut buf = vec![0u8; CHUNK];
            for k in 1000u64.. {
                if stop.load(Ordering::Acquire) {
                    break;
                }
                q.local_write(src, 0, &pattern(k, 0, CHUNK)).expect("fill");
                let op = Op {
                    local: src,
                    local_offset: 0,
                    remote: t.region_id(r3),
                    remote_offset: 0,
                    len: CHUNK as u64,
                };
                q.write(&peer, &[op], None, None)
                    .expect("third peer submit")
                    .wait()
                    .expect("third peer batch");
                t.local_read(r3, 0, &mut buf).expect("read");
                assert_eq!(mismatch(k, 0, &buf), None, "third peer's bytes");
                if fenced.load(Ordering::Acquire) {
                    after.fetch_add(1, Ordering::Release);
                }
            }
        })
    };
    wait_until("the writer is mid-stream", || {
        progress.load(Ordering::Acquire) >= 20
    });
    let paddr: SocketAddr = p.listen_addr();
    fencing.store(true, Ordering::Release);
    t.fence(paddr).expect("fence");
    let frozen = checksum(&t, r);
    fenced.store(true, Ordering::Release);
    let (seen, kind_seen) = writer.join().expect("writer");
    assert_eq!(kind_seen, Some(kind), "the transport under test");
    // Every later attempt failed with a typed error, and nothing landed.
    assert!(
        seen.ok_after <= 1,
        "{} writes succeeded after the fence",
        seen.ok_after
    );
    assert!(seen.errors.len() >= 199, "{} errors", seen.errors.len());
    for e in &seen.errors {
        assert!(
            matches!(
                e,
                Error::PeerDead(_)
                    | Error::Fenced { .. }
                    | Error::StaleRegion(_)
                    | Error::UnknownRegion(_)
            ),
            "untyped failure: {e}"
        );
    }
    assert!(
        seen.errors
            .iter()
            .any(|e| matches!(e, Error::Fenced { .. })),
        "reconnections are refused as fenced"
    );
    assert_eq!(checksum(&t, r), frozen, "bytes landed after fence returned");
    assert!(
        t.metrics().peers.iter().all(|x| x.listen_addr != paddr),
        "no connection of the fenced peer is left"
    );
    assert_eq!(t.fenced(), vec![paddr]);
    wait_until("the third peer kept going", || {
        q_after.load(Ordering::Acquire) >= 10
    });
    stop_q.store(true, Ordering::Release);
    third.join().expect("third peer");

    // Unfenced (a new incarnation at the same address): it is accepted again.
    assert!(t.unfence(paddr));
    let src = p.alloc_region(CHUNK, Access::Local).expect("alloc");
    p.local_write(src, 0, &pattern(77, 0, CHUNK)).expect("fill");
    let pp = p.connect(taddr).expect("connect after unfence");
    let op = Op {
        local: src,
        local_offset: 0,
        remote: t.region_id(r),
        remote_offset: 0,
        len: CHUNK as u64,
    };
    p.write(&pp, &[op], None, Some(Duration::from_secs(60)))
        .expect("submit")
        .wait()
        .expect("batch");
    let mut buf = vec![0u8; CHUNK];
    t.local_read(r, 0, &mut buf).expect("read");
    assert_eq!(mismatch(77, 0, &buf), None);
}

#[test]
fn a_fenced_peer_writes_nothing_more_over_tcp() {
    fenced_mid_stream(TransportKind::Tcp);
}

#[test]
fn a_fenced_peer_writes_nothing_more_over_shm() {
    fenced_mid_stream(TransportKind::Shm);
}

#[test]
fn a_fenced_address_is_refused_both_ways() {
    let _g = serial();
    let t = engine(TransportKind::Tcp);
    let p = engine(TransportKind::Tcp);
    // Fencing an address with nobody connected refuses it from then on, both ways.
    t.fence(p.listen_addr()).expect("fence");
    assert!(matches!(
        p.connect(t.listen_addr()),
        Err(Error::Fenced { .. })
    ));
    assert!(matches!(
        t.connect(p.listen_addr()),
        Err(Error::Fenced { addr }) if addr == p.listen_addr()
    ));
    assert_eq!(t.metrics().fenced_peers, 1);
    assert!(t.unfence(p.listen_addr()));
    assert!(!t.unfence(p.listen_addr()));
    p.connect(t.listen_addr()).expect("connect after unfence");
}

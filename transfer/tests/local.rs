//! In-process API tests: authentication, initiator-side checks, completion styles, shutdown.

mod common;

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use common::{mismatch, pattern};
use kvwire_transfer::coalesce::coalesce;
use kvwire_transfer::metrics::ERROR_KINDS;
use kvwire_transfer::{
    Access, Engine, EngineConfig, Error, Op, RegionHandle, RegionId, TransportKind,
};

fn cfg(kind: TransportKind, secret: Option<&[u8]>) -> EngineConfig {
    EngineConfig {
        transport: kind,
        secret: secret.map(|s| s.to_vec()),
        connect_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

/// Minimal executor: park the thread until woken (no runtime needed).
struct ThreadWaker(std::thread::Thread);
impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}
fn block_on<F: Future>(f: F) -> F::Output {
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_secs(1));
    }
}

#[test]
fn auth_refuses_wrong_or_missing_secret_both_ways() {
    for kind in [TransportKind::Tcp, TransportKind::Auto] {
        let t = Engine::new(cfg(kind, Some(b"right"))).expect("engine");
        // Right secret: accepted.
        let ok = Engine::new(cfg(kind, Some(b"right"))).expect("engine");
        ok.connect(t.listen_addr())
            .expect("connect with the right secret");
        // Wrong secret: the initiator finds the responder's proof wrong.
        let wrong = Engine::new(cfg(kind, Some(b"wrong"))).expect("engine");
        assert!(matches!(
            wrong.connect(t.listen_addr()),
            Err(Error::AuthFailed)
        ));
        // Missing secret on the initiator: the responder requires a proof.
        let none = Engine::new(cfg(kind, None)).expect("engine");
        assert!(matches!(
            none.connect(t.listen_addr()),
            Err(Error::AuthFailed)
        ));
        // Missing secret on the responder: the initiator requires a proof.
        let open = Engine::new(cfg(kind, None)).expect("engine");
        assert!(matches!(
            ok.connect(open.listen_addr()),
            Err(Error::AuthFailed)
        ));
        // The refused attempts left no peers behind on either target. A responder may finish
        // a handshake the initiator refused after the initiator has returned, and counts each
        // refused handshake as a connect error when it is done with it: waiting for those
        // counts (not for a fixed time) makes sure both targets are done with every attempt
        // before their peers are counted.
        let refused = |e: &Engine| -> u64 {
            let m = e.metrics();
            ERROR_KINDS
                .iter()
                .map(|k| m.error_count("connect", k))
                .sum()
        };
        let until = std::time::Instant::now() + Duration::from_secs(60);
        while refused(&t) < 2 || refused(&open) < 1 {
            assert!(
                std::time::Instant::now() < until,
                "refused handshakes not counted: target {}, open {}",
                refused(&t),
                refused(&open)
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!((refused(&t), refused(&open)), (2, 1));
        assert_eq!(t.peers().len(), 1);
        assert_eq!(open.peers().len(), 0);
    }
}

fn setup(
    kind: TransportKind,
) -> (
    Engine,
    Engine,
    kvwire_transfer::Peer,
    RegionHandle,
    [RegionHandle; 4],
) {
    let t = Engine::new(cfg(kind, None)).expect("engine");
    let rw = t.alloc_region(65536, Access::ReadWrite).expect("alloc");
    let wo = t.alloc_region(65536, Access::WriteOnly).expect("alloc");
    let ro = t.alloc_region(65536, Access::ReadOnly).expect("alloc");
    let lo = t.alloc_region(65536, Access::Local).expect("alloc");
    for r in [rw, wo, ro, lo] {
        t.local_write(r, 0, &pattern(5, 0, 65536)).expect("fill");
    }
    let i = Engine::new(cfg(kind, None)).expect("engine");
    let src = i.alloc_region(65536, Access::Local).expect("alloc");
    let p = i.connect(t.listen_addr()).expect("connect");
    (t, i, p, src, [rw, wo, ro, lo])
}

#[test]
fn initiator_refuses_bad_ops_before_sending() {
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let (t, i, p, src, [rw, wo, ro, lo]) = setup(kind);
        assert_eq!(p.regions().len(), 3, "Local regions are not offered");
        let op = |remote: RegionId, off: u64, len: u64| Op {
            local: src,
            local_offset: 0,
            remote,
            remote_offset: off,
            len,
        };
        let rid = t.region_id(rw);
        assert!(matches!(
            i.write(&p, &[op(rid, 65000, 1000)], None, None),
            Err(Error::OutOfBounds {
                region_len: 65536,
                ..
            })
        ));
        assert!(matches!(
            i.write(&p, &[op(rid, u64::MAX - 10, 100)], None, None),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            i.write(
                &p,
                &[op(
                    RegionId {
                        index: 999,
                        generation: 1
                    },
                    0,
                    1
                )],
                None,
                None
            ),
            Err(Error::UnknownRegion(_))
        ));
        assert!(matches!(
            i.write(&p, &[op(t.region_id(lo), 0, 1)], None, None),
            Err(Error::UnknownRegion(_))
        ));
        assert!(matches!(
            i.write(&p, &[op(t.region_id(ro), 0, 1)], None, None),
            Err(Error::AccessDenied(_))
        ));
        assert!(matches!(
            i.read(&p, &[op(t.region_id(wo), 0, 1)], None),
            Err(Error::AccessDenied(_))
        ));
        // Local side: out of bounds, stale handle.
        let mut bad = op(rid, 0, 100);
        bad.local_offset = 65500;
        assert!(matches!(
            i.write(&p, &[bad], None, None),
            Err(Error::OutOfBounds { .. })
        ));
        let tmp = i.alloc_region(4096, Access::Local).expect("alloc");
        i.unregister(tmp).expect("unregister");
        let stale = Op {
            local: tmp,
            ..op(rid, 0, 1)
        };
        assert!(matches!(
            i.write(&p, &[stale], None, None),
            Err(Error::StaleRegion(_))
        ));
        assert!(matches!(i.unregister(tmp), Err(Error::StaleRegion(_))));
        assert!(matches!(
            i.local_write(tmp, 0, b"x"),
            Err(Error::StaleRegion(_))
        ));
        // Tag too large.
        let big = vec![0u8; 1 << 20];
        assert!(matches!(
            i.write(&p, &[op(rid, 0, 1)], Some(&big), None),
            Err(Error::InvalidArgument(_))
        ));
        // Nothing landed anywhere.
        for r in [rw, wo, ro, lo] {
            let mut buf = vec![0u8; 65536];
            t.local_read(r, 0, &mut buf).expect("read");
            assert_eq!(mismatch(5, 0, &buf), None);
        }
        assert!(t.notifications().try_recv().is_none());
    }
}

#[test]
fn completion_by_wait_poll_and_await() {
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let (t, i, p, src, [rw, ..]) = setup(kind);
        i.local_write(src, 0, &pattern(9, 0, 65536)).expect("fill");
        let op = Op {
            local: src,
            local_offset: 0,
            remote: t.region_id(rw),
            remote_offset: 0,
            len: 65536,
        };
        // poll until done (bounded)
        let b = i.write(&p, &[op], Some(b"polled"), None).expect("submit");
        let r = loop {
            if let Some(r) = b.poll() {
                break r;
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        assert_eq!(r.expect("batch").bytes, 65536);
        // wait_timeout
        let b = i.write(&p, &[op], Some(b"timed"), None).expect("submit");
        let r = loop {
            if let Some(r) = b.wait_timeout(Duration::from_millis(100)) {
                break r;
            }
        };
        r.expect("batch");
        // async, without a runtime
        let b = i.write(&p, &[op], Some(b"awaited"), None).expect("submit");
        let st = block_on(b).expect("batch");
        assert_eq!(
            st.transport,
            if kind == TransportKind::Shm {
                TransportKind::Shm
            } else {
                TransportKind::Tcp
            }
        );
        let n = t.notifications();
        let mut tags = Vec::new();
        for _ in 0..3 {
            tags.push(block_on(n.recv()).expect("notification").tag);
        }
        assert_eq!(
            tags,
            vec![b"polled".to_vec(), b"timed".to_vec(), b"awaited".to_vec()]
        );
        let mut buf = vec![0u8; 65536];
        t.local_read(rw, 0, &mut buf).expect("read");
        assert_eq!(mismatch(9, 0, &buf), None);
        assert!(matches!(
            n.recv_timeout(Duration::from_millis(10)),
            Err(Error::Timeout)
        ));
        // A notification with no data at all.
        i.write(&p, &[], Some(b"bare"), None)
            .expect("submit")
            .wait()
            .expect("batch");
        assert_eq!(
            n.recv_timeout(Duration::from_secs(5)).expect("bare").tag,
            b"bare"
        );
    }
}

#[test]
fn both_directions_between_two_engines() {
    // The responder writes to the initiator over the inbound peer (lanes opened back lazily).
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let a = Engine::new(cfg(kind, Some(b"s"))).expect("engine");
        let b = Engine::new(cfg(kind, Some(b"s"))).expect("engine");
        let ra = a.alloc_region(1 << 20, Access::ReadWrite).expect("alloc");
        let rb = b.alloc_region(1 << 20, Access::ReadWrite).expect("alloc");
        a.local_write(ra, 0, &pattern(1, 0, 1 << 20)).expect("fill");
        b.local_write(rb, 0, &pattern(2, 0, 1 << 20)).expect("fill");
        let pa = a.connect(b.listen_addr()).expect("connect");
        let pb = b.peers().pop().expect("inbound peer");
        assert_eq!(pb.transport(), pa.transport());
        // a → b (first half), b → a (second half), at the same time.
        let wa = a
            .write(
                &pa,
                &[Op {
                    local: ra,
                    local_offset: 0,
                    remote: b.region_id(rb),
                    remote_offset: 0,
                    len: 1 << 19,
                }],
                None,
                None,
            )
            .expect("submit");
        let wb = b
            .write(
                &pb,
                &[Op {
                    local: rb,
                    local_offset: 1 << 19,
                    remote: a.region_id(ra),
                    remote_offset: 1 << 19,
                    len: 1 << 19,
                }],
                None,
                None,
            )
            .expect("submit");
        wa.wait().expect("a→b");
        wb.wait().expect("b→a");
        let mut buf = vec![0u8; 1 << 19];
        b.local_read(rb, 0, &mut buf).expect("read");
        assert_eq!(mismatch(1, 0, &buf), None);
        a.local_read(ra, 1 << 19, &mut buf).expect("read");
        assert_eq!(mismatch(2, 1 << 19, &buf), None);
    }
}

#[test]
fn shutdown_fails_everything_cleanly() {
    let (t, i, p, src, [rw, ..]) = setup(TransportKind::Tcp);
    let n = t.notifications();
    t.shutdown();
    assert!(matches!(
        n.recv_timeout(Duration::from_secs(5)),
        Err(Error::Shutdown)
    ));
    assert!(matches!(
        t.alloc_region(10, Access::Local),
        Err(Error::Shutdown)
    ));
    let op = Op {
        local: src,
        local_offset: 0,
        remote: t.region_id(rw),
        remote_offset: 0,
        len: 10,
    };
    // The initiator sees the peer die (or the batch fail) — never a hang. The deadline only
    // bounds a hang: a shorter one could pass before a loaded host lets the initiator read the
    // closed connection, and turn PeerDead into Timeout.
    let r = match i.write(&p, &[op], None, Some(Duration::from_secs(60))) {
        Ok(b) => b.wait(),
        Err(e) => Err(e),
    };
    assert!(matches!(r, Err(Error::PeerDead(_))), "got {r:?}");
    i.shutdown();
    assert!(matches!(
        i.write(&p, &[op], None, None),
        Err(Error::Shutdown)
    ));
    assert!(matches!(i.connect(t.listen_addr()), Err(Error::Shutdown)));
}

#[test]
fn shm_forced_to_a_tcp_only_peer_is_unsupported() {
    let t = Engine::new(cfg(TransportKind::Tcp, None)).expect("engine");
    let i = Engine::new(cfg(TransportKind::Shm, None)).expect("engine");
    assert!(matches!(
        i.connect(t.listen_addr()),
        Err(Error::Unsupported(_))
    ));
}

#[test]
fn descriptor_lists_offered_regions_only() {
    let e = Engine::new(EngineConfig::default()).expect("engine");
    let a = e.alloc_region(100, Access::ReadWrite).expect("alloc");
    let _b = e.alloc_region(100, Access::Local).expect("alloc");
    let d = e.descriptor();
    assert_eq!(d.addr, e.listen_addr());
    assert_eq!(d.regions.len(), 1);
    assert_eq!(d.regions[0].id, e.region_id(a));
    assert_eq!(d.regions[0].len, 100);
    assert!(matches!(
        e.alloc_region(0, Access::Local),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        e.local_write(a, 90, &[0u8; 20]),
        Err(Error::OutOfBounds { .. })
    ));
}

#[test]
fn coalesce_merges_only_adjacent_on_both_sides() {
    let e = Engine::new(EngineConfig::default()).expect("engine");
    let l = e.alloc_region(1 << 20, Access::Local).expect("alloc");
    let l2 = e.alloc_region(1 << 20, Access::Local).expect("alloc");
    let r = RegionId {
        index: 3,
        generation: 1,
    };
    let op = |lo: u64, ro: u64, len: u64| Op {
        local: l,
        local_offset: lo,
        remote: r,
        remote_offset: ro,
        len,
    };
    // adjacent on both sides, out of order
    assert_eq!(
        coalesce(&[op(100, 1100, 100), op(0, 1000, 100)]),
        vec![op(0, 1000, 200)]
    );
    // adjacent remotely only
    assert_eq!(coalesce(&[op(0, 0, 10), op(20, 10, 10)]).len(), 2);
    // different local region
    let other = Op {
        local: l2,
        ..op(10, 10, 10)
    };
    assert_eq!(coalesce(&[op(0, 0, 10), other]).len(), 2);
    // zero-length ops vanish
    assert_eq!(coalesce(&[op(0, 0, 0)]), vec![]);
    // 300 blocks of 16 KiB in one run
    let ops: Vec<Op> = (0..300u64)
        .map(|k| op(k * 16384, k * 16384, 16384))
        .collect();
    assert_eq!(coalesce(&ops), vec![op(0, 0, 300 * 16384)]);
}

#[test]
fn each_side_picks_its_own_direction_from_what_both_allow() {
    // Auto towards a tcp-only engine: tcp both ways, and data flows both ways.
    let tcp_only = Engine::new(cfg(TransportKind::Tcp, None)).expect("engine");
    let auto = Engine::new(cfg(TransportKind::Auto, None)).expect("engine");
    let ra = auto.alloc_region(4096, Access::ReadWrite).expect("alloc");
    let rt = tcp_only
        .alloc_region(4096, Access::ReadWrite)
        .expect("alloc");
    let p = auto.connect(tcp_only.listen_addr()).expect("connect");
    assert_eq!(p.transport(), TransportKind::Tcp);
    let back = tcp_only.peers().pop().expect("inbound");
    assert_eq!(back.transport(), TransportKind::Tcp);
    auto.local_write(ra, 0, &pattern(31, 0, 4096))
        .expect("fill");
    tcp_only
        .local_write(rt, 0, &pattern(32, 0, 4096))
        .expect("fill");
    let op = |l, r| Op {
        local: l,
        local_offset: 0,
        remote: r,
        remote_offset: 0,
        len: 2048,
    };
    auto.write(&p, &[op(ra, tcp_only.region_id(rt))], None, None)
        .expect("submit")
        .wait()
        .expect("batch");
    let mut o = op(rt, auto.region_id(ra));
    o.local_offset = 2048;
    o.remote_offset = 2048;
    tcp_only
        .write(&back, &[o], None, None)
        .expect("submit")
        .wait()
        .expect("batch");
    let mut buf = vec![0u8; 2048];
    tcp_only.local_read(rt, 0, &mut buf).expect("read");
    assert_eq!(mismatch(31, 0, &buf), None);
    auto.local_read(ra, 2048, &mut buf).expect("read");
    assert_eq!(mismatch(32, 2048, &buf), None);
}

#[test]
fn public_types_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Engine>();
    check::<kvwire_transfer::Peer>();
    check::<kvwire_transfer::Batch>();
    check::<kvwire_transfer::Notifications>();
    check::<Error>();
}

#[test]
fn a_peer_of_another_engine_is_refused() {
    let t = Engine::new(cfg(TransportKind::Tcp, None)).expect("target");
    let dst = t.alloc_region(4096, Access::WriteOnly).expect("dst");
    let a = Engine::new(cfg(TransportKind::Tcp, None)).expect("engine a");
    let b = Engine::new(cfg(TransportKind::Tcp, None)).expect("engine b");
    let src = a.alloc_region(4096, Access::Local).expect("src");
    let peer_of_b = b.connect(t.listen_addr()).expect("connect");
    let op = Op {
        local: src,
        local_offset: 0,
        remote: t.region_id(dst),
        remote_offset: 0,
        len: 16,
    };
    match a.write(&peer_of_b, &[op], None, None) {
        Err(Error::InvalidArgument(m)) => assert_eq!(m, "peer belongs to another engine"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    let peer_of_a = a.connect(t.listen_addr()).expect("connect");
    a.write(&peer_of_a, &[op], None, None)
        .expect("submit")
        .wait()
        .expect("its own peer");
}

#[test]
fn cuda_ipc_without_a_cuda_driver_is_unsupported() {
    if std::path::Path::new("/proc/driver/nvidia").exists() {
        eprintln!("SKIPPED: an NVIDIA driver is here; tests/cuda_ipc.rs covers cuda_ipc");
        return;
    }
    assert!(matches!(
        Engine::new(cfg(TransportKind::CudaIpc, None)),
        Err(Error::Unsupported(_))
    ));
    // `Auto` still works, over shm, and says which transports it has.
    let t = Engine::new(cfg(TransportKind::Auto, None)).expect("engine");
    let i = Engine::new(cfg(TransportKind::Auto, None)).expect("engine");
    let p = i.connect(t.listen_addr()).expect("connect");
    assert_eq!(p.transport(), TransportKind::Shm);
}

#[test]
fn a_region_list_with_device_keys_round_trips_and_a_bad_flag_is_refused() {
    use kvwire_transfer::wire::WireRegion;
    use kvwire_transfer::wire::{CtrlMsg, Field, ProtocolError};
    use kvwire_transfer::DeviceIpc;
    let id = kvwire_transfer::RegionId {
        index: 3,
        generation: 1,
    };
    let host = WireRegion::keyless(id, 1 << 20, Access::ReadWrite);
    let dev = WireRegion {
        ipc: Some(DeviceIpc {
            handle: [7; 64],
            offset: 4096,
        }),
        ..host.clone()
    };
    let msg = CtrlMsg::RegionsSet(vec![dev, host]);
    let bytes = msg.encode();
    let back = CtrlMsg::decode(&bytes).expect("decode");
    assert_eq!(back, msg);
    // The flag of the first region (after the header, count and 49 bytes of its entry: 41
    // bytes of fields, then the length of its RDMA chunks, 0 for none).
    let flag_at = bytes.len() - (50 + 72) - 50 + 49;
    assert_eq!(bytes[flag_at], 1);
    let mut bad = bytes.clone();
    bad[flag_at] = 2;
    match CtrlMsg::decode(&bad) {
        Err(kvwire_transfer::Error::Protocol(ProtocolError::BadValue {
            field: Field::DeviceIpc,
            value: 2,
        })) => {}
        other => panic!("expected a bad device-memory flag, got {other:?}"),
    }
}

#[test]
fn a_region_in_rdma_chunks_round_trips_and_keys_that_do_not_cover_it_are_refused() {
    use kvwire_transfer::wire::{
        CtrlMsg, Layout, MrChunks, ProtocolError, WireRegion, MAX_MR_CHUNKS,
    };
    let id = kvwire_transfer::RegionId {
        index: 4,
        generation: 2,
    };
    let region = |len: u64, chunk: u64, rkeys: Vec<u32>| WireRegion {
        addr: 0x7000_0000,
        rkey: 11,
        chunks: Some(MrChunks {
            len: chunk,
            rkeys: rkeys.into(),
        }),
        ..WireRegion::keyless(id, len, Access::ReadWrite)
    };
    // 3 MiB + 1 in chunks of 1 MiB: four chunks, the keys of chunks 1..=3 listed
    let good = CtrlMsg::RegionsAdded(vec![region((3 << 20) + 1, 1 << 20, vec![12, 13, 14])]);
    assert_eq!(CtrlMsg::decode(&good.encode()).expect("decode"), good);
    // The largest region a list may carry (every chunk, CUDA IPC keys) fits the body bound a
    // peer's region list is read with.
    let max = MAX_MR_CHUNKS as u64;
    let mut largest = region(max << 20, 1 << 20, vec![9; MAX_MR_CHUNKS - 1]);
    largest.ipc = Some(kvwire_transfer::DeviceIpc {
        handle: [3; 64],
        offset: 0,
    });
    let bytes = CtrlMsg::RegionsAdded(vec![largest]).encode();
    let body = bytes.len() - kvwire_transfer::wire::CTRL_HEADER_LEN;
    assert!(
        body as u32 <= kvwire_transfer::wire::body::regions(1),
        "a region of {body} bytes, the bound {}",
        kvwire_transfer::wire::body::regions(1)
    );
    for (len, chunk, keys) in [
        ((3 << 20) + 1, 1 << 20, vec![12, 13]), // a chunk without its key
        (3 << 20, 1 << 20, vec![12, 13, 14]),   // a key for a chunk past the end
        (1 << 20, 1 << 20, vec![]),             // one chunk is no chunking
        (1 << 40, 4096, vec![1; kvwire_transfer::wire::MAX_MR_CHUNKS]), // far more chunks than a key message holds
    ] {
        let bad = CtrlMsg::RegionsAdded(vec![region(len, chunk, keys)]).encode();
        match CtrlMsg::decode(&bad) {
            Err(kvwire_transfer::Error::Protocol(ProtocolError::BadCount {
                at: Layout::RegionChunks,
                ..
            })) => {}
            other => panic!("{len} B in chunks of {chunk}: {other:?}"),
        }
    }
}

//! Authenticated peers that abuse the control connection and the lanes: whole region lists
//! replaced (finding 4), notification floods (5), region tables and removed maps grown without
//! bound (5), a peer gone silent (no keepalive), a peer that stops reading (registration must
//! not wait for it). A legitimate initiator completes a verified transfer meanwhile; the
//! target's gauges stay within the configured budgets.

mod common;

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::time::Duration;

use common::hostile::{
    config, connect_from, fd_count, good_transfer, limits, serial, wait_until, write_checked, Peak,
    HANG, SECRET,
};
use common::raw_peer::{self, answer, read_msg, write_header, Raw};
use kvwire_transfer::wire::{self, CtrlMsg, FrameHeader, FrameKind, WireRegion};
use kvwire_transfer::{Access, Engine, Error, Limits, Op, RegionId, Resource};

fn region(index: u32) -> WireRegion {
    let id = RegionId {
        index,
        generation: 1,
    };
    WireRegion::keyless(id, 4096, Access::ReadWrite)
}

/// Sends a region-withdrawal fence and waits for its answer: every earlier message was handled.
fn sync(c: &mut TcpStream, id: u64) {
    let mut f = vec![1u8, 2];
    f.extend_from_slice(&id.to_le_bytes());
    c.write_all(&CtrlMsg::Transport { bit: 0x80, data: f }.encode())
        .expect("fence");
    loop {
        match read_msg(c).expect("control message").0 {
            CtrlMsg::Transport { bit: 0x80, data }
                if data[0] == 2 && data[2..] == id.to_le_bytes() =>
            {
                return
            }
            _ => {}
        }
    }
}

/// Reads the control connection until the target closes it.
fn until_closed(c: &mut TcpStream) {
    loop {
        match read_msg(c) {
            Ok(_) => {}
            Err(Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                return
            }
            Err(e) => panic!("expected the close, got {e}"),
        }
    }
}

fn target(lim: Limits) -> (Engine, kvwire_transfer::RegionHandle) {
    let t = Engine::new(config(Some(SECRET), lim)).expect("target");
    let r = t.alloc_region(1 << 20, Access::ReadWrite).expect("alloc");
    (t, r)
}

fn raw(t: &Engine, ip: u8) -> Raw {
    raw_peer::handshake(connect_from(ip, t.listen_addr()), Some(SECRET), 2).expect("handshake")
}

#[test]
fn regions_set_is_linear() {
    let _g = serial();
    let n = 1u32 << 16;
    let (t, r) = target(Limits {
        max_remote_regions: n as usize,
        ..limits()
    });
    let mut raw = raw(&t, 2);
    let legit = {
        let t = t.clone();
        std::thread::spawn(move || {
            drop(good_transfer(&t, r, 0, 10, config(Some(SECRET), limits())))
        })
    };
    let a: Vec<WireRegion> = (0..n).map(region).collect();
    let b: Vec<WireRegion> = (n..2 * n).map(region).collect();
    raw.ctrl
        .write_all(&CtrlMsg::RegionsSet(a).encode())
        .expect("set a");
    raw.ctrl
        .write_all(&CtrlMsg::RegionsSet(b).encode())
        .expect("set b");
    sync(&mut raw.ctrl, 7);
    legit.join().expect("legitimate transfer");
    let m = t.metrics();
    let n = u64::from(n);
    assert!(
        m.remote_table_ops <= 2 * (n + n) + n,
        "ops {}",
        m.remote_table_ops
    );
    assert_eq!(m.remote_region_entries, n);
    assert!(m.removed_region_entries <= n);
}

#[test]
fn notify_flood_is_budgeted() {
    let _g = serial();
    let (t, r) = target(limits());
    let notes = t.notifications();
    let raw = raw(&t, 2);
    let mut lane = connect_from(2, t.listen_addr());
    raw_peer::join(&mut lane, &raw.cred, 0).expect("lane");
    // 64 notifications of 64 KiB whose slice never comes: 15 fit the 1 MiB budget.
    let tag = vec![7u8; 64 << 10];
    let notify = |batch: u64, slices: u32, tag: &[u8]| {
        let mut f = FrameHeader::simple(FrameKind::Notify, batch, tag.len() as u32, slices)
            .encode()
            .to_vec();
        f.extend_from_slice(tag);
        f
    };
    let peer_bytes = |t: &Engine| t.metrics().peers.iter().map(|p| p.notify_bytes).max();
    let (mut acks, mut refused) = (0, 0);
    for b in 1..=64u64 {
        lane.write_all(&notify(b, 1, &tag)).expect("notify");
        let (h, p) = answer(&mut lane);
        match h.kind {
            FrameKind::Ack => acks += 1,
            FrameKind::Error => {
                let e = wire::decode_error(&p, true).expect("error");
                assert!(
                    matches!(
                        e,
                        Error::ResourceLimit {
                            resource: Resource::NotifyBytes,
                            limit: 1048576
                        }
                    ),
                    "{e}"
                );
                refused += 1;
            }
            k => panic!("{k:?}"),
        }
        assert!(peer_bytes(&t).unwrap_or(0) <= 1 << 20);
    }
    assert_eq!((acks, refused), (15, 49));
    // Another peer has its own budget: its notification is delivered.
    let i = Engine::new(config(Some(SECRET), limits())).expect("initiator");
    let src = i.alloc_region(4096, Access::Local).expect("alloc");
    let p = i.connect(t.listen_addr()).expect("connect");
    let op = Op {
        local: src,
        local_offset: 0,
        remote: t.region_id(r),
        remote_offset: 0,
        len: 4096,
    };
    i.write(&p, &[op], Some(b"legit"), None)
        .expect("submit")
        .wait()
        .expect("legitimate batch");
    assert_eq!(
        notes.recv_timeout(HANG).expect("notification").tag,
        b"legit"
    );

    // A peer whose notifications are delivered but not taken: once its queued ones fill the
    // budget its next one is refused; taking one lets the next through.
    let raw2 = raw_peer::handshake(connect_from(3, t.listen_addr()), Some(SECRET), 1).expect("hs");
    let mut l2 = connect_from(3, t.listen_addr());
    raw_peer::join(&mut l2, &raw2.cred, 0).expect("lane");
    let batch = |l2: &mut TcpStream, b: u64| -> Option<Error> {
        let mut f = write_header(t.region_id(r), 0, 16, b).to_vec();
        f[7] = wire::FLAG_TRACKED;
        f.extend_from_slice(&[1; 16]);
        f.extend_from_slice(&notify(b, 1, &tag));
        l2.write_all(&f).expect("batch");
        let (mut parts, mut err) = (0, None);
        while parts < 2 {
            let (h, p) = answer(l2);
            match h.kind {
                FrameKind::Ack => parts += h.aux.max(1),
                FrameKind::Error => {
                    err = Some(wire::decode_error(&p, true).expect("error"));
                    parts += 1;
                }
                k => panic!("{k:?}"),
            }
        }
        err
    };
    for b in 1..=15 {
        assert!(batch(&mut l2, b).is_none(), "batch {b}");
    }
    assert!(matches!(
        batch(&mut l2, 16),
        Some(Error::ResourceLimit {
            resource: Resource::NotifyBytes,
            ..
        })
    ));
    assert!(notes.try_recv().is_some(), "a queued notification");
    assert!(
        batch(&mut l2, 17).is_none(),
        "taking one gave its bytes back"
    );
    assert!(t.metrics().notifications_refused >= 50);
    drop((raw, raw2, i));
}

#[test]
fn region_announcements_are_capped() {
    let _g = serial();
    let (t, r) = target(limits());
    let mut raw1 = raw(&t, 2);
    let all: Vec<WireRegion> = (0..4096).map(region).collect();
    raw1.ctrl
        .write_all(&CtrlMsg::RegionsAdded(all).encode())
        .expect("4096 regions");
    sync(&mut raw1.ctrl, 1);
    assert_eq!(t.metrics().remote_region_entries, 4096);
    raw1.ctrl
        .write_all(&CtrlMsg::RegionsAdded(vec![region(5000)]).encode())
        .expect("one more");
    until_closed(&mut raw1.ctrl);
    assert_eq!(t.metrics().error_count("peer", "resource_limit"), 1);
    // A header announcing 32 MiB of regions: closed from the header alone.
    let mut raw2 = raw(&t, 3);
    let mut h = CtrlMsg::RegionsAdded(vec![]).encode();
    h[8..12].copy_from_slice(&(32u32 << 20).to_le_bytes());
    raw2.ctrl.write_all(&h[..12]).expect("header");
    until_closed(&mut raw2.ctrl);
    wait_until("both peers gone", || t.metrics().peers_connected == 0);
    drop(good_transfer(&t, r, 0, 11, config(Some(SECRET), limits())));
}

#[test]
fn removed_map_is_capped() {
    let _g = serial();
    let (t, r) = target(limits());
    let mut raw = raw(&t, 2);
    // Withdrawals of regions it never announced cost nothing.
    for k in 0..20u32 {
        let ids: Vec<RegionId> = (0..4096)
            .map(|i| RegionId {
                index: 100_000 + k * 4096 + i,
                generation: 1,
            })
            .collect();
        raw.ctrl
            .write_all(&CtrlMsg::RegionsRemoved(ids).encode())
            .expect("made-up withdrawals");
    }
    sync(&mut raw.ctrl, 1);
    assert_eq!(t.metrics().removed_region_entries, 0);
    for round in 0..2u32 {
        let rs: Vec<WireRegion> = (round * 4096..(round + 1) * 4096).map(region).collect();
        let ids: Vec<RegionId> = rs.iter().map(|r| r.id).collect();
        raw.ctrl
            .write_all(&CtrlMsg::RegionsAdded(rs).encode())
            .expect("announce");
        raw.ctrl
            .write_all(&CtrlMsg::RegionsRemoved(ids).encode())
            .expect("withdraw");
    }
    sync(&mut raw.ctrl, 2);
    let m = t.metrics();
    assert_eq!(m.remote_region_entries, 0);
    assert_eq!(
        m.removed_region_entries, 4096,
        "bounded by max_remote_regions"
    );
    drop(good_transfer(&t, r, 0, 12, config(Some(SECRET), limits())));
}

#[test]
fn silent_peer_is_dropped() {
    let _g = serial();
    let lim = Limits {
        idle_timeout: Duration::from_secs(3),
        ..limits()
    };
    let (t, r) = target(lim.clone());
    // A legitimate peer that stays idle all along: heartbeats keep it.
    let i = Engine::new(config(Some(SECRET), lim)).expect("initiator");
    let src = i.alloc_region(4096, Access::Local).expect("alloc");
    let p = i.connect(t.listen_addr()).expect("connect");
    wait_until("the legitimate peer is set up", || {
        t.metrics().lanes_open == 2
    });
    let (fds0, threads0) = (fd_count(), t.metrics().threads_live);
    // A peer that completes the handshake, opens two lanes, and then never says anything
    // (its kernel acknowledges, like a frozen process).
    let raw = raw(&t, 2);
    let lanes: Vec<TcpStream> = (0..2)
        .map(|k| {
            let mut s = connect_from(2, t.listen_addr());
            raw_peer::join(&mut s, &raw.cred, k).expect("lane");
            s
        })
        .collect();
    wait_until("the silent peer is dropped", || {
        t.metrics().peers_connected == 1
    });
    wait_until("its lanes are gone", || t.metrics().lanes_open == 2);
    wait_until("its threads are gone", || {
        t.metrics().threads_live == threads0
    });
    assert!(fd_count() <= fds0 + 3, "only its own three sockets remain");
    assert!(p.is_alive(), "the idle legitimate peer was kept");
    write_checked((&i, &p, src), (&t, r, 0), 13, 4096);
    drop((raw, lanes));
}

#[test]
fn slow_peer_does_not_stall_registration() {
    let _g = serial();
    let (t, _r) = target(limits());
    let legit = Engine::new(config(Some(SECRET), limits())).expect("initiator");
    let src = legit.alloc_region(4096, Access::Local).expect("alloc");
    let lp = legit.connect(t.listen_addr()).expect("connect");
    // A peer with a tiny receive buffer that never reads its control connection.
    let sock =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    sock.set_recv_buffer_size(4096).expect("rcvbuf");
    sock.bind(&SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 2), 0)).into())
        .expect("bind");
    sock.connect(&t.listen_addr().into()).expect("connect");
    let slow = raw_peer::handshake(sock.into(), Some(SECRET), 1).expect("handshake");
    let sampler = Peak::start(&t, |t| {
        let q = t.metrics().peers.iter().map(|p| p.ctrl_queue_bytes).max();
        q.unwrap_or(0)
    });
    // Registrations whose announcements are far more than the slow peer's buffers and queue
    // hold; every one returns (a hang bound on the whole loop, not a speed check).
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let t2 = t.clone();
    std::thread::spawn(move || {
        // Announcements (81 bytes a cycle) until the slow peer's socket buffers and its 256 KiB
        // queue are full and it is closed (80 MB at most), and as many again after.
        let mut cycles = 0u64;
        let mut after = None;
        while after.is_none_or(|a| cycles < 2 * a) && cycles < 1_000_000 {
            let h = t2.alloc_region(4096, Access::ReadWrite).expect("alloc");
            t2.unregister(h).expect("unregister");
            cycles += 1;
            if after.is_none() && cycles % 1000 == 0 && t2.metrics().peers_connected == 1 {
                after = Some(cycles);
            }
        }
        done_tx.send(after).expect("done");
    });
    let closed_after = done_rx
        .recv_timeout(HANG)
        .expect("registration waited for a slow peer");
    assert!(closed_after.is_some(), "the slow peer was never closed");
    let most = sampler.finish();
    assert!(most <= 256 << 10, "queue bound");
    wait_until("the slow peer is closed", || {
        t.metrics().peers_connected == 1
    });
    assert_eq!(t.metrics().error_count("peer", "resource_limit"), 1);
    // The legitimate peer saw every change, and writes into the last region.
    let last = t.alloc_region(4096, Access::ReadWrite).expect("alloc");
    let id = t.region_id(last);
    wait_until("the new region reached the peer", || {
        lp.regions().iter().any(|r| r.id == id)
    });
    assert_eq!(lp.regions().len(), 2);
    legit
        .local_write(src, 0, &common::pattern(14, 0, 4096))
        .expect("fill");
    let op = Op {
        local: src,
        local_offset: 0,
        remote: id,
        remote_offset: 0,
        len: 4096,
    };
    legit
        .write(&lp, &[op], None, None)
        .expect("submit")
        .wait()
        .expect("batch");
    let mut buf = vec![0u8; 4096];
    t.local_read(last, 0, &mut buf).expect("read");
    assert_eq!(common::mismatch(14, 0, &buf), None);
    drop(slow);
}

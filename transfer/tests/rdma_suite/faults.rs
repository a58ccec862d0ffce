//! Failures, each followed by a good batch where the pair survives: READs that miss their
//! deadline, bad regions (out of bounds, unknown, stale, withdrawn under the initiator's feet),
//! a dead peer, and a peer fenced while it writes.

use super::*;

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

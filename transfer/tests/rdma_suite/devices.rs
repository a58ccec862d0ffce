//! Devices: several per engine (every byte across both rails, traffic on both), and devices
//! shared by the engines of one process (one context and one completion thread per device).

use super::*;

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

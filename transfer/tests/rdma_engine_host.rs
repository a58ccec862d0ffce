//! The engine without RDMA (libibverbs pointed at a path that does not exist): it starts, does
//! not offer RDMA, refuses `TransportKind::Rdma` with a typed error, and moves bytes over shm
//! and tcp. One test in this binary, since it sets the environment (read by
//! `EngineConfig::from_env`).

use std::time::Duration;

use kvwire_transfer::verbs::LIBRARY_ENV;
use kvwire_transfer::{Access, Engine, EngineConfig, Error, Op, TransportKind};

#[test]
fn engine_without_rdma_uses_tcp_and_shm() {
    std::env::set_var(LIBRARY_ENV, "/nonexistent");
    match Engine::new(EngineConfig {
        transport: TransportKind::Rdma,
        ..EngineConfig::from_env()
    }) {
        Err(Error::Unsupported(m)) => assert!(m.contains("RDMA"), "message: {m}"),
        other => panic!("expected Unsupported for TransportKind::Rdma, got {other:?}"),
    }
    for (kind, want) in [
        (TransportKind::Auto, TransportKind::Shm),
        (TransportKind::Tcp, TransportKind::Tcp),
    ] {
        let target = Engine::new(EngineConfig {
            transport: kind,
            ..EngineConfig::from_env()
        })
        .expect("target engine starts without RDMA");
        let dst = target
            .alloc_region(1 << 20, Access::WriteOnly)
            .expect("dst");
        let init = Engine::new(EngineConfig {
            transport: kind,
            ..EngineConfig::from_env()
        })
        .expect("initiator engine");
        let src = init.alloc_region(1 << 20, Access::Local).expect("src");
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        init.local_write(src, 0, &data).expect("fill");
        let peer = init.connect(target.listen_addr()).expect("connect");
        // Auto: shm when this host lets us reach the peer's memory (ptrace policy), else tcp.
        let got = peer.transport();
        assert!(
            got == want || (kind == TransportKind::Auto && got == TransportKind::Tcp),
            "{kind:?} chose {got:?}"
        );
        let want = got;
        assert!(peer.lane_counters().is_empty(), "no RDMA lanes");
        assert!(
            peer.regions().iter().all(|r| r.len == 1 << 20),
            "regions announced"
        );
        let op = Op {
            local: src,
            local_offset: 0,
            remote: target.region_id(dst),
            remote_offset: 4096,
            len: data.len() as u64,
        };
        let st = init
            .write(&peer, &[op], Some(b"t"), None)
            .expect("submit")
            .wait()
            .expect("write");
        assert_eq!(st.transport, want);
        let n = target
            .notifications()
            .recv_timeout(Duration::from_secs(10))
            .expect("notification");
        assert_eq!(n.tag, b"t");
        let mut got = vec![0u8; data.len()];
        target.local_read(dst, 4096, &mut got).expect("read back");
        assert!(got == data, "{kind:?}: bytes differ");
    }
    std::env::remove_var(LIBRARY_ENV);
}

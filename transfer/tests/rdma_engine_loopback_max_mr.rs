//! The engine's `rdma` transport on the loopback device when the device limits one memory
//! registration to 1 MiB (`KVWIRE_LOOPBACK_MAX_MR`, its `max_mr_size`; `ibv_reg_mr` refuses
//! more): nothing configured, every 16 MiB region of the suite is registered in 16 chunks, and
//! the data path (many sizes, scatter-gather, notifications, reads), the typed errors (bad,
//! stale and withdrawn regions) and read deadlines of `rdma_suite` hold, every byte verified.
//! (How requests are cut at chunk boundaries, counted: `rdma_suite::chunks`.)
//!
//! One test in this binary: it sets the environment the loopback device and
//! `EngineConfig::from_env` read.

mod rdma_suite;

use kvwire_transfer::verbs::{find_loopback, Loopback};
use kvwire_transfer::TransportKind;

#[test]
fn engine_rdma_when_the_device_limits_a_registration() {
    let exe = std::env::current_exe().expect("path of this test binary");
    let lib = find_loopback(&exe).expect("the loopback device's library next to the test");
    std::env::set_var(kvwire_transfer::verbs::LIBRARY_ENV, &lib);
    std::env::set_var("KVWIRE_LOOPBACK_DEVICES", "2");
    std::env::set_var("KVWIRE_LOOPBACK_MAX_MR", (1u64 << 20).to_string());
    std::env::remove_var("KVWIRE_RDMA_DEVICE");
    std::env::remove_var("KVWIRE_RDMA_MR_CHUNK");
    let nic = rdma_suite::Nic::Loopback(Loopback::load(&lib).expect("load the loopback device"));
    let p = rdma_suite::pair(&["loop0"], &["loop1"], TransportKind::Rdma);
    assert_eq!(p.peer.transport(), TransportKind::Rdma);
    rdma_suite::writes_of_many_sizes(&p);
    rdma_suite::sg_writes_with_notifications(&p);
    rdma_suite::reads_of_many_sizes(&p);
    rdma_suite::bad_regions(&p, &nic);
    rdma_suite::read_deadline(&p, &nic);
    drop(p);
    println!("ENGINE-RDMA-MAX-MR-OK");
}

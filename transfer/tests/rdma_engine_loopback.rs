//! The engine's `rdma` transport on the in-process software device (`kvwire-verbs-loopback`,
//! loaded through `KVWIRE_IBVERBS_PATH` in place of libibverbs), on every host, no VM: the whole
//! suite of `rdma_suite` on `loop0` and `loop1`, with requests held in flight exactly where
//! the suite needs them (a region withdrawn under a write, READs that miss their deadline), then
//! again with every work request signalled. The device checks every request against its
//! registered regions as a NIC does, so the engine's keys, bounds and queue-pair states are
//! what is tested; the bytes move by memcpy.
//!
//! One test in this binary: it sets the environment that `EngineConfig::from_env` reads.

mod rdma_suite;

use kvwire_transfer::verbs::{find_loopback, Loopback};

#[test]
fn engine_rdma_on_the_loopback_device() {
    let exe = std::env::current_exe().expect("path of this test binary");
    let Some(lib) = find_loopback(&exe) else {
        panic!(
            "the loopback device's library is not next to {} (it is a dev-dependency of this \
             crate, so cargo builds it with the tests)",
            exe.display()
        );
    };
    std::env::set_var(kvwire_transfer::verbs::LIBRARY_ENV, &lib);
    std::env::set_var("KVWIRE_LOOPBACK_DEVICES", "2");
    std::env::remove_var("KVWIRE_RDMA_DEVICE");
    let nic = rdma_suite::Nic::Loopback(Loopback::load(&lib).expect("load the loopback device"));
    let (posted0, _) = loopback_counters(&nic);
    rdma_suite::run("loop0", "loop1", &nic);
    let (posted1, polled1) = loopback_counters(&nic);
    assert!(
        posted1 > posted0,
        "the suite ran without posting on the loopback device"
    );
    println!(
        "default signalling: {} work requests posted, {polled1} completions polled",
        posted1 - posted0
    );
    // Every work request signalled: the plan's other extreme.
    std::env::set_var("KVWIRE_RDMA_SIGNAL_EVERY", "1");
    rdma_suite::run("loop0", "loop1", &nic);
    std::env::remove_var("KVWIRE_RDMA_SIGNAL_EVERY");
    println!("ENGINE-RDMA-LOOPBACK-OK");
}

fn loopback_counters(nic: &rdma_suite::Nic) -> (u64, u64) {
    match nic {
        rdma_suite::Nic::Loopback(l) => l.counters(),
        rdma_suite::Nic::SoftRoce => (0, 0),
    }
}

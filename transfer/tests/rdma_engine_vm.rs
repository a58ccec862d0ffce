//! The engine's `rdma` transport inside the SoftRoCE VM (`tests/vm/run.sh`): the suite of
//! `rdma_suite` on rxe0 and rxe1 (the target on rxe0, the initiator on rxe1; both for the
//! multi-device checks), the stalled-READ case by black-holing the target's replies.
//!
//! On the host this boots the VM and runs this same test binary inside it (like `rdma_vm.rs`);
//! it only does so with `KVWIRE_VM_TESTS=1`, otherwise it prints `SKIPPED` (and fails when
//! `KVWIRE_REQUIRE_VM=1`). `rdma_engine_loopback.rs` runs the same suite on every host,
//! against the in-process software device.

mod rdma_suite;
mod vm_common;

const NAME: &str = "engine_rdma_in_softroce_vm";

#[test]
fn engine_rdma_in_softroce_vm() {
    if let vm_common::Vm::Guest = vm_common::run_in_vm(NAME, "ENGINE-RDMA-OK") {
        let d0 = std::env::var("KVWIRE_RXE_DEV0").unwrap_or_else(|_| "rxe0".into());
        let d1 = std::env::var("KVWIRE_RXE_DEV1").unwrap_or_else(|_| "rxe1".into());
        rdma_suite::run(&d0, &d1, &rdma_suite::Nic::SoftRoce);
        println!("ENGINE-RDMA-OK");
    }
}

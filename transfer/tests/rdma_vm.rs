//! The verbs self-test (`examples/rdma_selftest.rs`) inside the SoftRoCE VM: real RC QPs
//! between rxe0 and rxe1, every byte verified.
//!
//! On the host this test boots the VM with `tests/vm/run.sh` and runs *this same test binary*
//! inside it (so the code under test is always the freshly built one); inside the guest
//! (`KVWIRE_VM_GUEST=1`, set by the harness) it runs the self-test directly. Booting takes a
//! minute or two under TCG, so on the host it only runs with `KVWIRE_VM_TESTS=1`; otherwise it
//! prints `SKIPPED` (and fails when `KVWIRE_REQUIRE_VM=1`).

#[allow(dead_code)]
#[path = "../examples/rdma_selftest.rs"]
mod selftest;

mod vm_common;

const NAME: &str = "selftest_in_softroce_vm";

#[test]
fn selftest_in_softroce_vm() {
    if let vm_common::Vm::Guest = vm_common::run_in_vm(NAME, "SELFTEST-OK") {
        // inside the guest: rxe0 and rxe1 must exist
        std::env::set_var("KVWIRE_REQUIRE_RDMA", "1");
        // bandwidth phase shortened: the figures come from tests/vm/rdma_suite.sh
        let args: Vec<String> = ["--iters-64k", "200", "--iters-1m", "16"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        match selftest::run(&args) {
            Ok(true) => {}
            Ok(false) => panic!("devices missing inside the VM"),
            Err(e) => panic!("self-test failed: {e}"),
        }
    }
}

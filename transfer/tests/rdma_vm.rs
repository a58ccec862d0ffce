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

use std::path::PathBuf;
use std::process::Command;

const NAME: &str = "selftest_in_softroce_vm";

#[test]
fn selftest_in_softroce_vm() {
    if std::env::var("KVWIRE_VM_GUEST").is_ok_and(|v| v == "1") {
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
        return;
    }
    let enabled = std::env::var("KVWIRE_VM_TESTS").is_ok_and(|v| v == "1");
    let required = std::env::var("KVWIRE_REQUIRE_VM").is_ok_and(|v| v == "1");
    if !enabled {
        eprintln!("SKIPPED: set KVWIRE_VM_TESTS=1 to boot the SoftRoCE VM (tests/vm/run.sh)");
        assert!(
            !required,
            "KVWIRE_REQUIRE_VM=1 but KVWIRE_VM_TESTS is not 1"
        );
        return;
    }
    let me = std::env::current_exe().expect("path of this test binary");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(root.join("tests/vm/run.sh"))
        .arg(&me)
        .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
        .current_dir(&root)
        .output()
        .expect("spawn tests/vm/run.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "self-test in the VM failed");
    assert!(
        stdout.contains("SELFTEST-OK"),
        "self-test did not report success"
    );
    assert!(stdout.contains("test result: ok. 1 passed"));
}

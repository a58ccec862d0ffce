//! Shared by the SoftRoCE VM tests: boot the guest with `tests/vm/run.sh` and run the calling
//! test (this same test binary, so the code under test is always the freshly built one) inside.

use std::path::PathBuf;
use std::process::Command;

/// What the calling test should do.
pub enum Vm {
    /// Inside the guest (`KVWIRE_VM_GUEST=1`, set by the harness): run the test body.
    Guest,
    /// On the host without `KVWIRE_VM_TESTS=1`: skipped (loudly; a failure when
    /// `KVWIRE_REQUIRE_VM=1`).
    Skipped,
    /// On the host: the guest ran the test `name` and printed `ok_marker`.
    Passed,
}

/// Boots the VM and runs test `name` inside, asserting it passed and printed `ok_marker`.
pub fn run_in_vm(name: &str, ok_marker: &str) -> Vm {
    if std::env::var("KVWIRE_VM_GUEST").is_ok_and(|v| v == "1") {
        return Vm::Guest;
    }
    let enabled = std::env::var("KVWIRE_VM_TESTS").is_ok_and(|v| v == "1");
    let required = std::env::var("KVWIRE_REQUIRE_VM").is_ok_and(|v| v == "1");
    if !enabled {
        eprintln!("SKIPPED: set KVWIRE_VM_TESTS=1 to boot the SoftRoCE VM (tests/vm/run.sh)");
        assert!(
            !required,
            "KVWIRE_REQUIRE_VM=1 but KVWIRE_VM_TESTS is not 1"
        );
        return Vm::Skipped;
    }
    let me = std::env::current_exe().expect("path of this test binary");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(root.join("tests/vm/run.sh"))
        .arg(&me)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .current_dir(&root)
        .output()
        .expect("spawn tests/vm/run.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{name} failed in the VM");
    assert!(
        stdout.contains(ok_marker),
        "{name} did not print {ok_marker}"
    );
    assert!(stdout.contains("test result: ok. 1 passed"));
    Vm::Passed
}

/// `len` bytes of the seeded pattern (the data the VM tests write and read back).
#[allow(dead_code)] // not every VM test moves data
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    kvwire_testkit::pattern::bytes(seed, 0, len)
}

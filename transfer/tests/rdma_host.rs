//! Verbs on a machine without RDMA: loading and listing give typed outcomes, never a panic.
//!
//! On the project's machines the kernel has no RDMA, so either libibverbs is absent
//! (`NotAvailable`) or it loads and `ibv_get_device_list` fails with ENOSYS, which kvwire
//! reports as an empty list. On a machine with devices, the list is non-empty and each device
//! can be opened and queried.

use kvwire_transfer::verbs::{Verbs, VerbsError, DEFAULT_LIBRARY, LIBRARY_ENV};

#[test]
fn missing_library_path_is_not_available() {
    match Verbs::load_from("/nonexistent/libibverbs.so.1") {
        Err(VerbsError::NotAvailable { path, reason }) => {
            assert_eq!(path, "/nonexistent/libibverbs.so.1");
            assert!(!reason.is_empty());
        }
        other => panic!("expected NotAvailable, got {other:?}"),
    }
}

#[test]
fn env_override_is_honoured() {
    // The only test of this binary that touches the environment; the others use `load_from`.
    std::env::set_var(LIBRARY_ENV, "/nonexistent");
    let r = Verbs::load();
    std::env::remove_var(LIBRARY_ENV);
    match r {
        Err(VerbsError::NotAvailable { path, .. }) => assert_eq!(path, "/nonexistent"),
        other => panic!("expected NotAvailable for {LIBRARY_ENV}=/nonexistent, got {other:?}"),
    }
}

#[test]
fn not_a_verbs_library_is_not_available() {
    // libc loads fine but has none of the verbs symbols.
    match Verbs::load_from("libc.so.6") {
        Err(VerbsError::NotAvailable { reason, .. }) => {
            assert!(reason.contains("ibv_"), "reason: {reason}")
        }
        other => panic!("expected NotAvailable, got {other:?}"),
    }
}

#[test]
fn default_library_gives_a_typed_outcome() {
    let require = std::env::var("KVWIRE_REQUIRE_VERBS_LIB").is_ok_and(|v| v == "1");
    match Verbs::load_from(DEFAULT_LIBRARY) {
        Err(VerbsError::NotAvailable { reason, .. }) => {
            eprintln!("libibverbs not installed here ({reason}): NotAvailable, as expected");
            assert!(
                !require,
                "KVWIRE_REQUIRE_VERBS_LIB=1 but libibverbs did not load"
            );
        }
        Err(e) => panic!("load must be Ok or NotAvailable, got {e:?}"),
        Ok(verbs) => {
            let devices = verbs
                .devices()
                .expect("device listing is Ok (ENOSYS = empty)");
            eprintln!("libibverbs loaded, {} device(s)", devices.len());
            if devices.is_empty() {
                // no RDMA in this kernel: opening any name is a typed NoSuchDevice
                match verbs.open("mlx5_0") {
                    Err(VerbsError::NoSuchDevice(n)) => assert_eq!(n, "mlx5_0"),
                    other => panic!("expected NoSuchDevice, got {other:?}"),
                }
            }
            for d in &devices {
                let ctx = verbs.open(&d.name).expect("open a listed device");
                assert!(ctx.port_count() >= 1);
                let port = ctx.query_port(1).expect("query port 1");
                eprintln!(
                    "{}: {:?} numa={:?} pci={:?}",
                    d.name, port, d.numa_node, d.pci_address
                );
            }
        }
    }
}

//! The transfer bench end to end on loopback: target and initiator in one process
//! (library API), and the CLI with its own target process. Every run checks every byte.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvwire_bench::report::Pattern;
use kvwire_bench::target::TargetFault;
use kvwire_bench::{run, BenchError, Plan, Report, RunConfig, ServeConfig, Target};
use kvwire_transfer::{Access, Engine, EngineConfig, Op, TransportKind};

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// The quick plan with its wall-clock bounds per phase raised so far that only a hang reaches
/// them: every phase then runs its full count (`max_ops` writes, `read_max_ops` reads,
/// `kv_rounds` rounds) on any host, loaded or not, so the counts asserted below (operations,
/// KV rounds, which write a fault lands on, which slots are read back) do not depend on how
/// fast the host moves bytes. The sizes, hence the region the target needs, are the quick
/// plan's.
fn plan() -> Plan {
    Plan {
        max_secs: 600.0,
        read_max_secs: 600.0,
        kv_max_secs: 600.0,
        ..Plan::quick()
    }
}

fn target(transport: TransportKind, fault: Option<TargetFault>, secret: Option<&[u8]>) -> Target {
    Target::start(ServeConfig {
        listen: loopback(),
        secret: secret.map(|s| s.to_vec()),
        transport,
        region_len: plan().data_region_len(),
        fault,
    })
    .expect("target starts")
}

fn bench(
    t: &Target,
    transport: TransportKind,
    secret: Option<&[u8]>,
) -> Result<Report, BenchError> {
    run(&RunConfig {
        target: t.addr(),
        secret: secret.map(|s| s.to_vec()),
        transport,
        listen: loopback(),
        plan: plan(),
        progress: false,
        lanes: None,
        slice_size: None,
        metrics_addr: None,
    })
}

fn assert_complete(r: &Report, transport: &str) {
    assert_eq!(r.engine, "kvwire");
    assert_eq!(r.transport, transport);
    let plan = plan();
    for p in [Pattern::Serial, Pattern::Batch, Pattern::Read] {
        for &s in &plan.sizes {
            let row = r
                .results
                .iter()
                .find(|x| x.pattern == p && x.size == s)
                .unwrap_or_else(|| panic!("missing {p:?} row for {s}"));
            assert!(row.ops > 0 && row.gbps > 0.0 && row.p50_us > 0.0, "{row:?}");
        }
    }
    // Every row says what it cost in CPU, on both sides (the target's through its verdicts).
    for row in &r.results {
        let c = row.cpu_s_per_gb;
        assert!(c.initiator.is_some_and(|x| x > 0.0), "{row:?}");
        assert!(c.target.is_some_and(|x| x >= 0.0), "{row:?}");
    }
    let kv = r
        .results
        .iter()
        .find(|x| x.pattern == Pattern::KvLayer)
        .expect("kv row");
    assert_eq!(
        kv.ops,
        (plan.kv_rounds * plan.kv_layers * plan.kv_blocks) as u64
    );
    // the target checked every tag the initiator sent, and at least every written byte
    let c = &r.check;
    assert_eq!(c.tags_seen, c.tags_sent);
    assert_eq!(c.verified_tags, c.tags_sent);
    let written: u64 = r
        .results
        .iter()
        .filter(|x| x.pattern != Pattern::Read)
        .map(|x| x.ops * x.size)
        .sum();
    assert!(
        c.verified_bytes >= written,
        "{} < {written}",
        c.verified_bytes
    );
    let read: u64 = r
        .results
        .iter()
        .filter(|x| x.pattern == Pattern::Read)
        .map(|x| x.ops * x.size)
        .sum();
    assert!(c.read_bytes_checked >= read + plan.kv_round_bytes());
}

#[test]
fn tcp_every_byte_verified() {
    let t = target(TransportKind::Auto, None, None);
    let r = bench(&t, TransportKind::Tcp, None).expect("bench runs");
    assert!(r.verified, "{}", r.table());
    assert_complete(&r, "tcp");
    assert!(r.results.iter().all(|x| x.verified));
}

#[test]
fn shm_every_byte_verified() {
    let t = target(TransportKind::Auto, None, None);
    let r = bench(&t, TransportKind::Shm, None).expect("bench runs");
    assert!(r.verified, "{}", r.table());
    assert_complete(&r, "shm");
}

#[test]
fn secret_shared_by_both_sides_works() {
    let t = target(TransportKind::Auto, None, Some(b"s3cret"));
    let r = bench(&t, TransportKind::Tcp, Some(b"s3cret")).expect("bench runs");
    assert!(r.verified);
}

#[test]
fn wrong_secret_is_refused() {
    let t = target(TransportKind::Auto, None, Some(b"right"));
    match bench(&t, TransportKind::Tcp, Some(b"wrong")) {
        Err(BenchError::Engine { source, .. }) => {
            assert!(
                matches!(source, kvwire_transfer::Error::AuthFailed),
                "unexpected engine error: {source}"
            )
        }
        other => panic!(
            "expected an authentication failure, got {:?}",
            other.map(|r| r.verified)
        ),
    }
}

/// Bytes corrupted on the target after they landed are caught twice: by the target's
/// check of the batch and by the initiator's read-back.
#[test]
fn corrupted_bytes_are_detected() {
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        // measured batch 1 is the first serial write (slot 0, read back later)
        let t = target(
            TransportKind::Auto,
            Some(TargetFault::CorruptBeforeVerify { nth: 1 }),
            None,
        );
        let r = bench(&t, transport, None).expect("bench runs to the end");
        assert!(!r.verified, "{transport:?}: corruption went unnoticed");
        assert_eq!(r.check.mismatches, 1, "{transport:?}");
        assert!(r.check.read_mismatches >= 1, "{transport:?}");
        let first = &r.results[0];
        assert_eq!(first.pattern, Pattern::Serial);
        assert!(!first.verified);
        let read = r
            .results
            .iter()
            .find(|x| x.pattern == Pattern::Read && x.size == first.size)
            .unwrap();
        assert!(!read.verified);
        // the other phases still verify
        assert!(r
            .results
            .iter()
            .filter(|x| x.size != first.size)
            .all(|x| x.verified));
    }
}

/// The timed serial and batch writes carry no notification; a byte corrupted in the middle
/// of the serial phase (the 18th write of the first size, checked through the record sent
/// after the phase) is still caught by the target and by the read-back.
#[test]
fn serial_corruption_is_detected_without_per_write_tags() {
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        // data tag 1 is the record of the first size's serial writes; range 17 is write 18
        let t = target(
            TransportKind::Auto,
            Some(TargetFault::CorruptRangeBeforeVerify { nth: 1, range: 17 }),
            None,
        );
        let r = bench(&t, transport, None).expect("bench runs to the end");
        assert!(!r.verified, "{transport:?}: corruption went unnoticed");
        assert_eq!(r.check.mismatches, 1, "{transport:?}");
        assert!(r.check.read_mismatches >= 1, "{transport:?}");
        let first = &r.results[0];
        assert_eq!(first.pattern, Pattern::Serial);
        assert!(first.ops > 17, "{first:?}");
        assert!(!first.verified, "{transport:?}");
        assert!(r
            .results
            .iter()
            .filter(|x| x.size != first.size)
            .all(|x| x.verified));
        // no notification inside the timed serial, batch and read sections; one per layer
        // in the KV pattern
        let plan = plan();
        let mut per_write_tags = 0;
        for x in &r.results {
            match x.pattern {
                Pattern::KvLayer => assert_eq!(
                    x.timed_notifications,
                    (plan.kv_rounds * plan.kv_layers) as u64
                ),
                Pattern::Serial => {
                    assert_eq!(x.timed_notifications, 0);
                    per_write_tags += x.ops;
                }
                Pattern::Batch => {
                    assert_eq!(x.timed_notifications, 0);
                    per_write_tags += x.batches.unwrap_or(0);
                }
                Pattern::Read => assert_eq!(x.timed_notifications, 0),
            }
        }
        // a tag per timed write would need at least this many
        assert!(
            r.check.tags_sent < per_write_tags,
            "{} tags for {per_write_tags} timed batches",
            r.check.tags_sent
        );
        assert_eq!(r.check.tags_seen, r.check.tags_sent);
    }
}

#[test]
fn target_region_too_small_is_a_plan_error() {
    let t = Target::start(ServeConfig {
        listen: loopback(),
        secret: None,
        transport: TransportKind::Auto,
        region_len: 1 << 20,
        fault: None,
    })
    .unwrap();
    match bench(&t, TransportKind::Tcp, None) {
        Err(BenchError::Plan(msg)) => assert!(msg.contains("--region-size"), "{msg}"),
        other => panic!("expected a plan error, got {:?}", other.map(|r| r.verified)),
    }
}

/// A second engine connected to `t`, and a write into the ignored bytes of its control region
/// (a carrier for notifications that are not the bench's).
fn notifier(t: &Target) -> (Engine, kvwire_transfer::Peer, Op) {
    let e = Engine::new(EngineConfig {
        transport: TransportKind::Tcp,
        ..EngineConfig::default()
    })
    .unwrap();
    let peer = e.connect(t.addr()).unwrap();
    let ctrl = peer.regions().into_iter().find(|r| r.len == 4096).unwrap();
    let src = e.alloc_region(4096, Access::Local).unwrap();
    let op = Op {
        local: src,
        local_offset: 0,
        remote: ctrl.id,
        remote_offset: kvwire_bench::target::FLUSH_OFFSET,
        len: 8,
    };
    (e, peer, op)
}

/// Notifications that are not bench tags are counted, not trusted, and the target keeps
/// serving.
#[test]
fn garbage_notifications_do_not_break_the_target() {
    let t = target(TransportKind::Auto, None, None);
    let (e, peer, op) = notifier(&t);
    for tag in [
        &b"not a tag"[..],
        &[0u8; 36][..],
        &b"KVWB\x01\x01\xff\xff"[..],
    ] {
        e.write(&peer, std::slice::from_ref(&op), Some(tag), None)
            .unwrap()
            .wait()
            .unwrap();
    }
    let t0 = Instant::now();
    while t.verdict().bad_tags < 3 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "bad tags not counted: {:?}",
            t.verdict()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    e.shutdown();
    let r = bench(&t, TransportKind::Tcp, None).expect("bench runs");
    assert!(r.verified, "{}", r.table());
}

fn cli(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kvwire-bench"))
        .args(args)
        .env_remove("KVWIRE_BENCH_SECRET")
        .output()
        .expect("runs kvwire-bench")
}

/// The CLI with no target starts its own target process and writes the JSON format of
/// DESIGN.md.
#[test]
fn cli_quick_with_own_target_process() {
    let dir = std::env::temp_dir().join(format!("kvwire-bench-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for transport in ["tcp", "shm"] {
        let json = dir.join(format!("{transport}.json"));
        let out = cli(&[
            "transfer",
            "--quick",
            "--no-progress",
            "--transport",
            transport,
            "--secret",
            "x",
            "--json",
            json.to_str().unwrap(),
        ]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{transport}: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("serial_GBps") && stdout.contains("KV 4x8x64KiB"),
            "{stdout}"
        );
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        assert_eq!(v["engine"], "kvwire");
        assert_eq!(v["transport"], transport);
        assert_eq!(v["verified"], true);
        let rows = v["results"].as_array().unwrap();
        for p in ["serial", "batch", "kv_layer", "read"] {
            assert!(rows.iter().any(|r| r["pattern"] == p), "{p}");
        }
        assert!(rows.iter().all(|r| r["verified"] == true));
        // CPU per GB from both processes; on tcp the target's receive threads cost CPU too.
        for r in rows {
            let c = &r["cpu_s_per_gb"];
            assert!(c["initiator"].as_f64().is_some_and(|x| x > 0.0), "{r}");
            assert!(c["target"].as_f64().is_some_and(|x| x >= 0.0), "{r}");
        }
        if transport == "tcp" {
            let kv = rows.iter().find(|r| r["pattern"] == "kv_layer").unwrap();
            assert!(kv["cpu_s_per_gb"]["target"].as_f64().unwrap() > 0.0, "{kv}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cli_rejects_bad_arguments() {
    let out = cli(&["transfer", "--serve", "--target", "127.0.0.1:1"]);
    assert!(!out.status.success());
    let out = cli(&["transfer", "--sizes", "abc"]);
    assert!(!out.status.success());
    // nothing listens on port 1 of loopback: a clear error and exit code 1
    let out = cli(&[
        "transfer",
        "--quick",
        "--no-progress",
        "--target",
        "127.0.0.1:1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("connecting to the target"));
}

/// Two processes started separately (--serve, then --target): a target that corrupts one
/// batch makes the initiator report `verified: false` and exit with code 2.
#[test]
fn cli_serve_and_target_detects_corruption() {
    use std::io::BufRead;
    let mut server = std::process::Command::new(env!("CARGO_BIN_EXE_kvwire-bench"))
        .args([
            "transfer",
            "--serve",
            "--listen",
            "127.0.0.1:0",
            "--region-size",
            "16M",
            "--exit-on-stdin-eof",
            "--fault-corrupt-nth",
            "2",
        ])
        .env_remove("KVWIRE_BENCH_SECRET")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .strip_prefix(kvwire_bench::spawn::READY_PREFIX)
        .unwrap_or_else(|| panic!("no ready line: {line:?}"))
        .trim()
        .to_string();
    let json = std::env::temp_dir().join(format!("kvwire-bench-fault-{}.json", std::process::id()));
    let out = cli(&[
        "transfer",
        "--quick",
        "--no-progress",
        "--target",
        &addr,
        "--json",
        json.to_str().unwrap(),
    ]);
    drop(server.stdin.take());
    let _ = server.wait();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{stdout}");
    assert!(stdout.contains("verified=N"), "{stdout}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["verified"], false);
    assert_eq!(v["check"]["mismatches"], 1);
    let _ = std::fs::remove_file(&json);
}

/// Hostile tags (finding 9): a flush count that can never be reached, and a tag naming 4000
/// times the whole data region, cost the verifier at most one pass over the region each (here:
/// none) and never make it spin; a legitimate run in progress meanwhile is verified, its run
/// untouched by the attacker's tags.
#[test]
fn hostile_tags_cost_bounded_cpu() {
    use kvwire_bench::wire::{Phase, Range, Tag, MAX_TAG_RANGES};
    use std::sync::atomic::Ordering;
    let t = std::sync::Arc::new(
        Target::start(ServeConfig {
            listen: loopback(),
            secret: None,
            transport: TransportKind::Tcp,
            region_len: 64 << 20,
            fault: None,
        })
        .expect("target starts"),
    );
    let region = t.region_len();
    let legit = {
        let t = t.clone();
        std::thread::spawn(move || bench(&t, TransportKind::Tcp, None).expect("bench runs"))
    };
    // The attacker starts once the legitimate run is under way.
    let t0 = Instant::now();
    while t.stats().tags_checked.load(Ordering::Relaxed) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the legitimate run never started"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let (e, peer, op) = notifier(&t);
    let spin = Tag {
        run: 0xbad,
        phase: Phase::Flush,
        seq: 1,
        flush_total: u64::MAX,
        ranges: vec![],
        crc: 0,
    };
    let huge = Tag {
        run: 0xbad,
        phase: Phase::Batch,
        seq: 2,
        flush_total: 2,
        ranges: vec![
            Range {
                offset: 0,
                len: region
            };
            MAX_TAG_RANGES
        ],
        crc: 0,
    };
    let bad0 = t.stats().bad_tags.load(Ordering::Relaxed);
    for tag in [&spin, &huge] {
        e.write(&peer, std::slice::from_ref(&op), Some(&tag.encode()), None)
            .unwrap()
            .wait()
            .unwrap();
    }
    let t0 = Instant::now();
    while t.stats().bad_tags.load(Ordering::Relaxed) < bad0 + 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "hostile tags not refused"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let r = legit.join().expect("legitimate run");
    assert!(r.verified, "{}", r.table());
    let s = t.stats();
    assert_eq!(
        s.idle_checks.load(Ordering::Relaxed),
        0,
        "the verifier never spins"
    );
    let (bytes, tags) = (
        s.crc_bytes.load(Ordering::Relaxed),
        s.tags_checked.load(Ordering::Relaxed),
    );
    assert!(bytes <= region * tags, "{bytes} bytes read for {tags} tags");
    e.shutdown();
}

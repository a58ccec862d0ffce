//! `kvwire-bench --metrics-addr`: while a transfer run is going, its initiator engine serves
//! Prometheus text that parses (with an exposition parser) and counts the run's writes.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use kvwire_bench::initiator::METRICS_PREFIX;
use prometheus_parse::{Scrape, Value};

fn get_metrics(addr: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

fn tcp_write_batches(s: &Scrape) -> f64 {
    s.samples
        .iter()
        .filter(|x| {
            x.metric == "kvwire_batches_total"
                && x.labels.get("transport") == Some("tcp")
                && x.labels.get("dir") == Some("write")
        })
        .map(|x| match x.value {
            Value::Counter(v) | Value::Untyped(v) => v,
            _ => 0.0,
        })
        .sum()
}

/// What one quick transfer run showed through its endpoint while it was going.
struct Observed {
    /// Scrapes that parsed.
    parsed: u32,
    /// Largest tcp write-batch count seen.
    max_batches: f64,
}

/// Runs one quick transfer with `--metrics-addr` and scrapes its endpoint until a scrape shows
/// the run's writes (and at least two parsed), or the run ends. Every scrape that answers must
/// parse, and the run must succeed.
fn observe_one_run() -> Observed {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvwire-bench"))
        .args([
            "--metrics-addr",
            "127.0.0.1:0",
            "transfer",
            "--transport",
            "tcp",
            "--quick",
            "--max-secs",
            "1",
            "--no-progress",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvwire-bench");
    let mut err = BufReader::new(child.stderr.take().expect("stderr"));
    let mut url = None;
    let mut line = String::new();
    for _ in 0..1000 {
        line.clear();
        if err.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        if let Some(u) = line.trim().strip_prefix(METRICS_PREFIX) {
            url = Some(u.to_string());
            break;
        }
    }
    let url = url.expect("the bench prints its metrics URL");
    // Keep draining stderr so that the child never blocks on a full pipe.
    let drain = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = err.read_to_string(&mut rest);
        rest
    });
    let addr: SocketAddr = url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .parse()
        .expect("a socket address in the URL");
    let (mut parsed, mut max_batches) = (0, 0.0f64);
    // Bounded: at most 500 scrapes, 20 ms apart, or until the run ends.
    for _ in 0..500 {
        if child.try_wait().expect("try_wait").is_some() {
            break;
        }
        if let Some(body) = get_metrics(addr) {
            let s = Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
                .expect("the endpoint serves valid exposition text");
            assert!(!s.samples.is_empty());
            parsed += 1;
            max_batches = max_batches.max(tcp_write_batches(&s));
            if max_batches > 0.0 && parsed >= 2 {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = child.wait().expect("wait");
    let log = drain.join().unwrap_or_default();
    assert!(status.success(), "kvwire-bench failed: {log}");
    Observed {
        parsed,
        max_batches,
    }
}

/// Runs a quick transfer and scrapes it while it runs. How long the run lasts is up to the
/// host (measured: 2.1–2.5 s for a debug build on a shared 2-core host; scrapes are 20 ms
/// apart), and nothing in the bench waits for the test, so a starved test thread can see the
/// run end before a scrape shows a completed write. Such a run proves nothing either way and
/// is run again, up to `ATTEMPTS` times; a scrape that does not parse, or a failed run, fails
/// the test at once.
#[test]
fn transfer_run_serves_parseable_metrics_while_running() {
    const ATTEMPTS: usize = 3;
    for attempt in 1..=ATTEMPTS {
        let o = observe_one_run();
        if o.parsed >= 1 && o.max_batches > 0.0 {
            return;
        }
        eprintln!(
            "attempt {attempt}: the run ended before a scrape showed its writes \
             ({} scrapes parsed, {} write batches seen)",
            o.parsed, o.max_batches
        );
    }
    panic!("in {ATTEMPTS} runs, no scrape showed the run's writes while it was going");
}

#[test]
fn metrics_addr_is_refused_where_no_engine_serves_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire-bench"))
        .args([
            "--metrics-addr",
            "127.0.0.1:0",
            "calibrate",
            "--timeline",
            "/nonexistent/kvwire-timeline.jsonl",
        ])
        .output()
        .expect("run kvwire-bench");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--metrics-addr is supported by"), "{err}");
}

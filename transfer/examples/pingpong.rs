//! Serial write latency and large-write throughput over tcp and shm, target in a child process.
//!
//! `cargo run --release -p kvwire-transfer --example pingpong [iters]` (`KVWIRE_LANES=n` sets the
//! TCP lanes, default 4).
//!
//! For each transport and size: `iters` serial `write(..).wait()` round trips (one op, no
//! notification), p50/p99 latency; then GB/s (1e9 B/s) for 64 MiB batches. Before any timing
//! the first and last bytes are verified by reading them back.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvwire_transfer::{Access, Engine, EngineConfig, Op, TransportKind};

const REGION: usize = 64 << 20;

fn target() -> Result<(), kvwire_transfer::Error> {
    let e = Engine::new(EngineConfig::default())?;
    let _r = e.alloc_region(REGION, Access::ReadWrite)?;
    println!("ADDR {}", e.listen_addr());
    std::io::stdout().flush().ok();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line); // parent closes stdin when done
    Ok(())
}

/// CPU time (user + system) this process used so far, from /proc/self/stat, in clock ticks.
fn cpu_ticks() -> u64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = s.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // fields after the command: state is f[0]; utime = field 14 -> f[11], stime -> f[12]
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("target") {
        target()?;
        return Ok(());
    }
    let iters: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2000);
    let mut child = Command::new(std::env::current_exe()?)
        .arg("target")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let addr: std::net::SocketAddr = line.trim().trim_start_matches("ADDR ").parse()?;
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let lanes = std::env::var("KVWIRE_LANES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4);
        let e = Engine::new(EngineConfig {
            transport: kind,
            lanes,
            ..Default::default()
        })?;
        let src = e.alloc_region(REGION, Access::Local)?;
        let pattern: Vec<u8> = (0..REGION).map(|i| (i * 7 + 3) as u8).collect();
        e.local_write(src, 0, &pattern)?;
        let peer = e.connect(addr)?;
        let dst = peer.regions()[0];
        // Idle cost: connected, nothing to do, for one second.
        let t0 = cpu_ticks();
        std::thread::sleep(Duration::from_secs(1));
        println!(
            "{:?} idle: {} clock ticks of CPU in 1 s with a connected peer",
            kind,
            cpu_ticks() - t0
        );
        for size in [64usize, 4096, 65536, 1 << 20] {
            let op = Op {
                local: src,
                local_offset: 0,
                remote: dst.id,
                remote_offset: 0,
                len: size as u64,
            };
            for _ in 0..(iters / 10).max(10) {
                e.write(&peer, &[op], None, None)?.wait()?;
            }
            // verify
            let chk = e.alloc_region(size, Access::Local)?;
            e.read(&peer, &[Op { local: chk, ..op }], None)?.wait()?;
            let mut got = vec![0u8; size];
            e.local_read(chk, 0, &mut got)?;
            assert_eq!(&got[..], &pattern[..size], "verification failed");
            e.unregister(chk)?;
            let n = if size >= 1 << 20 { iters / 10 } else { iters };
            let mut lat = Vec::with_capacity(n);
            for _ in 0..n {
                let t = Instant::now();
                e.write(&peer, &[op], None, None)?.wait()?;
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
            let p50 = pct(&mut lat, 0.5);
            let p99 = pct(&mut lat, 0.99);
            println!(
                "{:?} serial write {:>8} B: p50 {:8.1} us  p99 {:8.1} us  ({:.2} GB/s at p50)",
                kind,
                size,
                p50,
                p99,
                size as f64 / p50 / 1e3
            );
        }
        // throughput: 64 MiB batches
        let op = Op {
            local: src,
            local_offset: 0,
            remote: dst.id,
            remote_offset: 0,
            len: REGION as u64,
        };
        e.write(&peer, &[op], None, None)?.wait()?;
        let reps = 16;
        let t = Instant::now();
        for _ in 0..reps {
            e.write(&peer, &[op], None, Some(Duration::from_secs(30)))?
                .wait()?;
        }
        let secs = t.elapsed().as_secs_f64();
        println!(
            "{:?} 64 MiB batches: {:.2} GB/s ({} x {} B in {:.3} s)",
            kind,
            (reps * REGION) as f64 / secs / 1e9,
            reps,
            REGION,
            secs
        );
        e.shutdown();
    }
    drop(child.stdin.take());
    child.wait()?;
    Ok(())
}

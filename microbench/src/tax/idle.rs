//! CPU used by idle kvwire engines: two engines (TCP, connected to each other, one region
//! registered on each) do nothing for a fixed interval; the CPU time of the threads they started
//! is read from `/proc/self/task/<tid>/schedstat` (ns on CPU) before and after.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kvwire_transfer::{Access, Engine, EngineConfig, TransportKind};
use serde::Serialize;

/// What the idle engines used.
#[derive(Clone, Debug, Serialize)]
pub struct EngineIdle {
    /// Engines (connected to each other).
    pub engines: usize,
    /// Transport of the connection.
    pub transport: String,
    /// Interval measured, seconds.
    pub interval_s: f64,
    /// Threads the engines started.
    pub threads: usize,
    /// CPU time of those threads over the interval, ms.
    pub cpu_ms: f64,
    /// The same as a percentage of one core.
    pub cpu_pct: f64,
    /// CPU ms per thread name (`comm`), summed.
    pub by_name: BTreeMap<String, f64>,
}

fn tids() -> BTreeSet<u32> {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// ns on CPU of one thread of this process (0 when it is gone).
pub fn cpu_ns(tid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn comm(tid: u32) -> String {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Measures two idle engines over `interval`.
pub fn run(interval: Duration) -> Result<EngineIdle, String> {
    let before = tids();
    let cfg = || EngineConfig {
        transport: TransportKind::Tcp,
        ..EngineConfig::from_env()
    };
    let a = Engine::new(cfg()).map_err(|e| format!("engine: {e}"))?;
    let b = Engine::new(cfg()).map_err(|e| format!("engine: {e}"))?;
    let _ra = a
        .alloc_region(1 << 20, Access::ReadWrite)
        .map_err(|e| format!("alloc: {e}"))?;
    let _rb = b
        .alloc_region(1 << 20, Access::ReadWrite)
        .map_err(|e| format!("alloc: {e}"))?;
    let peer = a
        .connect(b.listen_addr())
        .map_err(|e| format!("connect: {e}"))?;
    // Let connection set-up settle before the interval starts.
    std::thread::sleep(Duration::from_millis(200));
    let own: Vec<u32> = tids().difference(&before).copied().collect();
    let c0: Vec<u64> = own.iter().map(|&t| cpu_ns(t)).collect();
    let t0 = Instant::now();
    std::thread::sleep(interval);
    let wall = t0.elapsed();
    let mut by_name = BTreeMap::new();
    let mut total = 0u64;
    for (&t, &c) in own.iter().zip(&c0) {
        let d = cpu_ns(t).saturating_sub(c);
        total += d;
        *by_name.entry(comm(t)).or_insert(0.0) += d as f64 / 1e6;
    }
    let transport = format!("{:?}", peer.transport()).to_lowercase();
    drop(peer);
    a.shutdown();
    b.shutdown();
    Ok(EngineIdle {
        engines: 2,
        transport,
        interval_s: wall.as_secs_f64(),
        threads: own.len(),
        cpu_ms: total as f64 / 1e6,
        cpu_pct: 100.0 * total as f64 / wall.as_nanos() as f64,
        by_name,
    })
}

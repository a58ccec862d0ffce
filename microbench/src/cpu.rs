//! CPU time, for the CPU-seconds per GB the transfer rows report: this process's (all its
//! threads, `CLOCK_PROCESS_CPUTIME_ID`) and the calling thread's (`CLOCK_THREAD_CPUTIME_ID`).
//! `None` where the clock cannot be read; the figures are then left out, never made up.

use std::time::Duration;

use nix::time::{clock_gettime, ClockId};

/// CPU time of every thread of this process so far.
pub fn process() -> Option<Duration> {
    clock_gettime(ClockId::CLOCK_PROCESS_CPUTIME_ID)
        .ok()
        .map(Duration::from)
}

/// CPU time of the calling thread so far.
pub fn thread() -> Option<Duration> {
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID)
        .ok()
        .map(Duration::from)
}

/// Seconds of CPU per GB (1e9 bytes) moved; `None` without bytes or without a reading.
pub fn s_per_gb(cpu: Option<Duration>, bytes: u64) -> Option<f64> {
    match cpu {
        Some(c) if bytes > 0 => Some(c.as_secs_f64() / (bytes as f64 / 1e9)),
        _ => None,
    }
}

/// CPU time so far of this process's threads whose name starts with `prefix` (the scheduler's
/// per-thread run time, `/proc/self/task/*/schedstat`, in ns); `None` when no such thread is
/// found or the kernel keeps no schedstat.
pub fn threads_named(prefix: &str) -> Option<Duration> {
    let mut total = None;
    for t in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Ok(comm) = std::fs::read_to_string(t.path().join("comm")) else {
            continue;
        };
        if !comm.trim_end().starts_with(prefix) {
            continue;
        }
        let ns = std::fs::read_to_string(t.path().join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
        if let Some(ns) = ns {
            *total.get_or_insert(Duration::ZERO) += Duration::from_nanos(ns);
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clocks_advance_with_work_and_the_thread_clock_is_within_the_process_clock() {
        let (p0, t0) = (process().unwrap(), thread().unwrap());
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        let (t1, p1) = (thread().unwrap(), process().unwrap());
        assert!(t1 > t0, "{t0:?} -> {t1:?} ({x})");
        assert!(p1 - p0 >= t1 - t0);
    }

    #[test]
    fn per_gb_needs_bytes_and_a_reading() {
        assert_eq!(
            s_per_gb(Some(Duration::from_millis(500)), 2_000_000_000),
            Some(0.25)
        );
        assert_eq!(s_per_gb(Some(Duration::from_secs(1)), 0), None);
        assert_eq!(s_per_gb(None, 10), None);
    }
}

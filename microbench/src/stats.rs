//! Latency summaries.

use std::time::Duration;

/// Nearest-rank percentile `p` (0..=100) of `sorted` (ascending), as the peer benches
/// compute it: the element at `round(p/100 * (n-1))`. `None` when empty.
pub fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let k = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    Some(sorted[k.min(sorted.len() - 1)])
}

/// A set of measured latencies.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    lat: Vec<Duration>,
}

impl Samples {
    /// An empty set.
    pub fn new() -> Samples {
        Samples::default()
    }

    /// Records one latency.
    pub fn push(&mut self, d: Duration) {
        self.lat.push(d);
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.lat.len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.lat.is_empty()
    }

    /// Sum of all samples.
    pub fn total(&self) -> Duration {
        self.lat.iter().sum()
    }

    /// p50 and p99 in microseconds (0 when empty).
    pub fn p50_p99_us(&self) -> (f64, f64) {
        let mut s = self.lat.clone();
        s.sort_unstable();
        let us = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e6).unwrap_or(0.0);
        (us(percentile(&s, 50.0)), us(percentile(&s, 99.0)))
    }
}

/// GB/s (1e9 bytes per second) for `bytes` moved in `time`; 0 for an empty interval.
pub fn gbps(bytes: u64, time: Duration) -> f64 {
    let s = time.as_secs_f64();
    if s <= 0.0 {
        0.0
    } else {
        bytes as f64 / s / 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        assert_eq!(percentile(&v, 50.0), Some(Duration::from_micros(51)));
        assert_eq!(percentile(&v, 99.0), Some(Duration::from_micros(99)));
        assert_eq!(percentile(&v, 0.0), Some(Duration::from_micros(1)));
        assert_eq!(percentile(&v, 100.0), Some(Duration::from_micros(100)));
        assert_eq!(percentile(&[], 50.0), None);
        let one = [Duration::from_micros(7)];
        assert_eq!(percentile(&one, 99.0), Some(Duration::from_micros(7)));
    }

    #[test]
    fn samples_summary() {
        let mut s = Samples::new();
        assert_eq!(s.p50_p99_us(), (0.0, 0.0));
        for us in [30, 10, 20] {
            s.push(Duration::from_micros(us));
        }
        assert_eq!(s.len(), 3);
        assert_eq!(s.total(), Duration::from_micros(60));
        let (p50, p99) = s.p50_p99_us();
        assert!((p50 - 20.0).abs() < 1e-9 && (p99 - 30.0).abs() < 1e-9);
        assert!((gbps(2_000_000_000, Duration::from_secs(2)) - 1.0).abs() < 1e-12);
        assert_eq!(gbps(5, Duration::ZERO), 0.0);
    }
}

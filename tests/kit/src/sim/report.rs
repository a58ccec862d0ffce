//! What a run measured: merged timeline records and their aggregates.

use std::collections::BTreeMap;

use kvwire_connector::{DStats, Decomposition, Nanos, Outcome, PStats, TimelineRecord};

use super::check::Violation;
use super::world::Sim;

/// Aggregates of a run.
#[derive(Clone, Debug, Default)]
pub struct SimReport {
    /// Merged timeline records (D's, with P's timestamps), sorted by request id.
    pub records: Vec<TimelineRecord>,
    /// FNV-1a hash of the records' JSON lines.
    pub timeline_hash: u64,
    /// Requests that reached their first token.
    pub finished: usize,
    /// Requests that failed on D.
    pub failed: usize,
    /// Failures by reason (merged records: the root cause where P failed first).
    pub fail_reasons: BTreeMap<String, usize>,
    /// Failures on P by reason (from P's own records).
    pub p_fail_reasons: BTreeMap<String, usize>,
    /// Invariant violations (empty on a correct run).
    pub violations: Vec<Violation>,
    /// Sum over requests of D blocks × seconds reserved before promotion or release.
    pub d_block_seconds_waiting: f64,
    /// Events processed.
    pub events: u64,
    /// D steps run.
    pub d_steps: u64,
    /// Simulated time at the end.
    pub sim_end: Nanos,
    /// P crashes injected.
    pub p_crashes: u64,
    /// D core counters at the end.
    pub d_stats: DStats,
    /// P core counters summed over engines and lives.
    pub p_stats: PStats,
    /// `land` requests that took landing slots.
    pub d_landings: u64,
    /// `land` requests that fell back to `lazy` (landing pool full).
    pub d_land_fallbacks: u64,
}

impl SimReport {
    /// Timeline as JSON lines.
    pub fn json_lines(&self) -> String {
        let mut s = String::new();
        for r in &self.records {
            s.push_str(&r.to_json_line());
            s.push('\n');
        }
        s
    }

    /// Mean of a decomposition segment over finished requests, in milliseconds.
    pub fn mean_ms(&self, f: impl Fn(&Decomposition) -> Nanos) -> f64 {
        let v: Vec<f64> = self
            .records
            .iter()
            .filter_map(|r| r.decompose())
            .map(|d| f(&d) as f64 / 1e6)
            .collect();
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    }

    /// Quantile `q` of `decode_sent → first_token` over finished requests, in milliseconds.
    pub fn ttft_quantile_ms(&self, q: f64) -> f64 {
        let mut v: Vec<Nanos> = self
            .records
            .iter()
            .filter_map(|r| r.decompose())
            .map(|d| d.total())
            .collect();
        if v.is_empty() {
            return 0.0;
        }
        v.sort_unstable();
        let i = ((v.len() - 1) as f64 * q).round() as usize;
        v[i.min(v.len() - 1)] as f64 / 1e6
    }
}

pub(super) fn fnv1a(data: &[u8], mut h: u64) -> u64 {
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl Sim {
    pub(super) fn report(mut self) -> SimReport {
        for e in &self.ps {
            add_p_stats(&mut self.p_stats, e.core.stats());
        }
        let mut records: Vec<TimelineRecord> = self
            .d_records
            .iter()
            .map(|d| match self.p_records.get(&d.req) {
                Some(p) => TimelineRecord::merge(d, p),
                None => d.clone(),
            })
            .collect();
        records.sort_by_key(|r| r.req);
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut finished = 0;
        let mut failed = 0;
        let mut reasons = BTreeMap::new();
        let mut block_ns = 0u128;
        for r in &records {
            h = fnv1a(r.to_json_line().as_bytes(), h);
            h = fnv1a(b"\n", h);
            block_ns += r.d_block_ns_waiting();
            match r.outcome {
                Outcome::Finished => finished += 1,
                Outcome::Failed => {
                    failed += 1;
                    let k = r
                        .fail_reason
                        .map_or("unknown".to_string(), |f| format!("{f:?}"));
                    *reasons.entry(k).or_insert(0) += 1;
                }
            }
        }
        let mut p_reasons = BTreeMap::new();
        let mut p_recs: Vec<&TimelineRecord> = self.p_records.values().collect();
        p_recs.sort_by_key(|r| r.req);
        for r in p_recs {
            if r.outcome == Outcome::Failed {
                let k = r
                    .fail_reason
                    .map_or("unknown".to_string(), |f| format!("{f:?}"));
                *p_reasons.entry(k).or_insert(0) += 1;
            }
        }
        SimReport {
            p_fail_reasons: p_reasons,
            records,
            timeline_hash: h,
            finished,
            failed,
            fail_reasons: reasons,
            violations: self.check.violations().to_vec(),
            d_block_seconds_waiting: block_ns as f64 / 1e9,
            events: self.events,
            d_steps: self.d_steps,
            sim_end: self.now,
            p_crashes: self.p_crashes,
            d_stats: self.d.core.stats().clone(),
            p_stats: self.p_stats,
            d_landings: self.d.core.metrics().landings,
            d_land_fallbacks: self.d.core.metrics().land_fallbacks,
        }
    }
}

pub(super) fn add_p_stats(a: &mut PStats, b: &PStats) {
    a.late += b.late;
    a.duplicate_messages += b.duplicate_messages;
    a.unexpected_messages += b.unexpected_messages;
    a.early_overflow += b.early_overflow;
    a.orphans += b.orphans;
    a.finished += b.finished;
    a.failed += b.failed;
    a.drain_timeouts += b.drain_timeouts;
}

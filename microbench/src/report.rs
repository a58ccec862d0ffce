//! The bench's results: JSON in the format the peer comparison reads, and a human table
//! with the peer scripts' columns.

use serde::Serialize;
use std::fmt::Write as _;

use crate::plan::{fmt_size, Plan};

/// Measurement pattern of a result row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pattern {
    /// Writes with one in flight.
    Serial,
    /// Batches of `batch` writes; latency is per batch.
    Batch,
    /// The KV-layer pattern; latency is per layer (one batch).
    KvLayer,
    /// Read-backs with one in flight, every byte compared with what was written.
    Read,
}

/// One result row.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// What was measured.
    pub pattern: Pattern,
    /// Bytes per operation (per block for `kv_layer`).
    pub size: u64,
    /// Operations timed (writes, reads or blocks).
    pub ops: u64,
    /// Median latency, microseconds (per op; per batch for `batch`; per layer for `kv_layer`).
    pub p50_us: f64,
    /// 99th-percentile latency, microseconds.
    pub p99_us: f64,
    /// GB/s (1e9 B/s): bytes over the summed time with operations in flight
    /// (for `kv_layer`: bytes over the summed wall time of the timed rounds).
    pub gbps: f64,
    /// True when the target (writes) or the initiator (reads) checked every byte and all matched.
    pub verified: bool,
    /// `batch`: writes per batch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<usize>,
    /// `batch`: batches timed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batches: Option<u64>,
    /// `kv_layer`: layers, blocks per layer, timed rounds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv: Option<KvShape>,
    /// Notifications sent inside the timed sections of this row: 0 for the serial, batch
    /// and read phases (their writes are checked through records sent between timed
    /// operations), one per layer for `kv_layer`.
    pub timed_notifications: u64,
    /// CPU seconds per GB moved by this row's timed operations (see [`CpuPerGb`]).
    pub cpu_s_per_gb: CpuPerGb,
    /// RDMA: the slice sizes `[write, read]` the peer's large batches were cut with at the end
    /// of this row (they adapt between `slice_size` and `rdma_slice_max`); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slice_sizes: Option<[u64; 2]>,
}

/// CPU seconds (all threads) per GB (1e9 bytes) a row's timed operations moved, each side;
/// `null` where a side's CPU clock could not be read.
///
/// The initiator's counts only its timed sections (submit to completion), not the staging
/// and checking between them; the target's is its process's CPU between the verdicts around
/// the row, less its verifier thread's (checking is the bench's work, not the transfer's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CpuPerGb {
    /// The initiator process's.
    pub initiator: Option<f64>,
    /// The target process's.
    pub target: Option<f64>,
}

impl CpuPerGb {
    /// `I+T` (seconds per GB, two decimals), `-` for a side not measured.
    pub fn cell(&self) -> String {
        let f = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |x| format!("{x:.2}"));
        format!("{}+{}", f(self.initiator), f(self.target))
    }
}

/// Shape and per-round figures of the KV-layer pattern.
#[derive(Debug, Clone, Serialize)]
pub struct KvShape {
    /// Layers per round.
    pub layers: usize,
    /// Writes per layer.
    pub blocks: usize,
    /// Timed rounds.
    pub rounds: usize,
    /// Median GB/s over rounds.
    pub gbps_median_round: f64,
    /// Best round GB/s.
    pub gbps_best_round: f64,
    /// Remote blocks placed so that nothing coalesces.
    pub scatter: bool,
}

/// What the target reported at the end of the run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TargetSummary {
    /// Notifications (tags) the initiator sent.
    pub tags_sent: u64,
    /// Tags the target received.
    pub tags_seen: u64,
    /// Tags whose bytes the target checked.
    pub verified_tags: u64,
    /// Bytes the target checked.
    pub verified_bytes: u64,
    /// Tags whose bytes did not match.
    pub mismatches: u64,
    /// Notifications the target could not decode or that named bytes outside its region.
    pub bad_tags: u64,
    /// Bytes the initiator read back and compared.
    pub read_bytes_checked: u64,
    /// Read-backs that did not match.
    pub read_mismatches: u64,
}

/// One run's results.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Always `kvwire`.
    pub engine: &'static str,
    /// The transport the engine chose (`tcp`, `shm`).
    pub transport: String,
    /// This host's name.
    pub host: String,
    /// The target's address.
    pub target: String,
    /// True when every row verified and the target's counters add up.
    pub verified: bool,
    /// Result rows.
    pub results: Vec<Row>,
    /// The target's verification counters.
    pub check: TargetSummary,
    /// What was measured.
    pub plan: Plan,
}

impl Report {
    /// The human table: the peer scripts' columns (size, ops, p50_us, p99_us, serial_GBps,
    /// batch, batch_GBps, ok), then a `KV ...` line, then the read-backs.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "kvwire-bench transfer: transport={} host={} target={}",
            self.transport, self.host, self.target
        );
        let _ = writeln!(
            s,
            "{:>8} {:>5} {:>9} {:>9} {:>11} {:>5} {:>10} {:>3} {:>11} {:>11}",
            "size",
            "ops",
            "p50_us",
            "p99_us",
            "serial_GBps",
            "batch",
            "batch_GBps",
            "ok",
            "cpu_serial",
            "cpu_batch"
        );

        let yn = |b: bool| if b { "y" } else { "N" };
        for r in self.results.iter().filter(|r| r.pattern == Pattern::Serial) {
            let b = self
                .results
                .iter()
                .find(|x| x.pattern == Pattern::Batch && x.size == r.size);
            let (nb, bg, bok, bcpu) = b
                .map(|b| {
                    (
                        b.batch.unwrap_or(0),
                        b.gbps,
                        b.verified,
                        b.cpu_s_per_gb.cell(),
                    )
                })
                .unwrap_or((0, 0.0, true, "-".into()));
            let _ = writeln!(
                s,
                "{:>8} {:>5} {:>9.1} {:>9.1} {:>11.3} {:>5} {:>10.3} {:>3} {:>11} {:>11}",
                fmt_size(r.size),
                r.ops,
                r.p50_us,
                r.p99_us,
                r.gbps,
                nb,
                bg,
                yn(r.verified && bok),
                r.cpu_s_per_gb.cell(),
                bcpu
            );
        }
        for r in self
            .results
            .iter()
            .filter(|r| r.pattern == Pattern::KvLayer)
        {
            if let Some(k) = &r.kv {
                let _ = writeln!(
                    s,
                    "KV {}x{}x{} rounds={}: layer p50 {:.0} us p99 {:.0} us, {:.3} GB/s median round (best {:.3}; all rounds {:.3}), {} timed notifications (one per layer), CPU s/GB {}, verified={}{}",
                    k.layers,
                    k.blocks,
                    fmt_size(r.size),
                    k.rounds,
                    r.p50_us,
                    r.p99_us,
                    k.gbps_median_round,
                    k.gbps_best_round,
                    r.gbps,
                    r.timed_notifications,
                    r.cpu_s_per_gb.cell(),
                    yn(r.verified),
                    if k.scatter { " (scattered blocks)" } else { "" }
                );
            }
        }
        let reads: Vec<&Row> = self
            .results
            .iter()
            .filter(|r| r.pattern == Pattern::Read)
            .collect();
        if !reads.is_empty() {
            let _ = writeln!(
                s,
                "{:>8} {:>5} {:>9} {:>9} {:>11} {:>3} {:>11}",
                "read", "ops", "p50_us", "p99_us", "read_GBps", "ok", "cpu_read"
            );
            for r in reads {
                let _ = writeln!(
                    s,
                    "{:>8} {:>5} {:>9.1} {:>9.1} {:>11.3} {:>3} {:>11}",
                    fmt_size(r.size),
                    r.ops,
                    r.p50_us,
                    r.p99_us,
                    r.gbps,
                    yn(r.verified),
                    r.cpu_s_per_gb.cell()
                );
            }
        }
        let _ = writeln!(
            s,
            "serial and batch writes are timed without a notification; the target checks them from records sent between timed operations"
        );
        let _ = writeln!(
            s,
            "cpu_*: CPU seconds per GB moved, initiator+target (all threads; the initiator's in its timed sections, the target's less its verifier's)"
        );
        let slices: Vec<String> = self
            .results
            .iter()
            .filter_map(|r| {
                let [w, rd] = r.slice_sizes?;
                let what = match r.pattern {
                    Pattern::Serial => "serial",
                    Pattern::Batch => "batch",
                    Pattern::KvLayer => "kv",
                    Pattern::Read => "read",
                };
                Some(format!(
                    "{what} {} {}/{}",
                    fmt_size(r.size),
                    fmt_size(w),
                    fmt_size(rd)
                ))
            })
            .collect();
        if !slices.is_empty() {
            let _ = writeln!(
                s,
                "rdma slice sizes (write/read) after each row: {}",
                slices.join(", ")
            );
        }
        let c = &self.check;
        let _ = writeln!(
            s,
            "verified={} (target checked {} of {} tags, {} bytes, {} mismatches, {} bad tags; {} bytes read back, {} read mismatches)",
            yn(self.verified),
            c.verified_tags,
            c.tags_sent,
            c.verified_bytes,
            c.mismatches,
            c.bad_tags,
            c.read_bytes_checked,
            c.read_mismatches
        );
        s
    }
}

/// This host's name (from the kernel), or `unknown`.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(pattern: Pattern, size: u64) -> Row {
        Row {
            pattern,
            size,
            ops: 10,
            p50_us: 12.5,
            p99_us: 30.0,
            gbps: 1.25,
            verified: true,
            batch: (pattern == Pattern::Batch).then_some(8),
            batches: None,
            kv: (pattern == Pattern::KvLayer).then_some(KvShape {
                layers: 48,
                blocks: 32,
                rounds: 5,
                gbps_median_round: 2.0,
                gbps_best_round: 2.5,
                scatter: false,
            }),
            timed_notifications: if pattern == Pattern::KvLayer { 240 } else { 0 },
            cpu_s_per_gb: CpuPerGb {
                initiator: Some(0.5),
                target: None,
            },
            slice_sizes: None,
        }
    }

    #[test]
    fn json_has_the_design_fields() {
        let r = Report {
            engine: "kvwire",
            transport: "tcp".into(),
            host: "h".into(),
            target: "127.0.0.1:1".into(),
            verified: true,
            results: vec![
                row(Pattern::Serial, 4096),
                row(Pattern::Batch, 4096),
                row(Pattern::KvLayer, 262_144),
            ],
            check: TargetSummary::default(),
            plan: Plan::quick(),
        };
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(v["engine"], "kvwire");
        assert_eq!(v["transport"], "tcp");
        let rows = v["results"].as_array().unwrap();
        assert_eq!(rows[0]["pattern"], "serial");
        assert_eq!(rows[1]["pattern"], "batch");
        assert_eq!(rows[2]["pattern"], "kv_layer");
        for k in [
            "size",
            "ops",
            "p50_us",
            "p99_us",
            "gbps",
            "verified",
            "timed_notifications",
            "cpu_s_per_gb",
        ] {
            assert!(rows.iter().all(|r| r.get(k).is_some()), "{k}");
        }
        let t = r.table();
        assert!(t.contains("serial_GBps") && t.contains("batch_GBps"));
        assert!(t.contains("KV 48x32x256KiB rounds=5"));
        assert!(t.lines().any(|l| l.trim_start().starts_with("4KiB")));
        assert_eq!(rows[0]["cpu_s_per_gb"]["initiator"], 0.5);
        assert!(rows[0]["cpu_s_per_gb"]["target"].is_null());
        assert!(t.contains("0.50+-") && t.contains("cpu_serial"));
        assert!(rows.iter().all(|r| r.get("slice_sizes").is_none()));
        assert!(!t.contains("rdma slice sizes"));
    }

    #[test]
    fn rdma_rows_carry_their_slice_sizes() {
        let mut serial = row(Pattern::Serial, 65536);
        serial.slice_sizes = Some([1 << 20, 65536]);
        let mut kv = row(Pattern::KvLayer, 262_144);
        kv.slice_sizes = Some([2 << 20, 65536]);
        let r = Report {
            engine: "kvwire",
            transport: "rdma".into(),
            host: "h".into(),
            target: "127.0.0.1:1".into(),
            verified: true,
            results: vec![serial, kv],
            check: TargetSummary::default(),
            plan: Plan::quick(),
        };
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(
            v["results"][0]["slice_sizes"],
            serde_json::json!([1 << 20, 65536])
        );
        assert!(r.table().contains(
            "rdma slice sizes (write/read) after each row: serial 64KiB 1MiB/64KiB, kv 256KiB 2MiB/64KiB"
        ));
    }
}

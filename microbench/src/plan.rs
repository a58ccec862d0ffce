//! What a transfer bench run measures, and its bounds.

use serde::Serialize;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The measurements of one run. Every loop is bounded both in count and in time.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Write sizes for the serial, batch and read phases.
    pub sizes: Vec<u64>,
    /// Writes per batch in the batch phase.
    pub batch: usize,
    /// Most operations per size (serial writes, batched writes).
    pub max_ops: usize,
    /// Most bytes per size and phase.
    pub max_bytes: u64,
    /// Wall-clock bound per size and phase, seconds (data generation included).
    pub max_secs: f64,
    /// Most read-back operations per size.
    pub read_max_ops: usize,
    /// Wall-clock bound of the read-back of one size, seconds.
    pub read_max_secs: f64,
    /// KV pattern: layers per round.
    pub kv_layers: usize,
    /// KV pattern: writes (blocks) per layer, submitted as one batch.
    pub kv_blocks: usize,
    /// KV pattern: bytes per block.
    pub kv_block_size: u64,
    /// KV pattern: timed rounds (one untimed warm-up round runs first).
    pub kv_rounds: usize,
    /// Wall-clock bound of the KV phase, seconds.
    pub kv_max_secs: f64,
    /// KV pattern: place block j of a layer at slot (blocks-1-j) on the target, so no two
    /// writes are adjacent on both sides and nothing can be coalesced.
    pub kv_scatter: bool,
}

impl Plan {
    /// The full measurement: the sizes and bounds of the peer benches
    /// (4 KiB .. 64 MiB, batches of 8, 48 layers x 32 writes of 256 KiB, 5 rounds).
    pub fn full() -> Plan {
        Plan {
            sizes: vec![4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB],
            batch: 8,
            max_ops: 2000,
            max_bytes: 2 << 30,
            max_secs: 2.0,
            read_max_ops: 500,
            read_max_secs: 1.0,
            kv_layers: 48,
            kv_blocks: 32,
            kv_block_size: 256 * KIB,
            kv_rounds: 5,
            kv_max_secs: 30.0,
            kv_scatter: false,
        }
    }

    /// A short run (about a second) that still exercises every phase: small sizes, few
    /// operations, a small KV pattern. Used by tests and CI.
    pub fn quick() -> Plan {
        Plan {
            sizes: vec![4 * KIB, 64 * KIB, MIB],
            batch: 8,
            max_ops: 40,
            max_bytes: 64 * MIB,
            max_secs: 0.5,
            read_max_ops: 20,
            read_max_secs: 0.5,
            kv_layers: 4,
            kv_blocks: 8,
            kv_block_size: 64 * KIB,
            kv_rounds: 2,
            kv_max_secs: 5.0,
            kv_scatter: false,
        }
    }

    /// Largest write size (0 when there are none).
    pub fn max_size(&self) -> u64 {
        self.sizes.iter().copied().max().unwrap_or(0)
    }

    /// Bytes of one KV layer.
    pub fn kv_layer_bytes(&self) -> u64 {
        self.kv_blocks as u64 * self.kv_block_size
    }

    /// Bytes of one KV round.
    pub fn kv_round_bytes(&self) -> u64 {
        self.kv_layers as u64 * self.kv_layer_bytes()
    }

    /// Size of the target's data region (and of the initiator's source region) the plan needs.
    pub fn data_region_len(&self) -> u64 {
        let m = self.max_size();
        (self.batch as u64 * m)
            .max(2 * m)
            .max(self.kv_round_bytes())
            .max(4096)
    }

    /// Size of the initiator's region that read-backs land in.
    pub fn scratch_len(&self) -> u64 {
        self.max_size().max(self.kv_layer_bytes()).max(4096)
    }

    /// Checks the plan is usable: sizes non-zero and multiples of 8, counts non-zero,
    /// the KV layer within one tag's range limit.
    pub fn validate(&self) -> Result<(), String> {
        if self.sizes.is_empty() {
            return Err("no sizes".into());
        }
        if let Some(s) = self.sizes.iter().find(|&&s| s == 0 || s % 8 != 0) {
            return Err(format!("size {s} must be a non-zero multiple of 8"));
        }
        if self.batch == 0 || self.batch > crate::wire::MAX_RANGES {
            return Err(format!("batch must be 1..={}", crate::wire::MAX_RANGES));
        }
        if self.max_ops == 0 || self.read_max_ops == 0 {
            return Err("operation bounds must be non-zero".into());
        }
        if self.kv_layers == 0 || self.kv_blocks == 0 || self.kv_rounds == 0 {
            return Err("KV layers, blocks and rounds must be non-zero".into());
        }
        if self.kv_blocks > crate::wire::MAX_RANGES {
            return Err(format!(
                "KV blocks per layer must be at most {}",
                crate::wire::MAX_RANGES
            ));
        }
        if self.kv_block_size == 0 || self.kv_block_size % 8 != 0 {
            return Err("KV block size must be a non-zero multiple of 8".into());
        }
        Ok(())
    }
}

/// Parses a size such as `4K`, `64KiB`, `1M`, `16MiB` or `4096`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_uppercase();
    let (num, mult) = [
        ("KIB", KIB),
        ("MIB", MIB),
        ("GIB", 1 << 30),
        ("K", KIB),
        ("M", MIB),
        ("G", 1 << 30),
    ]
    .iter()
    .find_map(|(suf, m)| t.strip_suffix(suf).map(|n| (n.to_string(), *m)))
    .unwrap_or((t.clone(), 1));
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| format!("not a size: {s:?} (examples: 4096, 4K, 64KiB, 16M)"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("size too large: {s:?}"))
}

/// Formats a size the way the peer scripts do (`4KiB`, `64MiB`).
pub fn fmt_size(n: u64) -> String {
    if n >= MIB && n % MIB == 0 {
        format!("{}MiB", n / MIB)
    } else if n >= KIB && n % KIB == 0 {
        format!("{}KiB", n / KIB)
    } else {
        format!("{n}B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_format() {
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("16m"), Ok(16 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999999999G").is_err());
        assert_eq!(fmt_size(4096), "4KiB");
        assert_eq!(fmt_size(64 << 20), "64MiB");
        assert_eq!(fmt_size(100), "100B");
    }

    #[test]
    fn plans_are_valid_and_sized() {
        let f = Plan::full();
        f.validate().unwrap();
        assert_eq!(f.data_region_len(), 512 << 20);
        assert_eq!(f.kv_round_bytes(), 384 << 20);
        let q = Plan::quick();
        q.validate().unwrap();
        assert!(q.data_region_len() >= 8 << 20);
        let mut bad = Plan::quick();
        bad.sizes = vec![4095];
        assert!(bad.validate().is_err());
        let mut bad = Plan::quick();
        bad.kv_blocks = 65;
        assert!(bad.validate().is_err());
    }
}

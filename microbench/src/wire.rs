//! The two small records the bench's initiator and target exchange through the engine.
//!
//! * A [`Tag`] names ranges of the target's data region and the CRC-32 of their bytes
//!   (concatenated in the order listed), so the target can check what landed. The serial and
//!   batch phases send no notification with their timed writes: after the writes completed
//!   they send the record of all of them as tags of a batch with no writes, outside the timed
//!   section. Each KV layer carries its own tag, as the connector's layer writes do.
//! * A [`Verdict`] is what the target found. It lives at the start of the target's control
//!   region; the initiator fetches it with an engine `read`. It ends with its own CRC-32, so
//!   a copy torn by a concurrent update is recognised and fetched again.
//!
//! Both decoders take bytes from the network: they return typed errors, never panic.

/// First bytes of every tag.
pub const TAG_MAGIC: [u8; 4] = *b"KVWB";
/// First bytes of every verdict.
pub const VERDICT_MAGIC: [u8; 4] = *b"KVWV";
/// Version of both records.
pub const WIRE_VERSION: u8 = 2;
/// Most writes in one batch or KV layer (the plan's bound).
pub const MAX_RANGES: usize = 64;
/// Most ranges one tag may carry: a record of the writes since the last verdict is split
/// into tags of at most this many ranges, each within the engine's notification size limit.
pub const MAX_TAG_RANGES: usize = 4000;
/// Bytes of a tag before its ranges.
pub const TAG_HEADER_LEN: usize = 36;

const _: () =
    assert!(TAG_HEADER_LEN + 16 * MAX_TAG_RANGES <= kvwire_transfer::wire::MAX_TAG as usize);
const _: () = assert!(MAX_RANGES <= MAX_TAG_RANGES);
/// Encoded length of a verdict.
pub const VERDICT_LEN: usize = 96;

/// What a record decoder rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the record needs.
    #[error("record too short: {got} bytes, need {need}")]
    Short {
        /// Bytes received.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// The record does not start with the expected magic (e.g. not written yet).
    #[error("bad magic")]
    BadMagic,
    /// A version this build does not speak.
    #[error("unsupported record version {0}")]
    Version(u8),
    /// More ranges than [`MAX_TAG_RANGES`].
    #[error("too many ranges: {0}")]
    TooManyRanges(usize),
    /// Bytes after the end of the record.
    #[error("record length {got} does not match its content ({want})")]
    Length {
        /// Bytes received.
        got: usize,
        /// Bytes the header announces.
        want: usize,
    },
    /// The record's own checksum does not match (a torn copy).
    #[error("record checksum mismatch")]
    Torn,
    /// An unknown phase number.
    #[error("unknown phase {0}")]
    Phase(u8),
}

/// The measurement phase a batch belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// One write in flight at a time.
    Serial = 1,
    /// Batches of several writes.
    Batch = 2,
    /// The KV-layer pattern (also its warm-up round).
    KvLayer = 3,
    /// A control write that only asks the target to finish verifying (no data ranges).
    Flush = 4,
    /// Connection warm-up.
    Warmup = 5,
}

impl Phase {
    /// The phase for its wire number.
    pub fn from_u8(v: u8) -> Result<Phase, WireError> {
        Ok(match v {
            1 => Phase::Serial,
            2 => Phase::Batch,
            3 => Phase::KvLayer,
            4 => Phase::Flush,
            5 => Phase::Warmup,
            other => return Err(WireError::Phase(other)),
        })
    }
}

/// One `(offset, len)` range of the target's data region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// Offset in the target's data region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// The notification attached to a measured batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tag {
    /// Identifies the initiator's run; the target keeps one set of counters per run.
    pub run: u64,
    /// Phase of the batch.
    pub phase: Phase,
    /// Batch number within the run (unique, increasing).
    pub seq: u64,
    /// When non-zero: the number of tags the initiator has sent so far in this run,
    /// including this one. The target verifies everything it holds until it has seen
    /// that many, then publishes its verdict.
    pub flush_total: u64,
    /// CRC-32 of the bytes of `ranges`, concatenated in order.
    pub crc: u32,
    /// The ranges of the target's data region this batch wrote.
    pub ranges: Vec<Range>,
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

impl Tag {
    /// Encodes the tag.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(TAG_HEADER_LEN + 16 * self.ranges.len());
        out.extend_from_slice(&TAG_MAGIC);
        out.push(WIRE_VERSION);
        out.push(self.phase as u8);
        out.extend_from_slice(&(self.ranges.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.run.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.flush_total.to_le_bytes());
        out.extend_from_slice(&self.crc.to_le_bytes());
        for r in &self.ranges {
            out.extend_from_slice(&r.offset.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
        }
        out
    }

    /// Decodes a tag received from the network.
    pub fn decode(b: &[u8]) -> Result<Tag, WireError> {
        if b.len() < TAG_HEADER_LEN {
            return Err(WireError::Short {
                got: b.len(),
                need: TAG_HEADER_LEN,
            });
        }
        if b[..4] != TAG_MAGIC {
            return Err(WireError::BadMagic);
        }
        if b[4] != WIRE_VERSION {
            return Err(WireError::Version(b[4]));
        }
        let phase = Phase::from_u8(b[5])?;
        let n = u16::from_le_bytes([b[6], b[7]]) as usize;
        if n > MAX_TAG_RANGES {
            return Err(WireError::TooManyRanges(n));
        }
        let want = TAG_HEADER_LEN + 16 * n;
        if b.len() != want {
            return Err(WireError::Length { got: b.len(), want });
        }
        let ranges = (0..n)
            .map(|i| {
                let at = TAG_HEADER_LEN + 16 * i;
                Range {
                    offset: u64_at(b, at),
                    len: u64_at(b, at + 8),
                }
            })
            .collect();
        Ok(Tag {
            run: u64_at(b, 8),
            phase,
            seq: u64_at(b, 16),
            flush_total: u64_at(b, 24),
            crc: u32_at(b, 32),
            ranges,
        })
    }
}

/// What the target found for one run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// The run these counters belong to.
    pub run: u64,
    /// Tags received (decoded) for this run.
    pub tags_seen: u64,
    /// Tags whose ranges were checked.
    pub verified_tags: u64,
    /// Bytes checked.
    pub verified_bytes: u64,
    /// Tags whose CRC did not match the bytes in the region.
    pub mismatches: u64,
    /// Notifications that could not be decoded or named ranges outside the region
    /// (counted for the most recent run).
    pub bad_tags: u64,
    /// First mismatch: phase number (0 = none).
    pub first_bad_phase: u8,
    /// First mismatch: sequence number.
    pub first_bad_seq: u64,
    /// First mismatch: CRC the tag announced.
    pub first_bad_expected: u32,
    /// First mismatch: CRC of the bytes found.
    pub first_bad_actual: u32,
    /// The target process's CPU time (all threads) when it published this verdict, ns;
    /// 0 where its clock could not be read.
    pub cpu_ns: u64,
    /// Of that, the CPU its verifier thread spent (checking, polling), ns: the bench's own
    /// work, not the transfer's.
    pub checker_cpu_ns: u64,
}

impl Verdict {
    /// Encodes the verdict, its CRC-32 last.
    pub fn encode(&self) -> [u8; VERDICT_LEN] {
        let mut out = [0u8; VERDICT_LEN];
        out[..4].copy_from_slice(&VERDICT_MAGIC);
        out[4] = WIRE_VERSION;
        out[5] = self.first_bad_phase;
        let mut at = 8;
        for v in [
            self.run,
            self.tags_seen,
            self.verified_tags,
            self.verified_bytes,
            self.mismatches,
            self.bad_tags,
            self.first_bad_seq,
        ] {
            out[at..at + 8].copy_from_slice(&v.to_le_bytes());
            at += 8;
        }
        out[at..at + 4].copy_from_slice(&self.first_bad_expected.to_le_bytes());
        out[at + 4..at + 8].copy_from_slice(&self.first_bad_actual.to_le_bytes());
        at += 8;
        for v in [self.cpu_ns, self.checker_cpu_ns] {
            out[at..at + 8].copy_from_slice(&v.to_le_bytes());
            at += 8;
        }
        // 8 + 56 + 8 + 16 = 88; bytes 88..92 reserved (zero)
        let crc = crc32fast::hash(&out[..VERDICT_LEN - 4]);
        debug_assert!(at <= VERDICT_LEN - 4);
        out[VERDICT_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes a verdict fetched from the target.
    pub fn decode(b: &[u8]) -> Result<Verdict, WireError> {
        if b.len() < VERDICT_LEN {
            return Err(WireError::Short {
                got: b.len(),
                need: VERDICT_LEN,
            });
        }
        let b = &b[..VERDICT_LEN];
        if b[..4] != VERDICT_MAGIC {
            return Err(WireError::BadMagic);
        }
        if b[4] != WIRE_VERSION {
            return Err(WireError::Version(b[4]));
        }
        if crc32fast::hash(&b[..VERDICT_LEN - 4]) != u32_at(b, VERDICT_LEN - 4) {
            return Err(WireError::Torn);
        }
        Ok(Verdict {
            first_bad_phase: b[5],
            run: u64_at(b, 8),
            tags_seen: u64_at(b, 16),
            verified_tags: u64_at(b, 24),
            verified_bytes: u64_at(b, 32),
            mismatches: u64_at(b, 40),
            bad_tags: u64_at(b, 48),
            first_bad_seq: u64_at(b, 56),
            first_bad_expected: u32_at(b, 64),
            first_bad_actual: u32_at(b, 68),
            cpu_ns: u64_at(b, 72),
            checker_cpu_ns: u64_at(b, 80),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag() -> Tag {
        Tag {
            run: 0xDEAD_BEEF,
            phase: Phase::KvLayer,
            seq: 77,
            flush_total: 78,
            crc: 0x1234_5678,
            ranges: (0..32)
                .map(|i| Range {
                    offset: i * 262_144,
                    len: 262_144,
                })
                .collect(),
        }
    }

    #[test]
    fn tag_roundtrip() {
        let t = tag();
        let b = t.encode();
        assert_eq!(b.len(), TAG_HEADER_LEN + 32 * 16);
        assert_eq!(Tag::decode(&b), Ok(t));
    }

    #[test]
    fn tag_rejects_malformed_input() {
        let b = tag().encode();
        assert!(matches!(
            Tag::decode(&b[..10]),
            Err(WireError::Short { .. })
        ));
        assert!(matches!(
            Tag::decode(&b[..b.len() - 1]),
            Err(WireError::Length { .. })
        ));
        let mut x = b.clone();
        x.push(0);
        assert!(matches!(Tag::decode(&x), Err(WireError::Length { .. })));
        let mut x = b.clone();
        x[0] = b'X';
        assert_eq!(Tag::decode(&x), Err(WireError::BadMagic));
        let mut x = b.clone();
        x[4] = 9;
        assert_eq!(Tag::decode(&x), Err(WireError::Version(9)));
        let mut x = b.clone();
        x[5] = 200;
        assert_eq!(Tag::decode(&x), Err(WireError::Phase(200)));
        let mut x = b.clone();
        x[6] = 0xFF;
        x[7] = 0xFF;
        assert_eq!(Tag::decode(&x), Err(WireError::TooManyRanges(0xFFFF)));
        // every truncation and every single-byte corruption of the header decodes or
        // errors, never panics
        for cut in 0..b.len() {
            let _ = Tag::decode(&b[..cut]);
        }
        for i in 0..TAG_HEADER_LEN {
            let mut x = b.clone();
            x[i] ^= 0xA5;
            let _ = Tag::decode(&x);
        }
    }

    #[test]
    fn verdict_roundtrip_and_torn_copy() {
        let v = Verdict {
            run: 5,
            tags_seen: 10,
            verified_tags: 9,
            verified_bytes: 1 << 30,
            mismatches: 1,
            bad_tags: 2,
            first_bad_phase: 2,
            first_bad_seq: 4,
            first_bad_expected: 0xAAAA_5555,
            first_bad_actual: 0x5555_AAAA,
            cpu_ns: 7_000_000_123,
            checker_cpu_ns: 1_000_000_321,
        };
        let b = v.encode();
        assert_eq!(Verdict::decode(&b), Ok(v.clone()));
        for i in 5..VERDICT_LEN {
            let mut x = b;
            x[i] ^= 1;
            assert_eq!(Verdict::decode(&x), Err(WireError::Torn), "byte {i}");
        }
        assert_eq!(
            Verdict::decode(&[0u8; VERDICT_LEN]),
            Err(WireError::BadMagic)
        );
        assert!(matches!(
            Verdict::decode(&b[..20]),
            Err(WireError::Short { .. })
        ));
    }
}

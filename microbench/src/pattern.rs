//! Seeded data patterns and their checksums.
//!
//! Every operation of the bench writes bytes generated from its own seed (derived from the
//! run, the phase, the sequence number and the operation's index in its batch), so data of
//! two different operations never coincide and a write that landed at the wrong place, only
//! partly, or not at all is caught by the CRC-32 the target computes over what it holds.
//!
//! The generator (`kvwire_testkit::pattern`, re-exported as [`fill`]) is seekable, so any chunk
//! of an operation's data can be produced on its own: data are generated, checksummed and
//! copied into the engine's region in [`CHUNK`]-sized pieces that stay in cache.

use kvwire_testkit::rng::{mix, GOLDEN};
use kvwire_transfer::{Engine, RegionHandle};

/// Bytes generated, checksummed and copied at a time.
pub const CHUNK: usize = 1 << 20;

/// The seed of one operation's data.
///
/// `run` identifies the bench run, `phase` the measurement phase, `seq` the batch (or
/// serial operation) number within the run and `index` the operation's place in its batch.
pub fn op_seed(run: u64, phase: u8, seq: u64, index: u32) -> u64 {
    mix(run ^ mix(((phase as u64) << 56) ^ seq.wrapping_mul(GOLDEN) ^ ((index as u64) << 20)))
}

/// Fills a buffer with the bytes of a seeded stream from a given position (the testkit's byte
/// pattern: seekable, one XOR per word).
pub use kvwire_testkit::pattern::fill;

/// Generates `len` bytes of the stream `seed`, writes them into `region` at `offset`, and
/// returns the CRC-32 state of those bytes (so callers can combine it into a batch CRC).
///
/// `scratch` is a reusable buffer (grown to [`CHUNK`] bytes when needed).
pub fn stage(
    engine: &Engine,
    region: RegionHandle,
    offset: u64,
    len: u64,
    seed: u64,
    scratch: &mut Vec<u8>,
) -> Result<crc32fast::Hasher, kvwire_transfer::Error> {
    if scratch.len() < CHUNK {
        scratch.resize(CHUNK, 0);
    }
    let mut h = crc32fast::Hasher::new();
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(CHUNK as u64) as usize;
        let buf = &mut scratch[..n];
        fill(buf, seed, done);
        h.update(buf);
        engine.local_write(region, offset + done, buf)?;
        done += n as u64;
    }
    Ok(h)
}

/// Updates `h` with `len` bytes of `region` starting at `offset` (read through the engine
/// in [`CHUNK`]-sized pieces).
pub fn crc_region(
    engine: &Engine,
    region: RegionHandle,
    offset: u64,
    len: u64,
    h: &mut crc32fast::Hasher,
    scratch: &mut Vec<u8>,
) -> Result<(), kvwire_transfer::Error> {
    if scratch.len() < CHUNK {
        scratch.resize(CHUNK, 0);
    }
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(CHUNK as u64) as usize;
        let buf = &mut scratch[..n];
        engine.local_read(region, offset + done, buf)?;
        h.update(buf);
        done += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_differ_per_op() {
        let a = op_seed(1, 1, 7, 0);
        assert_ne!(a, op_seed(1, 1, 8, 0));
        assert_ne!(a, op_seed(1, 2, 7, 0));
        assert_ne!(a, op_seed(1, 1, 7, 1));
        assert_ne!(a, op_seed(2, 1, 7, 0));
        let mut x = vec![0u8; 4096];
        let mut y = vec![0u8; 4096];
        fill(&mut x, a, 0);
        fill(&mut y, op_seed(1, 1, 8, 0), 0);
        assert_ne!(x, y);
        // every 8-byte word of one op's data differs from the same word of the next op
        assert!(x.chunks(8).zip(y.chunks(8)).all(|(p, q)| p != q));
    }
}

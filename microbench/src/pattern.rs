//! Seeded data patterns and their checksums.
//!
//! Every operation of the bench writes bytes generated from its own seed (derived from the
//! run, the phase, the sequence number and the operation's index in its batch), so data of
//! two different operations never coincide and a write that landed at the wrong place, only
//! partly, or not at all is caught by the CRC-32 the target computes over what it holds.
//!
//! The generator is seekable (see [`fill`]), so any chunk of an operation's data can be
//! produced on its own: data are generated, checksummed and copied
//! into the engine's region in [`CHUNK`]-sized pieces that stay in cache.

use kvwire_transfer::{Engine, RegionHandle};

/// Bytes generated, checksummed and copied at a time.
pub const CHUNK: usize = 1 << 20;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 finaliser: a good 64-bit mixer.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of one operation's data.
///
/// `run` identifies the bench run, `phase` the measurement phase, `seq` the batch (or
/// serial operation) number within the run and `index` the operation's place in its batch.
pub fn op_seed(run: u64, phase: u8, seq: u64, index: u32) -> u64 {
    mix(run ^ mix(((phase as u64) << 56) ^ seq.wrapping_mul(GOLDEN) ^ ((index as u64) << 20)))
}

/// Words per pattern page.
const PAGE_WORDS: usize = 512;

/// Fills `buf` with the bytes found at byte `start` of the stream defined by `seed`.
///
/// Word `w` of the stream is `base[w % 512] ^ page(w / 512)`, where the 4 KiB `base` block
/// and the per-page constants both come from SplitMix64 of the seed: every page differs
/// from every other page and from every page of another seed, and filling runs at memory
/// speed (one XOR per word). `start` must be a multiple of 8 (every caller moves through a
/// stream in whole chunks).
pub fn fill(buf: &mut [u8], seed: u64, start: u64) {
    debug_assert_eq!(start % 8, 0, "pattern streams are read in whole words");
    let mut base = [0u64; PAGE_WORDS];
    for (i, b) in base.iter_mut().enumerate() {
        *b = mix(seed.wrapping_add((i as u64 + 1).wrapping_mul(GOLDEN)));
    }
    let page_const = |page: u64| mix(mix(seed ^ 0x5EED) ^ page.wrapping_mul(GOLDEN));
    let mut word = start / 8;
    let mut out = buf;
    while !out.is_empty() {
        let in_page = (word % PAGE_WORDS as u64) as usize;
        let c = page_const(word / PAGE_WORDS as u64);
        let n_words = PAGE_WORDS - in_page;
        let n_bytes = (n_words * 8).min(out.len());
        let (head, tail) = out.split_at_mut(n_bytes);
        let mut chunks = head.chunks_exact_mut(8);
        for (dst, b) in (&mut chunks).zip(&base[in_page..]) {
            dst.copy_from_slice(&(b ^ c).to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let k = in_page + n_bytes / 8;
            let w = (base[k] ^ c).to_le_bytes();
            let n = rest.len();
            rest.copy_from_slice(&w[..n]);
        }
        word += n_words as u64;
        out = tail;
    }
}

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
    fn fill_is_seekable() {
        let mut whole = vec![0u8; 4096 + 13];
        fill(&mut whole, 42, 0);
        let mut part = vec![0u8; 1024 + 13];
        fill(&mut part, 42, 3072);
        assert_eq!(&whole[3072..], &part[..]);
    }

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

    #[test]
    fn pattern_is_not_trivial() {
        let mut x = vec![0u8; 1 << 16];
        fill(&mut x, 9, 0);
        let zeros = x.iter().filter(|&&b| b == 0).count();
        // about 1/256 of random bytes are zero; a constant or sparse fill would fail this
        assert!(zeros < x.len() / 64, "{zeros} zero bytes");
        let mut words: Vec<&[u8]> = x.chunks(8).collect();
        words.sort();
        words.dedup();
        assert_eq!(words.len(), x.len() / 8, "words repeat within one op");
    }
}

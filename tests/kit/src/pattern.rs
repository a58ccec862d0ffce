//! The seeded byte pattern that tests and benches write and check: one stream of bytes per
//! seed, seekable, so any sub-range can be produced (and checked) on its own.
//!
//! Word `w` (bytes `8w..8w+8`, little endian) of the stream `seed` is `base[w % 512] ^
//! page(w / 512)`, where the 4 KiB `base` block and the per-page constants both come from
//! splitmix64 ([`mix`]) of the seed: every page differs from every other page and from every
//! page of another seed, and [`fill`] runs at memory speed (one XOR per word).

use crate::rng::{mix, GOLDEN};

/// Words per pattern page.
const PAGE_WORDS: usize = 512;

fn base_word(seed: u64, i: u64) -> u64 {
    mix(seed.wrapping_add((i + 1).wrapping_mul(GOLDEN)))
}

fn page_const(seed: u64, page: u64) -> u64 {
    mix(mix(seed ^ 0x5EED) ^ page.wrapping_mul(GOLDEN))
}

fn word(seed: u64, w: u64) -> u64 {
    base_word(seed, w % PAGE_WORDS as u64) ^ page_const(seed, w / PAGE_WORDS as u64)
}

/// Fills `buf` with the bytes found at byte `start` of the stream defined by `seed`.
pub fn fill(buf: &mut [u8], seed: u64, start: u64) {
    let mut out = buf;
    let skip = (start % 8) as usize;
    let mut w = start / 8;
    if skip != 0 && !out.is_empty() {
        // A stream read from the middle of a word: its tail first.
        let bytes = word(seed, w).to_le_bytes();
        let n = (8 - skip).min(out.len());
        let (head, tail) = out.split_at_mut(n);
        head.copy_from_slice(&bytes[skip..skip + n]);
        out = tail;
        w += 1;
    }
    let mut base = [0u64; PAGE_WORDS];
    for (i, b) in base.iter_mut().enumerate() {
        *b = base_word(seed, i as u64);
    }
    while !out.is_empty() {
        let in_page = (w % PAGE_WORDS as u64) as usize;
        let c = page_const(seed, w / PAGE_WORDS as u64);
        let n_words = PAGE_WORDS - in_page;
        let n_bytes = (n_words * 8).min(out.len());
        let (head, tail) = out.split_at_mut(n_bytes);
        let mut chunks = head.chunks_exact_mut(8);
        for (dst, b) in (&mut chunks).zip(&base[in_page..]) {
            dst.copy_from_slice(&(b ^ c).to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let last = (base[in_page + n_bytes / 8] ^ c).to_le_bytes();
            let n = rest.len();
            rest.copy_from_slice(&last[..n]);
        }
        w += n_words as u64;
        out = tail;
    }
}

/// `len` bytes of the stream `seed` from byte `start`.
pub fn bytes(seed: u64, start: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed, start);
    v
}

/// The byte at position `pos` of the stream `seed`.
pub fn at(seed: u64, pos: u64) -> u8 {
    word(seed, pos / 8).to_le_bytes()[(pos % 8) as usize]
}

/// The index of the first byte of `data` that differs from the stream `seed` read from
/// `start`, if any.
pub fn mismatch(seed: u64, start: u64, data: &[u8]) -> Option<usize> {
    let want = bytes(seed, start, data.len());
    data.iter().zip(&want).position(|(a, b)| a != b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seekable_from_any_byte() {
        let whole = bytes(42, 0, 3 * 4096 + 13);
        for start in [0usize, 1, 7, 8, 4095, 4096, 4100, 3 * 4096] {
            assert_eq!(bytes(42, start as u64, whole.len() - start), whole[start..]);
            assert_eq!(at(42, start as u64), whole[start]);
        }
        assert_eq!(bytes(42, 5, 2), whole[5..7]);
        assert_eq!(mismatch(42, 100, &whole[100..]), None);
        let mut bad = whole[100..200].to_vec();
        bad[17] ^= 1;
        assert_eq!(mismatch(42, 100, &bad), Some(17));
    }

    #[test]
    fn pattern_is_not_trivial() {
        let x = bytes(9, 0, 1 << 16);
        let zeros = x.iter().filter(|&&b| b == 0).count();
        // about 1/256 of random bytes are zero; a constant or sparse fill would fail this
        assert!(zeros < x.len() / 64, "{zeros} zero bytes");
        let mut words: Vec<&[u8]> = x.chunks(8).collect();
        words.sort();
        words.dedup();
        assert_eq!(words.len(), x.len() / 8, "words repeat within one stream");
        let y = bytes(10, 0, 1 << 16);
        assert!(x.chunks(8).zip(y.chunks(8)).all(|(p, q)| p != q));
    }
}

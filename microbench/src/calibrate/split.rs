//! The split of records into a training and a held-out part, by request id.

use super::records::Sample;

/// Percent of request-id hashes that go to the training part.
pub const TRAIN_PERCENT: u64 = 80;
/// Fewest training records a fit accepts.
pub const MIN_TRAIN: usize = 10;
/// Fewest held-out records a fit accepts.
pub const MIN_HELD_OUT: usize = 2;

/// Whether a request id belongs to the training part (see the module docs).
pub fn is_train(id: &str) -> bool {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // splitmix64 finaliser: spreads consecutive ids evenly.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    h % 100 < TRAIN_PERCENT
}

/// Splits samples into (training, held-out) by request id.
pub fn split(samples: &[Sample]) -> (Vec<Sample>, Vec<Sample>) {
    samples.iter().cloned().partition(|s| is_train(&s.id))
}

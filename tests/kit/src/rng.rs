//! A small seeded PRNG (xoshiro256**, seeded through splitmix64): reproducible across runs and
//! platforms, no dependency. Also the splitmix64 finaliser ([`mix`]) that the byte patterns
//! ([`crate::pattern`]) are built from.

/// The 64-bit golden ratio, splitmix64's increment.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 finaliser: a good 64-bit mixer (a bijection; nearby inputs come out
/// unrelated).
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Seeded pseudo-random generator.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator fully determined by `seed`.
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(GOLDEN);
            mix(x)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`.
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[lo, hi]` (inclusive); `lo` when `hi <= lo`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.f64() < p
    }

    /// Exponentially distributed with the given mean (for Poisson arrivals).
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.f64()).ln()
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.f64().max(1e-300);
        let u2 = self.f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(Rng::new(7).next_u64(), Rng::new(8).next_u64());
    }

    #[test]
    fn ranges_and_moments() {
        let mut r = Rng::new(3);
        let n = 20_000;
        let (mut sum, mut sq, mut e) = (0.0, 0.0, 0.0);
        for _ in 0..n {
            let v = r.range(5, 9);
            assert!((5..=9).contains(&v));
            let x = r.normal();
            sum += x;
            sq += x * x;
            e += r.exp(2.0);
        }
        let n = f64::from(n);
        assert!((sum / n).abs() < 0.05, "normal mean {}", sum / n);
        assert!((sq / n - 1.0).abs() < 0.05, "normal variance {}", sq / n);
        assert!((e / n - 2.0).abs() < 0.1, "exp mean {}", e / n);
        assert_eq!(r.range(4, 4), 4);
        assert_eq!(r.range(4, 1), 4);
    }
}

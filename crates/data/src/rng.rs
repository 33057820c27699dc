//! The crate's own seeded random numbers: SplitMix64 and a Fisher–Yates shuffle, written out here
//! (not taken from `rand`) so that the eval split and the epoch orders are part of the crate's
//! contract and cannot change with a dependency's version.
//!
//! * `mix64(x)`: the SplitMix64 finaliser
//!   (`z = (x ^ x>>30) * 0xbf58476d1ce4e5b9; z = (z ^ z>>27) * 0x94d049bb133111eb; z ^ z>>31`).
//! * A stream for (`seed`, `purpose`, `index`) starts SplitMix64 (increment `0x9e3779b97f4a7c15`,
//!   output `mix64(state)`) from the state `mix64(mix64(seed ^ purpose) ^ index)`.
//! * A draw below `n` is Lemire's unbiased multiply-shift: `x * n >> 64`, redrawing `x` while the
//!   low 64 bits of the product are below `2^64 mod n`.
//! * `shuffle` is Fisher–Yates from the back: for `i = len-1 .. 1`, swap `i` with a draw below
//!   `i + 1`.

/// Purpose tag of the eval split stream.
pub(crate) const PURPOSE_SPLIT: u64 = 0x7370_6c69_7400_0000; // "split"
/// Purpose tag of the epoch-order streams (index = epoch).
pub(crate) const PURPOSE_EPOCH: u64 = 0x6570_6f63_6800_0000; // "epoch"

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The SplitMix64 finaliser.
pub(crate) fn mix64(x: u64) -> u64 {
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A SplitMix64 generator.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// The stream for (`seed`, `purpose`, `index`).
    pub(crate) fn stream(seed: u64, purpose: u64, index: u64) -> Self {
        SplitMix64 { state: mix64(mix64(seed ^ purpose) ^ index) }
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix64(self.state)
    }

    /// A uniform draw in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(n);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }

    /// Shuffles `v` in place (Fisher–Yates from the back).
    pub(crate) fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            // `below(i + 1) <= i`, which is a usize.
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // Reference values of SplitMix64 seeded with state 1234567 (Vigna's splitmix64.c).
        let mut r = SplitMix64 { state: 1_234_567 };
        let got: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        assert_eq!(got, [6_457_827_717_110_365_317, 3_203_168_211_198_807_973, 9_817_491_932_198_370_423]);
    }

    #[test]
    fn below_is_in_range_and_roughly_uniform() {
        let mut r = SplitMix64::stream(7, PURPOSE_SPLIT, 0);
        let mut counts = [0usize; 5];
        for _ in 0..50_000 {
            counts[r.below(5) as usize] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn shuffle_is_a_deterministic_permutation() {
        let shuffled = |seed| {
            let mut v: Vec<u32> = (0..100).collect();
            SplitMix64::stream(seed, PURPOSE_EPOCH, 3).shuffle(&mut v);
            v
        };
        let a = shuffled(1);
        assert_eq!(a, shuffled(1));
        assert_ne!(a, shuffled(2));
        assert_ne!(a, (0..100).collect::<Vec<_>>());
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
    }
}

//! Deterministic random parameters and batches for tests, from a self-contained PRNG
//! (splitmix64 + Box-Muller) so the values never change with a dependency's version.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use mt_core::{ModelConfig, ModelLayout};

use crate::reference::IGNORE_INDEX;

/// The splitmix64 generator (Steele, Lea, Flood 2014): 64-bit state, one add and a mix per draw.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator started at `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `[0, n)` (`n > 0`), by multiply-high.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Standard normal by Box-Muller (one value per pair of uniforms).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]: ln is finite
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// FNV-1a hash of a name, to give every tensor its own stream.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3))
}

/// Deterministic f32 parameters for every tensor of the layout, by HF name: matrices
/// `N(0, 0.02)`, norm weights `1 + 0.1 N(0, 1)`, biases `0.02 N(0, 1)`. Each tensor draws from its
/// own stream seeded by `seed` and its name, so a tensor's values do not depend on which other
/// tensors the config has.
pub fn random_params(cfg: &ModelConfig, seed: u64) -> BTreeMap<String, Tensor> {
    let layout = ModelLayout::new(cfg);
    let mut params = BTreeMap::new();
    for (name, _, spec) in layout.all_params() {
        let mut rng = SplitMix64::new(seed ^ fnv1a(&name));
        // Biases and matrices share the 0.02 scale; norm weights sit around 1.
        let (shift, scale) = if name.ends_with("norm.weight") { (1.0, 0.1) } else { (0.0, 0.02) };
        let values: Vec<f32> = (0..spec.numel()).map(|_| (shift + scale * rng.normal()) as f32).collect();
        let t = Tensor::from_vec(values, spec.shape.as_slice(), &Device::Cpu)
            .expect("element count equals the product of the layout shape");
        params.insert(name, t);
    }
    params
}

/// A deterministic f32 tensor of standard normals with the given shape, on the CPU: what tests
/// use instead of `Tensor::randn`, whose CPU generator cannot be seeded.
pub fn randn(shape: impl Into<candle_core::Shape>, seed: u64) -> Tensor {
    let shape = shape.into();
    let mut rng = SplitMix64::new(seed);
    let values: Vec<f32> = (0..shape.elem_count()).map(|_| rng.normal() as f32).collect();
    Tensor::from_vec(values, shape, &Device::Cpu).expect("element count equals the shape's")
}

/// A deterministic batch: `batch * seq` token ids uniform in `[0, vocab)` (row-major) and
/// next-token targets (`targets[b, t] = ids[b, t + 1]`, -100 at each row's last position), of
/// which `round(mask_frac * n)` of the `n` real targets are then set to -100 at random.
///
/// # Panics
/// If `mask_frac` is not within `[0, 1]`.
pub fn random_batch(
    cfg: &ModelConfig,
    batch: usize,
    seq: usize,
    seed: u64,
    mask_frac: f64,
) -> (Vec<u32>, Vec<i64>) {
    assert!((0.0..=1.0).contains(&mask_frac), "mask_frac must be within [0, 1], got {mask_frac}");
    let mut rng = SplitMix64::new(seed);
    let ids: Vec<u32> = (0..batch * seq).map(|_| rng.below(cfg.vocab_size as u64) as u32).collect();
    let mut targets = vec![IGNORE_INDEX; batch * seq];
    let mut real = Vec::new();
    for b in 0..batch {
        for t in 0..seq.saturating_sub(1) {
            targets[b * seq + t] = i64::from(ids[b * seq + t + 1]);
            real.push(b * seq + t);
        }
    }
    let n_mask = (mask_frac * real.len() as f64).round() as usize;
    // Partial Fisher-Yates: the first n_mask entries become a uniform random subset.
    for i in 0..n_mask {
        let j = i + rng.below((real.len() - i) as u64) as usize;
        real.swap(i, j);
        targets[real[i]] = IGNORE_INDEX;
    }
    (ids, targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn randn_is_seeded_and_shaped() {
        let a = randn((3, 5), 7).to_vec2::<f32>().unwrap();
        assert_eq!(a, randn((3, 5), 7).to_vec2::<f32>().unwrap());
        assert_ne!(a, randn((3, 5), 8).to_vec2::<f32>().unwrap());
        let big = randn(40_000, 1).to_vec1::<f32>().unwrap();
        let mean = big.iter().map(|&x| f64::from(x)).sum::<f64>() / big.len() as f64;
        let var = big.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / big.len() as f64;
        assert!(mean.abs() < 0.02 && (var - 1.0).abs() < 0.03, "mean {mean} var {var}");
    }

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // First outputs of splitmix64 seeded with 1234567 (Vigna's reference implementation).
        let mut r = SplitMix64::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
    }

    #[test]
    fn normals_have_unit_variance() {
        let mut r = SplitMix64::new(9);
        let n = 20_000;
        let xs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "mean {mean}, var {var}");
    }

    #[test]
    fn params_are_deterministic_and_follow_the_init_rules() {
        let cfg = ModelConfig::tiny_llama();
        let a = random_params(&cfg, 1);
        let b = random_params(&cfg, 1);
        let c = random_params(&cfg, 2);
        crate::tol::assert_bitwise_eq(&a, &b, "same seed");
        assert_eq!(a.len(), ModelLayout::new(&cfg).all_params().len());
        let stats = |name: &str| {
            let v = crate::tol::to_f64_vec(&a[name]).unwrap();
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            (mean, (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt())
        };
        let (m, s) = stats("model.layers.0.mlp.up_proj.weight");
        assert!(m.abs() < 2e-3 && (s - 0.02).abs() < 1e-3, "matrix mean {m} std {s}");
        let (m, s) = stats("model.norm.weight");
        assert!((m - 1.0).abs() < 0.05 && (s - 0.1).abs() < 0.03, "norm mean {m} std {s}");
        assert!(crate::tol::rel_err(&c["model.norm.weight"], &a["model.norm.weight"]).unwrap() > 0.01);
    }

    #[test]
    fn batch_targets_are_next_tokens_with_the_requested_masking() {
        let cfg = ModelConfig::tiny_llama();
        let (ids, targets) = random_batch(&cfg, 3, 9, 5, 0.0);
        assert!(ids.iter().all(|&i| (i as usize) < cfg.vocab_size));
        for b in 0..3 {
            for t in 0..8 {
                assert_eq!(targets[b * 9 + t], i64::from(ids[b * 9 + t + 1]));
            }
            assert_eq!(targets[b * 9 + 8], IGNORE_INDEX);
        }
        let (ids2, masked) = random_batch(&cfg, 3, 9, 5, 0.25);
        assert_eq!(ids2, ids);
        assert_eq!(masked.iter().filter(|&&y| y == IGNORE_INDEX).count(), 3 + 6); // round(0.25 * 24)
        for (m, t) in masked.iter().zip(&targets) {
            assert!(*m == IGNORE_INDEX || m == t);
        }
    }
}

//! Seeded, deterministic model initialisation written straight into the host store: matrices
//! (embeddings, projections, LM head) ~ N(0, 0.02²), norm weights 1, biases 0.
//!
//! Each tensor draws from its own generator, seeded from the run seed and the tensor's HF name,
//! so a tensor's initial value does not depend on which other tensors the model has.

use mt_core::Result;
use mt_store::HostStore;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Standard deviation of the initial matrices (the `initializer_range` of HF Llama).
pub const INIT_STD: f64 = 0.02;

/// How one tensor is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum InitKind {
    /// Every element 1 (RMSNorm weights).
    Ones,
    /// Every element 0 (biases).
    Zeros,
    /// Independent normal draws with this standard deviation.
    Normal(f64),
}

/// The initialisation of the tensor called `hf_name` with `shape`.
pub fn init_kind(hf_name: &str, shape: &[usize]) -> InitKind {
    if hf_name.ends_with(".bias") {
        InitKind::Zeros
    } else if shape.len() == 1 && hf_name.ends_with("norm.weight") {
        InitKind::Ones
    } else {
        InitKind::Normal(INIT_STD)
    }
}

/// Writes the initial value of every parameter into `store` (zeroing the AdamW moments).
/// Returns the number of tensors written.
pub fn init_store(store: &HostStore, seed: u64) -> Result<usize> {
    let params = store.layout().all_params();
    for (name, _, spec) in &params {
        let n = spec.numel();
        let data = match init_kind(name, &spec.shape) {
            InitKind::Ones => vec![1.0; n],
            InitKind::Zeros => vec![0.0; n],
            InitKind::Normal(std) => {
                let mut rng = StdRng::seed_from_u64(seed ^ fnv1a(name.as_bytes()));
                normal_samples(&mut rng, n, std)
            }
        };
        store.write_param(name, &data)?;
    }
    Ok(params.len())
}

/// `n` draws from N(0, std²) by the Box–Muller transform (computed in f64, rounded to f32).
fn normal_samples(rng: &mut StdRng, n: usize, std: f64) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        // 1 - u lies in (0, 1], so the logarithm is finite.
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let theta = std::f64::consts::TAU * u2;
        out.push((r * theta.cos()) as f32);
        out.push((r * theta.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// 64-bit FNV-1a: a fixed, portable hash of a tensor name.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use mt_core::{ModelConfig, ModelLayout};
    use mt_store::GradDtype;

    use super::*;

    #[test]
    fn kinds_follow_the_names() {
        assert_eq!(init_kind("model.norm.weight", &[8]), InitKind::Ones);
        assert_eq!(init_kind("model.layers.0.input_layernorm.weight", &[8]), InitKind::Ones);
        assert_eq!(init_kind("model.layers.0.self_attn.q_norm.weight", &[8]), InitKind::Ones);
        assert_eq!(init_kind("model.layers.0.self_attn.q_proj.bias", &[8]), InitKind::Zeros);
        assert_eq!(init_kind("model.layers.0.self_attn.q_proj.weight", &[8, 8]), InitKind::Normal(INIT_STD));
        assert_eq!(init_kind("model.embed_tokens.weight", &[8, 8]), InitKind::Normal(INIT_STD));
    }

    #[test]
    fn init_is_seeded_and_has_the_right_statistics() {
        let layout = ModelLayout::new(&ModelConfig::tiny_llama());
        let a = HostStore::anonymous(&layout, GradDtype::Bf16).unwrap();
        let b = HostStore::anonymous(&layout, GradDtype::Bf16).unwrap();
        let c = HostStore::anonymous(&layout, GradDtype::Bf16).unwrap();
        assert_eq!(init_store(&a, 1).unwrap(), layout.all_params().len());
        init_store(&b, 1).unwrap();
        init_store(&c, 2).unwrap();
        let name = "model.layers.1.mlp.up_proj.weight";
        let (wa, wc) = (a.read_param(name).unwrap(), c.read_param(name).unwrap());
        assert_eq!(wa, b.read_param(name).unwrap());
        assert_ne!(wa, wc);
        let n = wa.len() as f64;
        let mean = wa.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let std = (wa.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(mean.abs() < 1e-3, "mean {mean}");
        assert!((std - INIT_STD).abs() < 1e-3, "std {std}");
        assert!(a.read_param("model.norm.weight").unwrap().iter().all(|&x| x == 1.0));
    }
}

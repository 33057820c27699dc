//! Seeded, deterministic model initialisation written straight into the host store: matrices
//! (embeddings, projections, LM head) ~ N(0, 0.02²), norm weights 1, biases 0.
//!
//! Each tensor draws from its own generators, seeded from the run seed and the tensor's HF name,
//! so a tensor's initial value does not depend on which other tensors the model has. A tensor is
//! drawn in blocks of [`INIT_BLOCK`] elements, each with its own generator, in parallel (a 3.6B
//! model initialises in seconds, not minutes); block 0's generator is the tensor's own seed.

use mt_core::Result;
use mt_store::{HostStore, ParamSink};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

/// Elements per independently seeded block of a tensor.
pub const INIT_BLOCK: usize = 1 << 20;

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

/// Writes the initial value of every parameter into `store` (the host store, zeroing its AdamW
/// moments, or a LoRA run's frozen base).
/// Returns the number of tensors written.
pub fn init_store(store: &impl ParamSink, seed: u64) -> Result<usize> {
    let params = store.layout().all_params();
    for (name, _, spec) in &params {
        let n = spec.numel();
        let data = match init_kind(name, &spec.shape) {
            InitKind::Ones => vec![1.0; n],
            InitKind::Zeros => vec![0.0; n],
            InitKind::Normal(std) => {
                let base = seed ^ fnv1a(name.as_bytes());
                let mut data = vec![0f32; n];
                data.par_chunks_mut(INIT_BLOCK).enumerate().for_each(|(b, out)| {
                    let mut rng =
                        StdRng::seed_from_u64(base ^ (b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    normal_samples(&mut rng, out, std);
                });
                data
            }
        };
        store.write_param(name, &data)?;
    }
    Ok(params.len())
}

/// Fills `out` with draws from N(0, std²): standard normals by the ziggurat method
/// (`rand_distr`'s `StandardNormal`, in f64, scaled and rounded to f32): no logarithm or sine
/// for most draws, so a random int8 base initialises in half the time it took by Box-Muller (a
/// 4-layer Llama-3 8B shape on 2 cores: 63 -> 33 s; the 70B's took ~5 minutes on 16 cores).
fn normal_samples(rng: &mut StdRng, out: &mut [f32], std: f64) {
    for x in out.iter_mut() {
        let z: f64 = rng.sample(rand_distr::StandardNormal);
        *x = (z * std) as f32;
    }
}

/// 64-bit FNV-1a: a fixed, portable hash of a tensor name.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// `megatrain init`: a seeded random model of the Hugging Face `config.json` at `config` (the
/// same values a run with [`crate::ModelChoice::Config`] and this seed starts from) written to
/// `out` as a Hugging Face directory. Only the master weights are touched, so a model needs
/// about 4 bytes per parameter of RAM.
pub fn init_model_dir(
    config: &std::path::Path,
    out: &std::path::Path,
    seed: u64,
    dtype: mt_hf::ExportDtype,
) -> crate::Result<mt_hf::ExportReport> {
    use crate::error::Context;
    let model = crate::ModelSource::load(&crate::ModelChoice::Config(config.to_owned()))?;
    let layout = mt_core::ModelLayout::new(&model.cfg);
    let store = HostStore::anonymous(&layout, mt_store::GradDtype::None)
        .context_with(|| "allocating the parameters".into())?;
    init_store(&store, seed).context_with(|| "initialising the model".into())?;
    let opts = mt_hf::ExportOptions {
        dtype,
        max_shard_bytes: mt_hf::DEFAULT_MAX_SHARD_BYTES,
        ..mt_hf::ExportOptions::default()
    };
    mt_hf::export(&store, &model.config_json, out, &opts)
        .context_with(|| format!("writing --out {}", out.display()))
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

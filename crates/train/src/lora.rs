//! A LoRA run's set-up: its adapters' configuration (the options, or a peft adapter's
//! `adapter_config.json` with `--lora-from`), the frozen base imported from the model
//! directory, the adapters' initial values (peft's: `A` kaiming-uniform, `B` zero, seeded; or the
//! adapter's), and the export (peft's format, or the merged model with `--merge`).

use std::path::Path;
use std::sync::Arc;

use mt_core::{LoraConfig, ModelConfig, ModelLayout};
use mt_store::{FrozenBase, GradDtype, HostStore};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{Context, Error, Result};
use crate::{ModelSource, TrainConfig};

/// The adapters of the run, if it is a LoRA run: `--lora-from`'s, which the other `--lora-*`
/// options may not contradict, or the options'. Refuses what is not implemented.
pub(crate) fn resolve(c: &TrainConfig, model: &ModelSource) -> Result<Option<LoraConfig>> {
    let options = c.lora.clone().map(|l| l.for_model(&model.cfg));
    let l = match (&c.lora_from, options) {
        (None, None) if c.base_dtype.is_some() => {
            return Err(Error::Options(
                "a base dtype applies to a LoRA run's frozen base, but this is not a LoRA run: give --lora-rank R (or --lora-from DIR) with it, or leave --base-dtype out".into(),
            ))
        }
        (None, None) => return Ok(None),
        (None, Some(l)) => l,
        (Some(dir), given) => {
            let l = mt_hf::peft::read_adapter_config(dir).context_with(|| "reading --lora-from".into())?;
            if let Some(g) = given {
                if (g.rank, g.alpha, &g.targets, g.rslora) != (l.rank, l.alpha, &l.targets, l.rslora) {
                    return Err(Error::Options(format!(
                        "--lora-from {} holds an adapter of rank {}, alpha {}, targets {:?}, rsLoRA {}: give no other --lora-* option, or the same",
                        dir.display(),
                        l.rank,
                        l.alpha,
                        l.targets.iter().map(|t| t.module()).collect::<Vec<_>>(),
                        l.rslora
                    )));
                }
            }
            l
        }
    };
    if l.dropout > 0.0 {
        return Err(Error::Options(format!(
            "--lora-dropout {}: dropout on the adapters' input is not implemented yet; use 0",
            l.dropout
        )));
    }
    l.check(&model.cfg).map_err(|e| Error::Options(e.to_string()))?;
    if c.ranks() > 1 {
        return Err(Error::Options("LoRA runs on one device for now: use --gpus 1 in one process".into()));
    }
    Ok(Some(LoraConfig { base: c.base_dtype(), ..l }))
}

/// The base model's config (without the adapters).
pub(crate) fn base_config(cfg: &ModelConfig) -> ModelConfig {
    ModelConfig { lora: None, ..cfg.clone() }
}

/// The frozen base weights, held in the encoding the run's LoRA config says (`--base-dtype`):
/// imported from `--model`'s directory, or, for a model given by `--config` (or the built-in
/// one), initialised
/// from `seed` as a full run's weights are ([`crate::init::init_store`]). The second is a base
/// for measuring speed and memory (a 70B's adapters need no 140 GB of weights on disk); it has
/// nothing to teach, which the run's start line says.
pub(crate) fn load_base(model: &ModelSource, seed: u64) -> Result<Arc<FrozenBase>> {
    let dtype = model.cfg.lora.as_ref().map_or(mt_core::BaseDtype::F32, |l| l.base);
    let base = FrozenBase::zeroed(&ModelLayout::new(&base_config(&model.cfg)), dtype);
    match &model.hf {
        Some(hf) => {
            mt_hf::import_weights_into(hf, &base)
                .context_with(|| format!("importing the base weights of {}", model.name))?;
        }
        None => {
            crate::init::init_store(&base, seed).context_with(|| "initialising the random base".into())?;
        }
    }
    Ok(Arc::new(base))
}

/// The adapters' initial values: `--lora-from`'s, or peft's initialisation (each `A` uniform in
/// `±1/√in`, kaiming-uniform with `a = √5`, seeded by the run's seed and the tensor's index;
/// each `B` zero, so the adapted model starts as the base). Returns the tensors written.
pub(crate) fn init_adapters(c: &TrainConfig, store: &HostStore) -> Result<usize> {
    if let Some(dir) = &c.lora_from {
        return mt_hf::peft::import_adapter(dir, store)
            .context_with(|| format!("reading the adapter in {}", dir.display()));
    }
    let params = store.layout().all_params();
    for (i, (name, _, spec)) in params.iter().enumerate() {
        let mut v = vec![0f32; spec.numel()];
        if name.ends_with("lora_A.weight") {
            let bound = 1.0 / (spec.shape[1] as f64).sqrt();
            let mut rng = StdRng::seed_from_u64(c.seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            v.iter_mut().for_each(|x| *x = rng.random_range(-bound..bound) as f32);
        }
        store.write_param(name, &v).context_with(|| format!("initialising {name}"))?;
    }
    Ok(params.len())
}

/// The export of a LoRA run: peft's adapter directory, or with `--merge` the base with every
/// adapter merged in (`W + s · B A`, W as `--model` or the seed gives it), exported as a full
/// model is.
pub(crate) fn export(
    c: &TrainConfig,
    model: &ModelSource,
    store: &HostStore,
    out: &Path,
    opts: &mt_hf::ExportOptions,
) -> Result<(usize, u64)> {
    let lora = model.cfg.lora.as_ref().ok_or_else(|| Error::Options("not a LoRA run".into()))?;
    if !c.merge {
        let files = mt_hf::peft::export_adapter(store, lora, &model.name, out)
            .context_with(|| format!("exporting the adapter to --out {}", out.display()))?;
        let bytes = files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum();
        return Ok((1, bytes));
    }
    let layout = ModelLayout::new(&base_config(&model.cfg));
    // Master weights only are written: the moments of an anonymous store stay unmapped zero pages.
    let ctx = || "merging the adapters into the base".to_owned();
    let merged = HostStore::anonymous(&layout, GradDtype::None).context_with(ctx)?;
    // The adapters go into the base as given (`--model`'s weights, or the seed's), not into the
    // run's encoding of it (`--base-dtype`: bf16, int8 or NF4 would round every weight, adapted
    // or not): the merged model is then what peft's merge over the same base gives.
    match &model.hf {
        Some(hf) => {
            mt_hf::import_weights_into(hf, &merged).context_with(ctx)?;
        }
        None => {
            crate::init::init_store(&merged, c.seed).context_with(ctx)?;
        }
    }
    mt_hf::peft::merge_into(store, lora, &merged).context_with(ctx)?;
    let r = mt_hf::export(&merged, &model.config_json, out, opts)
        .context_with(|| format!("exporting the merged model to --out {}", out.display()))?;
    Ok((r.n_shards, r.bytes_written))
}

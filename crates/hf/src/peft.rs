//! LoRA adapters in peft's on-disk format: `adapter_config.json` (peft's `LoraConfig`) and
//! `adapter_model.safetensors`, whose tensor names are peft's prefix `base_model.model.` and
//! transformers' module path, then `lora_A.weight` `[r, in]` or `lora_B.weight` `[out, r]`.
//! Read (`--lora-from`) into any [`ParamSink`] whose layout holds the adapters; written from
//! the store of a LoRA run (the export).

use std::path::{Path, PathBuf};

use half::{bf16, f16};
use mt_core::{LoraConfig, LoraTarget, ModelLayout};
use mt_store::{HostStore, ParamSink};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

use crate::{Error, Result};

/// peft's prefix of a causal LM's tensor names.
pub const PEFT_PREFIX: &str = "base_model.model.";
/// The adapter's configuration file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter's weights.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

fn bad(path: &Path, msg: impl Into<String>) -> Error {
    Error::Adapter { path: path.to_owned(), msg: msg.into() }
}

/// Reads `dir/adapter_config.json`: a LoRA adapter for a causal LM that this engine can train
/// (no DoRA, no per-module ranks or alphas, no trained biases or extra modules, targets named
/// as a list of our [`LoraTarget`]s).
pub fn read_adapter_config(dir: &Path) -> Result<LoraConfig> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(Error::io(&path))?;
    let v: Value =
        serde_json::from_str(&text).map_err(|source| Error::Json { path: path.clone(), source })?;
    let s = |k: &str| v.get(k).and_then(Value::as_str);
    if s("peft_type") != Some("LORA") {
        return Err(bad(&path, format!("peft_type is {:?}, expected \"LORA\"", v.get("peft_type"))));
    }
    if let Some(t) = s("task_type") {
        if t != "CAUSAL_LM" {
            return Err(bad(&path, format!("task_type is {t:?}, expected \"CAUSAL_LM\"")));
        }
    }
    let flag = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
    let empty = |k: &str| v.get(k).is_none_or(|x| x.is_null() || x.as_object().is_some_and(|o| o.is_empty()));
    for k in ["use_dora", "fan_in_fan_out", "lora_bias"] {
        if flag(k) {
            return Err(bad(&path, format!("{k} is true; only plain LoRA adapters are supported")));
        }
    }
    for k in ["rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"] {
        if !empty(k) {
            return Err(bad(&path, format!("{k} is set; only the same adapter on every layer is supported")));
        }
    }
    if s("bias").is_some_and(|b| b != "none") {
        return Err(bad(&path, "bias is not \"none\"; trained biases are not supported"));
    }
    let rank = v.get("r").and_then(Value::as_u64).ok_or_else(|| bad(&path, "no integer `r`"))? as usize;
    let alpha =
        v.get("lora_alpha").and_then(Value::as_f64).ok_or_else(|| bad(&path, "no number `lora_alpha`"))?;
    let dropout = v.get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
    let modules = v.get("target_modules").and_then(Value::as_array).ok_or_else(|| {
        bad(&path, "target_modules is not a list of module names (a regular expression is not supported)")
    })?;
    let targets = modules
        .iter()
        .map(|m| {
            let m = m.as_str().unwrap_or_default();
            LoraTarget::parse(m).ok_or_else(|| {
                bad(&path, format!("target module {m:?} is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    LoraConfig::new(rank, alpha, &targets, dropout, flag("use_rslora")).map_err(|e| bad(&path, e.to_string()))
}

/// peft's `adapter_config.json` for `lora` on the model `base_model` (a path or a hub name).
pub fn adapter_config_json(lora: &LoraConfig, base_model: &str) -> Value {
    let targets: Vec<&str> = lora.targets.iter().map(|t| t.module()).collect();
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "use_rslora": lora.rslora,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": base_model,
        "revision": null,
    })
}

fn to_f32(view: &TensorView<'_>, path: &Path, name: &str) -> Result<Vec<f32>> {
    let b = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        d => return Err(bad(path, format!("tensor `{name}` has dtype {d:?}; expected F32, BF16 or F16"))),
    })
}

/// Writes every adapter tensor of `dir/adapter_model.safetensors` into `sink` (whose layout is
/// a LoRA run's trainable one); every adapter of the layout must be there, and nothing else.
/// Returns the number of tensors.
pub fn import_adapter(dir: &Path, sink: &dyn ParamSink) -> Result<usize> {
    let path = dir.join(ADAPTER_WEIGHTS);
    let bytes = std::fs::read(&path).map_err(Error::io(&path))?;
    let st =
        SafeTensors::deserialize(&bytes).map_err(|e| bad(&path, format!("not a safetensors file: {e}")))?;
    let layout = sink.layout();
    let want = layout.all_params();
    let mut n = 0;
    for (name, _, spec) in &want {
        let key = format!("{PEFT_PREFIX}{name}");
        let view = st.tensor(&key).map_err(|_| {
            bad(&path, format!("no tensor `{key}`: the adapter does not match the model and --lora options"))
        })?;
        if view.shape() != spec.shape.as_slice() {
            return Err(bad(
                &path,
                format!("`{key}` has shape {:?}, the model needs {:?}", view.shape(), spec.shape),
            ));
        }
        sink.write_param(name, &to_f32(&view, &path, &key)?)?;
        n += 1;
    }
    if st.len() != want.len() {
        let extra = st
            .names()
            .into_iter()
            .find(|k| k.strip_prefix(PEFT_PREFIX).is_none_or(|n| layout.resolve(n).is_err()));
        return Err(bad(
            &path,
            format!("unexpected tensor {extra:?}: the adapter has more modules than the model's targets"),
        ));
    }
    Ok(n)
}

/// Writes `store`'s adapters (a LoRA run's) to `out` in peft's format: `adapter_model.safetensors`
/// (f32), then `adapter_config.json`, each through a temporary file renamed into place, the
/// config last (an output is complete when its config exists).
pub fn export_adapter(
    store: &HostStore,
    lora: &LoraConfig,
    base_model: &str,
    out: &Path,
) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    let layout: &ModelLayout = store.layout();
    let params = layout.all_params();
    let data = params
        .iter()
        .map(|(name, _, _)| {
            Ok(store.read_param(name)?.into_iter().flat_map(f32::to_le_bytes).collect::<Vec<u8>>())
        })
        .collect::<Result<Vec<_>>>()?;
    let views = params
        .iter()
        .zip(&data)
        .map(|((name, _, spec), bytes)| {
            let v = TensorView::new(Dtype::F32, spec.shape.clone(), bytes)
                .map_err(|e| bad(out, format!("tensor {name}: {e}")))?;
            Ok((format!("{PEFT_PREFIX}{name}"), v))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = std::collections::HashMap::from([("format".to_owned(), "pt".to_owned())]);
    let blob = safetensors::serialize(views, Some(meta))
        .map_err(|e| bad(out, format!("serialising the adapter: {e}")))?;
    let weights = out.join(ADAPTER_WEIGHTS);
    write_atomic(&weights, &blob)?;
    let config = out.join(ADAPTER_CONFIG);
    let text = serde_json::to_vec_pretty(&adapter_config_json(lora, base_model))
        .map_err(|e| bad(out, format!("serialising the adapter config: {e}")))?;
    write_atomic(&config, &text)?;
    Ok(vec![weights, config])
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp).map_err(Error::io(&tmp))?;
        f.write_all(bytes).map_err(Error::io(&tmp))?;
        f.sync_all().map_err(Error::io(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(Error::io(path))
}

/// `base + s · B A` of every adapted weight: the merged model's parameters, written into
/// `merged` (a store of the base model's layout that holds the base already).
pub fn merge_into(adapters: &HostStore, lora: &LoraConfig, merged: &HostStore) -> Result<()> {
    let s = lora.scale();
    for l in 0..adapters.layout().n_layers {
        for t in &lora.targets {
            let p = |n: &str| format!("model.layers.{l}.{n}");
            let (a, b) = (adapters.read_param(&p(t.a_name()))?, adapters.read_param(&p(t.b_name()))?);
            let mut w = merged.read_param(&p(t.weight()))?;
            let (r, inp) = (lora.rank, a.len() / lora.rank);
            let out = w.len() / inp;
            for o in 0..out {
                for i in 0..inp {
                    let d: f64 = (0..r).map(|k| f64::from(b[o * r + k]) * f64::from(a[k * inp + i])).sum();
                    w[o * inp + i] = (f64::from(w[o * inp + i]) + s * d) as f32;
                }
            }
            merged.write_param(&p(t.weight()), &w)?;
        }
    }
    Ok(())
}

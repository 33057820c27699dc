//! Loader of the committed LoRA fixtures made with peft + transformers
//! (`scripts/make_lora_golden.py`, `crates/testkit/fixtures/lora`): the base is a golden
//! fixture's initial weights ([`crate::golden`]); `<name>/adapter_model.safetensors` holds the
//! initial adapters as peft saves them; `<name>.safetensors` the batch, the step-0 logits and
//! loss, the losses and adapter gradient norms of three steps, `grad.<peft name>` and
//! `step3.<peft name>` of every adapter tensor.

use std::collections::BTreeMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use mt_core::{LoraConfig, LoraTarget, ModelLayout};

use crate::golden::{self, Golden};
use crate::{Error, Result};

/// Names of the committed LoRA fixtures (their base: the golden fixture of the same name).
pub const LORA_NAMES: [&str; 2] = ["llama_gqa", "qwen2_bias"];

/// peft's prefix of a causal LM's tensor names (`base_model.model.` + transformers' name).
pub const PEFT_PREFIX: &str = "base_model.model.";

/// Where the LoRA fixtures live.
pub fn fixtures_dir() -> PathBuf {
    golden::fixtures_dir().with_file_name("lora")
}

/// One LoRA fixture, validated against its layout.
#[derive(Debug, Clone)]
pub struct LoraGolden {
    /// The base fixture; its `cfg` has `lora` set.
    pub base: Golden,
    /// The adapters' initial values, by our name (`model.layers.0.self_attn.q_proj.lora_A.weight`).
    pub adapters: BTreeMap<String, Tensor>,
    /// Step-0 logits of base + adapters `[B, T, V]`.
    pub logits: Tensor,
    /// Step-0 loss.
    pub loss: f64,
    /// Loss before each of the three steps.
    pub losses: Vec<f64>,
    /// Global norm of the adapters' gradients at each step.
    pub grad_norms: Vec<f64>,
    /// Step-0 gradient of each adapter tensor.
    pub grads: BTreeMap<String, Tensor>,
    /// Each adapter tensor after three steps.
    pub step3: BTreeMap<String, Tensor>,
    /// Where peft's initial adapter directory is.
    pub adapter_dir: PathBuf,
}

/// The adapters of fixture `name`, as `scripts/make_lora_golden.py` configures them.
fn lora_of(name: &str) -> Result<LoraConfig> {
    let rslora = match name {
        "llama_gqa" => false,
        "qwen2_bias" => true,
        other => {
            return Err(Error::Fixture { path: fixtures_dir(), msg: format!("no LoRA fixture `{other}`") })
        }
    };
    Ok(LoraConfig::new(4, 8.0, &LoraTarget::ALL, 0.0, rslora)?)
}

fn read(path: &PathBuf) -> Result<std::collections::HashMap<String, Tensor>> {
    candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| Error::Fixture {
        path: path.clone(),
        msg: format!("cannot read safetensors: {e} (made by scripts/make_lora_golden.py)"),
    })
}

/// Loads fixture `name`.
pub fn load(name: &str) -> Result<LoraGolden> {
    let mut base = golden::load(name)?;
    base.cfg.lora = Some(lora_of(name)?);
    let dir = fixtures_dir();
    let adapter_dir = dir.join(name);
    let path = dir.join(format!("{name}.safetensors"));
    let mut t = read(&path)?;
    let init = read(&adapter_dir.join("adapter_model.safetensors"))?;
    let layout = ModelLayout::trainable(&base.cfg);
    let missing = |key: &str| Error::Fixture { path: path.clone(), msg: format!("missing tensor `{key}`") };
    let mut maps: [BTreeMap<String, Tensor>; 3] = Default::default();
    for (pname, _, spec) in layout.all_params() {
        let peft = format!("{PEFT_PREFIX}{pname}");
        let a = init.get(&peft).ok_or_else(|| missing(&peft))?.clone();
        let g = t.remove(&format!("grad.{peft}")).ok_or_else(|| missing(&peft))?;
        let s = t.remove(&format!("step3.{peft}")).ok_or_else(|| missing(&peft))?;
        for (map, x) in maps.iter_mut().zip([a, g, s]) {
            if x.dims() != spec.shape.as_slice() || x.dtype() != DType::F32 {
                return Err(Error::Fixture {
                    path: path.clone(),
                    msg: format!("`{peft}` is {:?} {:?}, expected F32 {:?}", x.dtype(), x.dims(), spec.shape),
                });
            }
            map.insert(pname.clone(), x);
        }
    }
    let mut vec1 = |k: &str| -> Result<Vec<f64>> {
        let x = t.remove(k).ok_or_else(|| missing(k))?;
        Ok(x.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f64::from).collect())
    };
    let (loss, losses, grad_norms) = (vec1("loss")?[0], vec1("losses")?, vec1("grad_norms")?);
    let ids = t.remove("input_ids").ok_or_else(|| missing("input_ids"))?.flatten_all()?.to_vec1::<i64>()?;
    if ids.iter().zip(&base.input_ids).any(|(a, &b)| *a != i64::from(b)) || ids.len() != base.input_ids.len()
    {
        return Err(Error::Fixture {
            path: path.clone(),
            msg: "its batch is not the golden fixture's".into(),
        });
    }
    let logits = t.remove("logits").ok_or_else(|| missing("logits"))?;
    let [adapters, grads, step3] = maps;
    Ok(LoraGolden { base, adapters, logits, loss, losses, grad_norms, grads, step3, adapter_dir })
}

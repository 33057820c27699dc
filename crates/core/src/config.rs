//! Model configuration, parsed from a Hugging Face `config.json` (transformers 4.x and 5.x
//! spellings), validated up front so that a bad file fails with a message naming the field.

use std::path::Path;

use serde_json::{Map, Value};

use crate::moe::{parse_moe, MoeConfig};
use crate::{Error, Result};

/// Decoder family. Each differs only in which optional parameters a layer has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3 and Mistral: no biases (unless `attention_bias`), no q/k norm.
    Llama,
    /// Qwen2 / Qwen2.5: bias on q, k, v projections.
    Qwen2,
    /// Qwen3: RMSNorm over the head dimension of q and k, before RoPE.
    Qwen3,
    /// Qwen3-MoE (`qwen3_moe`): Qwen3's attention, a mixture-of-experts MLP in every layer.
    Qwen3Moe,
    /// Mixtral: Mistral's attention, a mixture-of-experts MLP (top-k renormalised).
    Mixtral,
    /// OLMoE (`olmoe`): RMSNorm over the whole q and k projections, a mixture-of-experts MLP.
    Olmoe,
}

/// RoPE frequency scaling, as `rope_scaling` / `rope_parameters` in config.json.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor` (`rope_type: "linear"`).
    Linear {
        /// Scaling factor.
        factor: f64,
    },
    /// Llama 3.x frequency-dependent scaling (`rope_type: "llama3"`).
    Llama3 {
        /// Overall scaling factor for low frequencies.
        factor: f64,
        /// Wavelength threshold (in units of the original context) below which no scaling applies.
        low_freq_factor: f64,
        /// Wavelength threshold above which full scaling applies.
        high_freq_factor: f64,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: f64,
    },
}

/// Everything the engine needs to know about a model's shape and numerics.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Decoder family.
    pub arch: Arch,
    /// Vocabulary size (rows of the embedding and LM head).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Optional RoPE scaling.
    pub rope_scaling: Option<RopeScaling>,
    /// Longest position the model was configured for.
    pub max_position_embeddings: usize,
    /// Whether the LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Bias on the q, k, v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// RMSNorm on q and k (Qwen3, Qwen3-MoE: over each head; OLMoE: over the whole projection).
    pub qk_norm: bool,
    /// The q/k RMSNorm spans the whole projection (`[nh·hd]`, `[nkv·hd]` weights, OLMoE) rather
    /// than each head (`[hd]`, Qwen3).
    pub qk_norm_full: bool,
    /// The mixture-of-experts MLP of every layer (Qwen3-MoE, Mixtral, OLMoE); `None`: the dense
    /// SwiGLU MLP of `intermediate_size`.
    pub moe: Option<MoeConfig>,
    /// Sliding-window attention width, if the model uses one (Mistral); the engine refuses
    /// sequences longer than this rather than silently attending further.
    pub sliding_window: Option<usize>,
}

pub(crate) fn get<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

pub(crate) fn req_usize(obj: &Map<String, Value>, key: &str) -> Result<usize> {
    let v = get(obj, key).ok_or_else(|| Error::config(key, "missing (required)"))?;
    let n = v
        .as_u64()
        .ok_or_else(|| Error::config(key, format!("expected a non-negative integer, found {v}")))?;
    if n == 0 {
        return Err(Error::config(key, "must be greater than zero"));
    }
    usize::try_from(n).map_err(|_| Error::config(key, "too large"))
}

pub(crate) fn opt_usize(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match get(obj, key) {
        None => Ok(None),
        Some(_) => req_usize(obj, key).map(Some),
    }
}

pub(crate) fn opt_f64(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match get(obj, key) {
        None => Ok(None),
        Some(v) => {
            let x = v.as_f64().ok_or_else(|| Error::config(key, format!("expected a number, found {v}")))?;
            if !x.is_finite() {
                return Err(Error::config(key, "must be finite"));
            }
            Ok(Some(x))
        }
    }
}

pub(crate) fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>> {
    match get(obj, key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| Error::config(key, format!("expected true or false, found {v}"))),
    }
}

fn parse_rope(obj: &Map<String, Value>, field: &str) -> Result<(Option<f64>, Option<RopeScaling>)> {
    let Some(v) = get(obj, field) else { return Ok((None, None)) };
    let r = v.as_object().ok_or_else(|| Error::config(field, format!("expected an object, found {v}")))?;
    let theta = opt_f64(r, "rope_theta")?;
    let kind = get(r, "rope_type")
        .or_else(|| get(r, "type"))
        .map(|t| t.as_str().ok_or_else(|| Error::config(field, "rope_type must be a string")))
        .transpose()?
        .unwrap_or("default");
    let need = |k: &str| -> Result<f64> {
        opt_f64(r, k)?.ok_or_else(|| Error::config(format!("{field}.{k}"), "missing (required)"))
    };
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: need("factor")? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: {
                // An integer (a length), also written back as one: a fraction or a value past
                // 2^53 would export a config other than the one trained.
                let k = format!("{field}.original_max_position_embeddings");
                let x = need("original_max_position_embeddings")?;
                if x.fract() != 0.0 || x > 9_007_199_254_740_992.0 {
                    return Err(Error::config(k, format!("{x} is not an integer of at most 2^53")));
                }
                x
            },
        }),
        other => {
            return Err(Error::Unsupported(format!(
                "{field}.rope_type = {other:?}; supported: default, linear, llama3"
            )))
        }
    };
    match &scaling {
        Some(RopeScaling::Linear { factor }) if *factor <= 0.0 => {
            return Err(Error::config(format!("{field}.factor"), "linear rope scaling needs factor > 0"));
        }
        Some(RopeScaling::Llama3 {
            low_freq_factor,
            high_freq_factor,
            factor,
            original_max_position_embeddings,
        }) if high_freq_factor <= low_freq_factor
            || *factor <= 0.0
            || *low_freq_factor <= 0.0
            || *original_max_position_embeddings <= 0.0 =>
        {
            return Err(Error::config(
                field,
                "llama3 rope scaling needs factor > 0, original_max_position_embeddings > 0 and high_freq_factor > low_freq_factor > 0",
            ));
        }
        _ => {}
    }
    Ok((theta, scaling))
}

impl ModelConfig {
    /// Reads and validates an HF `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
        let value: Value =
            serde_json::from_str(&text).map_err(|source| Error::Json { path: path.to_owned(), source })?;
        Self::from_json(&value)
    }

    /// Validates an already parsed `config.json` document.
    pub fn from_json(value: &Value) -> Result<Self> {
        let obj =
            value.as_object().ok_or_else(|| Error::config("<root>", "config.json must be a JSON object"))?;
        let model_type = get(obj, "model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::config("model_type", "missing or not a string"))?;
        let arch = match model_type {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3_moe" => Arch::Qwen3Moe,
            "mixtral" => Arch::Mixtral,
            "olmoe" => Arch::Olmoe,
            other => {
                return Err(Error::Unsupported(format!(
                    "model_type {other:?}; supported: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, olmoe"
                )))
            }
        };
        if let Some(act) = get(obj, "hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(Error::Unsupported(format!("hidden_act {act}; only \"silu\" is implemented")));
            }
        }
        if opt_bool(obj, "mlp_bias")?.unwrap_or(false) {
            return Err(Error::Unsupported("mlp_bias = true".into()));
        }
        let hidden_size = req_usize(obj, "hidden_size")?;
        let num_attention_heads = req_usize(obj, "num_attention_heads")?;
        let num_key_value_heads = opt_usize(obj, "num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(Error::config(
                "num_key_value_heads",
                format!("{num_key_value_heads} does not divide num_attention_heads = {num_attention_heads}"),
            ));
        }
        let head_dim = match opt_usize(obj, "head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(Error::config(
                        "hidden_size",
                        format!("{hidden_size} is not divisible by num_attention_heads = {num_attention_heads} and no head_dim is given"),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim % 2 != 0 {
            return Err(Error::config("head_dim", format!("{head_dim} must be even for RoPE")));
        }
        // transformers 5 moved rope_theta and rope_scaling into `rope_parameters`.
        let (theta5, scaling5) = parse_rope(obj, "rope_parameters")?;
        let (theta4, scaling4) = parse_rope(obj, "rope_scaling")?;
        // Mixtral's transformers default is 1e6 (transformers writes it into config.json anyway).
        let default_theta = if arch == Arch::Mixtral { 1e6 } else { 10_000.0 };
        let rope_theta = opt_f64(obj, "rope_theta")?.or(theta5).or(theta4).unwrap_or(default_theta);
        if rope_theta <= 0.0 {
            return Err(Error::config("rope_theta", "must be positive"));
        }
        let rms_norm_eps = opt_f64(obj, "rms_norm_eps")?.unwrap_or(1e-6);
        if rms_norm_eps <= 0.0 {
            return Err(Error::config("rms_norm_eps", "must be positive"));
        }
        let attention_bias = opt_bool(obj, "attention_bias")?.unwrap_or(false);
        let (qkv_bias, o_bias, qk_norm) = match arch {
            Arch::Llama | Arch::Mixtral => (attention_bias, attention_bias, false),
            Arch::Qwen2 => (true, false, false),
            Arch::Qwen3 | Arch::Qwen3Moe | Arch::Olmoe => (attention_bias, attention_bias, true),
        };
        let sliding_window = match arch {
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => {
                if opt_bool(obj, "use_sliding_window")?.unwrap_or(false) {
                    return Err(Error::Unsupported("use_sliding_window = true".into()));
                }
                None
            }
            Arch::Llama | Arch::Mixtral => opt_usize(obj, "sliding_window")?,
            Arch::Olmoe => None,
        };
        let num_hidden_layers = req_usize(obj, "num_hidden_layers")?;
        let moe = parse_moe(obj, arch, num_hidden_layers)?;
        if arch == Arch::Olmoe && head_dim.checked_mul(num_attention_heads) != Some(hidden_size) {
            // transformers sizes OLMoE's q/k norms from hidden_size / num_attention_heads.
            return Err(Error::Unsupported(format!(
                "olmoe with head_dim {head_dim} != hidden_size / num_attention_heads = {}",
                hidden_size / num_attention_heads
            )));
        }
        let cfg = ModelConfig {
            arch,
            vocab_size: req_usize(obj, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(obj, "intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling: scaling5.or(scaling4),
            max_position_embeddings: opt_usize(obj, "max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: opt_bool(obj, "tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            qk_norm,
            qk_norm_full: arch == Arch::Olmoe,
            moe,
            sliding_window,
        };
        crate::layout::check_magnitudes(&cfg)?;
        Ok(cfg)
    }

    /// The built-in tiny Llama used by `megatrain train` when no config is given (byte-level
    /// vocabulary of 256 symbols).
    pub fn tiny_llama() -> Self {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 256,
            hidden_size: 128,
            intermediate_size: 344,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            max_position_embeddings: 1024,
            tie_word_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            qk_norm: false,
            qk_norm_full: false,
            moe: None,
            sliding_window: None,
        }
    }

    /// The model as a Hugging Face `config.json` document (transformers-5 spelling, with the
    /// transformers-4 `rope_theta`/`rope_scaling` keys too), for exporting a model that has no
    /// source `config.json` (the built-in one, or `megatrain init`). `from_json` of the result
    /// gives back `self`.
    pub fn to_hf_json(&self) -> Value {
        let (model_type, class) = match self.arch {
            Arch::Llama => ("llama", "LlamaForCausalLM"),
            Arch::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
            Arch::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
            Arch::Qwen3Moe => ("qwen3_moe", "Qwen3MoeForCausalLM"),
            Arch::Mixtral => ("mixtral", "MixtralForCausalLM"),
            Arch::Olmoe => ("olmoe", "OlmoeForCausalLM"),
        };
        let mut rope = serde_json::json!({ "rope_type": "default", "rope_theta": self.rope_theta });
        match &self.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => {
                rope["rope_type"] = "linear".into();
                rope["factor"] = (*factor).into();
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                rope["rope_type"] = "llama3".into();
                rope["factor"] = (*factor).into();
                rope["low_freq_factor"] = (*low_freq_factor).into();
                rope["high_freq_factor"] = (*high_freq_factor).into();
                rope["original_max_position_embeddings"] = (*original_max_position_embeddings as u64).into();
            }
        }
        let mut v = serde_json::json!({
            "architectures": [class],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope.clone(),
            "torch_dtype": "float32",
        });
        if self.rope_scaling.is_some() {
            v["rope_scaling"] = rope;
        }
        match self.arch {
            Arch::Llama | Arch::Mixtral | Arch::Olmoe => v["attention_bias"] = self.qkv_bias.into(),
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => {
                v["use_sliding_window"] = false.into();
                if self.arch != Arch::Qwen2 {
                    v["attention_bias"] = self.qkv_bias.into();
                }
            }
        }
        if let Some(moe) = &self.moe {
            moe.write_hf_json(self.arch, &mut v);
        }
        if let Some(w) = self.sliding_window {
            v["sliding_window"] = w.into();
        }
        v
    }

    /// Query width (`num_attention_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Key/value width (`num_key_value_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Checks that a sequence of `seq_len` tokens can be trained without changing semantics.
    pub fn check_seq_len(&self, seq_len: usize) -> Result<()> {
        if let Some(w) = self.sliding_window {
            if seq_len > w {
                return Err(Error::Unsupported(format!(
                    "sequence length {seq_len} exceeds the model's sliding_window {w}; sliding-window attention is not implemented"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "hidden_act": "silu"
        })
    }

    #[test]
    fn to_hf_json_round_trips_every_golden_config() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testkit/fixtures/golden");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.to_string_lossy().ends_with(".config.json") {
                let c = ModelConfig::from_file(&p).unwrap();
                assert_eq!(ModelConfig::from_json(&c.to_hf_json()).unwrap(), c, "{}", p.display());
                n += 1;
            }
        }
        assert_eq!(n, 7);
        let t = ModelConfig::tiny_llama();
        assert_eq!(ModelConfig::from_json(&t.to_hf_json()).unwrap(), t);
    }

    #[test]
    fn parses_minimal_llama_with_defaults() {
        let c = ModelConfig::from_json(&base()).unwrap();
        assert_eq!(c.arch, Arch::Llama);
        assert_eq!(c.head_dim, 4);
        assert_eq!(c.rope_theta, 10_000.0);
        assert!(!c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm);
    }

    #[test]
    fn reads_rope_from_transformers5_rope_parameters() {
        let mut v = base();
        v["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0));
    }

    #[test]
    fn qwen_flags() {
        let mut v = base();
        v["model_type"] = json!("qwen2");
        assert!(ModelConfig::from_json(&v).unwrap().qkv_bias);
        v["model_type"] = json!("qwen3");
        v["head_dim"] = json!(8);
        let c = ModelConfig::from_json(&v).unwrap();
        assert!(c.qk_norm && !c.qkv_bias);
        assert_eq!(c.q_dim(), 32);
    }

    #[test]
    fn bad_configs_name_the_problem() {
        let cases: Vec<(Value, &str)> = vec![
            (json!([1, 2]), "JSON object"),
            (
                {
                    let mut v = base();
                    v["model_type"] = json!("gpt2");
                    v
                },
                "gpt2",
            ),
            (
                {
                    let mut v = base();
                    v.as_object_mut().unwrap().remove("hidden_size");
                    v
                },
                "hidden_size",
            ),
            (
                {
                    let mut v = base();
                    v["hidden_size"] = json!("big");
                    v
                },
                "hidden_size",
            ),
            (
                {
                    let mut v = base();
                    v["num_key_value_heads"] = json!(3);
                    v
                },
                "num_key_value_heads",
            ),
            (
                {
                    let mut v = base();
                    v["hidden_act"] = json!("gelu");
                    v
                },
                "gelu",
            ),
            (
                {
                    let mut v = base();
                    v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
                    v
                },
                "yarn",
            ),
            (
                {
                    let mut v = base();
                    v["vocab_size"] = json!(0);
                    v
                },
                "vocab_size",
            ),
        ];
        for (v, needle) in cases {
            let err = ModelConfig::from_json(&v).unwrap_err().to_string();
            assert!(err.contains(needle), "error {err:?} should mention {needle:?}");
        }
    }

    #[test]
    fn sliding_window_refuses_longer_sequences() {
        let mut v = base();
        v["sliding_window"] = json!(8);
        let c = ModelConfig::from_json(&v).unwrap();
        assert!(c.check_seq_len(8).is_ok());
        assert!(c.check_seq_len(9).unwrap_err().to_string().contains("sliding_window"));
    }
}

//! Model configuration, parsed from a Hugging Face `config.json` (transformers 4.x and 5.x
//! spellings), validated up front so that a bad file fails with a message naming the field.

use std::path::Path;

use serde_json::{Map, Value};

use crate::gpt_oss::{self, LayerWindows};
use crate::moe::{parse_moe, MoeConfig};
use crate::{Error, Result};

mod rope;

use rope::parse_rope;
pub use rope::RopeScaling;

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
    /// GPT-OSS (`gpt_oss`): biases on q, k, v and o, a learned sink logit per query head, a
    /// sliding window on some layers (`layer_types`), YaRN RoPE, and a mixture of experts with a
    /// biased router (top-k of the logits, then their softmax) and biased experts with a clamped
    /// GLU; RMSNorm multiplies its weight before the cast back to the activations' dtype.
    GptOss,
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
    /// A learned sink logit per query head (`self_attn.sinks`, GPT-OSS): one more softmax term
    /// `e^{s_h}` in each row's denominator, with no value vector.
    pub attention_sinks: bool,
    /// The layers that attend over a sliding window of keys (GPT-OSS's `layer_types`); `None`
    /// when every layer attends causally over the whole sequence.
    pub layer_windows: Option<LayerWindows>,
    /// LoRA adapters on the decoder layers (a training option, not read from `config.json`):
    /// the layout then holds each layer's adapters after its base tensors, and only they train.
    pub lora: Option<crate::LoraConfig>,
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
            "gpt_oss" => Arch::GptOss,
            other => {
                return Err(Error::Unsupported(format!(
                    "model_type {other:?}; supported: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, olmoe, gpt_oss"
                )))
            }
        };
        gpt_oss::check_quantization(obj, arch == Arch::GptOss)?;
        if arch == Arch::GptOss {
            gpt_oss::check_unsupported(obj)?;
        }
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
        // Mixtral's transformers default is 1e6 (transformers writes it into config.json anyway),
        // GPT-OSS's 150000.
        let default_theta = match arch {
            Arch::Mixtral => 1e6,
            Arch::GptOss => gpt_oss::DEFAULT_THETA,
            _ => 10_000.0,
        };
        let rope_theta = opt_f64(obj, "rope_theta")?.or(theta5).or(theta4).unwrap_or(default_theta);
        if rope_theta <= 0.0 {
            return Err(Error::config("rope_theta", "must be positive"));
        }
        let rms_norm_eps = opt_f64(obj, "rms_norm_eps")?.unwrap_or(1e-6);
        if rms_norm_eps <= 0.0 {
            return Err(Error::config("rms_norm_eps", "must be positive"));
        }
        // GPT-OSS's default is true, everyone else's false.
        let attention_bias = opt_bool(obj, "attention_bias")?.unwrap_or(arch == Arch::GptOss);
        let (qkv_bias, o_bias, qk_norm) = match arch {
            Arch::Llama | Arch::Mixtral | Arch::GptOss => (attention_bias, attention_bias, false),
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
            // GPT-OSS's window applies to some layers only (`layer_windows`).
            Arch::Olmoe | Arch::GptOss => None,
        };
        let num_hidden_layers = req_usize(obj, "num_hidden_layers")?;
        let layer_windows =
            (arch == Arch::GptOss).then(|| gpt_oss::parse_windows(obj, num_hidden_layers)).transpose()?;
        // transformers 5's GptOssConfig sets YaRN when config.json names no RoPE scaling.
        let rope_scaling = scaling5.or(scaling4).or_else(|| {
            (arch == Arch::GptOss).then_some(RopeScaling::Yarn {
                factor: 32.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_max_position_embeddings: 4096.0,
                truncate: false,
                attention_factor: None,
            })
        });
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
            rope_scaling,
            max_position_embeddings: opt_usize(obj, "max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: opt_bool(obj, "tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            qk_norm,
            qk_norm_full: arch == Arch::Olmoe,
            moe,
            sliding_window,
            attention_sinks: arch == Arch::GptOss,
            layer_windows,
            lora: None,
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
            attention_sinks: false,
            layer_windows: None,
            lora: None,
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
            Arch::GptOss => ("gpt_oss", "GptOssForCausalLM"),
        };
        let rope = rope::to_json(self.rope_theta, self.rope_scaling.as_ref());
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
            Arch::Llama | Arch::Mixtral | Arch::Olmoe | Arch::GptOss => {
                v["attention_bias"] = self.qkv_bias.into()
            }
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
        if let Some(w) = &self.layer_windows {
            v["sliding_window"] = w.window.into();
            if let Some(listed) = &w.listed {
                let kinds = listed.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" });
                v["layer_types"] = kinds.collect::<Vec<_>>().into();
            }
        }
        v
    }

    /// The window of layer `i`'s attention (GPT-OSS's sliding layers), `None` for a causal layer
    /// over the whole sequence (and for a layer index past the config's `layer_types`).
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        let w = self.layer_windows.as_ref()?;
        w.windowed(i).unwrap_or(false).then_some(w.window)
    }

    /// Whether RMSNorm multiplies its weight in the statistics dtype before the cast back to the
    /// activations' dtype (GPT-OSS), rather than after it (Llama and the others). The two agree
    /// in f32; in bf16 they round differently.
    pub fn norm_weight_before_cast(&self) -> bool {
        self.arch == Arch::GptOss
    }

    /// Query width (`num_attention_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Key/value width (`num_key_value_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Checks that a training run may use sequences of `seq_len` tokens: within the positions the
    /// config declares (`max_position_embeddings`) and without changing semantics
    /// ([`Self::check_seq_len`]). The first is a policy, not a limit of the engine (RoPE has no
    /// table to run out of): a model whose weights never saw a position past that length is a
    /// different model there, so training it longer is refused unless its config says so.
    pub fn check_train_seq_len(&self, seq_len: usize) -> Result<()> {
        if seq_len > self.max_position_embeddings {
            return Err(Error::Unsupported(format!(
                "sequence length {seq_len} exceeds the model's max_position_embeddings ({}); use shorter \
                 sequences, or raise max_position_embeddings in config.json to train the model at this length \
                 (with a RoPE scaling where its weights were trained shorter)",
                self.max_position_embeddings
            )));
        }
        self.check_seq_len(seq_len)
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
mod tests;

//! What a `gpt_oss` `config.json` adds to the decoder families (transformers' `GptOssConfig`):
//! the sliding window of every other layer (`layer_types`, `sliding_window`), the MoE experts'
//! clamped GLU (`swiglu_limit`, `swiglu_alpha`), the legacy `experts_per_token`, and the MXFP4
//! `quantization_config` of the released checkpoints (dequantised on import). The attention
//! sinks, the biases and the router come with the family itself.

use serde_json::{Map, Value};

use crate::config::{get, opt_f64, opt_usize};
use crate::{Error, Result};

/// transformers' `GptOssConfig` defaults.
pub(crate) const DEFAULT_WINDOW: usize = 128;
pub(crate) const DEFAULT_THETA: f64 = 150_000.0;
pub(crate) const DEFAULT_EXPERTS: usize = 128;
pub(crate) const DEFAULT_TOP_K: usize = 4;
pub(crate) const DEFAULT_AUX_COEF: f64 = 0.001;
const DEFAULT_LIMIT: f64 = 7.0;
/// transformers 4 hard-codes it; transformers 5 reads `swiglu_alpha` with this default.
const DEFAULT_ALPHA: f64 = 1.702;

/// The layers that attend over a sliding window of keys (GPT-OSS): on such a layer query `q`
/// sees key `k` iff `q - window < k <= q` (transformers' `sliding_window_overlay` on the causal
/// mask); every other layer is plainly causal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerWindows {
    /// Keys a query sees on a windowed layer, itself included (`sliding_window`).
    pub window: usize,
    /// `layer_types` as `config.json` lists them (`true`: `"sliding_attention"`), or `None`:
    /// not listed, transformers' default (the even layers are windowed, the odd ones full).
    pub listed: Option<Vec<bool>>,
}

impl LayerWindows {
    /// Whether layer `i` is windowed; `None` for a layer index past the listed `layer_types`.
    pub fn windowed(&self, i: usize) -> Option<bool> {
        match &self.listed {
            Some(l) => l.get(i).copied(),
            None => Some(i.is_multiple_of(2)),
        }
    }
}

/// The experts' GLU of GPT-OSS: `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`,
/// `(up + 1) · gate · σ(alpha · gate)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClampedGlu {
    /// `swiglu_limit`.
    pub limit: f64,
    /// `swiglu_alpha` (transformers 4: always 1.702).
    pub alpha: f64,
}

/// `sliding_window` and `layer_types` of a `gpt_oss` config.
pub(crate) fn parse_windows(obj: &Map<String, Value>, n_layers: usize) -> Result<LayerWindows> {
    let window = opt_usize(obj, "sliding_window")?.unwrap_or(DEFAULT_WINDOW);
    let listed = match get(obj, "layer_types") {
        None => None,
        Some(Value::Array(a)) => {
            if a.len() != n_layers {
                return Err(Error::config(
                    "layer_types",
                    format!("lists {} layers, num_hidden_layers is {n_layers}", a.len()),
                ));
            }
            let kinds = a
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(Error::Unsupported(format!(
                        "layer_types[{i}] = {v}; gpt_oss layers are \"sliding_attention\" or \"full_attention\""
                    ))),
                })
                .collect::<Result<Vec<bool>>>()?;
            Some(kinds)
        }
        Some(v) => return Err(Error::config("layer_types", format!("expected a list, found {v}"))),
    };
    Ok(LayerWindows { window, listed })
}

/// `swiglu_limit` and `swiglu_alpha`.
pub(crate) fn parse_glu(obj: &Map<String, Value>) -> Result<ClampedGlu> {
    let limit = opt_f64(obj, "swiglu_limit")?.unwrap_or(DEFAULT_LIMIT);
    let alpha = opt_f64(obj, "swiglu_alpha")?.unwrap_or(DEFAULT_ALPHA);
    if limit <= 0.0 {
        return Err(Error::config("swiglu_limit", format!("{limit} must be positive")));
    }
    Ok(ClampedGlu { limit, alpha })
}

/// `num_experts_per_tok`, or the released checkpoints' legacy `experts_per_token` (both: equal).
pub(crate) fn top_k(obj: &Map<String, Value>) -> Result<Option<usize>> {
    match (opt_usize(obj, "num_experts_per_tok")?, opt_usize(obj, "experts_per_token")?) {
        (Some(a), Some(b)) if a != b => {
            Err(Error::config("num_experts_per_tok", format!("{a} but experts_per_token is {b}")))
        }
        (a, b) => Ok(a.or(b)),
    }
}

/// Refuses what a `gpt_oss` config may ask for that training does not do: attention dropout.
pub(crate) fn check_unsupported(obj: &Map<String, Value>) -> Result<()> {
    if opt_f64(obj, "attention_dropout")?.unwrap_or(0.0) != 0.0 {
        return Err(Error::Unsupported("gpt_oss with attention_dropout != 0 (dropout in training)".into()));
    }
    Ok(())
}

/// `quantization_config`: only the MXFP4 experts of the released GPT-OSS checkpoints, which the
/// import dequantises (anything else is refused, naming its method).
pub(crate) fn check_quantization(obj: &Map<String, Value>, is_gpt_oss: bool) -> Result<()> {
    let Some(q) = get(obj, "quantization_config") else { return Ok(()) };
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("<none>");
    match (method, is_gpt_oss) {
        ("mxfp4", true) => Ok(()),
        _ => Err(Error::Unsupported(format!(
            "quantization_config with quant_method {method:?}; only gpt_oss's \"mxfp4\" experts are read \
             (dequantised into the fp32 master weights)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use crate::{Arch, ExpertKind, ModelConfig, ModelLayout, RopeScaling};

    /// The released gpt-oss-20b `config.json`'s keys (transformers 4 spelling, as published).
    pub(crate) fn gpt_oss_20b() -> Value {
        json!({
            "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
            "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
            "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
            "intermediate_size": 2880,
            "layer_types": (0..24).map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" })
                .collect::<Vec<_>>(),
            "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
            "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
            "num_local_experts": 32, "output_router_logits": false, "pad_token_id": 199999,
            "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
            "rms_norm_eps": 1e-05,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
            "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
            "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0", "use_cache": true,
            "vocab_size": 201088
        })
    }

    fn gpt_oss_120b() -> Value {
        let mut v = gpt_oss_20b();
        v["num_hidden_layers"] = json!(36);
        v["num_local_experts"] = json!(128);
        v["layer_types"] = json!((0..36)
            .map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" })
            .collect::<Vec<_>>());
        v
    }

    #[test]
    fn released_shapes_parse_with_their_parameter_counts() {
        // OpenAI's model card: 20.9B / 116.8B parameters in total, 3.6B / 5.1B active.
        for (v, layers, experts, total, active) in
            [(gpt_oss_20b(), 24, 32, 20.9e9, 3.6e9), (gpt_oss_120b(), 36, 128, 116.8e9, 5.1e9)]
        {
            let c = ModelConfig::from_json(&v).unwrap();
            assert_eq!(c.arch, Arch::GptOss);
            assert_eq!((c.num_hidden_layers, c.head_dim, c.q_dim(), c.hidden_size), (layers, 64, 4096, 2880));
            assert!(c.qkv_bias && c.o_bias && c.attention_sinks && !c.qk_norm && c.sliding_window.is_none());
            let m = c.moe.as_ref().unwrap();
            assert_eq!((m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size), (experts, 4, 2880));
            assert!(m.norm_topk_prob && m.aux_coef().is_none() && m.router_aux_loss_coef == 0.9);
            assert!(matches!(m.experts, ExpertKind::GptOss(g) if g.limit == 7.0 && g.alpha == 1.702));
            let w = c.layer_windows.as_ref().unwrap();
            assert_eq!(w.window, 128);
            assert_eq!(
                (c.layer_window(0), c.layer_window(1), c.layer_window(layers - 1)),
                (Some(128), None, None)
            );
            assert!(matches!(
                c.rope_scaling,
                Some(RopeScaling::Yarn { factor, beta_fast, beta_slow, original_max_position_embeddings, truncate: false, attention_factor: None })
                    if factor == 32.0 && beta_fast == 32.0 && beta_slow == 1.0 && original_max_position_embeddings == 4096.0
            ));
            assert_eq!(c.rope_theta, 150000.0);
            let n = ModelLayout::new(&c).n_params() as f64;
            assert!((n - total).abs() < 0.05e9, "{n}");
            // OpenAI counts the unembedding but not the embedding lookup, which ours counts.
            let a = (crate::active_params(&c) - c.vocab_size * c.hidden_size) as f64;
            assert!((a - active).abs() < 0.05e9, "{a}");
            assert_eq!(ModelConfig::from_json(&c.to_hf_json()).unwrap(), c);
        }
    }

    #[test]
    fn defaults_follow_transformers() {
        let v = json!({"model_type": "gpt_oss", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 8,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4});
        let c = ModelConfig::from_json(&v).unwrap();
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.num_experts, m.num_experts_per_tok, m.router_aux_loss_coef), (128, 4, 0.001));
        assert_eq!((c.layer_window(0), c.layer_window(1), c.layer_window(2)), (Some(128), None, Some(128)));
        assert!(c.qkv_bias && c.o_bias);
        assert!(
            matches!(c.rope_scaling, Some(RopeScaling::Yarn { factor, truncate: false, .. }) if factor == 32.0)
        );
        assert_eq!(ModelConfig::from_json(&c.to_hf_json()).unwrap(), c);
    }

    #[test]
    fn what_is_not_supported_is_refused_by_name() {
        let cases: [(&str, Value, &str); 9] = [
            ("layer_types", json!(["sliding_attention"]), "lists 1 layers"),
            (
                "layer_types",
                json!((0..24).map(|_| "chunked_attention").collect::<Vec<_>>()),
                "chunked_attention",
            ),
            ("quantization_config", json!({"quant_method": "bitsandbytes"}), "bitsandbytes"),
            ("attention_dropout", json!(0.1), "attention_dropout"),
            ("experts_per_token", json!(2), "experts_per_token is 2"),
            ("swiglu_limit", json!(-1.0), "swiglu_limit"),
            (
                "rope_scaling",
                json!({"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                "mscale": 1.0, "mscale_all_dim": 1.0}),
                "mscale",
            ),
            (
                "rope_scaling",
                json!({"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                "partial_rotary_factor": 0.5}),
                "partial_rotary_factor",
            ),
            ("rope_scaling", json!({"rope_type": "longrope", "factor": 32.0}), "longrope"),
        ];
        for (key, value, needle) in cases {
            let mut v = gpt_oss_20b();
            v[key] = value;
            let err = ModelConfig::from_json(&v).unwrap_err().to_string();
            assert!(err.contains(needle), "{key}: {err}");
        }
        let mut v = gpt_oss_20b();
        v["model_type"] = json!("llama");
        v.as_object_mut().unwrap().remove("layer_types");
        let err = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(err.contains("mxfp4"), "{err}");
    }

    #[test]
    fn a_huge_layer_count_is_refused_without_building_a_list() {
        let mut v = gpt_oss_20b();
        v.as_object_mut().unwrap().remove("layer_types");
        v["num_hidden_layers"] = json!(1u64 << 60);
        let err = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(err.contains("2^48 parameters"), "{err}");
    }
}

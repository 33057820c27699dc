//! The mixture-of-experts part of a model configuration (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS):
//! how many experts, how many route each token, their width and kind, how the top-k routing
//! weights are normalised and the load-balancing loss, parsed from `config.json` in
//! transformers 4 and 5 spellings.

use serde_json::{Map, Value};

use crate::config::{get, opt_bool, opt_f64, opt_usize, req_usize};
use crate::gpt_oss::{self, ClampedGlu};
use crate::{Arch, Error, Result};

/// What the experts (and the router) of a mixture-of-experts layer are.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertKind {
    /// SwiGLU experts without biases behind a bias-free router `mlp.gate.weight`:
    /// `mlp.experts.gate_up_proj` `[E, 2·f_e, h]` (each expert's gate rows, then its up rows),
    /// `mlp.experts.down_proj` `[E, h, f_e]` (Qwen3-MoE, Mixtral, OLMoE).
    SwiGlu,
    /// GPT-OSS: a router with a bias (`mlp.router.weight`, `mlp.router.bias`), experts with
    /// biases and the clamped GLU, stored as transformers does (`[in, out]` per expert):
    /// `mlp.experts.gate_up_proj` `[E, h, 2·f_e]` (gate and up in alternate columns),
    /// `gate_up_proj_bias` `[E, 2·f_e]`, `down_proj` `[E, f_e, h]`, `down_proj_bias` `[E, h]`.
    GptOss(ClampedGlu),
}

/// A mixture-of-experts MLP: `num_experts` SwiGLU experts of width `moe_intermediate_size`, a
/// linear router (`[E, h]`, no bias) whose softmax picks `num_experts_per_tok` experts per
/// token. No capacity limit: every token reaches its experts.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per layer (`num_experts`, or `num_local_experts`: transformers 5 writes the
    /// latter for `qwen3_moe`, transformers 4 the former; Mixtral always the latter).
    pub num_experts: usize,
    /// Experts each token is routed to (top-k of the router's softmax).
    pub num_experts_per_tok: usize,
    /// Width of one expert's SwiGLU (`moe_intermediate_size` for Qwen3-MoE, `intermediate_size`
    /// for Mixtral and OLMoE).
    pub moe_intermediate_size: usize,
    /// The top-k probabilities are divided by their sum (`norm_topk_prob`; Mixtral always).
    pub norm_topk_prob: bool,
    /// Weight of the load-balancing loss in the training loss.
    pub router_aux_loss_coef: f64,
    /// Whether training adds the load-balancing loss (transformers adds it to the loss when
    /// `output_router_logits` is true).
    pub output_router_logits: bool,
    /// The experts' kind (and with it the router's).
    pub experts: ExpertKind,
}

impl MoeConfig {
    /// The coefficient the training loss gives the load-balancing loss: `router_aux_loss_coef`
    /// when `output_router_logits`, else none.
    pub fn aux_coef(&self) -> Option<f64> {
        self.output_router_logits.then_some(self.router_aux_loss_coef)
    }

    /// Adds the MoE keys of `arch` to a `config.json` document, spelled so that transformers 4
    /// and 5 both read them.
    pub(crate) fn write_hf_json(&self, arch: Arch, v: &mut Value) {
        let experts_key =
            if matches!(arch, Arch::Mixtral | Arch::GptOss) { "num_local_experts" } else { "num_experts" };
        v[experts_key] = self.num_experts.into();
        v["num_experts_per_tok"] = self.num_experts_per_tok.into();
        v["router_aux_loss_coef"] = self.router_aux_loss_coef.into();
        v["output_router_logits"] = self.output_router_logits.into();
        match arch {
            Arch::Qwen3Moe => {
                v["moe_intermediate_size"] = self.moe_intermediate_size.into();
                v["norm_topk_prob"] = self.norm_topk_prob.into();
                v["decoder_sparse_step"] = 1.into();
                v["mlp_only_layers"] = Value::Array(Vec::new());
            }
            Arch::Olmoe => {
                v["norm_topk_prob"] = self.norm_topk_prob.into();
                v["clip_qkv"] = Value::Null;
            }
            Arch::Mixtral => v["router_jitter_noise"] = 0.0.into(),
            Arch::GptOss => {
                if let ExpertKind::GptOss(glu) = self.experts {
                    v["swiglu_limit"] = glu.limit.into();
                    v["swiglu_alpha"] = glu.alpha.into();
                }
            }
            Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => {}
        }
    }
}

/// The MoE configuration of a `config.json` of family `arch` (`None` for the dense families),
/// with transformers' defaults for missing keys. Refuses what the engine does not implement:
/// dense layers among the MoE ones (`mlp_only_layers`, `decoder_sparse_step`), router jitter
/// noise, OLMoE's `clip_qkv`.
pub(crate) fn parse_moe(obj: &Map<String, Value>, arch: Arch, n_layers: usize) -> Result<Option<MoeConfig>> {
    // transformers' defaults: (num_experts, num_experts_per_tok, router_aux_loss_coef).
    let (experts, top_k, coef) = match arch {
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => return Ok(None),
        Arch::Qwen3Moe => (128, 8, 0.001),
        Arch::Mixtral => (8, 2, 0.001),
        Arch::Olmoe => (64, 8, 0.01),
        Arch::GptOss => (gpt_oss::DEFAULT_EXPERTS, gpt_oss::DEFAULT_TOP_K, gpt_oss::DEFAULT_AUX_COEF),
    };
    let num_experts = match (opt_usize_any(obj, "num_experts")?, opt_usize_any(obj, "num_local_experts")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(Error::config("num_experts", format!("{a} but num_local_experts is {b}")))
        }
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => experts,
    };
    if num_experts == 0 {
        return Err(Error::Unsupported(format!(
            "{arch:?} with 0 experts (every layer dense); use the dense family's model_type"
        )));
    }
    let listed_top_k =
        if arch == Arch::GptOss { gpt_oss::top_k(obj)? } else { opt_usize(obj, "num_experts_per_tok")? };
    let num_experts_per_tok = listed_top_k.unwrap_or(top_k);
    if num_experts_per_tok > num_experts {
        return Err(Error::config(
            "num_experts_per_tok",
            format!("{num_experts_per_tok} is more than the {num_experts} experts"),
        ));
    }
    let moe_intermediate_size = match arch {
        Arch::Qwen3Moe => req_usize(obj, "moe_intermediate_size")?,
        _ => req_usize(obj, "intermediate_size")?,
    };
    // GPT-OSS takes the softmax of the top-k logits: the top-k of the softmax renormalised, in
    // value and in gradient.
    let norm_topk_prob = match arch {
        Arch::Mixtral | Arch::GptOss => true,
        _ => opt_bool(obj, "norm_topk_prob")?.unwrap_or(false),
    };
    let router_aux_loss_coef = opt_f64(obj, "router_aux_loss_coef")?.unwrap_or(coef);
    let output_router_logits = opt_bool(obj, "output_router_logits")?.unwrap_or(false);
    match arch {
        Arch::Qwen3Moe => check_all_sparse(obj, n_layers)?,
        Arch::Mixtral => {
            if opt_f64(obj, "router_jitter_noise")?.unwrap_or(0.0) != 0.0 {
                return Err(Error::Unsupported(
                    "router_jitter_noise != 0 (random multiplicative noise on the router's input in training)"
                        .into(),
                ));
            }
        }
        Arch::Olmoe => {
            if get(obj, "clip_qkv").is_some() {
                return Err(Error::Unsupported("clip_qkv (clamped q, k, v in OLMoE attention)".into()));
            }
        }
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::GptOss => {}
    }
    let experts = match arch {
        Arch::GptOss => ExpertKind::GptOss(gpt_oss::parse_glu(obj)?),
        _ => ExpertKind::SwiGlu,
    };
    Ok(Some(MoeConfig {
        num_experts,
        num_experts_per_tok,
        moe_intermediate_size,
        norm_topk_prob,
        router_aux_loss_coef,
        output_router_logits,
        experts,
    }))
}

/// A non-negative integer that may be 0 (unlike `opt_usize`).
fn opt_usize_any(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match get(obj, key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| Error::config(key, format!("expected a non-negative integer, found {v}"))),
    }
}

/// Qwen3-MoE: layer `i` is a MoE layer unless `i` is in `mlp_only_layers` or `(i + 1)` is not a
/// multiple of `decoder_sparse_step`. Every layer must be one: a layer is one unit of one
/// layout, so mixed dense and MoE layers are refused, naming the dense ones.
fn check_all_sparse(obj: &Map<String, Value>, n_layers: usize) -> Result<()> {
    let step = opt_usize_any(obj, "decoder_sparse_step")?.unwrap_or(1);
    let only: Vec<usize> = match get(obj, "mlp_only_layers") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_u64().and_then(|n| usize::try_from(n).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| Error::config("mlp_only_layers", "expected a list of layer indices"))?,
        Some(v) => return Err(Error::config("mlp_only_layers", format!("expected a list, found {v}"))),
    };
    // The first dense layers, found without walking every layer index: `num_hidden_layers` comes
    // from the same untrusted file (a count of 10^18 would loop for years).
    let dense: Vec<usize> = if step == 1 {
        let mut d: Vec<usize> = only.iter().copied().filter(|&i| i < n_layers).collect();
        d.sort_unstable();
        d.dedup();
        d.truncate(16);
        d
    } else {
        // Layer 0 is dense for any step but 1, so this stops after at most 2·16 indices.
        (0..n_layers).filter(|i| only.contains(i) || step == 0 || (i + 1) % step != 0).take(16).collect()
    };
    if dense.is_empty() {
        return Ok(());
    }
    Err(Error::Unsupported(format!(
        "qwen3_moe with dense MLP layers {dense:?} (the first 16 at most) among the MoE ones (decoder_sparse_step {step}, \
         mlp_only_layers {only:?}); every layer must be a MoE layer"
    )))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::{Arch, ModelConfig};

    fn base(model_type: &str) -> serde_json::Value {
        json!({
            "model_type": model_type, "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "hidden_act": "silu", "num_experts_per_tok": 2
        })
    }

    #[test]
    fn reads_both_spellings_of_the_expert_count() {
        for (family, key) in [
            ("qwen3_moe", "num_experts"),
            ("qwen3_moe", "num_local_experts"),
            ("mixtral", "num_local_experts"),
            ("olmoe", "num_experts"),
        ] {
            let mut v = base(family);
            v[key] = json!(6);
            v["moe_intermediate_size"] = json!(12);
            let c = ModelConfig::from_json(&v).unwrap();
            let m = c.moe.as_ref().unwrap();
            assert_eq!((m.num_experts, m.num_experts_per_tok), (6, 2), "{family} {key}");
            assert_eq!(ModelConfig::from_json(&c.to_hf_json()).unwrap(), c, "{family}");
        }
        let mut v = base("mixtral");
        v["num_experts"] = json!(4);
        v["num_local_experts"] = json!(6);
        assert!(ModelConfig::from_json(&v).unwrap_err().to_string().contains("num_local_experts is 6"));
    }

    #[test]
    fn family_defaults_follow_transformers() {
        let mut q = base("qwen3_moe");
        q["moe_intermediate_size"] = json!(12);
        let c = ModelConfig::from_json(&q).unwrap();
        let m = c.moe.unwrap();
        assert!(c.qk_norm && !c.qk_norm_full && c.arch == Arch::Qwen3Moe);
        assert_eq!((m.num_experts, m.moe_intermediate_size, m.norm_topk_prob), (128, 12, false));
        assert_eq!((m.router_aux_loss_coef, m.aux_coef()), (0.001, None));

        let c = ModelConfig::from_json(&base("mixtral")).unwrap();
        let m = c.moe.unwrap();
        assert!(!c.qk_norm && m.norm_topk_prob && c.rope_theta == 1e6);
        assert_eq!((m.num_experts, m.moe_intermediate_size), (8, 24));

        let mut o = base("olmoe");
        o["output_router_logits"] = json!(true);
        let c = ModelConfig::from_json(&o).unwrap();
        let m = c.moe.unwrap();
        assert!(c.qk_norm && c.qk_norm_full && !m.norm_topk_prob);
        assert_eq!((m.num_experts, m.aux_coef()), (64, Some(0.01)));
    }

    #[test]
    fn refuses_what_is_not_implemented() {
        let cases = [
            ("qwen3_moe", "mlp_only_layers", json!([1]), "dense MLP layers [1]"),
            ("qwen3_moe", "decoder_sparse_step", json!(2), "dense MLP layers [0]"),
            ("mixtral", "router_jitter_noise", json!(0.01), "router_jitter_noise"),
            ("olmoe", "clip_qkv", json!(8.0), "clip_qkv"),
            ("olmoe", "head_dim", json!(8), "head_dim 8"),
            ("mixtral", "num_experts_per_tok", json!(9), "more than the 8 experts"),
        ];
        for (family, key, value, needle) in cases {
            let mut v = base(family);
            v["moe_intermediate_size"] = json!(12);
            v[key] = value;
            let err = ModelConfig::from_json(&v).unwrap_err().to_string();
            assert!(err.contains(needle), "{family} {key}: {err}");
        }
        let mut v = base("qwen3_moe");
        v["moe_intermediate_size"] = json!(12);
        v["mlp_only_layers"] = json!([]);
        v["decoder_sparse_step"] = json!(1);
        assert!(ModelConfig::from_json(&v).is_ok());
    }

    /// Sizes from an untrusted file: no overflow, no walk over every layer index, and a model
    /// past 2^48 parameters through its experts alone is refused like a dense one.
    #[test]
    fn huge_sizes_are_refused_without_overflow_or_a_long_loop() {
        let cases = [
            ("qwen3_moe", "num_hidden_layers", json!(1u64 << 60), "2^48 parameters"),
            ("qwen3_moe", "num_experts", json!(1u64 << 40), "experts of width"),
            ("mixtral", "intermediate_size", json!(1u64 << 62), "2^48 parameters"),
            ("olmoe", "head_dim", json!(1u64 << 62), "head_dim"),
        ];
        for (family, key, value, needle) in cases {
            let mut v = base(family);
            v["moe_intermediate_size"] = json!(12);
            v[key] = value;
            let err = ModelConfig::from_json(&v).unwrap_err().to_string();
            assert!(err.contains(needle), "{family} {key}: {err}");
        }
        let mut v = base("qwen3_moe");
        v["moe_intermediate_size"] = json!(12);
        v["num_hidden_layers"] = json!(1u64 << 60);
        v["decoder_sparse_step"] = json!(3);
        let err = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(err.contains("dense MLP layers [0, 1, 3, 4,"), "{err}");
    }
}

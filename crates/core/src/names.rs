//! Names of the tensors of a decoder layer and of the outer unit, as in the layout table
//! (Hugging Face names, without the `model.layers.{i}.` prefix for layers). The one place these
//! strings are spelled.

/// `input_layernorm.weight` `[h]`.
pub const INPUT_NORM: &str = "input_layernorm.weight";
/// `self_attn.q_proj.weight` `[nh * hd, h]`.
pub const Q: &str = "self_attn.q_proj.weight";
/// `self_attn.q_proj.bias` `[nh * hd]`.
pub const Q_BIAS: &str = "self_attn.q_proj.bias";
/// `self_attn.k_proj.weight` `[nkv * hd, h]`.
pub const K: &str = "self_attn.k_proj.weight";
/// `self_attn.k_proj.bias` `[nkv * hd]`.
pub const K_BIAS: &str = "self_attn.k_proj.bias";
/// `self_attn.v_proj.weight` `[nkv * hd, h]`.
pub const V: &str = "self_attn.v_proj.weight";
/// `self_attn.v_proj.bias` `[nkv * hd]`.
pub const V_BIAS: &str = "self_attn.v_proj.bias";
/// `self_attn.o_proj.weight` `[h, nh * hd]`.
pub const O: &str = "self_attn.o_proj.weight";
/// `self_attn.o_proj.bias` `[h]`.
pub const O_BIAS: &str = "self_attn.o_proj.bias";
/// `self_attn.q_norm.weight` `[hd]` (Qwen3).
pub const Q_NORM: &str = "self_attn.q_norm.weight";
/// `self_attn.k_norm.weight` `[hd]` (Qwen3).
pub const K_NORM: &str = "self_attn.k_norm.weight";
/// `post_attention_layernorm.weight` `[h]`.
pub const POST_NORM: &str = "post_attention_layernorm.weight";
/// `mlp.gate_proj.weight` `[f, h]`.
pub const GATE: &str = "mlp.gate_proj.weight";
/// `mlp.up_proj.weight` `[f, h]`.
pub const UP: &str = "mlp.up_proj.weight";
/// `mlp.down_proj.weight` `[h, f]`.
pub const DOWN: &str = "mlp.down_proj.weight";
/// `model.embed_tokens.weight` `[V, h]`.
pub const EMBED: &str = "model.embed_tokens.weight";
/// `model.norm.weight` `[h]`.
pub const FINAL_NORM: &str = "model.norm.weight";
/// `lm_head.weight` `[V, h]` (absent when the embeddings are tied).
pub const LM_HEAD: &str = "lm_head.weight";
/// `mlp.gate.weight` `[E, h]`: the router of a mixture-of-experts layer (transformers' name
/// for Qwen3-MoE, OLMoE and, in transformers 5, Mixtral).
pub const ROUTER: &str = "mlp.gate.weight";
/// `mlp.experts.gate_up_proj` `[E, 2·f_e, h]`: every expert's gate rows then up rows, expert by
/// expert (transformers 5's packed expert parameter).
pub const EXPERTS_GATE_UP: &str = "mlp.experts.gate_up_proj";
/// `mlp.experts.down_proj` `[E, h, f_e]`: every expert's down projection.
pub const EXPERTS_DOWN: &str = "mlp.experts.down_proj";
/// `self_attn.sinks` `[nh]`: GPT-OSS's learned sink logit per query head.
pub const SINKS: &str = "self_attn.sinks";
/// `mlp.router.weight` `[E, h]`: GPT-OSS's router.
pub const GPT_OSS_ROUTER: &str = "mlp.router.weight";
/// `mlp.router.bias` `[E]`: GPT-OSS's router bias.
pub const ROUTER_BIAS: &str = "mlp.router.bias";
/// `mlp.experts.gate_up_proj_bias` `[E, 2·f_e]`: GPT-OSS's gate and up biases (alternate
/// entries, as the columns of its `gate_up_proj`).
pub const EXPERTS_GATE_UP_BIAS: &str = "mlp.experts.gate_up_proj_bias";
/// `mlp.experts.down_proj_bias` `[E, h]`: GPT-OSS's down-projection biases.
pub const EXPERTS_DOWN_BIAS: &str = "mlp.experts.down_proj_bias";

//! Binding: named views of one unit's weights inside a flat 1-D slot tensor. A view is a
//! `narrow` + `reshape` of the slot, so binding copies nothing and a later write into the slot
//! is visible through every view.

use candle_core::{DType, Tensor};
use mt_core::{ExpertKind, ModelConfig, UnitLayout};

use crate::{Error, Result};

pub use mt_core::names;

/// Checks that `slot` is a 1-D float tensor holding at least `layout.len` elements.
fn check_slot(layout: &UnitLayout, slot: &Tensor) -> Result<()> {
    if !slot.dtype().is_float() {
        return Err(Error::dtype("weight slot", "a float dtype", slot.dtype()));
    }
    let found = match slot.dims() {
        [n] => *n,
        dims => return Err(Error::shape("weight slot", "1-D", dims)),
    };
    if found < layout.len {
        return Err(Error::SlotTooShort { what: "weight slot", expected: layout.len, found });
    }
    Ok(())
}

/// A view of the tensor `name` of `layout` inside `slot`, checked against the shape the config
/// implies (so a layout built for another config is refused, not misread).
fn view(layout: &UnitLayout, slot: &Tensor, name: &str, shape: &[usize]) -> Result<Tensor> {
    let spec = layout.get(name)?;
    if spec.shape != shape {
        return Err(Error::shape(format!("layout entry {name}"), format!("{shape:?}"), &spec.shape));
    }
    Ok(slot.narrow(0, spec.offset, spec.numel())?.reshape(shape)?)
}

fn view_if(
    on: bool,
    layout: &UnitLayout,
    slot: &Tensor,
    name: &str,
    shape: &[usize],
) -> Result<Option<Tensor>> {
    on.then(|| view(layout, slot, name, shape)).transpose()
}

/// Views of one decoder layer's weights. Linear weights are `[out, in]` (PyTorch convention).
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// `input_layernorm.weight` `[h]`.
    pub input_norm: Tensor,
    /// `q_proj.weight` `[nh * hd, h]`.
    pub q: Tensor,
    /// `q_proj.bias` `[nh * hd]`, when `cfg.qkv_bias`.
    pub q_bias: Option<Tensor>,
    /// `k_proj.weight` `[nkv * hd, h]`.
    pub k: Tensor,
    /// `k_proj.bias` `[nkv * hd]`, when `cfg.qkv_bias`.
    pub k_bias: Option<Tensor>,
    /// `v_proj.weight` `[nkv * hd, h]`.
    pub v: Tensor,
    /// `v_proj.bias` `[nkv * hd]`, when `cfg.qkv_bias`.
    pub v_bias: Option<Tensor>,
    /// `o_proj.weight` `[h, nh * hd]`.
    pub o: Tensor,
    /// `o_proj.bias` `[h]`, when `cfg.o_bias`.
    pub o_bias: Option<Tensor>,
    /// `q_norm.weight` `[hd]` (`[nh * hd]` when `cfg.qk_norm_full`), when `cfg.qk_norm`.
    pub q_norm: Option<Tensor>,
    /// `k_norm.weight` `[hd]` (`[nkv * hd]` when `cfg.qk_norm_full`), when `cfg.qk_norm`.
    pub k_norm: Option<Tensor>,
    /// `self_attn.sinks` `[nh]`, when `cfg.attention_sinks` (GPT-OSS).
    pub sinks: Option<Tensor>,
    /// `post_attention_layernorm.weight` `[h]`.
    pub post_norm: Tensor,
    /// The MLP's weights.
    pub mlp: MlpWeights,
    /// LoRA adapters of its linear layers (`cfg.lora`), after the base tensors in the slot.
    pub lora: Option<crate::lora::LoraWeights>,
}

/// Views of a decoder layer's MLP weights.
#[derive(Debug, Clone)]
pub enum MlpWeights {
    /// The dense SwiGLU MLP.
    Dense {
        /// `gate_proj.weight` `[f, h]`.
        gate: Tensor,
        /// `up_proj.weight` `[f, h]`.
        up: Tensor,
        /// `down_proj.weight` `[h, f]`.
        down: Tensor,
    },
    /// A mixture of `E` experts of width `f_e` behind a linear router (`mt_core::ExpertKind`
    /// says which: the biases are GPT-OSS's, as is the `[in, out]` orientation of its matrices).
    Moe {
        /// `mlp.gate.weight` `[E, h]` (GPT-OSS: `mlp.router.weight`).
        router: Tensor,
        /// `mlp.router.bias` `[E]` (GPT-OSS).
        router_bias: Option<Tensor>,
        /// `mlp.experts.gate_up_proj` `[E, 2·f_e, h]` (expert `e`'s gate rows, then its up rows);
        /// GPT-OSS: `[E, h, 2·f_e]`, gate and up in alternate columns.
        gate_up: Tensor,
        /// `mlp.experts.gate_up_proj_bias` `[E, 2·f_e]` (GPT-OSS; alternate gate and up).
        gate_up_bias: Option<Tensor>,
        /// `mlp.experts.down_proj` `[E, h, f_e]`; GPT-OSS: `[E, f_e, h]`.
        down: Tensor,
        /// `mlp.experts.down_proj_bias` `[E, h]` (GPT-OSS).
        down_bias: Option<Tensor>,
    },
}

impl LayerWeights {
    /// Binds views into `slot` (1-D, any float dtype, at least `layout.len` elements). No copy.
    pub fn bind(cfg: &ModelConfig, layout: &UnitLayout, slot: &Tensor) -> Result<Self> {
        use names::*;
        check_slot(layout, slot)?;
        let (h, f, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
        let (qn, kn) = if cfg.qk_norm_full { (q, kv) } else { (hd, hd) };
        let v = |name: &str, shape: &[usize]| view(layout, slot, name, shape);
        let v_if = |on: bool, name: &str, shape: &[usize]| view_if(on, layout, slot, name, shape);
        Ok(LayerWeights {
            input_norm: v(INPUT_NORM, &[h])?,
            q: v(Q, &[q, h])?,
            q_bias: v_if(cfg.qkv_bias, Q_BIAS, &[q])?,
            k: v(K, &[kv, h])?,
            k_bias: v_if(cfg.qkv_bias, K_BIAS, &[kv])?,
            v: v(V, &[kv, h])?,
            v_bias: v_if(cfg.qkv_bias, V_BIAS, &[kv])?,
            o: v(O, &[h, q])?,
            o_bias: v_if(cfg.o_bias, O_BIAS, &[h])?,
            q_norm: v_if(cfg.qk_norm, Q_NORM, &[qn])?,
            k_norm: v_if(cfg.qk_norm, K_NORM, &[kn])?,
            sinks: v_if(cfg.attention_sinks, SINKS, &[cfg.num_attention_heads])?,
            post_norm: v(POST_NORM, &[h])?,
            mlp: match &cfg.moe {
                None => MlpWeights::Dense {
                    gate: v(GATE, &[f, h])?,
                    up: v(UP, &[f, h])?,
                    down: v(DOWN, &[h, f])?,
                },
                Some(m) => {
                    let (e, fe) = (m.num_experts, m.moe_intermediate_size);
                    match m.experts {
                        ExpertKind::SwiGlu => MlpWeights::Moe {
                            router: v(ROUTER, &[e, h])?,
                            router_bias: None,
                            gate_up: v(EXPERTS_GATE_UP, &[e, 2 * fe, h])?,
                            gate_up_bias: None,
                            down: v(EXPERTS_DOWN, &[e, h, fe])?,
                            down_bias: None,
                        },
                        ExpertKind::GptOss(_) => MlpWeights::Moe {
                            router: v(GPT_OSS_ROUTER, &[e, h])?,
                            router_bias: Some(v(ROUTER_BIAS, &[e])?),
                            gate_up: v(EXPERTS_GATE_UP, &[e, h, 2 * fe])?,
                            gate_up_bias: Some(v(EXPERTS_GATE_UP_BIAS, &[e, 2 * fe])?),
                            down: v(EXPERTS_DOWN, &[e, fe, h])?,
                            down_bias: Some(v(EXPERTS_DOWN_BIAS, &[e, h])?),
                        },
                    }
                }
            },
            lora: crate::lora::LoraWeights::bind(cfg, v)?,
        })
    }

    /// The compute dtype (the slot's dtype).
    pub fn dtype(&self) -> DType {
        self.q.dtype()
    }
}

/// Views of the outer unit's weights.
#[derive(Debug, Clone)]
pub struct OuterWeights {
    /// `model.embed_tokens.weight` `[V, h]`.
    pub embed: Tensor,
    /// `model.norm.weight` `[h]`.
    pub norm: Tensor,
    /// `lm_head.weight` `[V, h]`; `None` when the head is tied to the embedding.
    pub lm_head: Option<Tensor>,
}

impl OuterWeights {
    /// Binds views into `slot` (1-D, any float dtype, at least `layout.len` elements). No copy.
    pub fn bind(cfg: &ModelConfig, layout: &UnitLayout, slot: &Tensor) -> Result<Self> {
        check_slot(layout, slot)?;
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        Ok(OuterWeights {
            embed: view(layout, slot, names::EMBED, &[v, h])?,
            norm: view(layout, slot, names::FINAL_NORM, &[h])?,
            lm_head: view_if(!cfg.tie_word_embeddings, layout, slot, names::LM_HEAD, &[v, h])?,
        })
    }

    /// The LM head matrix `[V, h]`: `lm_head.weight`, or the embedding when tied.
    pub fn head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Name of the tensor that receives the LM head's gradient.
    pub fn head_name(&self) -> &'static str {
        if self.lm_head.is_some() {
            names::LM_HEAD
        } else {
            names::EMBED
        }
    }

    /// The compute dtype (the slot's dtype).
    pub fn dtype(&self) -> DType {
        self.embed.dtype()
    }
}

//! The resident reference model: a plain Llama/Mistral/Qwen2/Qwen3 causal LM (and the
//! mixture-of-experts Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, in `reference_moe.rs`) written with candle
//! ops in the most obvious way (no streaming, no fused kernels, no explicit backward), trained by
//! candle autograd. It is the oracle the streamed engine's loss and gradients are checked against.
//!
//! Architecture Invariant: this module shares no code with the engine's layer templates
//! (`mt-layers`); the two implementations check each other. It follows the Hugging Face
//! transformers modelling code ("eager" attention) operation by operation.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var, D};
use mt_core::{ModelConfig, ModelLayout, RopeScaling};

use crate::reference_moe::{load_balancing_loss, Routing};
use crate::{Error, Result};

const EMBED: &str = "model.embed_tokens.weight";
const FINAL_NORM: &str = "model.norm.weight";
const LM_HEAD: &str = "lm_head.weight";

/// Label value that contributes nothing to the loss (PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// RoPE inverse frequencies (`head_dim / 2` of them), computed in f32 exactly as transformers
/// does: `inv_freq[i] = 1 / theta^(2i / head_dim)`, then the config's scaling:
///
/// - linear: `inv_freq / factor`;
/// - llama3: with `wavelen = 2π / inv_freq`, `low_wavelen = old_ctx / low_freq_factor`,
///   `high_wavelen = old_ctx / high_freq_factor`: long wavelengths (`> low_wavelen`) are divided by
///   `factor`, short ones (`< high_wavelen`) are kept, and the band between is interpolated with
///   `smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)`:
///   `(1 - smooth) * inv / factor + smooth * inv`.
pub fn rope_inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let hd = cfg.head_dim;
    let base = cfg.rope_theta as f32;
    let inv: Vec<f32> = (0..hd / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / hd as f32)).collect();
    match &cfg.rope_scaling {
        None => inv,
        Some(RopeScaling::Linear { factor }) => inv.iter().map(|&f| f / *factor as f32).collect(),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        }) => {
            let factor = *factor as f32;
            let (low_ff, old_ctx) = (*low_freq_factor as f32, *old as f32);
            let low_wavelen = (old / low_freq_factor) as f32;
            let high_wavelen = (old / high_freq_factor) as f32;
            let band = (high_freq_factor - low_freq_factor) as f32;
            inv.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    let inv_l = if wavelen > low_wavelen { f / factor } else { f };
                    // transformers: `~(wavelen < high) & ~(wavelen > low)`; wavelen is never NaN.
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    if medium {
                        let smooth = (old_ctx / wavelen - low_ff) / band;
                        (1.0 - smooth) * inv_l / factor + smooth * inv_l
                    } else {
                        inv_l
                    }
                })
                .collect()
        }
        Some(RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings: old,
            truncate,
            ..
        }) => yarn_inv_freq(&inv, hd, cfg.rope_theta, *factor, (*beta_fast, *beta_slow), *old, *truncate),
    }
}

/// YaRN: with `d(r) = hd · ln(old_ctx / (2π r)) / (2 ln θ)` (the dimension that turns `r` times
/// over the original context), `low = d(beta_fast)`, `high = d(beta_slow)` (floored and ceiled
/// when `truncate`, clamped to `[0, hd - 1]`), `ramp_i = clamp((i - low) / (high - low), 0, 1)`
/// over the `hd / 2` frequencies: `inv_i · (ramp_i / factor + (1 - ramp_i))`, computed in f32 as
/// transformers computes it.
fn yarn_inv_freq(
    inv: &[f32],
    hd: usize,
    theta: f64,
    factor: f64,
    (beta_fast, beta_slow): (f64, f64),
    old: f64,
    truncate: bool,
) -> Vec<f32> {
    let dim_of =
        |rot: f64| (hd as f64 * (old / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln());
    let (low, high) = if truncate {
        (dim_of(beta_fast).floor(), dim_of(beta_slow).ceil())
    } else {
        (dim_of(beta_fast), dim_of(beta_slow))
    };
    let low = low.max(0.0);
    let high = high.min(hd as f64 - 1.0);
    let high = if low == high { high + 0.001 } else { high };
    (0..inv.len())
        .map(|i| {
            let pos_freq = (theta as f32).powf((2 * i) as f32 / hd as f32);
            let (extrap, interp) = (1.0 / pos_freq, 1.0 / (factor as f32 * pos_freq));
            let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            interp * (1.0 - keep) + extrap * keep
        })
        .collect()
}

/// Checks a parameter map against the model layout: every layout parameter present with its
/// shape, no other names.
pub fn check_params(layout: &ModelLayout, params: &BTreeMap<String, Tensor>) -> Result<()> {
    let all = layout.all_params();
    for (name, _, spec) in &all {
        let t = params.get(name).ok_or_else(|| Error::MissingParam(name.clone()))?;
        if t.dims() != spec.shape.as_slice() {
            return Err(Error::Shape {
                what: name.clone(),
                expected: spec.shape.clone(),
                found: t.dims().to_vec(),
            });
        }
    }
    if let Some(extra) = params.keys().find(|k| !all.iter().any(|(n, _, _)| n == *k)) {
        return Err(Error::UnknownParam(extra.clone()));
    }
    Ok(())
}

/// A resident causal LM with its parameters as candle [`Var`]s keyed by HF name.
pub struct ReferenceModel {
    cfg: ModelConfig,
    layout: ModelLayout,
    dtype: DType,
    vars: BTreeMap<String, Var>,
}

impl std::fmt::Debug for ReferenceModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReferenceModel")
            .field("arch", &self.cfg.arch)
            .field("dtype", &self.dtype)
            .field("n_params", &self.layout.n_params())
            .finish()
    }
}

impl ReferenceModel {
    /// Builds the model from HF-named parameters (any float dtype; converted to `dtype`, which
    /// must be F32 or F64). Every name and shape is checked against [`ModelLayout`]; the error
    /// names the offending parameter.
    pub fn new(cfg: &ModelConfig, params: &BTreeMap<String, Tensor>, dtype: DType) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::F64) {
            return Err(Error::Unsupported(format!("dtype {dtype:?}; use F32 or F64")));
        }
        let layout = ModelLayout::new(cfg);
        let mut model = ReferenceModel { cfg: cfg.clone(), layout, dtype, vars: BTreeMap::new() };
        model.set_params(params)?;
        Ok(model)
    }

    /// Replaces every parameter (same checks as [`ReferenceModel::new`]). The new values get fresh
    /// storage; tensors returned earlier by [`ReferenceModel::params`] are not modified.
    pub fn set_params(&mut self, params: &BTreeMap<String, Tensor>) -> Result<()> {
        check_params(&self.layout, params)?;
        let mut vars = BTreeMap::new();
        for (name, t) in params {
            let t = t.to_device(&Device::Cpu)?.to_dtype(self.dtype)?;
            vars.insert(name.clone(), Var::from_tensor(&t)?);
        }
        self.vars = vars;
        Ok(())
    }

    /// The model's configuration.
    pub fn cfg(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The dtype the model computes in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Current parameters by HF name (in the model's dtype, detached from any graph).
    pub fn params(&self) -> BTreeMap<String, Tensor> {
        self.vars.iter().map(|(n, v)| (n.clone(), v.as_detached_tensor())).collect()
    }

    fn w(&self, name: &str) -> Result<&Tensor> {
        self.vars.get(name).map(Var::as_tensor).ok_or_else(|| Error::MissingParam(name.to_owned()))
    }

    pub(crate) fn layer_w(&self, i: usize, local: &str) -> Result<&Tensor> {
        self.w(&format!("model.layers.{i}.{local}"))
    }

    fn layer_b(&self, i: usize, local: &str, present: bool) -> Result<Option<&Tensor>> {
        if present {
            self.layer_w(i, local).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Checks `[b, t]` u32 token ids and returns `(b, t)`.
    fn check_ids(&self, input_ids: &Tensor) -> Result<(usize, usize)> {
        if input_ids.dtype() != DType::U32 {
            return Err(Error::Data(format!("input_ids must be U32, found {:?}", input_ids.dtype())));
        }
        let (b, t) = input_ids.dims2().map_err(|_| Error::Shape {
            what: "input_ids".into(),
            expected: vec![0, 0],
            found: input_ids.dims().to_vec(),
        })?;
        if b == 0 || t == 0 {
            return Err(Error::Data(format!("input_ids is empty (shape [{b}, {t}])")));
        }
        let max = input_ids.max_all()?.to_scalar::<u32>()?;
        if max as usize >= self.cfg.vocab_size {
            return Err(Error::Data(format!(
                "token id {max} out of range for vocab_size {}",
                self.cfg.vocab_size
            )));
        }
        self.cfg.check_seq_len(t)?;
        Ok((b, t))
    }

    /// cos and sin tables `[t, head_dim]`: angle = position * inv_freq in f32 (as transformers
    /// does), duplicated over both halves; cos/sin evaluated in f64 and cast to the model dtype.
    fn rope_tables(&self, t: usize) -> Result<(Tensor, Tensor)> {
        let inv = rope_inv_freq(&self.cfg);
        let hd = self.cfg.head_dim;
        // YaRN multiplies cos and sin by its attention factor.
        let scale = self.cfg.rope_scaling.as_ref().map_or(1.0, RopeScaling::attention_factor);
        let mut cos = Vec::with_capacity(t * hd);
        let mut sin = Vec::with_capacity(t * hd);
        for p in 0..t {
            for j in 0..hd {
                let angle = f64::from(p as f32 * inv[j % (hd / 2)]);
                cos.push(angle.cos() * scale);
                sin.push(angle.sin() * scale);
            }
        }
        let cos = Tensor::from_vec(cos, (t, hd), &Device::Cpu)?.to_dtype(self.dtype)?;
        let sin = Tensor::from_vec(sin, (t, hd), &Device::Cpu)?.to_dtype(self.dtype)?;
        Ok((cos, sin))
    }

    /// Additive causal mask `[t, t]`: 0 where key position <= query position (and, with a
    /// `window`, > query position - window: transformers' `sliding_window_overlay`), -inf
    /// elsewhere.
    fn causal_mask(&self, t: usize, window: Option<usize>) -> Result<Tensor> {
        let visible =
            move |q: usize, k: usize| k <= q && window.is_none_or(|w| k as i64 > q as i64 - w as i64);
        let m: Vec<f64> = (0..t)
            .flat_map(|q| (0..t).map(move |k| if visible(q, k) { 0.0 } else { f64::NEG_INFINITY }))
            .collect();
        Ok(Tensor::from_vec(m, (t, t), &Device::Cpu)?.to_dtype(self.dtype)?)
    }

    /// Final-normed hidden states `[b * t, hidden]`, and a MoE model's routing of each layer.
    fn hidden(&self, input_ids: &Tensor) -> Result<(Tensor, usize, usize, Vec<Routing>)> {
        let (b, t) = self.check_ids(input_ids)?;
        let mut x = self.w(EMBED)?.index_select(&input_ids.flatten_all()?, 0)?;
        let (cos, sin) = self.rope_tables(t)?;
        let mut routing = Vec::new();
        for i in 0..self.cfg.num_hidden_layers {
            let mask = self.causal_mask(t, self.cfg.layer_window(i))?;
            let (y, r) = self.decoder_layer(i, &x, b, t, &cos, &sin, &mask)?;
            x = y;
            routing.extend(r);
        }
        let x = rms_norm(&x, self.w(FINAL_NORM)?, self.cfg.rms_norm_eps)?;
        Ok((x, b, t, routing))
    }

    #[allow(clippy::too_many_arguments)]
    fn decoder_layer(
        &self,
        i: usize,
        x: &Tensor,
        b: usize,
        t: usize,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
    ) -> Result<(Tensor, Option<Routing>)> {
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let eps = cfg.rms_norm_eps;

        // Self-attention block.
        let a = rms_norm(x, self.layer_w(i, "input_layernorm.weight")?, eps)?;
        let q = linear(
            &a,
            self.layer_w(i, "self_attn.q_proj.weight")?,
            self.layer_b(i, "self_attn.q_proj.bias", cfg.qkv_bias)?,
        )?;
        let k = linear(
            &a,
            self.layer_w(i, "self_attn.k_proj.weight")?,
            self.layer_b(i, "self_attn.k_proj.bias", cfg.qkv_bias)?,
        )?;
        let v = linear(
            &a,
            self.layer_w(i, "self_attn.v_proj.weight")?,
            self.layer_b(i, "self_attn.v_proj.bias", cfg.qkv_bias)?,
        )?;
        // OLMoE normalises the whole projections, then [b*t, n*hd] -> [b, t, n, hd]; Qwen3
        // normalises each head, both before RoPE.
        let (q, k) = if cfg.qk_norm && cfg.qk_norm_full {
            (
                rms_norm(&q, self.layer_w(i, "self_attn.q_norm.weight")?, eps)?,
                rms_norm(&k, self.layer_w(i, "self_attn.k_norm.weight")?, eps)?,
            )
        } else {
            (q, k)
        };
        let mut q = q.reshape((b, t, nh, hd))?;
        let mut k = k.reshape((b, t, nkv, hd))?;
        if cfg.qk_norm && !cfg.qk_norm_full {
            q = rms_norm(&q, self.layer_w(i, "self_attn.q_norm.weight")?, eps)?;
            k = rms_norm(&k, self.layer_w(i, "self_attn.k_norm.weight")?, eps)?;
        }
        // -> [b, n, t, hd]
        let q = q.transpose(1, 2)?.contiguous()?;
        let k = k.transpose(1, 2)?.contiguous()?;
        let v = v.reshape((b, t, nkv, hd))?.transpose(1, 2)?.contiguous()?;
        let q = apply_rope(&q, cos, sin)?;
        let k = apply_rope(&k, cos, sin)?;
        // GQA: query head j reads kv head j / (nh / nkv).
        let k = repeat_kv(&k, nh / nkv)?;
        let v = repeat_kv(&v, nh / nkv)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?.broadcast_add(mask)?;
        let probs = if cfg.attention_sinks {
            // GPT-OSS: each head's sink logit as one more column of the softmax, then dropped.
            let sinks =
                self.layer_w(i, "self_attn.sinks")?.reshape((1, nh, 1, 1))?.broadcast_as((b, nh, t, 1))?;
            let combined = Tensor::cat(&[&scores, &sinks.contiguous()?], D::Minus1)?;
            softmax_last_dim(&combined)?.narrow(D::Minus1, 0, t)?
        } else {
            softmax_last_dim(&scores)?
        };
        let ctx = probs.matmul(&v)?; // [b, nh, t, hd]
        let ctx = ctx.transpose(1, 2)?.contiguous()?.reshape((b * t, nh * hd))?;
        let o = linear(
            &ctx,
            self.layer_w(i, "self_attn.o_proj.weight")?,
            self.layer_b(i, "self_attn.o_proj.bias", cfg.o_bias)?,
        )?;
        let x = (x + o)?;

        // SwiGLU MLP block, or a mixture of SwiGLU experts.
        let c = rms_norm(&x, self.layer_w(i, "post_attention_layernorm.weight")?, eps)?;
        if let Some(moe) = &cfg.moe {
            let (m, routing) = match moe.experts {
                mt_core::ExpertKind::SwiGlu => self.moe_block(i, &c, moe)?,
                mt_core::ExpertKind::GptOss(glu) => self.gpt_oss_moe_block(i, &c, moe, glu)?,
            };
            return Ok(((x + m)?, Some(routing)));
        }
        let gate = linear(&c, self.layer_w(i, "mlp.gate_proj.weight")?, None)?;
        let up = linear(&c, self.layer_w(i, "mlp.up_proj.weight")?, None)?;
        let m = linear(&(silu(&gate)? * up)?, self.layer_w(i, "mlp.down_proj.weight")?, None)?;
        Ok(((x + m)?, None))
    }

    /// Logits `[b, t, vocab]` for `[b, t]` u32 token ids.
    pub fn logits(&self, input_ids: &Tensor) -> Result<Tensor> {
        Ok(self.logits_routing(input_ids)?.0)
    }

    /// A MoE model's router logits `[b·t, E]` of every layer (none for a dense model).
    pub fn router_logits(&self, input_ids: &Tensor) -> Result<Vec<Tensor>> {
        Ok(self.logits_routing(input_ids)?.1.into_iter().map(|r| r.logits).collect())
    }

    fn logits_routing(&self, input_ids: &Tensor) -> Result<(Tensor, Vec<Routing>)> {
        let (h, b, t, routing) = self.hidden(input_ids)?;
        let head = if self.cfg.tie_word_embeddings { self.w(EMBED)? } else { self.w(LM_HEAD)? };
        Ok((linear(&h, head, None)?.reshape((b, t, self.cfg.vocab_size))?, routing))
    }

    /// Mean cross-entropy over the targets that are not [`IGNORE_INDEX`]; `targets` holds one
    /// label per input position (`b * t`, row-major), already shifted (next-token). A scalar in
    /// the model's dtype, attached to the autograd graph.
    pub fn loss(&self, input_ids: &Tensor, targets: &[i64]) -> Result<Tensor> {
        let n = input_ids.elem_count();
        if targets.len() != n {
            return Err(Error::Data(format!(
                "{} targets for {n} input positions (shape {:?}); need one per position",
                targets.len(),
                input_ids.dims()
            )));
        }
        let vocab = self.cfg.vocab_size;
        let mut rows = Vec::new();
        let mut labels = Vec::new();
        for (pos, &y) in targets.iter().enumerate() {
            if y == IGNORE_INDEX {
                continue;
            }
            if y < 0 || y as u64 >= vocab as u64 {
                return Err(Error::Data(format!(
                    "target {y} at position {pos} is neither -100 nor a token id < {vocab}"
                )));
            }
            rows.push(pos as u32);
            labels.push(y as u32);
        }
        if rows.is_empty() {
            return Err(Error::NoTargetTokens);
        }
        let count = rows.len();
        let (logits, routing) = self.logits_routing(input_ids)?;
        let logits = logits.reshape((n, vocab))?;
        let rows = Tensor::from_vec(rows, count, &Device::Cpu)?;
        let labels = Tensor::from_vec(labels, (count, 1), &Device::Cpu)?;
        let logp = log_softmax_last_dim(&logits.index_select(&rows, 0)?)?;
        let picked = logp.gather(&labels, 1)?; // [count, 1]
        let ce = (picked.sum_all()?.neg()? / count as f64)?;
        match self.cfg.moe.as_ref().and_then(|m| m.aux_coef()) {
            Some(coef) => Ok((ce + (load_balancing_loss(&routing)? * coef)?)?),
            None => Ok(ce),
        }
    }

    /// The loss (as f64) and the gradient of every parameter by HF name (model dtype). For a
    /// tied model the embedding gradient includes the LM head's contribution.
    pub fn loss_and_grads(
        &self,
        input_ids: &Tensor,
        targets: &[i64],
    ) -> Result<(f64, BTreeMap<String, Tensor>)> {
        let loss = self.loss(input_ids, targets)?;
        let store = loss.backward()?;
        let mut grads = BTreeMap::new();
        for (name, var) in &self.vars {
            let g = match store.get(var.as_tensor()) {
                Some(g) => g.clone(),
                None => var.as_tensor().zeros_like()?,
            };
            grads.insert(name.clone(), g);
        }
        Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, grads))
    }
}

/// `y = x W^T (+ b)` for `x: [n, in]`, `W: [out, in]` (PyTorch `Linear`).
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// RMSNorm over the last dimension: `w * (x / sqrt(mean(x^2) + eps))`.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let mean_sq = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv_rms = (mean_sq + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv_rms)?.broadcast_mul(w)
}

/// `x * sigmoid(x)` with `sigmoid(x) = 1 / (1 + exp(-x))`.
pub(crate) fn silu(x: &Tensor) -> candle_core::Result<Tensor> {
    let denom = (x.neg()?.exp()? + 1.0)?;
    x.div(&denom)
}

/// `x * cos + rotate_half(x) * sin`, `rotate_half(x) = cat(-x2, x1)` over the last dimension.
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// `[b, nkv, t, hd]` -> `[b, nkv * rep, t, hd]`, each kv head repeated `rep` times in place.
fn repeat_kv(x: &Tensor, rep: usize) -> candle_core::Result<Tensor> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let (b, nkv, t, hd) = x.dims4()?;
    x.unsqueeze(2)?.broadcast_as((b, nkv, rep, t, hd))?.contiguous()?.reshape((b, nkv * rep, t, hd))
}

/// Softmax over the last dimension: `exp(x - max) / sum(exp(x - max))`, the max held constant.
pub(crate) fn softmax_last_dim(x: &Tensor) -> candle_core::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Log-softmax over the last dimension: `(x - max) - log(sum(exp(x - max)))`.
fn log_softmax_last_dim(x: &Tensor) -> candle_core::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let z = x.broadcast_sub(&max)?;
    z.broadcast_sub(&z.exp()?.sum_keepdim(D::Minus1)?.log()?)
}

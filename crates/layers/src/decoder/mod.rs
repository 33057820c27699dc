//! The decoder layer template: explicit forward, and a backward that recomputes the forward
//! from the checkpointed layer input and accumulates every weight gradient into a `GradSink`.
//!
//! Long sequences: the attention runs over the whole chunk (flash attention keeps it O(t)), the
//! MLP over row tiles of [`LayerOptions::mlp_rows`] rows, so that no `[t, ffn]` tensor exists
//! whole; the backward recomputes each tile's MLP from the attention block's output just before
//! back-propagating through it.

use std::ops::Range;
use std::sync::Arc;

use candle_core::Tensor;
use mt_core::ModelConfig;

use crate::attention::{self, Dims, Extras};
use crate::lora::Adapted;
use crate::mlp;
use crate::moe::{RouterGrad, RouterStats};
use crate::ops::{add, linear, rms_norm, rms_norm_backward, RmsCache};
use crate::positions::Positions;
use crate::profile::{mark, start as prof_start};
use crate::rope::{self, Rope};
use crate::weights::{names, LayerWeights};
use crate::{Error, GradSink, Result};
use mt_core::LoraTarget;

mod state;

pub use state::LayerState;
use state::Saved;

/// Template for one decoder layer (Llama / Mistral / Qwen2 / Qwen3, and the mixture-of-experts
/// Qwen3-MoE / Mixtral / OLMoE / GPT-OSS, whose MLP is [`crate::moe`]'s). Stateless: it holds
/// only the configuration and how to run it; weights are passed in as views on every call.
///
/// GPT-OSS's layers differ by index (a sliding window on some, `layer_types`): its template
/// runs a layer once told which ([`DecoderLayer::for_layer`]), and refuses to run otherwise.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    cfg: Arc<ModelConfig>,
    opts: LayerOptions,
    /// The layer this template runs, when the model's layers differ.
    layer: Option<usize>,
}

/// How a decoder layer runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerOptions {
    /// Flash attention where it applies (bf16 on CUDA, head dim 16, 32, 64 or 128:
    /// [`flash_attention`]); the materialised scores elsewhere.
    pub flash: bool,
    /// Which flash kernels (the Hopper ones wherever they run, by default).
    pub flash_kernel: mt_kernels::FlashKernel,
    /// Rows (tokens of a chunk, all its sequences together) of each MLP tile; 0 = all at once.
    pub mlp_rows: usize,
    /// Which path a mixture of experts runs (the device kernels wherever they apply, by default).
    pub moe_kernels: crate::MoeKernels,
}

/// Whether the flash path applies to activations of `dtype` on `device` for a head dim of
/// `head_dim`.
pub fn flash_attention(device: &candle_core::Device, dtype: candle_core::DType, head_dim: usize) -> bool {
    #[cfg(feature = "cuda")]
    return mt_kernels::applies_on(device, dtype) && crate::flash_head_dim(head_dim);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, dtype, head_dim);
        false
    }
}

impl DecoderLayer {
    /// A template for layers of this model, materialised attention, no MLP tiles.
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::with_options(cfg, LayerOptions::default())
    }

    /// A template that runs as `opts` says.
    pub fn with_options(cfg: &ModelConfig, opts: LayerOptions) -> Self {
        DecoderLayer { cfg: Arc::new(cfg.clone()), opts, layer: None }
    }

    /// The template of layer `i` (a cheap copy): for a model whose layers differ by index
    /// (GPT-OSS's sliding-window layers) the only way to run one; for the others the same
    /// template. An index past the model's layers is refused.
    pub fn for_layer(&self, i: usize) -> Result<Self> {
        if i >= self.cfg.num_hidden_layers {
            return Err(Error::shape(
                "layer index",
                format!("< num_hidden_layers = {}", self.cfg.num_hidden_layers),
                &[i],
            ));
        }
        if let Some(w) = &self.cfg.layer_windows {
            if w.windowed(i).is_none() {
                return Err(Error::shape("layer index", "an index that layer_types lists", &[i]));
            }
        }
        Ok(DecoderLayer { cfg: Arc::clone(&self.cfg), opts: self.opts, layer: Some(i) })
    }

    /// The attention window of the layer this template runs (`None`: causal, whole sequence).
    fn window(&self) -> Option<usize> {
        self.layer.and_then(|i| self.cfg.layer_window(i))
    }

    /// The configuration the template was built for.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// How it runs.
    pub fn options(&self) -> LayerOptions {
        self.opts
    }

    /// Forward of `x: [b, t, h]` (the weights' dtype) at positions `0..t` of every sequence.
    pub fn forward(&self, w: &LayerWeights, x: &Tensor, rope: &Rope) -> Result<Tensor> {
        self.forward_at(w, x, rope, 0)
    }

    /// Forward at positions `start..start + t` of every sequence.
    pub fn forward_at(&self, w: &LayerWeights, x: &Tensor, rope: &Rope, start: usize) -> Result<Tensor> {
        self.forward_pos(w, x, &Positions::range(rope, start, x.dim(1)?)?)
    }

    /// Forward at the tokens' [`Positions`] (per-token positions, packed documents).
    pub fn forward_pos(&self, w: &LayerWeights, x: &Tensor, pos: &Positions) -> Result<Tensor> {
        let (out, _) = self.run(w, x, pos, Output::Keep, None)?;
        Ok(out.expect("the forward keeps its output"))
    }

    /// [`DecoderLayer::forward_pos`] (`keep`: [`DecoderLayer::forward_keep_pos`]) that adds a
    /// MoE layer's router statistics to `stats`, for the load-balancing loss of the step
    /// ([`RouterStats::aux_loss`]). A dense layer adds nothing.
    pub fn forward_routed(
        &self,
        w: &LayerWeights,
        x: &Tensor,
        pos: &Positions,
        keep: bool,
        stats: &mut RouterStats,
    ) -> Result<(Tensor, Option<LayerState>)> {
        let output = if keep { Output::KeepAll } else { Output::Keep };
        let (out, saved) = self.run(w, x, pos, output, Some(stats))?;
        Ok((out.expect("the forward keeps its output"), keep.then_some(LayerState(saved))))
    }

    /// A MoE layer's router logits `[b·t, E]` (the compute dtype) for the input `x`, what
    /// transformers returns as the layer's `router_logits`; `None` for a dense layer.
    pub fn router_logits(&self, w: &LayerWeights, x: &Tensor, pos: &Positions) -> Result<Option<Tensor>> {
        let crate::MlpWeights::Moe { router, router_bias, .. } = &w.mlp else { return Ok(None) };
        let (_, s) = self.run(w, x, pos, Output::Skip, None)?;
        let x1 = s.x1.expect("the recompute keeps x1");
        let (c, _) = rms_norm(&x1, &w.post_norm, self.cfg.rms_norm_eps, self.cfg.norm_weight_before_cast())?;
        Ok(Some(linear(&c, router, router_bias.as_ref())?))
    }

    /// Forward that keeps what the backward needs ([`LayerState`]), so that
    /// [`DecoderLayer::backward_kept`] need not recompute it: the same operations as
    /// [`DecoderLayer::forward`], so the same output and, backwards, the same gradients bit for
    /// bit; memory traded for the recompute (see [`DecoderLayer::kept_state_bytes`]).
    pub fn forward_keep(&self, w: &LayerWeights, x: &Tensor, rope: &Rope) -> Result<(Tensor, LayerState)> {
        self.forward_keep_pos(w, x, &Positions::range(rope, 0, x.dim(1)?)?)
    }

    /// [`DecoderLayer::forward_keep`] at the tokens' [`Positions`].
    pub fn forward_keep_pos(
        &self,
        w: &LayerWeights,
        x: &Tensor,
        pos: &Positions,
    ) -> Result<(Tensor, LayerState)> {
        let (out, saved) = self.run(w, x, pos, Output::KeepAll, None)?;
        Ok((out.expect("the forward keeps its output"), LayerState(saved)))
    }

    /// Back-propagates `dy: [b, t, h]` through the forward that `state` kept: what
    /// [`DecoderLayer::backward`] does after its recompute.
    pub fn backward_kept(
        &self,
        w: &LayerWeights,
        state: LayerState,
        dy: &Tensor,
        grads: &GradSink,
    ) -> Result<Tensor> {
        self.backward_kept_routed(w, state, dy, grads, None)
    }

    /// [`DecoderLayer::backward_kept`] with the load-balancing loss's gradient `aux` added at a
    /// MoE layer's router probabilities.
    pub fn backward_kept_routed(
        &self,
        w: &LayerWeights,
        state: LayerState,
        dy: &Tensor,
        grads: &GradSink,
        aux: Option<&RouterGrad>,
    ) -> Result<Tensor> {
        let s = state.0;
        let Dims { b, t, .. } = s.dims;
        let want = [b, t, self.cfg.hidden_size];
        if dy.dims() != want || dy.dtype() != s.a.dtype() {
            return Err(Error::shape(
                "dy",
                format!("{want:?} {:?} (the kept forward's)", s.a.dtype()),
                dy.dims(),
            ));
        }
        self.backward_saved(w, s, dy, grads, aux)
    }

    /// Recomputes the forward from the checkpointed input `x`, back-propagates `dy: [b, t, h]`,
    /// accumulates every weight gradient into `grads` and returns `dx` (in `x`'s dtype).
    pub fn backward(
        &self,
        w: &LayerWeights,
        x: &Tensor,
        dy: &Tensor,
        rope: &Rope,
        grads: &GradSink,
    ) -> Result<Tensor> {
        self.backward_at(w, x, dy, rope, 0, grads)
    }

    /// [`DecoderLayer::backward`] at positions `start..start + t`.
    pub fn backward_at(
        &self,
        w: &LayerWeights,
        x: &Tensor,
        dy: &Tensor,
        rope: &Rope,
        start: usize,
        grads: &GradSink,
    ) -> Result<Tensor> {
        self.backward_pos(w, x, dy, &Positions::range(rope, start, x.dim(1)?)?, grads)
    }

    /// [`DecoderLayer::backward`] at the tokens' [`Positions`].
    pub fn backward_pos(
        &self,
        w: &LayerWeights,
        x: &Tensor,
        dy: &Tensor,
        pos: &Positions,
        grads: &GradSink,
    ) -> Result<Tensor> {
        self.backward_routed(w, x, dy, pos, grads, None)
    }

    /// [`DecoderLayer::backward_pos`] with the load-balancing loss's gradient `aux` added at a
    /// MoE layer's router probabilities (none: the loss without it).
    pub fn backward_routed(
        &self,
        w: &LayerWeights,
        x: &Tensor,
        dy: &Tensor,
        pos: &Positions,
        grads: &GradSink,
        aux: Option<&RouterGrad>,
    ) -> Result<Tensor> {
        if dy.dims() != x.dims() || dy.dtype() != x.dtype() {
            return Err(Error::shape(
                "dy",
                format!("the shape and dtype of x: {:?} {:?}", x.dims(), x.dtype()),
                dy.dims(),
            ));
        }
        // The recompute stops at the attention block: each MLP tile is recomputed in the
        // backward, and the layer's output is not needed backwards.
        let (_, s) = self.run(w, x, pos, Output::Skip, None)?;
        self.backward_saved(w, s, dy, grads, aux)
    }

    /// The MLP tiles of `n` rows: `[0, n)` in pieces of [`LayerOptions::mlp_rows`].
    fn tile_ranges(&self, n: usize) -> Vec<Range<usize>> {
        let rows = if self.opts.mlp_rows == 0 { n } else { self.opts.mlp_rows.min(n) }.max(1);
        (0..n).step_by(rows).map(|r| r..(r + rows).min(n)).collect()
    }

    /// The backward proper, from what the forward saved; each saved tensor is dropped as soon as
    /// nothing later needs it (a long sequence's `[t, hidden]` tensors are gigabytes).
    fn backward_saved(
        &self,
        w: &LayerWeights,
        s: Saved,
        dy: &Tensor,
        grads: &GradSink,
        aux: Option<&RouterGrad>,
    ) -> Result<Tensor> {
        let dev = dy.device();
        let h = self.cfg.hidden_size;
        let Dims { b, t, nh, nkv, hd } = s.dims;
        let n = s.rows;
        let dy = dy.reshape((n, h))?;
        prof_start(dev);

        // MLP, tile by tile: out = x1 + down(silu(gate(c)) ⊙ up(c)), c = norm2(x1).
        let tiles = self.tile_ranges(n);
        let mut dx1_parts = Vec::with_capacity(tiles.len());
        let Saved { dims, cos, sin, docs, norm1, a, q_norm, k_norm, attn, o, x1, mlp, .. } = s;
        let mut kept = mlp.into_iter();
        for r in &tiles {
            let m = match kept.next() {
                Some(m) => m,
                None => {
                    let x1 = x1.as_ref().expect("x1 is kept when the MLP is recomputed");
                    mlp::forward(
                        &self.cfg,
                        w,
                        &x1.narrow(0, r.start, r.len())?,
                        false,
                        None,
                        self.opts.moe_kernels,
                    )?
                    .1
                }
            };
            let dy_t = dy.narrow(0, r.start, r.len())?;
            dx1_parts.push(mlp::backward(&self.cfg, w, m, &dy_t, grads, aux)?);
        }
        drop(x1);
        let dx1 = join_rows(dx1_parts, n, &tiles)?;

        // Attention: x1 = x + o_proj(attn(rope(q), rope(k), v)).
        let lora = w.lora.as_ref();
        let back =
            |t, dy: &Tensor, x: &Tensor, wt: &Tensor, b| Adapted::of(lora, t).backward(dy, x, wt, grads, b);
        let d_o = back(LoraTarget::O, &dx1, &o, &w.o, bias(&w.o_bias, names::O_BIAS))?;
        drop(o);
        mark(dev, "bwd 5 o proj (2 GEMMs + accumulate)");
        let (dq, dk, dv, dsinks) =
            attention::backward(&d_o.reshape((b, t, nh * hd))?, &attn, dims, docs.as_deref())?;
        drop((d_o, attn));
        if let Some(ds) = dsinks {
            grads.accumulate(names::SINKS, &ds)?;
        }
        mark(dev, "bwd 4 attention");
        let unrotate = |x: Tensor| rope::apply_backward(&x, &cos, &sin);
        let (mut dq, mut dk) = (unrotate(dq)?, unrotate(dk)?);
        let full = self.cfg.qk_norm_full;
        if let (Some(cache), Some(wn)) = (&q_norm, &w.q_norm) {
            let (d, dw) = rms_norm_backward(&norm_shape(dq, full)?, wn, cache)?;
            grads.accumulate(names::Q_NORM, &dw)?;
            dq = d.reshape((b, t, nh, hd))?;
        }
        if let (Some(cache), Some(wn)) = (&k_norm, &w.k_norm) {
            let (d, dw) = rms_norm_backward(&norm_shape(dk, full)?, wn, cache)?;
            grads.accumulate(names::K_NORM, &dw)?;
            dk = d.reshape((b, t, nkv, hd))?;
        }
        mark(dev, "bwd 3 qk norm + rope");
        let dq = dq.reshape((n, nh * hd))?;
        let dk = dk.reshape((n, nkv * hd))?;
        let dv = dv.reshape((n, nkv * hd))?;
        // a feeds q, k and v: its gradient is the sum of the three (added as they come).
        let da_q = back(LoraTarget::Q, &dq, &a, &w.q, bias(&w.q_bias, names::Q_BIAS))?;
        drop(dq);
        let da_k = back(LoraTarget::K, &dk, &a, &w.k, bias(&w.k_bias, names::K_BIAS))?;
        drop(dk);
        let da = add(&da_q, &da_k)?;
        drop((da_q, da_k));
        let da_v = back(LoraTarget::V, &dv, &a, &w.v, bias(&w.v_bias, names::V_BIAS))?;
        drop((dv, a));
        let da = add(&da, &da_v)?;
        drop(da_v);
        mark(dev, "bwd 2 qkv proj (6 GEMMs + accumulate)");
        let (dx_norm, d_in) = rms_norm_backward(&da, &w.input_norm, &norm1)?;
        drop((da, norm1));
        grads.accumulate(names::INPUT_NORM, &d_in)?;
        let dx = add(&dx1, &dx_norm)?;
        mark(dev, "bwd 1 input norm");
        Ok(dx.reshape((b, t, h))?)
    }

    fn check_input(&self, w: &LayerWeights, x: &Tensor, pos: &Positions) -> Result<(usize, usize)> {
        let h = self.cfg.hidden_size;
        let (b, t) = match x.dims() {
            [b, t, hh] if *hh == h => (*b, *t),
            d => return Err(Error::shape("layer input x", format!("[b, t, {h}]"), d)),
        };
        if x.dtype() != w.dtype() {
            return Err(Error::dtype(
                "layer input x",
                format!("{:?} (the weights' dtype)", w.dtype()),
                x.dtype(),
            ));
        }
        if pos.dtype() != w.dtype() {
            return Err(Error::dtype(
                "RoPE table",
                format!("{:?} (the weights' dtype)", w.dtype()),
                pos.dtype(),
            ));
        }
        let rows = pos.cos_sin().0.dim(0)?;
        if rows != t && rows != b * t {
            return Err(Error::shape("RoPE rows of the positions", format!("{t} or {}", b * t), &[rows]));
        }
        self.cfg.check_seq_len(t)?;
        if self.cfg.layer_windows.is_some() && self.layer.is_none() {
            return Err(Error::Options(
                "this model's layers differ by index (gpt_oss's layer_types): run each with DecoderLayer::for_layer(i)"
                    .into(),
            ));
        }
        attention::check_device(&self.cfg, x.device(), x.dtype(), self.opts.flash)?;
        Ok((b, t))
    }

    /// The forward, keeping what the backward needs; the MLP (its output, and what the backward
    /// needs of it) as `output` says; a MoE layer's router statistics added to `stats`.
    fn run(
        &self,
        w: &LayerWeights,
        x: &Tensor,
        pos: &Positions,
        output: Output,
        mut stats: Option<&mut RouterStats>,
    ) -> Result<(Option<Tensor>, Saved)> {
        let cfg = &self.cfg;
        let (b, t) = self.check_input(w, x, pos)?;
        let (h, nh, nkv, hd) =
            (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let dims = Dims { b, t, nh, nkv, hd };
        let n = b * t;
        let eps = cfg.rms_norm_eps;
        let (cos, sin) = pos.cos_sin();
        let (cos, sin) = (cos.clone(), sin.clone());
        let docs = pos.docs_arc();
        let xf = x.reshape((n, h))?;
        let dev = x.device();
        prof_start(dev);

        let (a, norm1) = rms_norm(&xf, &w.input_norm, eps, cfg.norm_weight_before_cast())?;
        mark(dev, "fwd 1 input norm");
        let lora = w.lora.as_ref();
        let proj =
            |t: LoraTarget, wt: &Tensor, bias: Option<&Tensor>| Adapted::of(lora, t).forward(&a, wt, bias);
        let q = proj(LoraTarget::Q, &w.q, w.q_bias.as_ref())?.reshape((b, t, nh, hd))?;
        let k = proj(LoraTarget::K, &w.k, w.k_bias.as_ref())?.reshape((b, t, nkv, hd))?;
        let v = proj(LoraTarget::V, &w.v, w.v_bias.as_ref())?.reshape((b, t, nkv, hd))?;
        mark(dev, "fwd 2 qkv proj (GEMM)");
        let full = cfg.qk_norm_full;
        let (q, q_norm) = norm_opt(norm_shape(q, full)?, w.q_norm.as_ref(), eps)?;
        let (k, k_norm) = norm_opt(norm_shape(k, full)?, w.k_norm.as_ref(), eps)?;
        let (q, k) = (q.reshape((b, t, nh, hd))?, k.reshape((b, t, nkv, hd))?);
        // By value, so that the unrotated tensor is freed as soon as its rotation exists.
        let rotate = |x: Tensor| rope::apply(&x, &cos, &sin);
        let (q, k) = (rotate(q)?, rotate(k)?);
        mark(dev, "fwd 3 qk norm + rope");
        let flash = self.opts.flash.then_some(self.opts.flash_kernel);
        let extras = Extras { window: self.window(), sinks: w.sinks.as_ref() };
        let (o, attn) = attention::forward(&q, &k, &v, dims, docs.as_deref(), flash, extras)?;
        drop((q, k, v));
        let o = o.reshape((n, nh * hd))?;
        mark(dev, "fwd 4 attention");
        let x1 = add(&xf, &Adapted::of(lora, LoraTarget::O).forward(&o, &w.o, w.o_bias.as_ref())?)?;
        mark(dev, "fwd 5 o proj (GEMM) + residual");

        let (out, x1, mlp) = match output {
            // The backward recomputes each tile from x1.
            Output::Skip => (None, Some(x1), Vec::new()),
            Output::Keep | Output::KeepAll => {
                let tiles = self.tile_ranges(n);
                let mut outs = Vec::with_capacity(tiles.len());
                let mut mlp = Vec::new();
                for r in &tiles {
                    let x1_t = x1.narrow(0, r.start, r.len())?;
                    let (y, m) =
                        mlp::forward(cfg, w, &x1_t, true, stats.as_deref_mut(), self.opts.moe_kernels)?;
                    outs.push(y.expect("the tile's output was asked for"));
                    if output == Output::KeepAll {
                        mlp.push(m);
                    }
                }
                let out = join_rows(outs, n, &tiles)?.reshape((b, t, h))?;
                (Some(out), None, mlp)
            }
        };
        let saved = Saved { rows: n, dims, cos, sin, docs, norm1, a, q_norm, k_norm, attn, o, x1, mlp };
        Ok((out, saved))
    }
}

/// Rows `[n, h]` from the tiles' pieces (one piece: itself, no copy).
fn join_rows(mut parts: Vec<Tensor>, n: usize, tiles: &[Range<usize>]) -> Result<Tensor> {
    if parts.len() == 1 {
        return Ok(parts.remove(0));
    }
    let first = &parts[0];
    let out = Tensor::zeros((n, first.dim(1)?), first.dtype(), first.device())?;
    for (p, r) in parts.iter().zip(tiles) {
        out.slice_set(p, 0, r.start)?;
    }
    Ok(out)
}

/// What [`DecoderLayer::run`] does with the MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    /// Computes the layer's output.
    Keep,
    /// Computes the output and keeps what the MLP's backward needs.
    KeepAll,
    /// Stops after the attention block (the backward's recompute).
    Skip,
}

/// `x: [b, t, heads, hd]` as the q/k norm sees it: unchanged for a norm per head (Qwen3),
/// `[b, t, 1, heads·hd]` for one over the whole projection (OLMoE). No copy.
fn norm_shape(x: Tensor, full: bool) -> Result<Tensor> {
    if !full {
        return Ok(x);
    }
    let (b, t, heads, hd) = x.dims4()?;
    Ok(x.reshape((b, t, 1, heads * hd))?)
}

/// RMSNorm over the last dimension of q or k (Qwen3's per head, OLMoE's over the projection),
/// when the layer has one.
fn norm_opt(x: Tensor, w: Option<&Tensor>, eps: f64) -> Result<(Tensor, Option<RmsCache>)> {
    match w {
        Some(w) => {
            let (y, cache) = rms_norm(&x, w, eps, false)?;
            Ok((y, Some(cache)))
        }
        None => Ok((x, None)),
    }
}

/// The bias gradient's name, for a projection that has a bias.
fn bias(b: &Option<Tensor>, name: &'static str) -> Option<&'static str> {
    b.as_ref().map(|_| name)
}

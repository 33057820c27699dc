//! Causal grouped-query attention with its backward: the materialised scores of transformers'
//! eager path (every device), or flash attention (`kernels/cuda/flash_attn.cu`: bf16 on CUDA, O(t)
//! memory, for head dims 16, 32, 64, 128). Packed documents (`Docs`) mask keys outside a
//! query's document on both paths.
//!
//! GPT-OSS's additions ([`Extras`]): a sliding window of keys (`q - window < k <= q`) and a
//! learned sink logit per query head, one more term `e^{s_h}` in each row's softmax denominator
//! with no value vector (so a row's probabilities sum to less than one). The materialised candle
//! path and both sets of flash kernels (portable and Hopper) have both; the fused-softmax kernels
//! neither, so on a GPU such a model runs flash attention and nothing else ([`check_gpu`]).
//!
//! Layout trick for GQA: query head `i` uses key/value head `i / g` (`g = nh / nkv`), so the
//! `nh` query heads are viewed as `[nkv, g]` and the `g` heads of a group are stacked along the
//! query-time axis: `q: [b, nkv, g·t, hd]` against `k, v: [b, nkv, t, hd]`. Key and value are
//! never repeated, and in the backward the sum of dK/dV over the heads of a group falls out of
//! the matrix product over the stacked axis.

use candle_core::{DType, Device, Tensor, D};
use mt_core::ModelConfig;
use mt_kernels::FlashKernel;

use crate::ops::{matmul, matmul_wide, stat_dtype, swap12, wide_dtype};
use crate::positions::Docs;
use crate::Result;

/// Shapes of one attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) nh: usize,
    pub(crate) nkv: usize,
    pub(crate) hd: usize,
}

impl Dims {
    fn g(&self) -> usize {
        self.nh / self.nkv
    }
}

/// GPT-OSS's additions to one attention call: the layer's window and its heads' sink logits.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Extras<'a> {
    /// Keys a query sees (itself included) on a sliding-window layer.
    pub(crate) window: Option<usize>,
    /// The sink logit of each query head, `[nh]`.
    pub(crate) sinks: Option<&'a Tensor>,
}

impl Extras<'_> {
    /// Neither a window nor sinks: what the fused-softmax kernels take.
    #[cfg(feature = "cuda")]
    fn none(&self) -> bool {
        self.window.is_none() && self.sinks.is_none()
    }
}

/// Whether `cfg`'s attention has what only some paths run: GPT-OSS's sink logits or sliding
/// windows.
fn has_extras(cfg: &ModelConfig) -> bool {
    cfg.attention_sinks || cfg.layer_windows.is_some()
}

/// Refuses to run `cfg`'s layers on `device` with activations of `dtype` where its attention
/// needs what the path that would run lacks ([`check_gpu`], with whether flash attention runs
/// there: `flash` asked and [`crate::flash_attention`] applies).
pub fn check_device(cfg: &ModelConfig, device: &Device, dtype: DType, flash: bool) -> Result<()> {
    if device.is_cpu() {
        return Ok(());
    }
    let runs = flash && crate::flash_attention(device, dtype, cfg.head_dim);
    Ok(check_gpu(cfg, dtype, Some(runs))?)
}

/// Refuses to run `cfg`'s layers on a GPU with activations of `dtype`, flash attention
/// (`Some(true)`), the materialised scores (`Some(false)`) or the planner's choice (`None`),
/// where its attention needs what that path lacks: GPT-OSS's sink
/// logits and sliding windows run on a GPU only in the flash kernels, portable or Hopper (the
/// fused-softmax kernels have neither, and the candle fallback's `t x t` probabilities are not
/// what the planner counts for a bf16 GPU run). One sentence naming the option to change.
pub fn check_gpu(cfg: &ModelConfig, dtype: DType, attention: Option<bool>) -> mt_core::Result<()> {
    if !has_extras(cfg) {
        return Ok(());
    }
    let why = if attention == Some(false) || dtype != DType::BF16 || !crate::flash_head_dim(cfg.head_dim) {
        "its attention sinks and sliding windows run on a GPU in the flash attention kernels only, which take \
         bf16 weights on a GPU of compute capability 8.0 or later; use --precision bf16 with --attention flash, \
         or the CPU backend (--device cpu)"
    } else {
        return Ok(());
    };
    Err(mt_core::Error::Unsupported(format!("gpt_oss on a GPU: {why}")))
}

/// What the backward needs from the forward.
#[derive(Debug)]
pub(crate) enum AttnCache {
    /// The materialised path.
    Dense {
        /// Queries `[b, nkv, g·t, hd]`, compute dtype.
        q: Tensor,
        /// Keys `[b, nkv, t, hd]`.
        k: Tensor,
        /// Values `[b, nkv, t, hd]`.
        v: Tensor,
        /// The attention probabilities, `[b, nkv, g·t, t]`.
        p: Probs,
        /// With sinks, each row's sink probability `e^{s_h} / Z`, `[b, nkv, g·t, 1]`, in the
        /// probabilities' dtype.
        sink_p: Option<Tensor>,
    },
    /// Flash attention: the inputs as they came (`q: [b, t, nh, hd]`, `k, v: [b, t, nkv, hd]`),
    /// the output `o: [b, t, nh, hd]` and each row's log-sum-exp (f32 `[b, nh, t]`, the sinks
    /// included); the backward recomputes the probabilities tile by tile. GPT-OSS's window and
    /// its sinks as the kernels take them (f32 `[nh]`).
    #[cfg(feature = "cuda")]
    Flash {
        q: Tensor,
        k: Tensor,
        v: Tensor,
        o: Tensor,
        lse: Tensor,
        kernel: FlashKernel,
        window: Option<usize>,
        sinks: Option<Tensor>,
    },
}

impl AttnCache {
    /// Bytes of its tensors, but for the flash path's output, which is the layer's attention
    /// output (the decoder counts it).
    pub(crate) fn bytes(&self) -> u64 {
        let t = |x: &Tensor| (x.elem_count() * x.dtype().size_in_bytes()) as u64;
        match self {
            AttnCache::Dense { q, k, v, p, sink_p } => {
                let p = match p {
                    Probs::Full(p) => t(p),
                    #[cfg(feature = "cuda")]
                    Probs::Fused { s, pb, stats } => t(s) + t(pb) + t(stats),
                };
                t(q) + t(k) + t(v) + p + sink_p.as_ref().map_or(0, t)
            }
            #[cfg(feature = "cuda")]
            AttnCache::Flash { q, k, v, lse, sinks, .. } => {
                t(q) + t(k) + t(v) + t(lse) + sinks.as_ref().map_or(0, t)
            }
        }
    }
}

/// How the materialised forward keeps the probabilities for the backward.
#[derive(Debug)]
pub(crate) enum Probs {
    /// In the statistics dtype (the candle path).
    Full(Tensor),
    /// The fused bf16 CUDA path (`kernels/cuda/softmax.cu`) keeps the raw bf16 scores `s = q kᵀ`,
    /// the bf16 probabilities `pb` (what multiplies `v`) and each row's `(max, sum)` in f32:
    /// its backward recomputes the f32 probabilities from them bit for bit, so no f32 `[.., t, t]`
    /// tensor is ever written.
    #[cfg(feature = "cuda")]
    Fused { s: Tensor, pb: Tensor, stats: Tensor },
}

/// Additive causal mask `[t, t]`: 0 where key `j <= ` query `i` (and, with a window,
/// `j > i - window`), `-inf` elsewhere.
fn causal_mask(t: usize, window: Option<usize>, dtype: DType, device: &Device) -> Result<Tensor> {
    let visible = |i: usize, j: usize| j <= i && window.is_none_or(|w| j + w > i);
    let v: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if visible(i, j) { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(v, (t, t), device)?.to_dtype(dtype)?)
}

/// `[b, t, heads, hd]` → `[b, heads, t, hd]`, contiguous.
fn heads_first(x: &Tensor) -> Result<Tensor> {
    swap12(x)
}

/// Softmax over the last dimension with the row maximum subtracted (a constant per row, so it
/// takes no part in the gradient and is detached).
fn softmax_last(s: &Tensor) -> Result<Tensor> {
    let m = s.max_keepdim(D::Minus1)?.detach();
    let e = s.broadcast_sub(&m)?.exp()?;
    let z = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&z)?)
}

/// Softmax over the last dimension of `s` `[.., n]` with one more logit per row, `sink`
/// `[.., 1]`, whose probability is returned apart (transformers: the sink concatenated as a
/// last column, the softmax taken, the column dropped): `(e^{s_j} / Z, e^{sink} / Z)`,
/// `Z = Σ_j e^{s_j} + e^{sink}`, with the row maximum over both subtracted.
fn softmax_with_sink(s: &Tensor, sink: &Tensor) -> Result<(Tensor, Tensor)> {
    let m = s.max_keepdim(D::Minus1)?.maximum(sink)?.detach();
    let e = s.broadcast_sub(&m)?.exp()?;
    let es = (sink - &m)?.exp()?;
    let z = (e.sum_keepdim(D::Minus1)? + &es)?;
    Ok((e.broadcast_div(&z)?, (es / z)?))
}

/// Forward. `q: [b, t, nh, hd]`, `k, v: [b, t, nkv, hd]` (after RoPE), compute dtype; `flash`
/// (which kernels, `mt_kernels::FlashKernel`) takes the flash path where it applies
/// (`crate::flash_attention`), `None` or elsewhere the materialised one:
/// `scores = q kᵀ` in the compute dtype, cast to the statistics dtype and scaled there by
/// `hd^-1/2` (one rounding, as the fused kernel; transformers' eager path scales in the compute
/// dtype, rounding twice), causal (and document) mask, softmax in the statistics dtype,
/// probabilities cast back, `o = P v`. On the candle path the scaled scores (and in the backward
/// `c P`) are one more statistics-dtype temporary of the scores' size.
/// Returns `o: [b, t, nh·hd]`.
pub(crate) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d: Dims,
    docs: Option<&Docs>,
    flash: Option<FlashKernel>,
    extras: Extras<'_>,
) -> Result<(Tensor, AttnCache)> {
    let Dims { b, t, nh, nkv, hd } = d;
    #[cfg(feature = "cuda")]
    if let Some(kernel) = flash.filter(|_| crate::flash_attention(q.device(), q.dtype(), hd)) {
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        // The kernels take the sinks as f32 (the logits are bf16 in the slot: exact in f32).
        let sinks = extras.sinks.map(|s| s.to_dtype(DType::F32)?.contiguous()).transpose()?;
        let fx = mt_kernels::FlashExtras { window: extras.window, sinks: sinks.as_ref() };
        let (o, lse) = mt_kernels::flash_forward_with(&q, &k, &v, docs.map(Docs::bounds), fx, kernel)?;
        let out = o.reshape((b, t, nh * hd))?;
        return Ok((out, AttnCache::Flash { q, k, v, o, lse, kernel, window: extras.window, sinks }));
    }
    let _ = flash;
    let dtype = q.dtype();
    // f32 on the CPU: scores and softmax in f64, the probabilities kept in f32 (`ops::is_wide`).
    let sd = wide_dtype(q);
    let g = d.g();
    let q = heads_first(q)?.reshape((b, nkv, g * t, hd))?;
    let k = heads_first(k)?;
    let v = heads_first(v)?;
    let scale = 1.0 / (hd as f64).sqrt();
    #[cfg(feature = "cuda")]
    if mt_kernels::applies(&q) && extras.none() {
        // One fused kernel for scale, causal mask and softmax (kernels/cuda/softmax.cu), bf16 out;
        // keys of other documents get -inf scores first.
        let mut s = q.matmul(&k.t()?)?;
        if let Some(docs) = docs {
            let m = docs.mask(dtype, None)?;
            s = s.reshape((b, nkv, g, t, t))?.broadcast_add(&m)?.reshape((b, nkv, g * t, t))?;
        }
        let (pb, stats) = mt_kernels::causal_softmax(&s, scale)?;
        let o = swap12(&pb.matmul(&v)?.reshape((b, nh, t, hd))?)?.reshape((b, t, nh * hd))?;
        return Ok((o, AttnCache::Dense { q, k, v, p: Probs::Fused { s, pb, stats }, sink_p: None }));
    }
    // The scale is applied in the statistics dtype, one rounding, as the fused kernel does.
    let s = (matmul_wide(&q, &k.t()?)? * scale)?;
    let s = s.reshape((b, nkv, g, t, t))?;
    let s = match docs {
        Some(docs) => s.broadcast_add(&docs.mask(sd, extras.window)?)?,
        None => s.broadcast_add(&causal_mask(t, extras.window, sd, q.device())?)?,
    };
    let s = s.reshape((b, nkv, g * t, t))?;
    let (p, sink_p) = match extras.sinks {
        None => (softmax_last(&s)?, None),
        Some(sinks) => {
            // Query head `kv·g + j` is row block `j` of group `kv` on the stacked axis.
            let col = sinks.to_dtype(sd)?.reshape((1, nkv, g, 1))?.broadcast_as((b, nkv, g, t))?;
            let (p, sp) = softmax_with_sink(&s, &col.reshape((b, nkv, g * t, 1))?)?;
            (p, Some(sp.to_dtype(stat_dtype(dtype))?))
        }
    };
    let p = p.to_dtype(stat_dtype(dtype))?;
    let o = matmul(&p.to_dtype(dtype)?, &v)?;
    let o = o.reshape((b, nh, t, hd))?.transpose(1, 2)?.reshape((b, t, nh * hd))?;
    Ok((o, AttnCache::Dense { q, k, v, p: Probs::Full(p), sink_p }))
}

/// The attention's input gradients: `(dq [b,t,nh,hd], dk [b,t,nkv,hd], dv [b,t,nkv,hd])` and,
/// with sinks, the sinks' `[nh]` (in the statistics dtype; f64 for f32 on the CPU).
pub(crate) type AttnGrads = (Tensor, Tensor, Tensor, Option<Tensor>);

/// Backward. `d_o: [b, t, nh·hd]`.
///
/// With `S = c Q Kᵀ` (`c = hd^-1/2`), `P = softmax(S)`, `O = P V`:
/// `dV = Pᵀ dO`, `dP = dO Vᵀ`, `dS = P ⊙ (dP - rowsum(dP ⊙ P))` (softmax Jacobian; masked
/// entries have `P = 0` and so `dS = 0`), `dQ = c dS K`, `dK = c dSᵀ Q`. Over the stacked
/// `g·t` axis the products `Pᵀ dO` and `dSᵀ Q` sum the contributions of the `g` query heads
/// that share a key/value head. (Flash: the same with `rowsum(dP ⊙ P) = rowsum(dO ⊙ O)`.)
/// A sink is one more softmax column whose `dP` is 0 (it has no value): `dS` keeps its form, and
/// `ds_h = -Σ_rows of head h  p_sink · rowsum(dP ⊙ P)`.
pub(crate) fn backward(d_o: &Tensor, cache: &AttnCache, d: Dims, docs: Option<&Docs>) -> Result<AttnGrads> {
    let Dims { b, t, nh, nkv, hd } = d;
    let (q, k, v, p, sink_p) = match cache {
        AttnCache::Dense { q, k, v, p, sink_p } => (q, k, v, p, sink_p),
        #[cfg(feature = "cuda")]
        AttnCache::Flash { q, k, v, o, lse, kernel, window, sinks } => {
            let d_o = d_o.reshape((b, t, nh, hd))?.contiguous()?;
            let fx = mt_kernels::FlashExtras { window: *window, sinks: sinks.as_ref() };
            let bounds = docs.map(Docs::bounds);
            let grads = mt_kernels::flash_backward_with(q, k, v, o, lse, &d_o, bounds, fx, *kernel)?;
            return Ok(grads);
        }
    };
    let _ = docs;
    let dtype = d_o.dtype();
    let g = d.g();
    let scale = 1.0 / (hd as f64).sqrt();
    let d_o = swap12(&d_o.reshape((b, t, nh, hd))?)?.reshape((b, nkv, g * t, hd))?;
    // Without the cuda feature `Probs` has one variant.
    #[allow(clippy::infallible_destructuring_match)]
    let p = match p {
        Probs::Full(p) => p,
        #[cfg(feature = "cuda")]
        Probs::Fused { s, pb, stats } => {
            let dv = pb.t()?.matmul(&d_o)?;
            // dS with the scale folded in, P recomputed from s and the row statistics, in one
            // kernel (kernels/cuda/softmax.cu).
            let ds = mt_kernels::softmax_backward(&d_o.matmul(&v.t()?)?, s, stats, scale)?;
            let (dq, dk, dv) = heads_last(ds.matmul(k)?, ds.t()?.matmul(q)?, dv, d)?;
            return Ok((dq, dk, dv, None));
        }
    };
    let dv = matmul(&p.to_dtype(dtype)?.t()?, &d_o)?;
    let dp = matmul_wide(&d_o, &v.t()?)?;
    let p = p.to_dtype(dp.dtype())?;
    let row = (&dp * &p)?.sum_keepdim(D::Minus1)?;
    let dsink = match sink_p {
        // Rows `[b, nkv, g·t]` → per head `kv·g + j`.
        Some(sp) => {
            let per_row = (sp.to_dtype(row.dtype())? * &row)?.reshape((b, nkv, nh / nkv, t))?;
            Some(per_row.sum(3)?.sum(0)?.reshape(nh)?.neg()?)
        }
        None => None,
    };
    // The scale folded into dS before its rounding, `(c P) ⊙ (dP - row)`, as the fused kernel.
    let ds = ((p * scale)? * dp.broadcast_sub(&row)?)?.to_dtype(dtype)?;
    let (dq, dk, dv) = heads_last(matmul(&ds, k)?, matmul(&ds.t()?, q)?, dv, d)?;
    Ok((dq, dk, dv, dsink))
}

/// `dq [b, nkv, g·t, hd]`, `dk, dv [b, nkv, t, hd]` back to `[b, t, heads, hd]`, contiguous.
fn heads_last(dq: Tensor, dk: Tensor, dv: Tensor, d: Dims) -> Result<(Tensor, Tensor, Tensor)> {
    let Dims { b, t, nh, hd, .. } = d;
    let dq = swap12(&dq.reshape((b, nh, t, hd))?)?;
    let dk = swap12(&dk)?;
    let dv = swap12(&dv)?;
    Ok((dq, dk, dv))
}

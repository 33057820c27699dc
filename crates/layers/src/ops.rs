//! Building blocks with their backward: RMSNorm, linear projections, SiLU, and the f64
//! accumulation of f32 layers on the CPU ([`is_wide`]). Each backward is written out by hand and
//! derived in its doc comment; none relies on autograd.

use candle_core::{DType, Tensor, D};

use crate::{GradSink, Result};

/// The dtype in which statistics (norm variance, softmax, loss) are kept: f32 for the
/// half-precision types, the compute dtype itself otherwise.
pub(crate) fn stat_dtype(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

/// Whether `x` is f32 on the CPU, where every reduction accumulates in f64 and each op's result
/// is rounded to f32 once: matrix products, the norms' statistics, softmax, cross-entropy and
/// bias sums ([`wide_dtype`]).
///
/// Why: an f32 reduction over `k` terms carries up to `k` roundings; measured stage by stage
/// against a float64 evaluation of the same model, the products' reductions dominated, then the
/// norms' and softmax's: the step-0 gradients were 2.9e-7 (relative L2) from float64, exactly
/// PyTorch fp32's distance, and are 0.9e-7 so. AdamW turns the absolute error of a gradient
/// element near its `eps` into an update-sized difference, so the weights after a few steps
/// gain about the same factor (`crates/megatrain/tests/numerics.rs`). The CPU only: the GPU's
/// fp32 path keeps cuBLAS's f32 products, its bf16 path the fused kernels, which round as
/// candle's bf16 ops do.
pub(crate) fn is_wide(x: &Tensor) -> bool {
    x.dtype() == DType::F32 && x.device().is_cpu()
}

/// The dtype an op's reductions and statistics run in for inputs like `x`: f64 for f32 on the
/// CPU ([`is_wide`]), else [`stat_dtype`].
pub(crate) fn wide_dtype(x: &Tensor) -> DType {
    if is_wide(x) {
        DType::F64
    } else {
        stat_dtype(x.dtype())
    }
}

/// `a b` in `a`'s dtype; f32 on the CPU accumulates in f64 and rounds once ([`is_wide`]).
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if is_wide(a) {
        return Ok(matmul_wide(a, b)?.to_dtype(DType::F32)?);
    }
    Ok(a.matmul(b)?)
}

/// `a b` in [`wide_dtype`]: f32 on the CPU as the f64 product of the f32 operands, not rounded;
/// elsewhere `a.matmul(b)` cast to the statistics dtype.
pub(crate) fn matmul_wide(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if is_wide(a) {
        return Ok(a.to_dtype(DType::F64)?.matmul(&b.to_dtype(DType::F64)?)?);
    }
    Ok(a.matmul(b)?.to_dtype(stat_dtype(a.dtype()))?)
}

/// `a + b` for tensors of one shape; on CUDA in bf16 one vectorised kernel, bit for bit
/// candle's add (`mt_kernels::add`).
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    return Ok(mt_kernels::add(a, b)?);
    #[cfg(not(feature = "cuda"))]
    Ok((a + b)?)
}

/// `x.transpose(1, 2).contiguous()` of a 4-D tensor; on CUDA in bf16 one vectorised copy kernel
/// (`mt_kernels::swap12`).
pub(crate) fn swap12(x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    return Ok(mt_kernels::swap12(x)?);
    #[cfg(not(feature = "cuda"))]
    Ok(x.transpose(1, 2)?.contiguous()?)
}

/// What RMSNorm's backward needs from its forward.
#[derive(Debug)]
pub(crate) struct RmsCache {
    /// The input in the statistics dtype.
    xs: Tensor,
    /// `r = rsqrt(mean(x²) + eps)`, `[.., 1]`, statistics dtype.
    r: Tensor,
    /// `x * r` cast to the compute dtype (what the weight multiplies; in the statistics dtype when
    /// the weight multiplies first); `None` on the fused CUDA path, where `xs` is the bf16 input
    /// itself and `r` is `[rows]`.
    xhat: Option<Tensor>,
    /// The weight multiplied in the statistics dtype, before the cast (GPT-OSS).
    weight_first: bool,
    /// `xs` is the input tensor itself (the fused path, or an input already in the statistics
    /// dtype), not a copy.
    xs_is_input: bool,
    /// The norm's epsilon (the f64 backward of an f32 CPU norm recomputes `r` from `xs`).
    eps: f64,
}

impl RmsCache {
    /// Bytes of its tensors.
    pub(crate) fn bytes(&self) -> u64 {
        let t = |x: &Tensor| (x.elem_count() * x.dtype().size_in_bytes()) as u64;
        t(&self.xs) + t(&self.r) + self.xhat.as_ref().map_or(0, t)
    }

    /// Whether `xs` is the norm's input itself rather than a copy.
    pub(crate) fn shares_input(&self) -> bool {
        self.xs_is_input
    }

    /// The kept input (or its statistics-dtype copy).
    pub(crate) fn input(&self) -> &Tensor {
        &self.xs
    }
}

/// RMSNorm over the last dimension, as transformers computes it: statistics in the statistics
/// dtype, `x * r` cast back to the input dtype, then multiplied by the weight in that dtype; or,
/// `weight_first` (GPT-OSS), multiplied by the weight in the statistics dtype and then cast.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, weight_first: bool) -> Result<(Tensor, RmsCache)> {
    #[cfg(feature = "cuda")]
    if mt_kernels::applies(x) && w.dtype() == DType::BF16 && !weight_first {
        let (y, r) = mt_kernels::rms_norm(x, w, eps)?;
        return Ok((y, RmsCache { xs: x.clone(), r, xhat: None, xs_is_input: true, eps, weight_first }));
    }
    if is_wide(x) {
        // One rounding of `w x r` either way.
        return rms_norm_wide(x, w, eps);
    }
    let dtype = x.dtype();
    let sd = stat_dtype(dtype);
    let xs = x.to_dtype(sd)?;
    let r = rms_recip(&xs, eps)?;
    let xs_is_input = sd == dtype;
    if weight_first {
        let xhat = xs.broadcast_mul(&r)?;
        let y = xhat.broadcast_mul(&w.to_dtype(sd)?)?.to_dtype(dtype)?;
        return Ok((y, RmsCache { xs, r, xhat: Some(xhat), xs_is_input, eps, weight_first }));
    }
    let xhat = xs.broadcast_mul(&r)?.to_dtype(dtype)?;
    let y = xhat.broadcast_mul(w)?;
    Ok((y, RmsCache { xs, r, xhat: Some(xhat), xs_is_input, eps, weight_first }))
}

/// `r = (mean(x²) + eps)^(-1/2)` over the last dimension, `[.., 1]`, in `xs`'s dtype.
fn rms_recip(xs: &Tensor, eps: f64) -> Result<Tensor> {
    let var = xs.sqr()?.mean_keepdim(D::Minus1)?;
    Ok((var + eps)?.sqrt()?.recip()?)
}

/// [`rms_norm`] of an f32 CPU input ([`is_wide`]): `r`, `x r` and `w x r` in f64, each output
/// rounded to f32 once. The cache holds what the f32 path holds (the input itself, `r` and `x r`
/// in f32: the bytes `DecoderLayer::kept_state_bytes` counts); the backward recomputes `r` in f64.
fn rms_norm_wide(x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, RmsCache)> {
    let xs = x.to_dtype(DType::F64)?;
    let r = rms_recip(&xs, eps)?;
    let xhat = xs.broadcast_mul(&r)?;
    let y = xhat.broadcast_mul(&w.to_dtype(DType::F64)?)?.to_dtype(DType::F32)?;
    let (r, xhat) = (r.to_dtype(DType::F32)?, xhat.to_dtype(DType::F32)?);
    Ok((y, RmsCache { xs: x.clone(), r, xhat: Some(xhat), xs_is_input: true, eps, weight_first: false }))
}

/// Backward of [`rms_norm`]. With `r = (mean(x²) + eps)^(-1/2)` over the `n` features and
/// `g = dy ⊙ w`: `y_j = w_j x_j r` and `∂r/∂x_k = -r³ x_k / n`, so
/// `dx_k = r g_k - x_k r³ mean(g ⊙ x)` and `dw = Σ_rows dy ⊙ x r`.
/// Returns `(dx` in the compute dtype, `dw` in the statistics dtype (f64 for f32 on the CPU)`)`.
pub(crate) fn rms_norm_backward(dy: &Tensor, w: &Tensor, cache: &RmsCache) -> Result<(Tensor, Tensor)> {
    let Some(xhat) = &cache.xhat else { return fused_rms_backward(dy, w, cache) };
    let dtype = dy.dtype();
    let wide = is_wide(dy);
    // f32 on the CPU: everything in f64, `r` recomputed from the input (as the forward formed it).
    let sd = if wide { DType::F64 } else { cache.xs.dtype() };
    let xs = cache.xs.to_dtype(sd)?;
    let r = if wide { rms_recip(&xs, cache.eps)? } else { cache.r.clone() };
    let n = xs.dim(D::Minus1)?;
    let rows = xs.elem_count() / n;
    let dys = dy.to_dtype(sd)?;
    let dw = (&dys * xhat.to_dtype(sd)?)?.reshape((rows, n))?.sum(0)?;
    let g = if wide || cache.weight_first {
        dys.broadcast_mul(&w.to_dtype(sd)?)?
    } else {
        dy.broadcast_mul(w)?.to_dtype(sd)?
    };
    let gx_mean = (&g * &xs)?.mean_keepdim(D::Minus1)?;
    let r3 = ((&r * &r)? * &r)?;
    let dx = (g.broadcast_mul(&r)? - xs.broadcast_mul(&(r3 * gx_mean)?)?)?;
    Ok((dx.to_dtype(dtype)?, dw))
}

#[cfg(feature = "cuda")]
fn fused_rms_backward(dy: &Tensor, w: &Tensor, cache: &RmsCache) -> Result<(Tensor, Tensor)> {
    Ok(mt_kernels::rms_norm_backward(dy, &cache.xs, w, &cache.r)?)
}

#[cfg(not(feature = "cuda"))]
fn fused_rms_backward(_: &Tensor, _: &Tensor, _: &RmsCache) -> Result<(Tensor, Tensor)> {
    unreachable!("RmsCache without xhat is only built by the cuda feature's fused path")
}

/// `y = x Wᵀ (+ b)`, `x: [N, in]`, `W: [out, in]` (a strided view is fine), `b: [out]`.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if is_wide(x) {
        // f32 on the CPU: the bias added to the f64 product, one rounding.
        let y = matmul_wide(x, &w.t()?)?;
        let y = match b {
            Some(b) => y.broadcast_add(&b.to_dtype(DType::F64)?)?,
            None => y,
        };
        return Ok(y.to_dtype(DType::F32)?);
    }
    let y = x.matmul(&w.t()?)?;
    Ok(match b {
        Some(b) => add_bias(&y, b)?,
        None => y,
    })
}

/// `y + b` with `b` broadcast over the rows; on CUDA in bf16 one vectorised kernel, bit for bit
/// candle's broadcasting add (which ran at a tenth of the memory bandwidth on the 14B's q bias).
fn add_bias(y: &Tensor, b: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    return Ok(mt_kernels::add_row(y, b)?);
    #[cfg(not(feature = "cuda"))]
    Ok(y.broadcast_add(b)?)
}

/// Backward of [`linear`] for `dy: [N, out]`: returns `dx = dy W` `[N, in]` and accumulates
/// `dW = dyᵀ x` `[out, in]` (the sum over rows of the outer products) into `grads[weight]` and,
/// for a projection with a bias, `db = Σ_rows dy` (in the statistics dtype) into `grads[bias]`.
pub(crate) fn linear_backward(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    grads: &GradSink,
    weight: &str,
    bias: Option<&str>,
) -> Result<Tensor> {
    let dx = matmul(dy, w)?;
    grads.accumulate_matmul(weight, dy, x)?;
    if let Some(bias) = bias {
        grads.accumulate_col_sums(bias, dy)?;
    }
    Ok(dx)
}

/// Derivative of `silu(g) = g σ(g)`: `σ(g) (1 + g (1 - σ(g)))`, evaluated in [`wide_dtype`] and
/// returned in `g`'s dtype.
pub(crate) fn silu_grad(g: &Tensor) -> Result<Tensor> {
    let gs = g.to_dtype(wide_dtype(g))?;
    let sig = (gs.neg()?.exp()? + 1.0)?.recip()?;
    let d = (&sig * ((&gs * (1.0 - &sig)?)? + 1.0)?)?;
    Ok(d.to_dtype(g.dtype())?)
}

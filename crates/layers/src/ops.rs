//! Building blocks with their backward: RMSNorm, linear projections, SiLU. Each backward is
//! written out by hand and derived in its doc comment; none relies on autograd.

use candle_core::{DType, Tensor, D};

use crate::{GradSink, Result};

/// The dtype in which statistics (norm variance, softmax, loss) are computed: f32 for the
/// half-precision types, the compute dtype itself otherwise.
pub(crate) fn stat_dtype(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

/// `a + b` for tensors of one shape; on CUDA in bf16 one vectorised kernel, bit for bit
/// candle's add (`cuda_kernels::add`).
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    return Ok(crate::cuda_kernels::add(a, b)?);
    #[cfg(not(feature = "cuda"))]
    Ok((a + b)?)
}

/// `x.transpose(1, 2).contiguous()` of a 4-D tensor; on CUDA in bf16 one vectorised copy kernel
/// (`cuda_kernels::swap12`).
pub(crate) fn swap12(x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    return Ok(crate::cuda_kernels::swap12(x)?);
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
    /// `x * r` cast to the compute dtype (what the weight multiplies); `None` on the fused CUDA
    /// path, where `xs` is the bf16 input itself and `r` is `[rows]`.
    xhat: Option<Tensor>,
    /// `xs` is the input tensor itself (the fused path, or an input already in the statistics
    /// dtype), not a copy.
    xs_is_input: bool,
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
/// dtype, `x * r` cast back to the input dtype, then multiplied by the weight in that dtype.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, RmsCache)> {
    #[cfg(feature = "cuda")]
    if crate::cuda_kernels::applies(x) && w.dtype() == DType::BF16 {
        let (y, r) = crate::cuda_kernels::rms_norm(x, w, eps)?;
        return Ok((y, RmsCache { xs: x.clone(), r, xhat: None, xs_is_input: true }));
    }
    let dtype = x.dtype();
    let xs = x.to_dtype(stat_dtype(dtype))?;
    let var = xs.sqr()?.mean_keepdim(D::Minus1)?;
    let r = (var + eps)?.sqrt()?.recip()?;
    let xhat = xs.broadcast_mul(&r)?.to_dtype(dtype)?;
    let y = xhat.broadcast_mul(w)?;
    Ok((y, RmsCache { xs, r, xhat: Some(xhat), xs_is_input: stat_dtype(dtype) == dtype }))
}

/// Backward of [`rms_norm`]. With `r = (mean(x²) + eps)^(-1/2)` over the `n` features and
/// `g = dy ⊙ w`: `y_j = w_j x_j r` and `∂r/∂x_k = -r³ x_k / n`, so
/// `dx_k = r g_k - x_k r³ mean(g ⊙ x)` and `dw = Σ_rows dy ⊙ x r`.
/// Returns `(dx` in the compute dtype, `dw` in the statistics dtype`)`.
pub(crate) fn rms_norm_backward(dy: &Tensor, w: &Tensor, cache: &RmsCache) -> Result<(Tensor, Tensor)> {
    let Some(xhat) = &cache.xhat else { return fused_rms_backward(dy, w, cache) };
    let dtype = dy.dtype();
    let sd = cache.xs.dtype();
    let n = cache.xs.dim(D::Minus1)?;
    let rows = cache.xs.elem_count() / n;
    let dys = dy.to_dtype(sd)?;
    let dw = (&dys * xhat.to_dtype(sd)?)?.reshape((rows, n))?.sum(0)?;
    let g = dy.broadcast_mul(w)?.to_dtype(sd)?;
    let gx_mean = (&g * &cache.xs)?.mean_keepdim(D::Minus1)?;
    let r3 = ((&cache.r * &cache.r)? * &cache.r)?;
    let dx = (g.broadcast_mul(&cache.r)? - cache.xs.broadcast_mul(&(r3 * gx_mean)?)?)?;
    Ok((dx.to_dtype(dtype)?, dw))
}

#[cfg(feature = "cuda")]
fn fused_rms_backward(dy: &Tensor, w: &Tensor, cache: &RmsCache) -> Result<(Tensor, Tensor)> {
    Ok(crate::cuda_kernels::rms_norm_backward(dy, &cache.xs, w, &cache.r)?)
}

#[cfg(not(feature = "cuda"))]
fn fused_rms_backward(_: &Tensor, _: &Tensor, _: &RmsCache) -> Result<(Tensor, Tensor)> {
    unreachable!("RmsCache without xhat is only built by the cuda feature's fused path")
}

/// `y = x Wᵀ (+ b)`, `x: [N, in]`, `W: [out, in]` (a strided view is fine), `b: [out]`.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
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
    return Ok(crate::cuda_kernels::add_row(y, b)?);
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
    let dx = dy.matmul(w)?;
    grads.accumulate_matmul(weight, dy, x)?;
    if let Some(bias) = bias {
        grads.accumulate_col_sums(bias, dy)?;
    }
    Ok(dx)
}

/// Derivative of `silu(g) = g σ(g)`: `σ(g) (1 + g (1 - σ(g)))`, evaluated in the statistics
/// dtype and returned in `g`'s dtype.
pub(crate) fn silu_grad(g: &Tensor) -> Result<Tensor> {
    let gs = g.to_dtype(stat_dtype(g.dtype()))?;
    let sig = (gs.neg()?.exp()? + 1.0)?.recip()?;
    let d = (&sig * ((&gs * (1.0 - &sig)?)? + 1.0)?)?;
    Ok(d.to_dtype(g.dtype())?)
}

//! Rotary position embedding: the frequency table (with `linear`, `llama3` and `yarn` scaling,
//! computed in f32 exactly as transformers does), the angles `pos · inv_freq` as transformers
//! forms them (f32) or exact (f64), YaRN's attention factor on cos and sin, and the rotation with
//! its backward.

use candle_core::{DType, Device, Tensor, D};
use mt_core::{ModelConfig, RopeScaling};

use crate::{Error, Result};

/// Precomputed `cos` and `sin` tables, `[max_t, head_dim]` in the compute dtype, each row being
/// `cat(freqs, freqs)` with `freqs[pos, i] = pos * inv_freq[i]` (transformers' layout).
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    max_t: usize,
}

impl Rope {
    /// The inverse frequencies `inv_freq[i]`, `i < head_dim / 2`, after RoPE scaling.
    ///
    /// transformers computes them in f32 with Python-float scalars rounded to f32 at each
    /// operation (`1 / base ** (arange(0, dim, 2).float() / dim)`, then the scaling); every step
    /// below is the same f32 operation in the same order, so the table matches bit for bit up to
    /// the last-ulp accuracy of `powf`.
    pub fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
        let dim = cfg.head_dim;
        let base = cfg.rope_theta as f32;
        let default = (0..dim).step_by(2).map(|i| {
            let exponent = i as f32 / dim as f32;
            // powf in f64 of the f32 operands, rounded once: the correctly rounded f32 power.
            let p = (f64::from(base).powf(f64::from(exponent))) as f32;
            1.0f32 / p
        });
        match &cfg.rope_scaling {
            None => default.collect(),
            Some(RopeScaling::Linear { factor }) => {
                let factor = *factor as f32;
                default.map(|f| f / factor).collect()
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            }) => {
                // transformers' `_compute_llama3_parameters`, scalar by scalar.
                let low_wavelen = (old / low_freq_factor) as f32;
                let high_wavelen = (old / high_freq_factor) as f32;
                let two_pi = (2.0 * std::f64::consts::PI) as f32;
                let (factor32, low32) = (*factor as f32, *low_freq_factor as f32);
                let band = (high_freq_factor - low_freq_factor) as f32;
                let old32 = *old as f32;
                default
                    .map(|f| {
                        let wavelen = two_pi / f;
                        let inv_l = if wavelen > low_wavelen { f / factor32 } else { f };
                        let smooth = (old32 / wavelen - low32) / band;
                        let smoothed = (1.0 - smooth) * inv_l / factor32 + smooth * inv_l;
                        // transformers: `~(wavelen < high) * ~(wavelen > low)`; wavelen is never NaN.
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                        if medium {
                            smoothed
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
            }) => {
                // transformers' `_compute_yarn_parameters`: the correction range in f64 (Python
                // floats), the ramp and the blend in f32, each op rounded as torch rounds it
                // (a Python scalar enters an f32 op as an f32).
                let correction = |rot: f64| {
                    dim as f64 * (old / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * cfg.rope_theta.ln())
                };
                let (mut low, mut high) = (correction(*beta_fast), correction(*beta_slow));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
                if low == high {
                    high += 0.001;
                }
                let (low32, span32, factor32) = (low as f32, (high - low) as f32, *factor as f32);
                (0..dim)
                    .step_by(2)
                    .enumerate()
                    .map(|(j, i)| {
                        let pos_freq = f64::from(base).powf(f64::from(i as f32 / dim as f32)) as f32;
                        let extrapolated = 1.0f32 / pos_freq;
                        let interpolated = 1.0f32 / (factor32 * pos_freq);
                        let ramp = ((j as f32 - low32) / span32).clamp(0.0, 1.0);
                        let keep = 1.0f32 - ramp;
                        interpolated * (1.0 - keep) + extrapolated * keep
                    })
                    .collect()
            }
        }
    }

    /// Builds the tables for positions `0..max_t` with the angles transformers uses
    /// ([`RopeAngles::Transformers`]).
    pub fn new(cfg: &ModelConfig, max_t: usize, dtype: DType, device: &Device) -> Result<Self> {
        Self::with_angles(cfg, max_t, dtype, device, RopeAngles::Transformers)
    }

    /// Builds the tables for positions `0..max_t`: the angle `pos · inv_freq` formed as
    /// `angles` says, its cosine and sine evaluated in f64 (with the library's full argument
    /// reduction) and rounded once to f32, then cast to `dtype` (an f64 table keeps the f64
    /// values).
    pub fn with_angles(
        cfg: &ModelConfig,
        max_t: usize,
        dtype: DType,
        device: &Device,
        angles: RopeAngles,
    ) -> Result<Self> {
        if !dtype.is_float() {
            return Err(Error::dtype("RoPE table", "a float dtype", dtype));
        }
        let inv = Self::inv_freq(cfg);
        let hd = cfg.head_dim;
        debug_assert_eq!(2 * inv.len(), hd);
        // YaRN's attention factor multiplies cos and sin (transformers: the f32 values times the
        // factor, in f32); 1 for every other scaling, where the product is exact.
        let scale = cfg.rope_scaling.as_ref().map_or(1.0, RopeScaling::attention_factor);
        let scale32 = scale as f32;
        let table = |f: fn(f64) -> f64| -> Result<Tensor> {
            Ok(if dtype == DType::F64 {
                Tensor::from_vec(table_rows(&inv, max_t, angles, f, |x| x * scale), (max_t, hd), device)?
            } else {
                // Rounded to f32 once (twice with an attention factor), with no f64 table of
                // `max_t · hd` values in between.
                let conv = |x: f64| x as f32 * scale32;
                Tensor::from_vec(table_rows(&inv, max_t, angles, f, conv), (max_t, hd), device)?
                    .to_dtype(dtype)?
            })
        };
        Ok(Rope { cos: table(f64::cos)?, sin: table(f64::sin)?, max_t })
    }

    /// The device the tables live on.
    pub fn device(&self) -> &Device {
        self.cos.device()
    }

    /// The whole `cos` and `sin` tables, `[max_t, head_dim]`.
    pub(crate) fn tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// Number of positions in the table.
    pub fn max_t(&self) -> usize {
        self.max_t
    }

    /// The table's dtype.
    pub fn dtype(&self) -> DType {
        self.cos.dtype()
    }

    /// `cos` and `sin` rows for positions `start..start + t`, `[t, head_dim]` views.
    pub fn cos_sin(&self, start: usize, t: usize) -> Result<(Tensor, Tensor)> {
        let end = start + t;
        if end > self.max_t {
            return Err(Error::Positions { start, end, max_t: self.max_t });
        }
        Ok((self.cos.narrow(0, start, t)?, self.sin.narrow(0, start, t)?))
    }
}

/// How the rotation angle `pos · inv_freq` is formed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RopeAngles {
    /// The f32 product, as transformers (and the inference engines that follow it) forms it at
    /// every position, in every model dtype: the definition the golden fixtures and checkpoints
    /// use. Its rounding is at most `angle · 2^-24`: 1e-4 rad at position 2048, 2e-3 rad at
    /// 32768, 0.031 rad at 524287 for the highest-frequency pair (the bf16 spacing of cos near
    /// ±1 is 2^-9 ≈ 2e-3).
    #[default]
    Transformers,
    /// The exact angle, formed in f64 (a 24-bit `inv_freq` times a position below 2^29 is exact
    /// there): for models whose inference computes RoPE exactly.
    Exact,
}

/// Rows `0..max_t` of a table, flat: row `pos` is `cat(v, v)` with `v[i] = conv(f(angle))`,
/// `angle = pos · inv[i]` formed as `angles` says.
fn table_rows<T: Copy>(
    inv: &[f32],
    max_t: usize,
    angles: RopeAngles,
    f: fn(f64) -> f64,
    conv: impl Fn(f64) -> T,
) -> Vec<T> {
    let half = inv.len();
    let angle = |pos: usize, w: f32| match angles {
        RopeAngles::Transformers => f64::from(pos as f32 * w),
        RopeAngles::Exact => pos as f64 * f64::from(w),
    };
    let mut out = Vec::with_capacity(max_t * 2 * half);
    for pos in 0..max_t {
        let start = out.len();
        out.extend(inv.iter().map(|&w| conv(f(angle(pos, w)))));
        out.extend_from_within(start..start + half);
    }
    out
}

/// `rotate_half(x) = cat(-x[..., hd/2:], x[..., :hd/2])` over the last dimension.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    Ok(Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?)
}

/// Rotates `x: [b, t, heads, hd]` with `cos, sin: [t, hd]` (the same rows for every sequence) or
/// `[b·t, hd]` (a row per token): `x * cos + rotate_half(x) * sin`.
pub(crate) fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, t, heads, hd) = x.dims4()?;
    let rows = cos.dim(0)?;
    if rows != t && rows == b * t {
        // A row per token: the batch as one sequence of b·t tokens.
        let y = apply(&x.reshape((1, b * t, heads, hd))?, cos, sin)?;
        return Ok(y.reshape((b, t, heads, hd))?);
    }
    #[cfg(feature = "cuda")]
    if mt_kernels::applies(x) && cos.dtype() == x.dtype() && sin.dtype() == x.dtype() {
        return Ok(mt_kernels::rope(x, cos, sin, false)?);
    }
    let cos = cos.reshape((1, t, 1, hd))?;
    let sin = sin.reshape((1, t, 1, hd))?;
    Ok((x.broadcast_mul(&cos)? + rotate_half(x)?.broadcast_mul(&sin)?)?)
}

/// Backward of [`apply`]. With `R` the matrix of `rotate_half`, `y = cos ⊙ x + sin ⊙ (R x)`, so
/// `dx = cos ⊙ dy + Rᵀ (sin ⊙ dy)`. `R` is a signed permutation with `Rᵀ = -R`, and because
/// `sin = cat(f, f)` has equal halves, `R (sin ⊙ dy) = sin ⊙ (R dy)`. Hence
/// `dx = cos ⊙ dy + (-sin) ⊙ (R dy)`: the forward rotation with `sin` negated (the inverse
/// rotation, since the rotation is orthogonal).
pub(crate) fn apply_backward(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, t, heads, hd) = dy.dims4()?;
    let rows = cos.dim(0)?;
    if rows != t && rows == b * t {
        let y = apply_backward(&dy.reshape((1, b * t, heads, hd))?, cos, sin)?;
        return Ok(y.reshape((b, t, heads, hd))?);
    }
    #[cfg(feature = "cuda")]
    if mt_kernels::applies(dy) && cos.dtype() == dy.dtype() && sin.dtype() == dy.dtype() {
        return Ok(mt_kernels::rope(dy, cos, sin, true)?);
    }
    apply(dy, cos, &sin.neg()?)
}

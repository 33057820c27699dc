//! The AdamW update: hyperparameters, the fused rayon kernel, its plain scalar reference, and the
//! master-to-upload cast.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::coded::run_coded;
use crate::error::{check_len, Error};
use crate::moments::Moments;
use crate::simd::{streaming::Writer, Isa};

/// Elements per rayon task. Fixed, so the work split (and [`crate::sum_squares`]'s reduction order)
/// does not depend on the thread count. 16K f32 = 64 KiB per stream: large enough to amortise task
/// overhead, small enough to balance 64M parameters over many cores.
pub const CHUNK: usize = 16 * 1024;

/// Elements per inner block of a chunk: bf16 grads are widened into a stack buffer of this size, and
/// the upload cast reads the block of new master values while it is still in L1.
pub(crate) const BLOCK: usize = 1024;

/// AdamW hyperparameters, as `torch.optim.AdamW` takes them (`amsgrad`, `maximize` and the
/// `capturable`/`differentiable` modes are not supported).
///
/// They are `f64` because torch's are Python floats: torch derives every scalar of the update
/// (`1 - beta1`, `1 - lr * weight_decay`, the bias corrections) in double precision and only then
/// rounds it to f32. Holding `beta2 = 0.999` as an f32 instead shifts `1 - beta2` by 1.3e-5 relative,
/// which moves `v` away from torch's by far more than fp32 rounding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// Base learning rate. [`step_fused`] reads the per-step rate from [`StepArgs::lr`], which a
    /// schedule derives from this one; [`AdamW::args`] copies it unchanged.
    pub lr: f64,
    /// Decay of the first moment, `0 <= beta1 < 1`.
    pub beta1: f64,
    /// Decay of the second moment, `0 <= beta2 < 1`.
    pub beta2: f64,
    /// Added to the bias-corrected `sqrt(v)` in the denominator, `>= 0`.
    pub eps: f64,
    /// Decoupled weight decay: each step multiplies the parameter by `1 - lr * weight_decay`.
    pub weight_decay: f64,
}

impl Default for AdamW {
    /// torch's defaults: `lr = 1e-3, betas = (0.9, 0.999), eps = 1e-8, weight_decay = 1e-2`.
    fn default() -> Self {
        Self { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

impl AdamW {
    /// Arguments for step `step` at the base learning rate with no gradient clipping.
    pub fn args(&self, step: u64) -> StepArgs {
        StepArgs { step, lr: self.lr, grad_scale: 1.0 }
    }

    /// Checks the hyper-parameters and step arguments with torch's constructor's ranges (every
    /// step function does this before writing anything).
    pub fn validate(&self, a: &StepArgs) -> Result<(), Error> {
        if a.step == 0 {
            return Err(Error::ZeroStep);
        }
        let check = |name, value: f64, ok: bool, expected| {
            if ok {
                Ok(())
            } else {
                Err(Error::Hyperparameter { name, value, expected })
            }
        };
        let beta_ok = |b: f64| (0.0..1.0).contains(&b);
        check("lr", a.lr, a.lr >= 0.0 && a.lr.is_finite(), "a finite value >= 0")?;
        check("beta1", self.beta1, beta_ok(self.beta1), "0 <= beta1 < 1")?;
        check("beta2", self.beta2, beta_ok(self.beta2), "0 <= beta2 < 1")?;
        check("eps", self.eps, self.eps >= 0.0 && self.eps.is_finite(), "a finite value >= 0")?;
        check(
            "weight_decay",
            self.weight_decay,
            self.weight_decay >= 0.0 && self.weight_decay.is_finite(),
            "a finite value >= 0",
        )
    }
}

/// What changes from one step to the next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepArgs {
    /// The 1-based step number `t` (torch increments its counter before the update, so its first
    /// update runs with `t = 1`).
    pub step: u64,
    /// This step's learning rate (after any schedule). `f64` for the reason given on [`AdamW`].
    pub lr: f64,
    /// Multiplies every gradient element before the update: the clip coefficient from
    /// [`crate::clip_coef`], or 1.0 for none. torch's `clip_grad_norm_` multiplies the gradients in
    /// place by its f32 coefficient; this does the same multiplication on the fly.
    pub grad_scale: f32,
}

/// A gradient slice. bf16 gradients are widened to f32 exactly before use.
#[derive(Debug, Clone, Copy)]
pub enum Grad<'a> {
    /// fp32 gradient.
    F32(&'a [f32]),
    /// bf16 gradient (the compact gradient buffer of exact mode).
    Bf16(&'a [bf16]),
}

impl Grad<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Grad::F32(g) => g.len(),
            Grad::Bf16(g) => g.len(),
        }
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where the cast of the new master goes (the staging copy that is uploaded to the GPU), if anywhere.
/// Casts round to nearest, ties to even (`half`'s `from_f32`).
#[derive(Debug)]
pub enum Upload<'a> {
    /// No upload copy.
    None,
    /// fp32 copy.
    F32(&'a mut [f32]),
    /// bf16 copy.
    Bf16(&'a mut [bf16]),
    /// fp16 copy.
    F16(&'a mut [f16]),
}

impl Upload<'_> {
    /// Number of elements, or `None` for [`Upload::None`].
    pub(crate) fn len(&self) -> Option<usize> {
        match self {
            Upload::None => None,
            Upload::F32(u) => Some(u.len()),
            Upload::Bf16(u) => Some(u.len()),
            Upload::F16(u) => Some(u.len()),
        }
    }
}

/// The f32 scalars of one step, derived as torch's `_single_tensor_adam` derives them: in f64
/// (Python floats), rounded to f32 when the tensor op that consumes them is called.
#[derive(Debug, Clone, Copy)]
pub struct Coeffs {
    /// Multiplies every gradient element first (the clip coefficient).
    pub grad_scale: f32,
    /// `param.mul_(1 - lr * weight_decay)`.
    pub decay: f32,
    /// `exp_avg.lerp_(grad, w)` with `w = 1 - beta1`. ATen's lerp computes `m + w * (g - m)` when
    /// `|w| < 0.5` and `g - (g - m) * (1 - w)` otherwise. Both are `base + coeff * (g - m)`: base `m`,
    /// coeff `w`; or base `g`, coeff `w - 1` (exact for `w` in [0.5, 1], and `x + -y == x - y`).
    pub lerp_small: bool,
    /// The lerp's `coeff` (see `lerp_small`).
    pub lerp_coeff: f32,
    /// `exp_avg_sq.mul_(beta2)`.
    pub beta2: f32,
    /// `value` of `exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)`.
    pub one_minus_beta2: f32,
    /// `bias_correction2 ** 0.5`, the divisor of `exp_avg_sq.sqrt()`.
    pub bc2_sqrt: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// `lr / bias_correction1`; torch passes its negation as addcdiv's `value`.
    pub step_size: f32,
}

impl Coeffs {
    /// The scalars of step `a` under `h`, after checking them as [`step_fused`] does: for an
    /// implementation of the same update elsewhere (the GPU kernel of a device-resident unit),
    /// which evaluates the fused loop's expressions with these values.
    ///
    /// # Errors
    /// As [`step_fused`]: [`Error::ZeroStep`], [`Error::Hyperparameter`].
    pub fn of(h: &AdamW, a: &StepArgs) -> Result<Self, Error> {
        h.validate(a)?;
        Ok(Self::new(h, a))
    }

    fn new(h: &AdamW, a: &StepArgs) -> Self {
        // torch reads the step from a float32 tensor with `.item()`: exact for t < 2^24.
        let t = a.step as f64;
        let bias_correction1 = 1.0 - h.beta1.powf(t);
        let bias_correction2 = 1.0 - h.beta2.powf(t);
        let w = (1.0 - h.beta1) as f32;
        let lerp_small = w.abs() < 0.5;
        Self {
            grad_scale: a.grad_scale,
            decay: (1.0 - a.lr * h.weight_decay) as f32,
            lerp_small,
            lerp_coeff: if lerp_small { w } else { w - 1.0 },
            beta2: h.beta2 as f32,
            one_minus_beta2: (1.0 - h.beta2) as f32,
            bc2_sqrt: bias_correction2.powf(0.5) as f32,
            eps: h.eps as f32,
            step_size: (a.lr / bias_correction1) as f32,
        }
    }
}

/// The fused update of one block: straight-line f32 arithmetic, no branches that depend on the
/// data (`lerp_small` is loop-invariant), so LLVM vectorises it. Rust neither contracts `a * b + c`
/// into an FMA nor reassociates, so every SIMD lane rounds exactly as [`step_reference`] does.
#[inline(always)]
pub(crate) fn update_block(c: &Coeffs, g: &[f32], p: &mut [f32], m: &mut [f32], v: &mut [f32]) {
    for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        let g = g * c.grad_scale;
        let base = if c.lerp_small { *m } else { g };
        let m_new = base + c.lerp_coeff * (g - *m);
        let v_new = *v * c.beta2 + c.one_minus_beta2 * g * g;
        let denom = v_new.sqrt() / c.bc2_sqrt + c.eps;
        *p = *p * c.decay - c.step_size * m_new / denom;
        *m = m_new;
        *v = v_new;
    }
}

/// [`update_block`] over moments held in bf16 or 8 bits (`coded`), decoded: the same expressions
/// in the same order but for the bias correction of `v`, a product by `1 / bc2_sqrt` (one
/// division per call) instead of a quotient per element. The moments are rounded to bf16 or 8
/// bits right after, far coarser than that one rounding, and divisions are what the vectorised
/// pass waits on (one division and one square root per element instead of two and one). The
/// device kernels for those moments (`kernels/cuda/adamw.cu`) compute the same.
#[inline(always)]
pub(crate) fn update_block_coded(c: &Coeffs, g: &[f32], p: &mut [f32], m: &mut [f32], v: &mut [f32]) {
    let inv_bc2 = 1.0 / c.bc2_sqrt;
    for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        let g = g * c.grad_scale;
        let base = if c.lerp_small { *m } else { g };
        let m_new = base + c.lerp_coeff * (g - *m);
        let v_new = *v * c.beta2 + c.one_minus_beta2 * g * g;
        let denom = v_new.sqrt() * inv_bc2 + c.eps;
        *p = *p * c.decay - c.step_size * m_new / denom;
        *m = m_new;
        *v = v_new;
    }
}

/// A gradient element type the fused kernel reads.
pub(crate) trait GradElem: Copy + Send + Sync {
    fn to_f32(self) -> f32;

    /// `src` as f32: itself for f32, else widened into `buf`.
    fn widen<'b>(src: &'b [Self], buf: &'b mut [f32; BLOCK]) -> &'b [f32] {
        let dst = &mut buf[..src.len()];
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
        dst
    }
}

impl GradElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    fn widen<'b>(src: &'b [f32], _buf: &'b mut [f32; BLOCK]) -> &'b [f32] {
        src
    }
}

impl GradElem for bf16 {
    /// `bf16::to_f32`, NaN quietening included, as a select instead of `half`'s branch so that
    /// [`GradElem::widen`] vectorises.
    #[inline(always)]
    fn to_f32(self) -> f32 {
        let b = u32::from(self.to_bits());
        let is_nan = b & 0x7FFF > 0x7F80;
        f32::from_bits((if is_nan { b | 0x40 } else { b }) << 16)
    }
}

/// An upload element type the fused kernel and [`cast_into`] write.
pub(crate) trait UploadElem: bytemuck::Pod + Send + Sync {
    fn narrow(src: &[f32], dst: &mut [Self]);

    /// [`UploadElem::narrow`] written with streaming stores (see `simd::streaming`): the
    /// casts go to an L1-sized block buffer and from there to `dst`, so `dst`'s lines are never
    /// read. For outputs nobody on the CPU reads soon: upload staging, the stored gradient.
    fn narrow_streaming(src: &[f32], dst: &mut [Self], w: &mut Writer) {
        let mut buf = [Self::zeroed(); BLOCK];
        for (s, d) in src.chunks(BLOCK).zip(dst.chunks_mut(BLOCK)) {
            let b = &mut buf[..s.len()];
            Self::narrow(s, b);
            w.copy(d, b);
        }
    }
}

impl UploadElem for f32 {
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    fn narrow_streaming(src: &[f32], dst: &mut [f32], w: &mut Writer) {
        w.copy(dst, src);
    }
}

impl UploadElem for bf16 {
    fn narrow(src: &[f32], dst: &mut [bf16]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(bf16_bits(s));
        }
    }
}

/// `bf16::from_f32(x).to_bits()` — round to nearest even, NaNs kept quiet with their sign and top
/// payload bits — without `half`'s early return for NaN, so that the loops calling it vectorise
/// (a select instead of a branch; 2.4x the single-core throughput of the cast on the development
/// machine). Bitwise equal to `half` on every f32 (tests).
#[inline(always)]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    // Adding 0x7FFF plus the kept part's lowest bit carries into the kept part exactly when the
    // dropped half is above one half, or equal to it with an odd kept part. (Wraps only for NaNs,
    // whose sum is discarded.)
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let quiet_nan = (b >> 16) | 0x40;
    let is_nan = b & 0x7FFF_FFFF > 0x7F80_0000;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

impl UploadElem for f16 {
    fn narrow(src: &[f32], dst: &mut [f16]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = f16::from_f32(s);
        }
    }
}

/// One rayon task: the chunk in L1-sized blocks, each widened (bf16 grads), updated, and cast.
pub(crate) fn update_chunk<G: GradElem, U: UploadElem>(
    c: &Coeffs,
    g: &[G],
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    mut up: Option<&mut [U]>,
) {
    let mut buf = [0.0f32; BLOCK];
    let mut w = up.is_some().then(Writer::new);
    let blocks = p.chunks_mut(BLOCK).zip(m.chunks_mut(BLOCK)).zip(v.chunks_mut(BLOCK)).zip(g.chunks(BLOCK));
    for (i, (((p, m), v), g)) in blocks.enumerate() {
        let g = G::widen(g, &mut buf);
        update_block(c, g, p, m, v);
        if let (Some(up), Some(w)) = (up.as_deref_mut(), w.as_mut()) {
            let lo = i * BLOCK;
            U::narrow_streaming(p, &mut up[lo..lo + p.len()], w);
        }
    }
}

/// Splits the (length-checked) slices into [`CHUNK`]s and runs them on the rayon pool.
fn run<G: GradElem, U: UploadElem>(
    c: &Coeffs,
    g: &[G],
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    up: Option<&mut [U]>,
) {
    let (p, m, v, g) =
        (p.par_chunks_mut(CHUNK), m.par_chunks_mut(CHUNK), v.par_chunks_mut(CHUNK), g.par_chunks(CHUNK));
    match up {
        Some(up) => (p, m, v, g, up.par_chunks_mut(CHUNK))
            .into_par_iter()
            .for_each(|(p, m, v, g, u)| update_chunk(c, g, p, m, v, Some(u))),
        None => {
            (p, m, v, g).into_par_iter().for_each(|(p, m, v, g)| update_chunk::<G, U>(c, g, p, m, v, None))
        }
    }
}

fn run_upload<G: GradElem>(c: &Coeffs, step: u64, g: &[G], p: &mut [f32], mom: Moments<'_>, up: Upload<'_>) {
    match (mom, up) {
        (Moments::F32 { m, v }, Upload::None) => run::<G, f32>(c, g, p, m, v, None),
        (Moments::F32 { m, v }, Upload::F32(u)) => run(c, g, p, m, v, Some(u)),
        (Moments::F32 { m, v }, Upload::Bf16(u)) => run(c, g, p, m, v, Some(u)),
        (Moments::F32 { m, v }, Upload::F16(u)) => run(c, g, p, m, v, Some(u)),
        (mom, Upload::None) => run_coded::<G, f32>(Isa::detect(), c, step, g, p, mom, None),
        (mom, Upload::F32(u)) => run_coded(Isa::detect(), c, step, g, p, mom, Some(u)),
        (mom, Upload::Bf16(u)) => run_coded(Isa::detect(), c, step, g, p, mom, Some(u)),
        (mom, Upload::F16(u)) => run_coded(Isa::detect(), c, step, g, p, mom, Some(u)),
    }
}

/// The checks of an update over `n` parameters (every length equal to the master's, the extra
/// buffer's too when given; hyper-parameters torch would accept), then its scalars.
pub(crate) fn checked(
    h: &AdamW,
    a: &StepArgs,
    n: usize,
    grad: usize,
    moments: &Moments<'_>,
    (extra, extra_len): (&'static str, Option<usize>),
) -> Result<Coeffs, Error> {
    check_len("grad", n, grad)?;
    moments.check(n)?;
    if let Some(len) = extra_len {
        check_len(extra, n, len)?;
    }
    h.validate(a)?;
    Ok(Coeffs::new(h, a))
}

/// One fused AdamW pass over a parameter range: reads `grad`, `master` and the moments; writes
/// `master`, the moments and, if given, the upload copy of the new master. Parallel over fixed
/// [`CHUNK`]s on the current rayon pool; the result does not depend on the number of threads.
/// With fp32 moments it is bitwise identical to [`step_reference`] on the (widened) gradient;
/// with bf16 or 8-bit moments it is [`step_reference`] on the decoded moments, whose new values
/// are then encoded (stochastically, with `a.step` and the moments' stream: [`crate::moments`]).
///
/// # Errors
/// [`Error::LengthMismatch`] if `grad`, the moments or `upload` differ in length from `master`;
/// [`Error::ZeroStep`] if `a.step == 0`; [`Error::Hyperparameter`] for a value torch would reject.
/// Nothing is written when an error is returned.
pub fn step_fused(
    h: &AdamW,
    a: &StepArgs,
    grad: Grad<'_>,
    master: &mut [f32],
    moments: Moments<'_>,
    upload: Upload<'_>,
) -> Result<(), Error> {
    let c = checked(h, a, master.len(), grad.len(), &moments, ("upload", upload.len()))?;
    match grad {
        Grad::F32(g) => run_upload(&c, a.step, g, master, moments, upload),
        Grad::Bf16(g) => run_upload(&c, a.step, g, master, moments, upload),
    }
    Ok(())
}

/// The plain scalar loop [`step_fused`] is tested against: torch's `_single_tensor_adam` for fp32
/// parameters with `decoupled_weight_decay=True`, one element at a time, no rayon, no blocking.
///
/// # Panics
/// If the slices differ in length or `a.step == 0` (it is a test oracle; [`step_fused`] returns
/// errors instead).
pub fn step_reference(
    h: &AdamW,
    a: &StepArgs,
    grad: &[f32],
    master: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    let n = master.len();
    assert!(
        grad.len() == n && m.len() == n && v.len() == n,
        "step_reference: lengths differ: grad {}, master {n}, m {}, v {}",
        grad.len(),
        m.len(),
        v.len()
    );
    assert!(a.step >= 1, "step_reference: the step is 1-based, got 0");
    // Python-float (f64) scalars, rounded to f32 by the tensor ops that take them.
    let t = a.step as f64;
    let bias_correction1 = 1.0 - h.beta1.powf(t);
    let bias_correction2 = 1.0 - h.beta2.powf(t);
    let step_size = (a.lr / bias_correction1) as f32;
    let bias_correction2_sqrt = bias_correction2.powf(0.5) as f32;
    let decay = (1.0 - a.lr * h.weight_decay) as f32;
    let lerp_weight = (1.0 - h.beta1) as f32;
    let beta2 = h.beta2 as f32;
    let one_minus_beta2 = (1.0 - h.beta2) as f32;
    let eps = h.eps as f32;
    for i in 0..n {
        // torch.nn.utils.clip_grad_norm_: grad.mul_(clip_coef)
        let g = grad[i] * a.grad_scale;
        // param.mul_(1 - lr * weight_decay)
        master[i] *= decay;
        // exp_avg.lerp_(grad, 1 - beta1), with ATen's choice of formula by the weight
        m[i] = if lerp_weight.abs() < 0.5 {
            m[i] + lerp_weight * (g - m[i])
        } else {
            g - (g - m[i]) * (1.0 - lerp_weight)
        };
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2); addcmul is self + value * t1 * t2
        v[i] = v[i] * beta2 + one_minus_beta2 * g * g;
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = v[i].sqrt() / bias_correction2_sqrt + eps;
        // param.addcdiv_(exp_avg, denom, value=-step_size); addcdiv is self + value * t1 / t2
        master[i] -= step_size * m[i] / denom;
    }
}

/// Casts `master` into an upload buffer without updating it (a layer re-fetched for backward).
/// Rayon-parallel over [`CHUNK`]s; [`Upload::None`] does nothing.
///
/// # Errors
/// [`Error::LengthMismatch`] if the upload buffer's length differs from `master`'s.
pub fn cast_into(master: &[f32], upload: Upload<'_>) -> Result<(), Error> {
    match upload {
        Upload::None => Ok(()),
        Upload::F32(u) => cast_par(master, u),
        Upload::Bf16(u) => cast_par(master, u),
        Upload::F16(u) => cast_par(master, u),
    }
}

fn cast_par<U: UploadElem>(src: &[f32], dst: &mut [U]) -> Result<(), Error> {
    check_len("upload", src.len(), dst.len())?;
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| U::narrow_streaming(s, d, &mut Writer::new()));
    Ok(())
}

#[cfg(test)]
mod tests;

//! The AdamW update: hyperparameters, the fused rayon kernel, its plain scalar reference, and the
//! master-to-upload cast.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{check_len, Error};

/// Elements per rayon task. Fixed, so the work split (and [`crate::sum_squares`]'s reduction order)
/// does not depend on the thread count. 16K f32 = 64 KiB per stream: large enough to amortise task
/// overhead, small enough to balance 64M parameters over many cores.
pub const CHUNK: usize = 16 * 1024;

/// Elements per inner block of a chunk: bf16 grads are widened into a stack buffer of this size, and
/// the upload cast reads the block of new master values while it is still in L1.
const BLOCK: usize = 1024;

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
    fn len(&self) -> Option<usize> {
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
struct Coeffs {
    grad_scale: f32,
    /// `param.mul_(1 - lr * weight_decay)`.
    decay: f32,
    /// `exp_avg.lerp_(grad, w)` with `w = 1 - beta1`. ATen's lerp computes `m + w * (g - m)` when
    /// `|w| < 0.5` and `g - (g - m) * (1 - w)` otherwise. Both are `base + coeff * (g - m)`: base `m`,
    /// coeff `w`; or base `g`, coeff `w - 1` (exact for `w` in [0.5, 1], and `x + -y == x - y`).
    lerp_small: bool,
    lerp_coeff: f32,
    beta2: f32,
    /// `value` of `exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)`.
    one_minus_beta2: f32,
    /// `bias_correction2 ** 0.5`, the divisor of `exp_avg_sq.sqrt()`.
    bc2_sqrt: f32,
    eps: f32,
    /// `lr / bias_correction1`; torch passes its negation as addcdiv's `value`.
    step_size: f32,
}

impl Coeffs {
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
fn update_block(c: &Coeffs, g: &[f32], p: &mut [f32], m: &mut [f32], v: &mut [f32]) {
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

/// A gradient element type the fused kernel reads.
trait GradElem: Copy + Send + Sync {
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
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// An upload element type the fused kernel and [`cast_into`] write.
trait UploadElem: Copy + Send + Sync {
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl UploadElem for f32 {
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl UploadElem for bf16 {
    fn narrow(src: &[f32], dst: &mut [bf16]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = bf16::from_f32(s);
        }
    }
}

impl UploadElem for f16 {
    fn narrow(src: &[f32], dst: &mut [f16]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = f16::from_f32(s);
        }
    }
}

/// One rayon task: the chunk in L1-sized blocks, each widened (bf16 grads), updated, and cast.
fn update_chunk<G: GradElem, U: UploadElem>(
    c: &Coeffs,
    g: &[G],
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    mut up: Option<&mut [U]>,
) {
    let mut buf = [0.0f32; BLOCK];
    let blocks = p.chunks_mut(BLOCK).zip(m.chunks_mut(BLOCK)).zip(v.chunks_mut(BLOCK)).zip(g.chunks(BLOCK));
    for (i, (((p, m), v), g)) in blocks.enumerate() {
        let g = G::widen(g, &mut buf);
        update_block(c, g, p, m, v);
        if let Some(up) = up.as_deref_mut() {
            let lo = i * BLOCK;
            U::narrow(p, &mut up[lo..lo + p.len()]);
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

fn run_upload<G: GradElem>(c: &Coeffs, g: &[G], p: &mut [f32], m: &mut [f32], v: &mut [f32], up: Upload<'_>) {
    match up {
        Upload::None => run::<G, f32>(c, g, p, m, v, None),
        Upload::F32(u) => run(c, g, p, m, v, Some(u)),
        Upload::Bf16(u) => run(c, g, p, m, v, Some(u)),
        Upload::F16(u) => run(c, g, p, m, v, Some(u)),
    }
}

/// One fused AdamW pass over a parameter range: reads `grad`, `master`, `m`, `v`; writes `master`,
/// `m`, `v` and, if given, the upload copy of the new master. Parallel over fixed [`CHUNK`]s on the
/// current rayon pool; the result is bitwise identical to [`step_reference`] on the (widened) gradient
/// and does not depend on the number of threads.
///
/// # Errors
/// [`Error::LengthMismatch`] if `grad`, `m`, `v` or `upload` differ in length from `master`;
/// [`Error::ZeroStep`] if `a.step == 0`; [`Error::Hyperparameter`] for a value torch would reject.
/// Nothing is written when an error is returned.
pub fn step_fused(
    h: &AdamW,
    a: &StepArgs,
    grad: Grad<'_>,
    master: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    upload: Upload<'_>,
) -> Result<(), Error> {
    let n = master.len();
    check_len("grad", n, grad.len())?;
    check_len("m", n, m.len())?;
    check_len("v", n, v.len())?;
    if let Some(len) = upload.len() {
        check_len("upload", n, len)?;
    }
    h.validate(a)?;
    let c = Coeffs::new(h, a);
    match grad {
        Grad::F32(g) => run_upload(&c, g, master, m, v, upload),
        Grad::Bf16(g) => run_upload(&c, g, master, m, v, upload),
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
    dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| U::narrow(s, d));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Over two full chunks plus a ragged tail, so chunk and block boundaries are crossed.
    const N: usize = 2 * CHUNK + 3 * BLOCK + 77;

    fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(lo..hi)).collect()
    }

    /// Gradients spanning many magnitudes (incl. exact zeros and values below eps) and both signs.
    fn grads(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match i % 17 {
                0 => 0.0,
                1 => rng.random_range(-1e-9f32..1e-9),
                _ => rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-6..3)),
            })
            .collect()
    }

    #[track_caller]
    fn assert_bitwise(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            panic!(
                "{what}[{i}]: fused {:e} ({:#010x}) != reference {:e} ({:#010x})",
                got[i],
                got[i].to_bits(),
                want[i],
                want[i].to_bits()
            );
        }
    }

    struct State {
        p: Vec<f32>,
        m: Vec<f32>,
        v: Vec<f32>,
    }

    impl State {
        /// torch's state before step 1: m = v = 0.
        fn fresh(rng: &mut StdRng, n: usize) -> Self {
            Self { p: uniform(rng, n, -2.0, 2.0), m: vec![0.0; n], v: vec![0.0; n] }
        }

        /// A state deep into training.
        fn warm(rng: &mut StdRng, n: usize) -> Self {
            let m = uniform(rng, n, -1e-2, 1e-2);
            let v = m.iter().map(|x| x * x * rng.random_range(1.0f32..4.0)).collect();
            Self { p: uniform(rng, n, -2.0, 2.0), m, v }
        }
    }

    /// Runs `steps` steps from `first` on both paths (f32 grads) and asserts bitwise equality.
    fn fused_matches_reference(h: AdamW, grad_scale: f32, first: u64, steps: u64, start: State, seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut r = State { p: start.p.clone(), m: start.m.clone(), v: start.v.clone() };
        let mut f = start;
        for t in first..first + steps {
            let g = grads(&mut rng, f.p.len());
            // A schedule: a different lr each step.
            let a = StepArgs { step: t, lr: h.lr * (1.0 + 0.1 * t as f64), grad_scale };
            step_fused(&h, &a, Grad::F32(&g), &mut f.p, &mut f.m, &mut f.v, Upload::None).unwrap();
            step_reference(&h, &a, &g, &mut r.p, &mut r.m, &mut r.v);
            assert_bitwise(&format!("t={t} master"), &f.p, &r.p);
            assert_bitwise(&format!("t={t} m"), &f.m, &r.m);
            assert_bitwise(&format!("t={t} v"), &f.v, &r.v);
        }
    }

    #[test]
    fn fused_equals_reference_bitwise_weight_decay_zero() {
        let mut rng = StdRng::seed_from_u64(1);
        let h = AdamW { weight_decay: 0.0, ..AdamW::default() };
        fused_matches_reference(h, 1.0, 1, 4, State::fresh(&mut rng, N), 11);
    }

    #[test]
    fn fused_equals_reference_bitwise_weight_decay_and_clipping() {
        let mut rng = StdRng::seed_from_u64(2);
        let h = AdamW { lr: 3e-4, weight_decay: 0.1, ..AdamW::default() };
        fused_matches_reference(h, 0.37, 1, 4, State::fresh(&mut rng, N), 12);
        fused_matches_reference(h, 0.8125, 1000, 3, State::warm(&mut rng, N), 13);
    }

    #[test]
    fn fused_equals_reference_bitwise_large_lerp_weight() {
        // 1 - beta1 >= 0.5 takes ATen lerp's other formula: g - (g - m) * (1 - w).
        let mut rng = StdRng::seed_from_u64(3);
        for beta1 in [0.3, 0.0] {
            let h = AdamW { beta1, ..AdamW::default() };
            fused_matches_reference(h, 1.0, 5, 3, State::warm(&mut rng, N), 14);
        }
    }

    #[test]
    fn bf16_grads_match_reference_on_widened_grads() {
        let mut rng = StdRng::seed_from_u64(4);
        let h = AdamW { weight_decay: 0.05, ..AdamW::default() };
        let mut f = State::warm(&mut rng, N);
        let (mut rp, mut rm, mut rv) = (f.p.clone(), f.m.clone(), f.v.clone());
        let mut up = vec![bf16::ZERO; N];
        for t in 7..10 {
            let g: Vec<bf16> = grads(&mut rng, N).into_iter().map(bf16::from_f32).collect();
            let wide: Vec<f32> = g.iter().map(|x| x.to_f32()).collect();
            let a = StepArgs { step: t, lr: 2e-3, grad_scale: 0.5 };
            step_fused(&h, &a, Grad::Bf16(&g), &mut f.p, &mut f.m, &mut f.v, Upload::Bf16(&mut up)).unwrap();
            step_reference(&h, &a, &wide, &mut rp, &mut rm, &mut rv);
            assert_bitwise("master", &f.p, &rp);
            assert_bitwise("m", &f.m, &rm);
            assert_bitwise("v", &f.v, &rv);
            assert!(up.iter().zip(&rp).all(|(u, p)| u.to_bits() == bf16::from_f32(*p).to_bits()));
        }
    }

    #[test]
    fn result_does_not_depend_on_thread_count() {
        let mut rng = StdRng::seed_from_u64(5);
        let s = State::warm(&mut rng, N);
        let g = grads(&mut rng, N);
        let h = AdamW::default();
        let run_on = |threads| {
            let (mut p, mut m, mut v) = (s.p.clone(), s.m.clone(), s.v.clone());
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                step_fused(&h, &h.args(3), Grad::F32(&g), &mut p, &mut m, &mut v, Upload::None).unwrap()
            });
            (p, m, v)
        };
        let (one, four) = (run_on(1), run_on(4));
        assert_bitwise("master", &four.0, &one.0);
        assert_bitwise("m", &four.1, &one.1);
        assert_bitwise("v", &four.2, &one.2);
    }

    /// Step 1 by hand. With m0 = v0 = 0, beta1 = 0.9, beta2 = 0.999:
    ///   m1 = 0.1 g, v1 = 0.001 g^2, bias_correction1 = 0.1, bias_correction2 = 0.001,
    ///   step_size = lr / 0.1, denom = sqrt(0.001 g^2) / sqrt(0.001) + eps = |g| + eps,
    ///   update = step_size * m1 / denom = lr * g / (|g| + eps),
    /// which is lr * sign(g) for |g| >> eps, and lr * g / eps for |g| << eps.
    /// Weight decay first scales the parameter by 1 - lr * wd.
    #[test]
    fn first_step_moves_each_parameter_by_lr_times_sign_of_grad() {
        let h = AdamW { lr: 1e-3, weight_decay: 0.0, ..AdamW::default() };
        let g = [0.5f32, -2.0, 300.0, -1e-4, 1e-12, 0.0];
        let mut p = [1.0f32, 1.0, -0.25, 0.0, 0.0, 3.0];
        let (mut m, mut v) = ([0.0f32; 6], [0.0f32; 6]);
        let p0 = p;
        step_fused(&h, &h.args(1), Grad::F32(&g), &mut p, &mut m, &mut v, Upload::None).unwrap();
        for i in 0..g.len() {
            let (g, eps) = (f64::from(g[i]), 1e-8);
            let update = 1e-3 * g / (g.abs() + eps);
            if g.abs() >= 0.5 {
                assert!((update - 1e-3 * g.signum()).abs() < 1e-10, "|g| >> eps: update is lr * sign(g)");
            }
            let want = f64::from(p0[i]) - update;
            let got = f64::from(p[i]);
            assert!((got - want).abs() <= 1e-7 * want.abs().max(1e-3), "p[{i}] = {got}, want {want}");
        }
        // m1 = (1 - beta1) g and v1 = (1 - beta2) g^2, with the f32-rounded coefficients.
        assert_eq!(m, g.map(|x| 0.1f32 * x));
        assert_eq!(v, g.map(|x| 0.001f32 * x * x));

        // Weight decay: p = 2 (1 - 1e-3 * 0.1) - 1e-3 = 1.9988 for g = 3.
        let h = AdamW { weight_decay: 0.1, ..h };
        let (mut p, mut m, mut v) = ([2.0f32], [0.0f32], [0.0f32]);
        step_fused(&h, &h.args(1), Grad::F32(&[3.0]), &mut p, &mut m, &mut v, Upload::None).unwrap();
        assert!((f64::from(p[0]) - 1.9988).abs() < 2e-7, "p = {}", p[0]);
    }

    #[test]
    fn upload_copies_equal_the_cast_of_the_new_master() {
        let mut rng = StdRng::seed_from_u64(6);
        let h = AdamW::default();
        let s = State::warm(&mut rng, N);
        let g = grads(&mut rng, N);
        let fresh = || (s.p.clone(), s.m.clone(), s.v.clone());

        let (mut p, mut m, mut v) = fresh();
        step_fused(&h, &h.args(2), Grad::F32(&g), &mut p, &mut m, &mut v, Upload::None).unwrap();
        let new_master = p;

        let mut u32s = vec![0.0f32; N];
        let (mut p, mut m, mut v) = fresh();
        step_fused(&h, &h.args(2), Grad::F32(&g), &mut p, &mut m, &mut v, Upload::F32(&mut u32s)).unwrap();
        assert_bitwise("f32 upload", &u32s, &new_master);
        assert_bitwise("master with f32 upload", &p, &new_master);

        let mut ubf = vec![bf16::ZERO; N];
        let (mut p, mut m, mut v) = fresh();
        step_fused(&h, &h.args(2), Grad::F32(&g), &mut p, &mut m, &mut v, Upload::Bf16(&mut ubf)).unwrap();
        assert!(ubf.iter().zip(&new_master).all(|(u, x)| u.to_bits() == bf16::from_f32(*x).to_bits()));

        let mut uf16 = vec![f16::ZERO; N];
        let (mut p, mut m, mut v) = fresh();
        step_fused(&h, &h.args(2), Grad::F32(&g), &mut p, &mut m, &mut v, Upload::F16(&mut uf16)).unwrap();
        assert!(uf16.iter().zip(&new_master).all(|(u, x)| u.to_bits() == f16::from_f32(*x).to_bits()));
    }

    #[test]
    fn cast_into_rounds_to_nearest_even() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut src = uniform(&mut rng, N, -70000.0, 70000.0);
        // Ties and specials: 1 + 2^-8 is halfway between two bf16 values and rounds to even (1.0);
        // 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
        src[..6].copy_from_slice(&[
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            f32::INFINITY,
            -0.0,
            f32::MAX,
            1e-40,
        ]);
        let mut ubf = vec![bf16::ZERO; N];
        cast_into(&src, Upload::Bf16(&mut ubf)).unwrap();
        assert_eq!(ubf[0], bf16::ONE);
        assert_eq!(ubf[1].to_f32(), 1.0 + 2f32.powi(-6));
        assert_eq!(ubf[2], bf16::INFINITY);
        assert_eq!(ubf[4], bf16::INFINITY, "f32::MAX rounds up past the largest bf16");
        assert!(ubf.iter().zip(&src).all(|(u, x)| u.to_bits() == bf16::from_f32(*x).to_bits()));

        let mut uf16 = vec![f16::ZERO; N];
        cast_into(&src, Upload::F16(&mut uf16)).unwrap();
        assert!(uf16.iter().zip(&src).all(|(u, x)| u.to_bits() == f16::from_f32(*x).to_bits()));

        let mut u32s = vec![0.0f32; N];
        cast_into(&src, Upload::F32(&mut u32s)).unwrap();
        assert_bitwise("f32 cast", &u32s, &src);
        cast_into(&src, Upload::None).unwrap();
    }

    #[test]
    fn length_mismatch_is_reported_with_the_slice_name_and_nothing_is_written() {
        let h = AdamW::default();
        let a = h.args(1);
        let g = [1.0f32; 4];
        let g_short = [1.0f32; 3];
        let (mut p, mut m, mut v, mut v5) = ([0.5f32; 4], [0.0f32; 4], [0.0f32; 4], [0.0f32; 5]);
        let mut m3 = [0.0f32; 3];
        let mut up = [bf16::ZERO; 2];

        let e = step_fused(&h, &a, Grad::F32(&g_short), &mut p, &mut m, &mut v, Upload::None).unwrap_err();
        assert_eq!(e, Error::LengthMismatch { slice: "grad", expected: 4, found: 3 });
        let e = step_fused(&h, &a, Grad::F32(&g), &mut p, &mut m3, &mut v, Upload::None).unwrap_err();
        assert_eq!(e, Error::LengthMismatch { slice: "m", expected: 4, found: 3 });
        let e = step_fused(&h, &a, Grad::F32(&g), &mut p, &mut m, &mut v5, Upload::None).unwrap_err();
        assert_eq!(e, Error::LengthMismatch { slice: "v", expected: 4, found: 5 });
        let e = step_fused(&h, &a, Grad::F32(&g), &mut p, &mut m, &mut v, Upload::Bf16(&mut up)).unwrap_err();
        assert_eq!(e, Error::LengthMismatch { slice: "upload", expected: 4, found: 2 });
        let msg = e.to_string();
        assert!(msg.contains("`upload` has 2") && msg.contains("`master` has 4"), "{msg}");
        assert_eq!((p, m, v), ([0.5; 4], [0.0; 4], [0.0; 4]), "a rejected call wrote nothing");

        let e = cast_into(&p, Upload::Bf16(&mut up)).unwrap_err();
        assert_eq!(e, Error::LengthMismatch { slice: "upload", expected: 4, found: 2 });
        assert_eq!(up, [bf16::ZERO; 2]);
    }

    #[test]
    fn zero_step_and_out_of_range_hyperparameters_are_rejected() {
        let (mut p, mut m, mut v) = ([0.5f32; 2], [0.0f32; 2], [0.0f32; 2]);
        let g = [1.0f32; 2];
        let mut call =
            |h: AdamW, a: StepArgs| step_fused(&h, &a, Grad::F32(&g), &mut p, &mut m, &mut v, Upload::None);
        let h = AdamW::default();
        assert_eq!(call(h, h.args(0)), Err(Error::ZeroStep));
        let bad = [
            (AdamW { beta1: 1.0, ..h }, h.args(1), "beta1"),
            (AdamW { beta2: -0.1, ..h }, h.args(1), "beta2"),
            (AdamW { eps: f64::NAN, ..h }, h.args(1), "eps"),
            (AdamW { weight_decay: -1.0, ..h }, h.args(1), "weight_decay"),
            (h, StepArgs { lr: -1e-3, ..h.args(1) }, "lr"),
        ];
        for (h, a, field) in bad {
            match call(h, a) {
                Err(Error::Hyperparameter { name, .. }) => assert_eq!(name, field),
                other => panic!("{field}: expected a hyperparameter error, got {other:?}"),
            }
        }
        assert_eq!((p, m, v), ([0.5; 2], [0.0; 2], [0.0; 2]));
    }

    /// Golden values from PyTorch 2.15.0 (`/opt/golden-venv`, CPU), produced by this script:
    ///
    /// ```python
    /// import torch
    /// p = torch.tensor([0.5, -1.25, 2.0, 0.0, -0.03125, 3.5, -7.0, 1e-3], dtype=torch.float32, requires_grad=True)
    /// grads = [
    ///     torch.tensor([0.1, -0.2, 0.3, -0.4, 5.0, -6.0, 1e-9, 0.0], dtype=torch.float32),
    ///     torch.tensor([-0.05, 0.25, 0.125, -1.5, 2.0, 0.75, 3e-9, 0.5], dtype=torch.float32),
    ///     torch.tensor([0.2, 0.2, -0.7, 0.01, -4.0, 1.0, 2e-9, -0.25], dtype=torch.float32),
    /// ]
    /// opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
    ///                         foreach=False, fused=False)
    /// for g in grads:
    ///     p.grad = g.clone()
    ///     p.grad.mul_(0.5)  # clip_grad_norm_ multiplies the grads in place by its coefficient
    ///     opt.step()
    /// s = opt.state[p]
    /// for name, t in [("p", p.detach()), ("m", s["exp_avg"]), ("v", s["exp_avg_sq"])]:
    ///     print(name, ", ".join(f"{x:.9e}" for x in t.tolist()))
    /// ```
    ///
    /// torch 2.15 on the AVX-512 machine that produced these fuses `lerp_` and `addcmul_` into FMAs,
    /// which this crate does not: 4 of the 24 values differ from ours by one f32 ulp (largest
    /// relative difference 9.1e-8), the other 20 are bitwise equal.
    #[test]
    fn three_steps_match_pytorch_adamw() {
        let mut p = [0.5f32, -1.25, 2.0, 0.0, -0.03125, 3.5, -7.0, 1e-3];
        let grads: [[f32; 8]; 3] = [
            [0.1, -0.2, 0.3, -0.4, 5.0, -6.0, 1e-9, 0.0],
            [-0.05, 0.25, 0.125, -1.5, 2.0, 0.75, 3e-9, 0.5],
            [0.2, 0.2, -0.7, 0.01, -4.0, 1.0, 2e-9, -0.25],
        ];
        let want_p = [
            4.979257882e-01,
            -1.249233007e+00,
            1.997780561e+00,
            2.576394472e-03,
            -3.331518173e-02,
            3.500854254e+00,
            -6.998131752e+00,
            2.699736797e-05,
        ];
        let want_m = [
            1.180000044e-02,
            1.315000001e-02,
            -1.722499914e-02,
            -8.320000023e-02,
            9.249997884e-02,
            -1.592500210e-01,
            2.755000117e-10,
            9.999999776e-03,
        ];
        let want_v = [
            1.311937831e-05,
            3.558938624e-05,
            1.488573762e-04,
            6.018825225e-04,
            1.123650745e-02,
            9.372492321e-03,
            3.497250160e-21,
            7.806250505e-05,
        ];
        let h = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
        let (mut m, mut v) = ([0.0f32; 8], [0.0f32; 8]);
        for (i, g) in grads.iter().enumerate() {
            let a = StepArgs { step: i as u64 + 1, lr: 1e-3, grad_scale: 0.5 };
            step_fused(&h, &a, Grad::F32(g), &mut p, &mut m, &mut v, Upload::None).unwrap();
        }
        for (name, got, want) in [("p", p, want_p), ("m", m, want_m), ("v", v, want_v)] {
            for (i, (&got, want)) in got.iter().zip(want).enumerate() {
                let rel = (f64::from(got) - want).abs() / want.abs();
                assert!(rel <= 1e-6, "{name}[{i}] = {got:e}, torch {want:e} (relative error {rel:e})");
            }
        }
    }
}

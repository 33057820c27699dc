//! The optimizer of a unit whose fp32 master weights and AdamW moments live on the compute device
//! (the outer unit, when the planner keeps it resident): the update and the gradient's sum of
//! squares as in-place candle ops. On the CPU they run mt-optim's own code on the tensors' memory
//! (so they are bitwise the host optimizer); on CUDA, `kernels/cuda/adamw.cu`, which evaluates the same
//! f32 expressions with the same scalars ([`mt_optim::Coeffs`]), and encodes bf16 or 8-bit moments
//! as mt-optim does (the same stochastic rounding draws, [`mt_optim::rounding_key`]).
//!
//! A state is `[master | m | v]` in f32 words: the master weights, then each moment as the host
//! store keeps it ([`StateDtype::moment_bytes`]), [`StateDtype::state_words`] in all.

use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Tensor};
use mt_core::StateDtype;
use mt_optim::{AdamW, Coeffs, Grad, Moments, StepArgs, Upload};

use crate::{Error, Result};

/// How a unit's moments are held, and whose they are: the encoding and the unit's stream of
/// stochastic rounding draws (its store record index), so the device update is the host's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateKind {
    /// The moments' encoding.
    pub dtype: StateDtype,
    /// The unit's record index (`mt_core::Unit::index`).
    pub stream: u64,
}

struct AdamWStep {
    h: AdamW,
    a: StepArgs,
    kind: StateKind,
    /// bf16 weights to write from the new master weights in the same pass (CUDA only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    weights: Option<Tensor>,
    /// The scalars the CUDA kernel takes (the CPU path derives them inside mt-optim).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    coeffs: Coeffs,
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    match s {
        CpuStorage::F32(v) if l.is_contiguous() => {
            Ok(&v[l.start_offset()..l.start_offset() + l.shape().elem_count()])
        }
        _ => Err(candle_core::Error::Msg(format!("device AdamW: {what} must be a contiguous f32 tensor"))),
    }
}

impl InplaceOp2 for AdamWStep {
    fn name(&self) -> &'static str {
        "mt-adamw"
    }

    fn cpu_fwd(
        &self,
        st: &mut CpuStorage,
        ls: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> candle_core::Result<()> {
        let g = f32_slice(g, lg, "the gradient")?;
        let n = g.len();
        let (off, len) = (ls.start_offset(), ls.shape().elem_count());
        let CpuStorage::F32(v) = st else {
            return Err(candle_core::Error::Msg("device AdamW: the state must be f32".into()));
        };
        let StateKind { dtype, stream } = self.kind;
        if !ls.is_contiguous() || len != dtype.state_words(n) {
            return Err(candle_core::Error::Msg(format!(
                "device AdamW: the state must be a contiguous [master | m | v] of {} words ({dtype} moments of {n}), found {len}",
                dtype.state_words(n)
            )));
        }
        let fail = |e: mt_optim::Error| candle_core::Error::Msg(format!("device AdamW: {e}"));
        let (master, moments) =
            Moments::split_state(dtype, n, &mut v[off..off + len], stream).map_err(fail)?;
        mt_optim::step_fused(&self.h, &self.a, Grad::F32(g), master, moments, Upload::None).map_err(fail)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        st: &mut candle_core::CudaStorage,
        ls: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> candle_core::Result<()> {
        let mom = crate::ops::Moments {
            dtype: self.kind.dtype,
            key: mt_optim::rounding_key(self.a.step, self.kind.stream),
        };
        crate::ops::adamw(st, ls, g, lg, &self.coeffs, mom, self.weights.as_ref())
    }
}

fn check(state: &Tensor, grad: &Tensor, dtype: StateDtype) -> Result<usize> {
    let n = grad.elem_count();
    if state.dtype() != DType::F32 || grad.dtype() != DType::F32 {
        return Err(Error::tensor("resident optimizer state and gradient", "f32", state.dtype()));
    }
    if state.dims() != [dtype.state_words(n)] || !state.is_contiguous() || !grad.is_contiguous() {
        return Err(Error::tensor(
            "resident optimizer state",
            format!("[{}] (master | m | v with {dtype} moments of {n})", dtype.state_words(n)),
            state.dims(),
        ));
    }
    Ok(n)
}

/// AdamW step `a` on a device-resident unit, in place — `state` is `[master | m | v]` (f32
/// words: the master, then the moments as `kind` encodes them), `grad` its f32 gradient (`n`);
/// the same arithmetic and encoding as mt-optim's host update — then the unit's new master
/// weights cast into `weights` (its device slot, `n` elements): on CUDA with bf16 weights in the
/// same pass (one read of the state instead of three more passes), elsewhere as a separate cast,
/// bitwise the same.
pub fn adamw_step_into(
    state: &Tensor,
    grad: &Tensor,
    h: &AdamW,
    a: &StepArgs,
    kind: StateKind,
    weights: &Tensor,
) -> Result<()> {
    let n = check(state, grad, kind.dtype)?;
    if weights.elem_count() != n || !weights.is_contiguous() {
        return Err(Error::tensor("resident weights", format!("[{n}] contiguous"), weights.dims()));
    }
    let coeffs = Coeffs::of(h, a)?;
    let fused = weights.device().is_cuda() && weights.dtype() == DType::BF16;
    let op = AdamWStep { h: *h, a: *a, kind, coeffs, weights: fused.then(|| weights.clone()) };
    state.inplace_op2(grad, &op)?;
    if !fused {
        cast_master_into(state, weights)?;
    }
    Ok(())
}

/// The master weights of `state` (`[master | m | v]`, the master first) cast into `weights`.
pub fn cast_master_into(state: &Tensor, weights: &Tensor) -> Result<()> {
    let n = weights.elem_count();
    weights.slice_set(&state.narrow(0, 0, n)?.to_dtype(weights.dtype())?, 0, 0)?;
    Ok(())
}

/// A sum of squares that may still be on its way: on CUDA the per-block partials stay on the
/// device until [`SumSquares::value`] reads them, so taking it does not stall the issuing thread
/// (a resident layer's share of the global norm is read once, at the end of the step).
#[derive(Debug)]
pub enum SumSquares {
    /// Already known.
    Value(f64),
    /// f64 partials on the device, summed in order when read.
    Partials(Tensor),
}

impl SumSquares {
    /// The sum (reads the partials back: synchronises with the stream that computes them).
    pub fn value(self) -> Result<f64> {
        match self {
            SumSquares::Value(v) => Ok(v),
            SumSquares::Partials(t) => Ok(t.to_vec1::<f64>()?.iter().fold(0.0, |acc, s| acc + s)),
        }
    }
}

/// Sum of squares of an f32 gradient in f64, deterministic (fixed order) on each device: on the
/// CPU mt-optim's [`mt_optim::sum_squares`], on CUDA a fixed-grid tree reduction whose partials
/// are read (and summed in order) only by [`SumSquares::value`].
pub fn sum_squares(grad: &Tensor) -> Result<SumSquares> {
    if grad.dtype() != DType::F32 || !grad.is_contiguous() {
        return Err(Error::tensor("gradient for its sum of squares", "contiguous f32", grad.dtype()));
    }
    #[cfg(feature = "cuda")]
    if grad.device().is_cuda() {
        return Ok(SumSquares::Partials(crate::ops::sum_squares_partials(grad)?));
    }
    let g = grad.flatten_all()?.to_vec1::<f32>()?;
    Ok(SumSquares::Value(mt_optim::sum_squares(Grad::F32(&g))))
}

/// [`narrow_bf16_sum_squares`]'s in-place op on the bf16 output.
struct NarrowBf16 {
    /// The CPU path's sum of squares (taken in the same pass as the cast).
    cpu_sum: std::sync::Mutex<Option<f64>>,
}

impl InplaceOp2 for NarrowBf16 {
    fn name(&self) -> &'static str {
        "mt-narrow-bf16"
    }

    fn cpu_fwd(
        &self,
        out: &mut CpuStorage,
        lo: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> candle_core::Result<()> {
        let g = f32_slice(g, lg, "the gradient")?;
        let CpuStorage::BF16(o) = out else {
            return Err(candle_core::Error::Msg("gradient narrowing: the output must be bf16".into()));
        };
        let (off, len) = (lo.start_offset(), lo.shape().elem_count());
        if !lo.is_contiguous() || len != g.len() {
            return Err(candle_core::Error::Msg(format!(
                "gradient narrowing: a contiguous {}-element output expected, found {len}",
                g.len()
            )));
        }
        let s = mt_optim::cast_sum_squares(g, Upload::Bf16(&mut o[off..off + len]))
            .map_err(|e| candle_core::Error::Msg(format!("gradient narrowing: {e}")))?;
        *self.cpu_sum.lock().unwrap_or_else(|p| p.into_inner()) = Some(s);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        out: &mut candle_core::CudaStorage,
        lo: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> candle_core::Result<()> {
        crate::ops::narrow_bf16(out, lo, g, lg)
    }
}

/// A streamed layer's f32 gradient narrowed into `out` (bf16, same length) for a bf16 landing,
/// with the sum of squares of what `out` holds: the values and the sum the host's land would have
/// taken (`mt_optim::cast_sum_squares` into a bf16 store gradient). On the CPU that very
/// function, so bitwise the host's land; on CUDA `kernels/cuda/adamw.cu` (the same rounding, NaNs
/// included; the sum in a fixed tree over the narrowed values, read by [`SumSquares::value`]).
pub fn narrow_bf16_sum_squares(grad: &Tensor, out: &Tensor) -> Result<SumSquares> {
    if grad.dtype() != DType::F32 {
        return Err(Error::tensor("gradient to narrow", "f32", grad.dtype()));
    }
    if out.dtype() != DType::BF16 {
        return Err(Error::tensor("bf16 gradient landing buffer", "bf16", out.dtype()));
    }
    if grad.elem_count() != out.elem_count() || !grad.is_contiguous() || !out.is_contiguous() {
        return Err(Error::tensor(
            "bf16 gradient landing buffer",
            format!("[{}]", grad.elem_count()),
            out.dims(),
        ));
    }
    let op = NarrowBf16 { cpu_sum: std::sync::Mutex::new(None) };
    out.inplace_op2(grad, &op)?;
    #[cfg(feature = "cuda")]
    if out.device().is_cuda() {
        return Ok(SumSquares::Partials(crate::ops::sum_squares_partials(out)?));
    }
    let s = op.cpu_sum.lock().unwrap_or_else(|p| p.into_inner()).take();
    s.map(SumSquares::Value)
        .ok_or_else(|| candle_core::Error::Msg("gradient narrowing: the CPU op did not run".into()).into())
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// On the CPU, `adamw_step_into` is mt-optim's update of the same `[master | m | v]` words, for
    /// every moments' encoding, and the weights are the cast of the new master.
    #[test]
    fn cpu_update_is_mt_optims_over_the_same_state() {
        let n = 300;
        let (h, a) = (AdamW::default(), StepArgs { step: 3, lr: 1e-2, grad_scale: 0.5 });
        let g: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        for dtype in [StateDtype::F32, StateDtype::Bf16, StateDtype::Int8] {
            let kind = StateKind { dtype, stream: 7 };
            let mut words: Vec<f32> = (0..dtype.state_words(n)).map(|i| (i % 13) as f32 / 13.0).collect();
            let state = Tensor::from_slice(&words, words.len(), &Device::Cpu).unwrap();
            let grad = Tensor::from_slice(&g, n, &Device::Cpu).unwrap();
            let weights = Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap();
            adamw_step_into(&state, &grad, &h, &a, kind, &weights).unwrap();

            let (master, moments) = Moments::split_state(dtype, n, &mut words, kind.stream).unwrap();
            mt_optim::step_fused(&h, &a, Grad::F32(&g), master, moments, Upload::None).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&state.to_vec1::<f32>().unwrap()), bits(&words), "{dtype}: state");
            assert_eq!(bits(&weights.to_vec1::<f32>().unwrap()), bits(&words[..n]), "{dtype}: weights");
        }
    }

    /// A state of the wrong length is refused before anything is written, naming the tensor.
    #[test]
    fn a_state_of_the_wrong_length_is_refused_by_name() {
        let state = Tensor::zeros(10, DType::F32, &Device::Cpu).unwrap();
        let grad = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        let weights = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        let kind = StateKind { dtype: StateDtype::F32, stream: 0 };
        let a = StepArgs { step: 1, lr: 1e-3, grad_scale: 1.0 };
        let e =
            adamw_step_into(&state, &grad, &AdamW::default(), &a, kind, &weights).unwrap_err().to_string();
        assert!(e.starts_with("resident optimizer state: expected [12]"), "{e}");
        assert_eq!(state.to_vec1::<f32>().unwrap(), vec![0.0; 10]);
    }
}

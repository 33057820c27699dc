//! SwiGLU forward and backward (`kernels/cuda/fused.cu`): `bf16(silu(gate)) * up` and its two
//! gradients, each one pass, with the bf16 roundings of the candle sequence they replace.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};
use half::bf16;

use super::sources::FUSED;
use super::{grid_for, msg};

struct Swiglu;

impl CustomOp2 for Swiglu {
    cuda_only!("mt-swiglu", 2);
    fn cuda_fwd(
        &self,
        g: &CudaStorage,
        lg: &Layout,
        u: &CudaStorage,
        lu: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let total = lg.shape().elem_count();
        if lu.shape() != lg.shape() || !lg.is_contiguous() || !lu.is_contiguous() {
            return Err(msg("swiglu: gate and up must be contiguous and of one shape"));
        }
        let dev = g.device();
        let gs = g.as_cuda_slice::<bf16>()?.slice(lg.start_offset()..);
        let us = u.as_cuda_slice::<bf16>()?.slice(lu.start_offset()..);
        let func = dev.get_or_load_custom_func("mt_swiglu_fwd", FUSED.module, FUSED.ptx()?)?;
        // SAFETY: every element is written by the kernel below.
        let out = unsafe { dev.alloc::<bf16>(total)? };
        let tot = total as i64;
        let mut b = func.builder();
        b.arg(&gs);
        b.arg(&us);
        b.arg(&out);
        b.arg(&tot);
        // SAFETY: signature (bf16*, bf16*, bf16*, long long); all hold `total` elements.
        unsafe { b.launch(grid_for(total)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lg.shape().clone()))
    }
}

struct SwigluBwd;

impl CustomOp3 for SwigluBwd {
    cuda_only!("mt-swiglu-bwd", 3);
    fn cuda_fwd(
        &self,
        d: &CudaStorage,
        ld: &Layout,
        g: &CudaStorage,
        lg: &Layout,
        u: &CudaStorage,
        lu: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let total = lg.shape().elem_count();
        if ld.shape() != lg.shape()
            || lu.shape() != lg.shape()
            || !ld.is_contiguous()
            || !lg.is_contiguous()
            || !lu.is_contiguous()
        {
            return Err(msg("swiglu backward: inputs must be contiguous and of one shape"));
        }
        let dev = g.device();
        let ds = d.as_cuda_slice::<bf16>()?.slice(ld.start_offset()..);
        let gs = g.as_cuda_slice::<bf16>()?.slice(lg.start_offset()..);
        let us = u.as_cuda_slice::<bf16>()?.slice(lu.start_offset()..);
        let func = dev.get_or_load_custom_func("mt_swiglu_bwd", FUSED.module, FUSED.ptx()?)?;
        // SAFETY: every element of both halves is written by the kernel below.
        let out = unsafe { dev.alloc::<bf16>(2 * total)? };
        let tot = total as i64;
        let mut b = func.builder();
        b.arg(&ds);
        b.arg(&gs);
        b.arg(&us);
        b.arg(&out);
        b.arg(&tot);
        // SAFETY: signature (bf16*, bf16*, bf16*, bf16*, long long); out holds 2 * total.
        unsafe { b.launch(grid_for(total)) }.w()?;
        let mut dims = vec![2];
        dims.extend_from_slice(lg.dims());
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(dims)))
    }
}

/// `bf16(silu(gate)) * up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    gate.contiguous()?.apply_op2_no_bwd(&up.contiguous()?, &Swiglu)
}

/// Backward of [`swiglu`] for `d = dL/d(mid)`: `(d_gate, d_up)`.
pub fn swiglu_backward(d: &Tensor, gate: &Tensor, up: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let out = d.contiguous()?.apply_op3_no_bwd(&gate.contiguous()?, &up.contiguous()?, &SwigluBwd)?;
    Ok((out.get(0)?, out.get(1)?))
}

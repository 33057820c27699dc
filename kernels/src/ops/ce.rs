//! Cross-entropy over bf16 logits (`kernels/cuda/fused.cu`): the per-row loss and the gradient
//! of the weighted loss, one block per row, the logits read as bf16 and never cast.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};
use half::bf16;

use super::sources::FUSED;
use super::{msg, rows_and_t};

struct CeLoss;

impl CustomOp2 for CeLoss {
    cuda_only!("mt-ce-loss", 2);
    fn cuda_fwd(
        &self,
        l: &CudaStorage,
        ll: &Layout,
        t: &CudaStorage,
        lt: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, v) = rows_and_t(ll, "cross-entropy logits")?;
        if lt.shape().elem_count() != rows || !lt.is_contiguous() {
            return Err(msg("cross-entropy: one contiguous target per row needed"));
        }
        let dev = l.device();
        let ls = l.as_cuda_slice::<bf16>()?.slice(ll.start_offset()..);
        let ts = t.as_cuda_slice::<u32>()?.slice(lt.start_offset()..);
        // 16-byte loads when every row starts 16-byte aligned (candle's allocations are).
        let vec8 = v.is_multiple_of(8) && ll.start_offset().is_multiple_of(8);
        let kernel = if vec8 { "mt_ce_loss8" } else { "mt_ce_loss" };
        let func = dev.get_or_load_custom_func(kernel, FUSED.module, FUSED.ptx()?)?;
        // SAFETY: every element is written by the kernel below (one per row).
        let out = unsafe { dev.alloc::<f32>(rows)? };
        let v32 = v as i32;
        let mut b = func.builder();
        b.arg(&ls);
        b.arg(&ts);
        b.arg(&out);
        b.arg(&v32);
        let cfg =
            LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: signature (bf16*, unsigned*, float*, int); one block per row of V logits; the
        // `8` kernel's 16-byte loads only with V % 8 == 0 and a view starting at a multiple of 8
        // elements of a 256-byte aligned allocation, so every row is 16-byte aligned.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(rows)))
    }
}

struct CeGrad;

impl CustomOp3 for CeGrad {
    cuda_only!("mt-ce-grad", 3);
    fn cuda_fwd(
        &self,
        l: &CudaStorage,
        ll: &Layout,
        t: &CudaStorage,
        lt: &Layout,
        w: &CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, v) = rows_and_t(ll, "cross-entropy logits")?;
        if lt.shape().elem_count() != rows
            || lw.shape().elem_count() != rows
            || !lt.is_contiguous()
            || !lw.is_contiguous()
        {
            return Err(msg("cross-entropy gradient: one contiguous target and weight per row needed"));
        }
        let dev = l.device();
        let ls = l.as_cuda_slice::<bf16>()?.slice(ll.start_offset()..);
        let ts = t.as_cuda_slice::<u32>()?.slice(lt.start_offset()..);
        let ws = w.as_cuda_slice::<f32>()?.slice(lw.start_offset()..);
        let vec8 = v.is_multiple_of(8) && ll.start_offset().is_multiple_of(8);
        let kernel = if vec8 { "mt_ce_grad8" } else { "mt_ce_grad" };
        let func = dev.get_or_load_custom_func(kernel, FUSED.module, FUSED.ptx()?)?;
        // SAFETY: every element is written by the kernel below.
        let out = unsafe { dev.alloc::<bf16>(rows * v)? };
        let v32 = v as i32;
        let mut b = func.builder();
        b.arg(&ls);
        b.arg(&ts);
        b.arg(&ws);
        b.arg(&out);
        b.arg(&v32);
        let cfg =
            LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: signature (bf16*, unsigned*, float*, bf16*, int); one block per row; the `8`
        // kernel's 16-byte loads and stores under the alignment conditions of `CeLoss` (`out` is
        // a fresh allocation, its rows as aligned as the logits').
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), ll.shape().clone()))
    }
}

/// Per-row cross-entropy `logsumexp(l) − l[target]` of bf16 logits `[rows, V]` (f32 `[rows]`).
pub fn ce_loss(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    logits.contiguous()?.apply_op2_no_bwd(&targets.contiguous()?, &CeLoss)
}

/// `d(w · ce)/dl = w (softmax(l) − onehot(target))` in bf16, `weights` f32 per row.
pub fn ce_grad(logits: &Tensor, targets: &Tensor, weights: &Tensor) -> candle_core::Result<Tensor> {
    logits.contiguous()?.apply_op3_no_bwd(&targets.contiguous()?, &weights.contiguous()?, &CeGrad)
}

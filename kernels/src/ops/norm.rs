//! RMSNorm forward (row statistics, then the normalised and weighted row) and backward (`dx`,
//! and the weight gradient reduced over row groups in a fixed order) as fused bf16 kernels
//! (`kernels/cuda/fused.cu`), with the same roundings as the candle sequence they replace.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Tensor};
use half::bf16;

use super::sources::FUSED;
use super::{grid_for, launch_cfg, msg, rows_and_t, with_bf16};

struct RmsStats {
    eps: f32,
}

impl CustomOp1 for RmsStats {
    cuda_only!("mt-rms-stats", 1);
    fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, n) = rows_and_t(l, "rms stats")?;
        let dev = x.device();
        let xs = x.as_cuda_slice::<bf16>()?.slice(l.start_offset()..);
        let func = dev.get_or_load_custom_func("mt_rms_stats", FUSED.module, FUSED.ptx()?)?;
        // SAFETY: every element is written by the kernel below.
        let out = unsafe { dev.alloc::<f32>(rows)? };
        let (n32, eps) = (n as i32, self.eps);
        let mut b = func.builder();
        b.arg(&xs);
        b.arg(&out);
        b.arg(&n32);
        b.arg(&eps);
        // SAFETY: signature (bf16*, float*, int, float); one block per row of n elements.
        unsafe { b.launch(launch_cfg(rows)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(rows)))
    }
}

struct RmsApply {
    w: Tensor,
}

impl CustomOp2 for RmsApply {
    cuda_only!("mt-rms-apply", 2);
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        r: &CudaStorage,
        lr: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, n) = rows_and_t(lx, "rms apply")?;
        if lr.shape().elem_count() != rows || self.w.elem_count() != n {
            return Err(msg("rms apply: r or w does not match x"));
        }
        let dev = x.device();
        let xs = x.as_cuda_slice::<bf16>()?.slice(lx.start_offset()..);
        let rs = r.as_cuda_slice::<f32>()?.slice(lr.start_offset()..);
        let func = dev.get_or_load_custom_func("mt_rms_apply", FUSED.module, FUSED.ptx()?)?;
        let total = rows * n;
        // SAFETY: every element is written by the kernel below.
        let out = unsafe { dev.alloc::<bf16>(total)? };
        let (tot, n32) = (total as i64, n as i32);
        with_bf16(&self.w, |ws| {
            let mut b = func.builder();
            b.arg(&xs);
            b.arg(&rs);
            b.arg(ws);
            b.arg(&out);
            b.arg(&tot);
            b.arg(&n32);
            // SAFETY: signature (bf16*, float*, bf16*, bf16*, long long, int); sizes checked above.
            unsafe { b.launch(grid_for(total)) }.w()?;
            Ok(())
        })?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lx.shape().clone()))
    }
}

/// The backward kernels' inputs as device views, with `x`'s shape `[rows, n]`.
struct BwdInputs<'a> {
    rows: usize,
    n: usize,
    dy: CudaView<'a, bf16>,
    x: CudaView<'a, bf16>,
    r: CudaView<'a, f32>,
}

/// Views of `dy` (bf16), `x` (bf16) and `r` (f32), checked against `x`'s `[rows, n]`.
fn backward_inputs<'a>(
    (dy, ldy): (&'a CudaStorage, &Layout),
    (x, lx): (&'a CudaStorage, &Layout),
    (r, lr): (&'a CudaStorage, &Layout),
    what: &str,
) -> candle_core::Result<BwdInputs<'a>> {
    let (rows, n) = rows_and_t(lx, what)?;
    if rows_and_t(ldy, what)? != (rows, n) || lr.shape().elem_count() != rows {
        return Err(msg(format!("{what}: dy or r does not match x")));
    }
    let dys = dy.as_cuda_slice::<bf16>()?.slice(ldy.start_offset()..);
    let xs = x.as_cuda_slice::<bf16>()?.slice(lx.start_offset()..);
    let rs = r.as_cuda_slice::<f32>()?.slice(lr.start_offset()..);
    Ok(BwdInputs { rows, n, dy: dys, x: xs, r: rs })
}

struct RmsBwdDx {
    w: Tensor,
}

impl CustomOp3 for RmsBwdDx {
    cuda_only!("mt-rms-bwd-dx", 3);
    fn cuda_fwd(
        &self,
        dy: &CudaStorage,
        ldy: &Layout,
        x: &CudaStorage,
        lx: &Layout,
        r: &CudaStorage,
        lr: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let BwdInputs { rows, n, dy: dys, x: xs, r: rs } =
            backward_inputs((dy, ldy), (x, lx), (r, lr), "rms backward")?;
        if self.w.elem_count() != n {
            return Err(msg("rms backward: w does not match x"));
        }
        let dev = x.device();
        let func = dev.get_or_load_custom_func("mt_rms_bwd_dx", FUSED.module, FUSED.ptx()?)?;
        // SAFETY: every element is written by the kernel below.
        let out = unsafe { dev.alloc::<bf16>(rows * n)? };
        let n32 = n as i32;
        with_bf16(&self.w, |ws| {
            let mut b = func.builder();
            b.arg(&dys);
            b.arg(&xs);
            b.arg(&rs);
            b.arg(ws);
            b.arg(&out);
            b.arg(&n32);
            // SAFETY: signature (bf16*, bf16*, float*, bf16*, bf16*, int); one block per row.
            unsafe { b.launch(launch_cfg(rows)) }.w()?;
            Ok(())
        })?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lx.shape().clone()))
    }
}

/// Row groups of the deterministic RMSNorm weight-gradient reduction.
const DW_GROUPS: usize = 64;

struct RmsBwdDw;

impl CustomOp3 for RmsBwdDw {
    cuda_only!("mt-rms-bwd-dw", 3);
    fn cuda_fwd(
        &self,
        dy: &CudaStorage,
        ldy: &Layout,
        x: &CudaStorage,
        lx: &Layout,
        r: &CudaStorage,
        lr: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let BwdInputs { rows, n, dy: dys, x: xs, r: rs } =
            backward_inputs((dy, ldy), (x, lx), (r, lr), "rms dw")?;
        let dev = x.device();
        let func = dev.get_or_load_custom_func("mt_rms_bwd_dw", FUSED.module, FUSED.ptx()?)?;
        let groups = DW_GROUPS.min(rows.max(1));
        // SAFETY: every element is written by the kernel below (each (group, column) once).
        let out = unsafe { dev.alloc::<f32>(groups * n)? };
        let (rows32, n32) = (rows as i32, n as i32);
        let mut b = func.builder();
        b.arg(&dys);
        b.arg(&xs);
        b.arg(&rs);
        b.arg(&out);
        b.arg(&rows32);
        b.arg(&n32);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(32) as u32, groups as u32, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: signature (bf16*, bf16*, float*, float*, int, int); out holds groups * n.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from((groups, n))))
    }
}

/// RMSNorm over the last axis: `(y, r)` with `r = 1/sqrt(mean(x²) + eps)` per row (f32).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<(Tensor, Tensor)> {
    let x = x.contiguous()?;
    let r = x.apply_op1_no_bwd(&RmsStats { eps: eps as f32 })?;
    let y = x.apply_op2_no_bwd(&r, &RmsApply { w: w.contiguous()? })?;
    Ok((y, r))
}

/// Backward of [`rms_norm`]: `(dx` bf16, `dw` f32 `[n])`.
pub fn rms_norm_backward(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    r: &Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (dy, x) = (dy.contiguous()?, x.contiguous()?);
    let dx = dy.apply_op3_no_bwd(&x, r, &RmsBwdDx { w: w.contiguous()? })?;
    let dw = dy.apply_op3_no_bwd(&x, r, &RmsBwdDw)?.sum(0)?;
    Ok((dx, dw))
}

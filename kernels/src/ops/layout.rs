//! Data movement of the attention layout, the residual and bias adds, as 16-byte-a-thread kernels
//! (`kernels/cuda/fused.cu`): candle's strided copy and broadcasting add run at a fraction of the
//! memory bandwidth on these shapes (ncu on the H200: a 50 MB head transpose 258 µs, a 50 MB
//! bf16 add 107 µs). Both are bit-for-bit the candle ops they replace.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};
use half::bf16;

use super::sources::FUSED;
use super::{grid_for, msg};

/// Whether a contiguous bf16 CUDA tensor's data can be moved in 16-byte groups.
fn groups_of_8(l: &Layout) -> bool {
    l.is_contiguous() && l.start_offset().is_multiple_of(8) && l.shape().elem_count().is_multiple_of(8)
}

struct Swap12;

impl CustomOp1 for Swap12 {
    cuda_only!("mt-swap12", 1);

    fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let [b, n1, n2, d] = *l.dims() else { return Err(msg("swap12: needs a 4-D tensor")) };
        if !groups_of_8(l) || d % 8 != 0 {
            return Err(msg(
                "swap12: needs a contiguous, 16-byte aligned tensor whose last axis is a multiple of 8",
            ));
        }
        let dev = x.device();
        let src = x.as_cuda_slice::<bf16>()?.slice(l.start_offset()..);
        let func = dev.get_or_load_custom_func("mt_swap12", FUSED.module, FUSED.ptx()?)?;
        let n = b * n1 * n2 * d;
        // SAFETY: the kernel below writes every element (each 8-element group once).
        let out = unsafe { dev.alloc::<bf16>(n)? };
        let (total8, n1_, n2_, d8) = ((n / 8) as i64, n1 as i32, n2 as i32, (d / 8) as i32);
        let mut bld = func.builder();
        bld.arg(&src);
        bld.arg(&out);
        bld.arg(&total8);
        bld.arg(&n1_);
        bld.arg(&n2_);
        bld.arg(&d8);
        // SAFETY: the kernel reads and writes uint4 groups: both views start 16-byte aligned
        // (candle's allocations are 256-byte aligned and the input starts at a multiple of 8
        // elements, checked above) and hold n = 8 · total8 elements; grid-stride loop.
        unsafe { bld.launch(grid_for(n / 8)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from((b, n2, n1, d))))
    }
}

/// `a + b` in bf16: `b` of `a`'s shape, or (`row`) one row of `a`'s last axis broadcast to all.
struct AddBf16 {
    row: bool,
}

impl CustomOp2 for AddBf16 {
    cuda_only!("mt-add-bf16", 2);

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        la: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let w = *la.dims().last().unwrap_or(&0);
        let b_fits =
            if self.row { lb.dims() == [w] && w.is_multiple_of(8) } else { la.shape() == lb.shape() };
        if !groups_of_8(la) || !groups_of_8(lb) || !b_fits {
            return Err(msg(
                "add: needs contiguous, 16-byte aligned bf16 tensors, the second of the first's shape \
                 or (bias) one row of its last axis, a multiple of 8",
            ));
        }
        let dev = a.device();
        let n = la.shape().elem_count();
        let sa = a.as_cuda_slice::<bf16>()?.slice(la.start_offset()..);
        let sb = b.as_cuda_slice::<bf16>()?.slice(lb.start_offset()..);
        let name = if self.row { "mt_add_row_bf16" } else { "mt_add_bf16" };
        let func = dev.get_or_load_custom_func(name, FUSED.module, FUSED.ptx()?)?;
        // SAFETY: the kernel below writes every element.
        let out = unsafe { dev.alloc::<bf16>(n)? };
        let (total8, w8) = ((n / 8) as i64, (w / 8) as i32);
        let mut bld = func.builder();
        bld.arg(&sa);
        bld.arg(&sb);
        bld.arg(&out);
        bld.arg(&total8);
        if self.row {
            bld.arg(&w8);
        }
        // SAFETY: uint4 accesses on 16-byte aligned views (checked above): a and out hold
        // n = 8 · total8 elements, b n of them or (row) w = 8 · w8, read at e % w8; grid-stride
        // loop.
        unsafe { bld.launch(grid_for(n / 8)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), la.shape().clone()))
    }
}

fn applies(l: &Layout, t: &Tensor) -> bool {
    t.device().is_cuda() && t.dtype() == DType::BF16 && groups_of_8(l)
}

/// `x.transpose(1, 2).contiguous()` of a 4-D tensor; one kernel on CUDA bf16 when the last axis
/// is a multiple of 8 and `x` is contiguous and aligned, candle's copy otherwise.
pub fn swap12(x: &Tensor) -> candle_core::Result<Tensor> {
    if applies(x.layout(), x) && x.rank() == 4 && x.dims()[3].is_multiple_of(8) {
        return x.apply_op1_no_bwd(&Swap12);
    }
    x.transpose(1, 2)?.contiguous()
}

/// `a + b` for tensors of one shape; one kernel on CUDA bf16 when both are contiguous and
/// aligned, candle's add otherwise.
pub fn add(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if applies(a.layout(), a) && applies(b.layout(), b) && a.shape() == b.shape() {
        return a.apply_op2_no_bwd(b, &AddBf16 { row: false });
    }
    a + b
}

/// `a + b` for `b` one row of `a`'s last axis (a projection's bias), broadcast to every row; one
/// kernel on CUDA bf16 when both are contiguous and aligned and the row a multiple of 8 long,
/// candle's broadcasting add otherwise (same bits either way).
pub fn add_row(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let w = a.dims().last().copied().unwrap_or(0);
    if applies(a.layout(), a) && applies(b.layout(), b) && b.dims() == [w] && w.is_multiple_of(8) {
        return a.apply_op2_no_bwd(b, &AddBf16 { row: true });
    }
    a.broadcast_add(b)
}

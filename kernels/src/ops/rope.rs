//! Rotary position embedding of `[b, t, heads, hd]` bf16 tensors (`kernels/cuda/fused.cu`), and
//! its inverse for the backward, with the bf16 roundings of the candle sequence it replaces.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp3, Layout, Shape, Tensor};
use half::bf16;

use super::sources::FUSED;
use super::{grid_for, msg};

struct Rope {
    sign: f32,
}

impl CustomOp3 for Rope {
    cuda_only!("mt-rope", 3);
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        c: &CudaStorage,
        lc: &Layout,
        s: &CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (t, heads, hd) = match lx.dims() {
            [_, t, h, d] => (*t, *h, *d),
            d => return Err(msg(format!("rope: x must be [b, t, heads, hd], found {d:?}"))),
        };
        if lc.dims() != [t, hd]
            || ls.dims() != [t, hd]
            || !lx.is_contiguous()
            || !lc.is_contiguous()
            || !ls.is_contiguous()
            || hd % 2 != 0
        {
            return Err(msg("rope: cos/sin must be contiguous [t, hd] (hd even) and x contiguous"));
        }
        let total = lx.shape().elem_count();
        let dev = x.device();
        let xs = x.as_cuda_slice::<bf16>()?.slice(lx.start_offset()..);
        let cs = c.as_cuda_slice::<bf16>()?.slice(lc.start_offset()..);
        let ss = s.as_cuda_slice::<bf16>()?.slice(ls.start_offset()..);
        // 16 bytes a thread when every 8-element group lies in one half of one head and every
        // view starts 16-byte aligned (candle's allocations are 256-byte aligned).
        let wide = hd % 16 == 0 && [lx, lc, ls].iter().all(|l| l.start_offset() % 8 == 0);
        let func = dev.get_or_load_custom_func(
            if wide { "mt_rope8" } else { "mt_rope" },
            FUSED.module,
            FUSED.ptx()?,
        )?;
        // SAFETY: every element is written by the kernel below.
        let out = unsafe { dev.alloc::<bf16>(total)? };
        let (tot, t32, h32, hd32, sign) = (total as i64, t as i32, heads as i32, hd as i32, self.sign);
        let mut b = func.builder();
        b.arg(&xs);
        b.arg(&cs);
        b.arg(&ss);
        b.arg(&out);
        b.arg(&tot);
        b.arg(&t32);
        b.arg(&h32);
        b.arg(&hd32);
        b.arg(&sign);
        // SAFETY: signature (bf16*, bf16*, bf16*, bf16*, long long, int, int, int, float) of
        // both kernels; mt_rope8's uint4 accesses are 16-byte aligned (checked above: hd % 16 ==
        // 0 and 8-element aligned starts) and in bounds (x and out hold total elements, cos/sin
        // t · hd); grid-stride loops.
        unsafe { b.launch(grid_for(if wide { total / 8 } else { total })) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lx.shape().clone()))
    }
}

/// RoPE of `x [b, t, heads, hd]` with `[t, hd]` tables; `inverse` applies the backward.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> candle_core::Result<Tensor> {
    let op = Rope { sign: if inverse { -1.0 } else { 1.0 } };
    x.contiguous()?.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)
}

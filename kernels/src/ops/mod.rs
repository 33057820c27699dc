//! Our CUDA kernels (`kernels/cuda/*.cu`) as candle custom ops, launched on candle's stream, their
//! sources compiled once per process by NVRTC for the device's architecture (`nvrtc.rs`; every
//! source is listed in `sources.rs`):
//!
//! - [`causal_softmax`]: scale + causal mask + softmax of bf16 scores in one pass (bf16 out, and
//!   each row's max and sum);
//! - [`softmax_backward`]: `c · P ⊙ (dP − rowsum(dP ⊙ P))` in one pass, P recomputed in f32 from
//!   the scores and the row statistics (bf16 out);
//! - [`flash_forward`] / [`flash_backward`]: flash attention (`flash.rs`; the Hopper kernels in
//!   `flash_hopper.rs`); [`flash_forward_with`] / [`flash_backward_with`] with GPT-OSS's sliding
//!   window and sink logits ([`FlashExtras`], both kernel sets);
//! - [`accumulate_matmul_t`]: a weight gradient added into the f32 gradient buffer by one cuBLAS
//!   GEMM (`gemm.rs`);
//! - [`rows_add`]: the embedding backward's deterministic row scatter-add (`embed.rs`);
//! - [`rms_norm`] / [`rms_norm_backward`], [`swiglu`] / [`swiglu_backward`], [`rope`]: the
//!   decoder's elementwise work (`kernels/cuda/fused.cu`), each one or two passes instead of 5-12
//!   candle ops, with the same bf16 roundings as the candle sequence they replace;
//! - [`ce_loss`] / [`ce_grad`]: cross-entropy over bf16 logits (`ce.rs`); [`col_sums_add`],
//!   [`swap12`], [`add`], [`add_row`]: a bias gradient, the attention layout and the adds;
//! - [`MoeRouting`], [`moe_swiglu`], [`moe_swiglu_backward`]: mixture-of-experts on the device
//!   (routing, grouping by expert, grouped GEMMs on the kernels [`MoeGemm`] picks, combine;
//!   `moe/`, called by mt-layers' MoE device path);
//! - the device AdamW's kernels (`optim.rs`, called by `crate::device_optim`);
//! - [`decode_base`]: a LoRA run's int8 or NF4 frozen base dequantised into a weight slot on a
//!   copy stream (`base.rs`).
//!
//! The softmax pair replaces ~10 candle passes over the `[b, heads, t, t]` score tensor each
//! (casts, scale, broadcast mask, max, subtract, exp, sum, divide) and the per-call upload of a
//! `t × t` mask.
//! This is the only module of mt-kernels with `unsafe` (allocation and kernel launch).

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig};
use candle_core::{DType, Layout, Storage, Tensor};
use half::bf16;

const THREADS: u32 = 256;

fn msg(m: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(m.into())
}

/// The bf16 elements of a contiguous CUDA tensor (a view into a weight slot is fine) that is not one of the op's inputs (a
/// weight held by the op).
fn with_bf16<R>(
    t: &Tensor,
    f: impl FnOnce(&CudaView<'_, bf16>) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (st, l) = t.storage_and_layout();
    if !l.is_contiguous() || t.dtype() != DType::BF16 {
        return Err(msg("fused kernel: weights must be contiguous bf16 tensors"));
    }
    match &*st {
        Storage::Cuda(cs) => f(&cs.as_cuda_slice::<bf16>()?.slice(l.start_offset()..)),
        _ => Err(msg("fused kernel: weight not on the CUDA device")),
    }
}

/// Grid-stride launch over `total` elements (at most 32 blocks per SM of an H100/H200).
fn grid_for(total: usize) -> LaunchConfig {
    let blocks = total.div_ceil(THREADS as usize).clamp(1, 132 * 32) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

fn rows_and_t(l: &Layout, what: &str) -> candle_core::Result<(usize, usize)> {
    if !l.is_contiguous() {
        return Err(candle_core::Error::Msg(format!("{what}: needs a contiguous tensor")));
    }
    let t = *l.dims().last().ok_or_else(|| candle_core::Error::Msg(format!("{what}: scalar input")))?;
    Ok((l.shape().elem_count() / t.max(1), t))
}

fn launch_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// `name` and a CPU forward that refuses, for an op that exists only as a CUDA kernel; the
/// argument is the op's arity (1, 2 or 3 inputs; `inplace1`..`inplace3` for an `InplaceOp1`..`3`).
macro_rules! cuda_only {
    ($name:literal, 1) => {
        cuda_only!(@name $name);
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
            Err(cuda_only!(@err $name))
        }
    };
    ($name:literal, 2) => {
        cuda_only!(@name $name);
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(CpuStorage, Shape)> {
            Err(cuda_only!(@err $name))
        }
    };
    ($name:literal, 3) => {
        cuda_only!(@name $name);
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(CpuStorage, Shape)> {
            Err(cuda_only!(@err $name))
        }
    };
    ($name:literal, inplace1) => {
        cuda_only!(@name $name);
        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
            Err(cuda_only!(@err $name))
        }
    };
    ($name:literal, inplace2) => {
        cuda_only!(@name $name);
        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> candle_core::Result<()> {
            Err(cuda_only!(@err $name))
        }
    };
    ($name:literal, inplace3) => {
        cuda_only!(@name $name);
        fn cpu_fwd(
            &self,
            _: &mut CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<()> {
            Err(cuda_only!(@err $name))
        }
    };
    (@name $name:literal) => {
        fn name(&self) -> &'static str {
            $name
        }
    };
    (@err $name:literal) => {
        msg(concat!($name, " is a CUDA kernel (no CPU implementation)"))
    };
}

mod nvrtc;
mod sources;

mod layout;
pub use layout::{add, add_row, swap12};
mod colsum;
pub use colsum::col_sums_add;
mod embed;
pub use embed::rows_add;
mod gemm;
pub use gemm::{accumulate_matmul_t, gemm_applies};
mod norm;
pub use norm::{rms_norm, rms_norm_backward};
mod optim;
pub(crate) use optim::{adamw, narrow_bf16, sum_squares_partials, Moments};
mod softmax;
pub use softmax::{causal_softmax, softmax_backward};
mod flash;
mod flash_hopper;
mod flash_launch;
pub use flash::{flash_backward, flash_backward_with, flash_forward, flash_forward_with};
pub use flash_hopper::hopper_applies;
pub use flash_launch::FlashExtras;
mod swiglu;
pub use swiglu::{swiglu, swiglu_backward};
mod rope;
pub use rope::rope;
mod ce;
pub use ce::{ce_grad, ce_loss};
mod base;
pub use base::decode_base;
mod moe;
pub use moe::{moe_swiglu, moe_swiglu_backward, ExpertMatrix, MoeGemm, MoeRouting};

/// Whether the fused bf16 kernels apply to `x`: a bf16 tensor on a CUDA device of compute
/// capability 8.0 or later (A100, RTX 30xx, RTX 40xx / L40S, H100 / H200). They use nothing newer
/// than sm_80 (flash attention's `cp.async`, `ldmatrix` and bf16 `mma.sync`; the rest plain CUDA
/// C), and every file compiles for sm_80, 86, 89 and 90 without spills beyond sm_90's
/// (`docs/decisions/0034-gpu-portability.md`); older GPUs use the candle path.
pub fn applies(x: &Tensor) -> bool {
    applies_on(x.device(), x.dtype())
}

/// [`applies`] for tensors of `dtype` on `device`.
pub fn applies_on(device: &candle_core::Device, dtype: DType) -> bool {
    static FUSED: OnceLock<bool> = OnceLock::new();
    match device {
        candle_core::Device::Cuda(d) if dtype == DType::BF16 => *FUSED.get_or_init(|| {
            nvrtc::note_device(d);
            d.cuda_stream().context().compute_capability().is_ok_and(|(major, _)| major >= 8)
        }),
        _ => false,
    }
}

#[cfg(test)]
mod base_tests;

#[cfg(test)]
mod ce_tests;

#[cfg(test)]
mod flash_tests;

#[cfg(test)]
mod moe_tests;

//! megatrain's own CUDA kernels and the optimizer of a unit whose state lives on the compute
//! device (as candle has `candle-kernels`).
//!
//! - Under the `cuda` feature, the kernels of `kernels/cuda/*.cu` as candle custom ops (fused
//!   softmax, flash attention, RMSNorm, SwiGLU, RoPE, cross-entropy, the embedding backward,
//!   layout copies and adds, a bias gradient's column sums, and the cuBLAS GEMM that accumulates a
//!   weight gradient), each source compiled once per process by NVRTC for the GPU's own
//!   architecture and launched on candle's stream. Every source is registered in one place,
//!   `src/ops/sources.rs`. The layer templates (mt-layers) call them where `applies` says so.
//! - [`device_optim`]: AdamW of a device-resident or GPU-updated unit over any moments' encoding,
//!   bitwise mt-optim's host update; the gradient's sum of squares; bf16 narrowing. On the CPU it
//!   runs mt-optim's own code, so it is built without the `cuda` feature too.
//!
//! Without the `cuda` feature nothing here needs a CUDA toolchain.
// `unsafe` only in `ops` (allocation and kernel launch), checked by the tidy test.
#![deny(unsafe_code)]

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod ops;

pub mod device_optim;
mod error;

pub use error::{Error, Result};
#[cfg(feature = "cuda")]
pub use ops::{
    accumulate_matmul_t, add, add_row, applies, applies_on, causal_softmax, ce_grad, ce_loss, col_sums_add,
    flash_backward, flash_backward_with, flash_forward, flash_forward_with, gemm_applies, hopper_applies,
    moe_swiglu, moe_swiglu_backward, rms_norm, rms_norm_backward, rope, rows_add, softmax_backward, swap12,
    swiglu, swiglu_backward, ExpertMatrix, FlashExtras, MoeRouting,
};

/// Which flash attention kernels run (`megatrain train --attention`): the Hopper kernels wherever
/// they run (compute capability 9.0, head dim 64 or 128) and the portable ones elsewhere, or one
/// set forced (the Hopper set refused where it cannot run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FlashKernel {
    /// The Hopper kernels wherever they run, the portable ones elsewhere.
    #[default]
    Auto,
    /// The Hopper kernels (`kernels/cuda/flash_attn_hopper.cu`).
    Hopper,
    /// The Hopper kernels with the backward's dQ partials added in the order they arrive rather
    /// than in key-block order: faster where a head has few key blocks (short sequences), not
    /// bitwise repeatable (fp32 adds in a varying order).
    HopperUnordered,
    /// The portable kernels (`kernels/cuda/flash_attn.cu`), on any GPU of compute capability 8.0+.
    Portable,
}

/// Query rows of a tile of the Hopper backward (`MT_HFA_BQ` of `kernels/cuda/flash_attn_hopper.cu`).
pub(crate) const HOPPER_BQ: usize = 64;

/// Bytes of the Hopper backward's fp32 dQ buffer for `b` sequences of `t` tokens and `heads` query
/// heads of `hd` (`[b, heads, ⌈t / 64⌉, 64 × hd]`, live through the attention's backward): the
/// workspace the portable kernels do not need, which the planner adds where the Hopper ones run.
pub fn hopper_dq_buffer_bytes(b: usize, t: usize, heads: usize, hd: usize) -> u64 {
    (b * heads * t.div_ceil(HOPPER_BQ) * HOPPER_BQ * hd * 4) as u64
}

/// Whether flash attention is built for head dim `hd` (it also needs bf16 on a CUDA device of
/// compute capability 8.0 or later: `applies_on`).
pub fn flash_head_dim(hd: usize) -> bool {
    matches!(hd, 16 | 32 | 64 | 128)
}

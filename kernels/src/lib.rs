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

// Used by the CUDA kernels' compiles; tested without CUDA too.
#[cfg(any(feature = "cuda", test))]
mod cubin_cache;
pub mod device_optim;
mod error;

pub use error::{Error, Result};
#[cfg(feature = "cuda")]
pub use ops::{
    accumulate_matmul_t, add, add_row, applies, applies_on, causal_softmax, ce_grad, ce_loss, col_sums_add,
    decode_base, flash_backward, flash_backward_with, flash_forward, flash_forward_with, gemm_applies,
    hopper_applies, moe_swiglu, moe_swiglu_backward, rms_norm, rms_norm_backward, rope, rows_add,
    softmax_backward, swap12, swiglu, swiglu_backward, ExpertMatrix, FlashExtras, MoeGemm, MoeRouting,
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

/// The most experts the MoE kernels route over (`ops/moe`: a 32-bit mask of 32 experts a lane).
pub const MOE_MAX_EXPERTS: usize = 1024;
/// The largest top-k the MoE kernels route (`MT_MOE_MAX_K` of `kernels/cuda/moe.cu`).
pub const MOE_MAX_TOP_K: usize = 32;

/// Routed rows per chunk of the MoE kernels' counting sort (`MT_MOE_CHUNK`): each chunk keeps a
/// `[E]` u32 count and base.
pub const MOE_SORT_CHUNK: usize = 1024;
/// Columns of a MoE grouped GEMM tile (`MT_MOE_BN`), the narrowest of the kernel sets' (the
/// wgmma set's are 256): the down projection's backward writes one f32 partial of the routing
/// weights' gradient per row and column tile, so this counts the most partials any set writes.
pub const MOE_GEMM_TILE: usize = 128;

/// Whether the MoE kernels (`MoeRouting` and its grouped GEMMs, under `cuda`) take a layer of
/// `experts` experts of width `width`, top-`k` routing and hidden size `hidden`, over a tile of
/// `tokens` rows: 1 to [`MOE_MAX_EXPERTS`] experts, top-1 to top-[`MOE_MAX_TOP_K`] (at most the
/// experts), both widths non-zero multiples of 8 (16-byte rows of bf16), fewer than 2^31 routed
/// rows (`tokens · k`, the kernels' `int` indices). The launchers refuse anything else.
pub fn moe_fits(experts: usize, k: usize, hidden: usize, width: usize, tokens: usize) -> bool {
    (1..=MOE_MAX_EXPERTS).contains(&experts)
        && (1..=MOE_MAX_TOP_K.min(experts)).contains(&k)
        && hidden > 0
        && width > 0
        && hidden.is_multiple_of(8)
        && width.is_multiple_of(8)
        && tokens.checked_mul(k).is_some_and(|r| r < 1 << 31)
}

/// Whether flash attention is built for head dim `hd` (it also needs bf16 on a CUDA device of
/// compute capability 8.0 or later: `applies_on`).
pub fn flash_head_dim(hd: usize) -> bool {
    matches!(hd, 16 | 32 | 64 | 128)
}

#[cfg(test)]
mod tests {
    use super::moe_fits;

    /// The launchers' limits, at their edges (`ops/moe`'s checks refuse what this refuses).
    #[test]
    fn moe_fits_is_the_launchers_limits() {
        assert!(moe_fits(64, 8, 2048, 1024, 32768));
        assert!(moe_fits(1024, 32, 8, 8, 1));
        assert!(!moe_fits(1025, 8, 2048, 1024, 1), "experts");
        assert!(!moe_fits(0, 1, 2048, 1024, 1), "no experts");
        assert!(!moe_fits(64, 33, 2048, 1024, 1), "top-33");
        assert!(!moe_fits(4, 5, 2048, 1024, 1), "top-k above the experts");
        assert!(!moe_fits(64, 0, 2048, 1024, 1), "top-0");
        assert!(!moe_fits(64, 8, 2044, 1024, 1), "hidden size");
        assert!(!moe_fits(64, 8, 2048, 1020, 1), "expert width");
        assert!(!moe_fits(64, 8, 0, 1024, 1), "zero width");
        assert!(moe_fits(64, 8, 2048, 1024, (1 << 28) - 1));
        assert!(!moe_fits(64, 8, 2048, 1024, 1 << 28), "2^31 routed rows");
    }
}

//! Every CUDA source of the crate, in one place: `common.cuh` (prepended to each file) and one
//! [`Source`] per `kernels/cuda/*.cu`, each compiled by NVRTC at its first use (`nvrtc.rs`).
//!
//! A new kernel file: put it in `kernels/cuda/`, add its `Source` here (file name, a module name
//! of its own), and launch its kernels from a module of `ops/` through
//! `dev.get_or_load_custom_func(kernel, SOURCE.module, SOURCE.ptx()?)` (as `softmax.rs` does).

use super::nvrtc::Source;

/// The text of `kernels/cuda/<file>`, embedded at build time (a path from the crate's root).
macro_rules! cuda_text {
    ($file:literal) => {
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/cuda/", $file))
    };
}

/// The [`Source`] of `kernels/cuda/<file>`, loaded as candle module `module`.
macro_rules! source {
    ($file:literal, $module:literal) => {
        Source::new($file, $module, cuda_text!($file))
    };
}

/// Device helpers every kernel file uses (`bf2f`, `f2bf`, ...), prepended to each source.
pub(crate) const COMMON: &str = cuda_text!("common.cuh");
/// The Hopper PTX wrappers (mbarriers, TMA, wgmma, setmaxnreg), prepended to the sm_90a sources.
pub(crate) const HOPPER: &str = cuda_text!("hopper.cuh");

/// RMSNorm, SwiGLU, RoPE, cross-entropy, column sums, layout copies and adds.
pub(crate) static FUSED: Source = source!("fused.cu", "mt_fused");
/// The attention softmax pair of the materialised path.
pub(crate) static SOFTMAX: Source = source!("softmax.cu", "mt_softmax");
/// The embedding backward's row scatter-add.
pub(crate) static EMBED: Source = source!("embed.cu", "mt_embed");
/// Flash attention, forward and backward.
pub(crate) static FLASH: Source = source!("flash_attn.cu", "mt_flash");
/// Flash attention on Hopper: compiled after `flash_attn.cu` (whose helpers it uses) into one
/// sm_90a CUBIN by `flash_hopper.rs`, not through [`Source::ptx`].
pub(crate) static FLASH_HOPPER: Source = source!("flash_attn_hopper.cu", "mt_flash_hopper");
/// Mixture-of-experts: routing, grouping by expert, grouped GEMMs, SwiGLU, combine.
pub(crate) static MOE: Source = source!("moe.cu", "mt_moe");
/// A LoRA run's frozen base dequantised into a weight slot.
pub(crate) static BASE: Source = source!("base.cu", "mt_base");
/// The MoE grouped GEMMs on Hopper: compiled after `moe.cu` (whose helpers it uses) into one
/// sm_90a CUBIN by `moe/kernels.rs`, not through [`Source::ptx`].
pub(crate) static MOE_HOPPER: Source = source!("moe_hopper.cu", "mt_moe_hopper");
/// The device AdamW, Σg² and the bf16 narrowing of a gradient.
pub(crate) static ADAMW: Source = source!("adamw.cu", "mt_adamw");

//! Every CUDA source of the crate, in one place: `common.cuh` (prepended to each file) and one
//! [`Source`] per `kernels/cuda/*.cu`, each compiled by NVRTC at its first use (`nvrtc.rs`).
//!
//! A new kernel file: put it in `kernels/cuda/`, add its `Source` here (file name, a module name
//! of its own), and launch its kernels from a module of `ops/` through
//! `dev.get_or_load_custom_func(kernel, SOURCE.module, SOURCE.ptx()?)` (as `softmax.rs` does).

use super::nvrtc::Source;

/// Device helpers every kernel file uses (`bf2f`, `f2bf`, ...), prepended to each source.
pub(crate) const COMMON: &str = include_str!("../../cuda/common.cuh");

/// RMSNorm, SwiGLU, RoPE, cross-entropy, column sums, layout copies and adds.
pub(crate) static FUSED: Source = Source::new("fused.cu", "mt_fused", include_str!("../../cuda/fused.cu"));
/// The attention softmax pair of the materialised path.
pub(crate) static SOFTMAX: Source =
    Source::new("softmax.cu", "mt_softmax", include_str!("../../cuda/softmax.cu"));
/// The embedding backward's row scatter-add.
pub(crate) static EMBED: Source = Source::new("embed.cu", "mt_embed", include_str!("../../cuda/embed.cu"));
/// Flash attention, forward and backward.
pub(crate) static FLASH: Source =
    Source::new("flash_attn.cu", "mt_flash", include_str!("../../cuda/flash_attn.cu"));
/// Flash attention on Hopper: compiled after `flash_attn.cu` (whose helpers it uses) into one
/// sm_90a CUBIN by `flash_hopper.rs`, not through [`Source::ptx`].
pub(crate) static FLASH_HOPPER: Source =
    Source::new("flash_attn_hopper.cu", "mt_flash_hopper", include_str!("../../cuda/flash_attn_hopper.cu"));
/// The device AdamW, Σg² and the bf16 narrowing of a gradient.
pub(crate) static ADAMW: Source = Source::new("adamw.cu", "mt_adamw", include_str!("../../cuda/adamw.cu"));

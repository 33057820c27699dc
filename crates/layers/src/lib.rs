//! Stateless layer templates of the streamed training engine, on candle tensors: the decoder
//! layer of Llama / Mistral / Qwen2 / Qwen3 and the outer unit (embedding, final norm, LM head,
//! chunked cross-entropy), each with an explicit forward and a hand-written backward.
//!
//! The numerics follow Hugging Face transformers' eager implementation operation by operation
//! (which dtype each step runs in, scaling after `q kᵀ`, f32 RoPE tables, f32 statistics for
//! half-precision inputs), so that an f32 run reproduces transformers to f32 rounding; f32 layers
//! on the CPU accumulate their reductions in f64 and round each op's result once, which puts
//! them about 3x closer to a float64 evaluation than PyTorch's float32 (`ops::is_wide`).
//!
//! Architecture Invariant: no autograd graph is built or kept by the library. Weights arrive as
//! views into a flat slot ([`LayerWeights::bind`], [`OuterWeights::bind`]: `narrow` + `reshape`,
//! no copy); gradients leave by being added into a flat gradient buffer ([`GradSink`]); a
//! template holds nothing but the model configuration.
//!
//! Architecture Invariant: the loss never materialises `[b·t, V]` logits; at most
//! `rows_per_block` rows of logits (and of their gradient) are alive at once.
// The CUDA kernels, their launches and their `unsafe` live in mt-kernels.
#![forbid(unsafe_code)]

mod attention;
mod decoder;
mod error;
mod grads;
mod lora;
mod mlp;
mod moe;
mod ops;
mod outer;
mod positions;
pub mod profile;
mod rope;
mod weights;

pub use attention::{check_device, check_gpu};
pub use decoder::{flash_attention, DecoderLayer, LayerOptions, LayerState};
pub use moe::{
    moe_device_workspace_bytes, moe_kernels_apply, moe_kernels_fit, MoeKernels, RouterGrad, RouterStats,
};

/// Whether the fused CUDA kernels (`kernels/cuda/*.cu`, compiled by NVRTC for the device's compute
/// capability) run for tensors of `dtype` on `device`: bf16 on a GPU of compute capability 8.0
/// or later (A100, RTX 30xx, RTX 40xx / L40S, H100 / H200). Elsewhere candle's ops run, which
/// keep more for the backward ([`DecoderLayer::kept_state_bytes`]).
pub fn fused_kernels(device: &candle_core::Device, dtype: candle_core::DType) -> bool {
    #[cfg(feature = "cuda")]
    return mt_kernels::applies_on(device, dtype);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, dtype);
        false
    }
}

/// Whether flash attention of activations of `dtype` on `device` at head dim `head_dim` runs the
/// Hopper kernels with `kernel` (`mt_kernels::hopper_applies`: compute capability 9.0, head dim
/// 64 or 128; never when forced portable). `Hopper` where they cannot run is refused at the
/// first attention (the planner says so first: `megatrain train --attention hopper`).
pub fn hopper_attention(
    device: &candle_core::Device,
    dtype: candle_core::DType,
    head_dim: usize,
    kernel: FlashKernel,
) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return kernel != FlashKernel::Portable
            && flash_attention(device, dtype, head_dim)
            && mt_kernels::hopper_applies(d, head_dim);
    }
    let _ = (device, dtype, head_dim, kernel);
    false
}
pub use error::{Error, Result};
pub use grads::GradSink;
pub use lora::{LoraPair, LoraWeights};
pub use mt_kernels::{flash_head_dim, hopper_dq_buffer_bytes, FlashKernel};
pub use outer::Outer;
pub use positions::Positions;
pub use rope::{Rope, RopeAngles};
pub use weights::{names, LayerWeights, MlpWeights, OuterWeights};

//! Fused, rayon-parallel CPU AdamW that matches `torch.optim.AdamW` (its single-tensor path,
//! `_single_tensor_adam` with decoupled weight decay) to fp32 rounding, plus the pieces of global-norm
//! gradient clipping that run on the host.
//!
//! # The fused pass
//! [`step_fused`] walks a parameter range once. For each element it reads the gradient (f32 or bf16),
//! the fp32 master weight and the two moments `m` and `v`, and writes the new master, `m`, `v` and,
//! optionally, the upload copy of the new master (bf16, f16 or f32) that is staged for the GPU:
//!
//! ```text
//! g  = grad * grad_scale                    clip_grad_norm_ scales grads in place
//! p  = p * (1 - lr * wd)                    param.mul_(1 - lr * weight_decay)
//! m  = m + (1 - beta1) * (g - m)            exp_avg.lerp_(grad, 1 - beta1)
//! v  = v * beta2 + (1 - beta2) * g * g      exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
//! denom = sqrt(v) / sqrt(1 - beta2^t) + eps
//! p  = p - (lr / (1 - beta1^t)) * m / denom param.addcdiv_(exp_avg, denom, value=-step_size)
//! ```
//!
//! The scalars are derived in f64 and rounded to f32 once per call, as torch does with its Python
//! floats; the per-element arithmetic is f32, correctly rounded, in exactly torch's operation order.
//! [`step_reference`] is the same formula as a plain scalar loop; the fused kernel is tested to be
//! bitwise equal to it, and both against numbers produced by PyTorch. Bitwise equality with torch
//! itself is neither possible nor stable: torch 2.15's AVX2/AVX-512 CPU kernels fuse `lerp_` and
//! `addcmul_` into FMAs, and its vectorised `sqrt` differed from the correctly rounded one on 0.6% of
//! random inputs in our check, so the two agree to an f32 ulp or so per step.
//!
//! The range is split into fixed chunks of [`CHUNK`] elements, one rayon task each; a task processes
//! its chunk in L1-sized blocks with a straight-line inner loop that LLVM vectorises (4-wide SSE2 for
//! baseline x86-64; a `-C target-cpu` with AVX2 widens it without changing a single result bit).
//!
//! # Memory traffic
//! AdamW does a few flops per element (two divisions and a square root being the dear ones), so on
//! a many-core host it is bound mostly by memory bandwidth. Per parameter, with f32 gradients: read grad 4 B + master 4 + m 4 + v 4, write master 4 + m 4 + v 4 = 28 B, plus 2 B for
//! a bf16 upload copy: 30 B per parameter (bf16 gradients save 2 B). An unfused implementation
//! re-reads and re-writes the state once per tensor op, several times this traffic. Throughput in
//! elements per second is parameters per second.
//!
//! # Determinism
//! The update is elementwise and Rust neither contracts multiply-adds into FMAs nor reassociates,
//! so every result is bitwise independent of the thread count and of how LLVM vectorised the loop.
//! [`sum_squares`] sums fixed chunks in a fixed order and adds the per-chunk partial sums
//! sequentially, so the gradient norm, and with it [`clip_coef`], is bitwise reproducible too.
//! Over bf16 and 8-bit moments (`coded`), where LLVM does not vectorise the decode and encode, the
//! pass runs in hand-written AVX2 or AVX-512 kernels chosen at run time (`simd`): the scalar
//! definitions' operations in their order, lane by lane, so the same bits on every CPU, and the
//! device kernels' (`kernels/cuda/adamw.cu`).
//!
//! Outputs nobody on the CPU reads again soon (the upload copy, casts into staging) are written
//! with streaming stores (`simd::streaming`): their lines are not read for ownership first, which
//! would add 2 B of DRAM traffic per parameter to a bf16 upload copy.
//!
//! Architecture Invariant: this crate knows nothing about layers, the store or devices; it updates
//! flat slices that the caller carves out of its records.
#![deny(unsafe_code)]

mod adamw;
mod coded;
mod error;
mod land;
mod moments;
mod norm;
#[allow(unsafe_code)]
mod simd;

pub use adamw::{cast_into, step_fused, step_reference, AdamW, Coeffs, Grad, StepArgs, Upload, CHUNK};
pub use error::Error;
pub use land::land_and_step;
pub use moments::{decode_moments, rounding_key, Moments, Q8Moment};
pub use norm::{cast_sum_squares, clip_coef, sum_squares};

/// The vector instruction set the update over bf16 and 8-bit moments runs on: `avx512`, `avx2`
/// or `scalar` (the widest this CPU has, or a narrower one that `MEGATRAIN_HOST_SIMD` asks for),
/// for logs and benchmarks.
pub fn simd_name() -> &'static str {
    simd::Isa::detect().name()
}

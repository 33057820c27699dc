//! Flash attention: the forward (output and each row's log-sum-exp) and the deterministic
//! backward for bf16 `[b, t, heads, hd]` tensors, causal, grouped-query, with optional
//! packed-document bounds and GPT-OSS's sliding window and sink logits ([`FlashExtras`]), by
//! one of two sets of kernels ([`FlashKernel`]):
//! - the Hopper kernels (`flash_hopper.rs`: wgmma, TMA, warp specialisation; compute capability
//!   9.0, head dims 64 and 128), the choice wherever they run;
//! - the portable kernels here (`kernels/cuda/flash_attn.cu`: mma.sync, compute capability 8.0
//!   and later, head dims 16 to 128): `D = rowsum(dO ⊙ O)`, then dK/dV per key tile and dQ per
//!   query tile, no atomics, and with sinks their gradient (one CTA per head, a fixed order).
//!   Launch geometry and shared memory as the kernels' header comment states.
//!
//! The operand checks, output buffers and launch set-up both sets share are in
//! `flash_launch.rs`. `scripts/attention_bench.py` launches both the same way.

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaSlice, LaunchArgs, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Tensor};

use super::flash_hopper;
use super::flash_launch::{
    allow_smem, backward_outputs, backward_tensors, cuda_dev, dims, forward_outputs, forward_tensors,
    launch_config, row_dot, sink_grad, FlashExtras, Operands, Scalars, Views,
};
use super::msg;
use super::sources::FLASH;
use crate::FlashKernel;

/// Threads of every flash kernel (`MT_FA_THREADS`).
const THREADS: u32 = 128;

/// Dynamic shared memory of each kernel for head dim `hd` (the kernels' header comment).
fn smem(kernel: &str, hd: usize) -> u32 {
    let base = (hd * 768) as u32;
    if kernel == "dkdv" {
        base + 1024
    } else {
        base
    }
}

/// `name` of the portable module (compiled by NVRTC, cached by candle per device) with its
/// dynamic shared memory limit raised to `smem`.
fn portable(dev: &CudaDevice, name: &str, smem: u32) -> candle_core::Result<CudaFunction> {
    let f = dev.get_or_load_custom_func(name, FLASH.module, FLASH.ptx()?)?.into_cuda_function();
    allow_smem(&f, smem)?;
    Ok(f)
}

/// Pushes the arguments the dK/dV and the dQ kernels start with: `bf16* Q, K, V, dO, float* LSE,
/// D`.
fn push_backward_inputs<'b>(
    a: &mut LaunchArgs<'b>,
    x: &'b Views<'_>,
    d: &'b CudaSlice<f32>,
) -> candle_core::Result<()> {
    let (_, lse, d_o) = x.grad()?;
    a.arg(&x.q);
    a.arg(&x.k);
    a.arg(&x.v);
    a.arg(d_o);
    a.arg(lse);
    a.arg(d);
    Ok(())
}

/// Pushes the arguments the dK/dV and the dQ kernels end with: `int window, T, NH, NKV, float
/// scale, scale_log2`.
fn push_backward_scalars<'b>(a: &mut LaunchArgs<'b>, x: &'b Views<'_>, s: &'b Scalars) {
    a.arg(&x.window);
    s.push_sizes(a, false);
    a.arg(&s.scale);
    a.arg(&s.scale_log2);
}

/// Whether `kernel` means the Hopper kernels for `q`'s device and head dim `hd`; an error where
/// they were asked for and cannot run.
fn hopper(dev: &CudaDevice, hd: usize, kernel: FlashKernel) -> candle_core::Result<bool> {
    match kernel {
        FlashKernel::Portable => Ok(false),
        FlashKernel::Auto => Ok(flash_hopper::hopper_applies(dev, hd)),
        FlashKernel::Hopper | FlashKernel::HopperUnordered if flash_hopper::hopper_applies(dev, hd) => Ok(true),
        FlashKernel::Hopper | FlashKernel::HopperUnordered => Err(msg(format!(
            "the Hopper attention kernels run on a GPU of compute capability 9.0 (H100, H200) with head dim 64 or 128 (this model's is {hd}) and MEGATRAIN_NVRTC_CC unset or 90; use --attention flash or portable"
        ))),
    }
}

/// Forward: `(o [b, t, nh, hd] bf16, lse [b, nh, t] f32)`. `docs`: u32 `[b, t]` first and
/// one-past-last index of each token's document.
pub fn flash_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    docs: Option<(&Tensor, &Tensor)>,
    kernel: FlashKernel,
) -> candle_core::Result<(Tensor, Tensor)> {
    flash_forward_with(q, k, v, docs, FlashExtras::default(), kernel)
}

/// [`flash_forward`] with a sliding window and sink logits (`extras`): `o` and `lse` include
/// the sinks (each row's denominator has its head's `e^{s_h}`).
pub fn flash_forward_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    docs: Option<(&Tensor, &Tensor)>,
    extras: FlashExtras<'_>,
    kernel: FlashKernel,
) -> candle_core::Result<(Tensor, Tensor)> {
    let shape @ (b, t, nh, _, hd) = dims(q, k)?;
    let dev = cuda_dev(q)?;
    let operands = Operands::forward(q, k, v, docs, extras, shape)?;
    if hopper(&dev, hd, kernel)? {
        return flash_hopper::forward(&dev, &operands);
    }
    let st = dev.cuda_stream();
    let x = operands.views()?;
    // SAFETY: every element of both is written by the kernel below (rows < t of every head).
    let (o, lse) = unsafe { forward_outputs(&dev, shape)? };
    let sm = smem("fwd", hd);
    let f = portable(&dev, &format!("mt_flash_fwd_hd{hd}"), sm)?;
    let s = Scalars::new(shape);
    let mut a = st.launch_builder(&f);
    a.arg(&x.q);
    a.arg(&x.k);
    a.arg(&x.v);
    a.arg(&o);
    a.arg(&lse);
    x.push_starts(&mut a);
    x.push_sinks(&mut a);
    a.arg(&x.window);
    s.push_sizes(&mut a, false);
    a.arg(&s.scale_log2);
    let cfg = launch_config((t.div_ceil(128) as u32, nh as u32, b as u32), THREADS, sm);
    // SAFETY: signature (bf16* Q, K, V, O, float* LSE, int* seg_lo or null, float* sinks or
    // null, int window, T, NH, NKV, float); Q/O hold b·t·nh·hd, K/V b·t·nkv·hd, LSE b·nh·t,
    // seg_lo b·t, sinks nh elements (checked by `views`), every index the kernel forms is below
    // those (64-bit offsets); `sm` bytes of shared memory as the kernel lays it out, allowed
    // above.
    unsafe { a.launch(cfg) }.w()?;
    Ok(forward_tensors(&dev, shape, (o, lse)))
}

/// Backward: `(dq [b, t, nh, hd], dk, dv [b, t, nkv, hd])`, bf16, from the forward's inputs, its
/// output `o`, `lse` and `d_o = dL/do` (either kernel set's forward: they save the same LSE).
#[allow(clippy::too_many_arguments)]
pub fn flash_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    docs: Option<(&Tensor, &Tensor)>,
    kernel: FlashKernel,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let (dq, dk, dv, _) = flash_backward_with(q, k, v, o, lse, d_o, docs, FlashExtras::default(), kernel)?;
    Ok((dq, dk, dv))
}

/// [`flash_backward`] of a [`flash_forward_with`] (the same `extras`): also, with sinks, their
/// gradient `dL/ds_h = -Σ_rows e^{s_h - LSE} rowsum(dO ⊙ O)`, f32 `[nh]` summed over the batch
/// in a fixed order (bitwise repeatable).
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    docs: Option<(&Tensor, &Tensor)>,
    extras: FlashExtras<'_>,
    kernel: FlashKernel,
) -> candle_core::Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    let shape @ (b, t, nh, nkv, hd) = dims(q, k)?;
    let dev = cuda_dev(q)?;
    let operands = Operands::backward(q, k, v, o, lse, d_o, docs, extras, shape)?;
    if hopper(&dev, hd, kernel)? {
        let ordered = kernel != FlashKernel::HopperUnordered;
        return flash_hopper::backward(&dev, &operands, ordered);
    }
    let st = dev.cuda_stream();
    let x = operands.views()?;
    let d = row_dot(&dev, &st, &portable(&dev, "mt_flash_bwd_dot", 0)?, &x, shape)?;

    let s = Scalars::new(shape);
    // SAFETY: every element of each is written by the kernels below (rows < t of every head).
    let [dq, dk, dv] = unsafe { backward_outputs(&dev, shape)? };
    let tiles = t.div_ceil(64) as u32;
    let sm = smem("dkdv", hd);
    let f = portable(&dev, &format!("mt_flash_bwd_dkdv_hd{hd}"), sm)?;
    let mut a = st.launch_builder(&f);
    push_backward_inputs(&mut a, &x, &d)?;
    a.arg(&dk);
    a.arg(&dv);
    x.push_bounds(&mut a)?;
    push_backward_scalars(&mut a, &x, &s);
    let cfg = launch_config((tiles, nkv as u32, b as u32), THREADS, sm);
    // SAFETY: signature (bf16* Q, K, V, dO, float* LSE, D, bf16* dK, dV, int* seg_lo, seg_hi
    // (both or neither null), int window, T, NH, NKV, float scale, scale_log2); sizes as checked
    // by `views` (dK/dV b·t·nkv·hd, LSE and D b·nh·t); `sm` bytes of shared memory, allowed
    // above.
    unsafe { a.launch(cfg) }.w()?;

    let sm = smem("dq", hd);
    let f = portable(&dev, &format!("mt_flash_bwd_dq_hd{hd}"), sm)?;
    let mut a = st.launch_builder(&f);
    push_backward_inputs(&mut a, &x, &d)?;
    a.arg(&dq);
    x.push_starts(&mut a);
    push_backward_scalars(&mut a, &x, &s);
    let cfg = launch_config((tiles, nh as u32, b as u32), THREADS, sm);
    // SAFETY: signature (bf16* Q, K, V, dO, float* LSE, D, bf16* dQ, int* seg_lo or null, int
    // window, T, NH, NKV, float scale, scale_log2); dQ holds b·t·nh·hd; `sm` bytes, allowed above.
    unsafe { a.launch(cfg) }.w()?;
    let dsinks = match &x.sinks {
        Some(sinks) => Some(sink_grad(&dev, &portable(&dev, "mt_flash_sink_grad", 0)?, &x, sinks, &d, &s)?),
        None => None,
    };
    let (dq, dk, dv) = backward_tensors(&dev, shape, [dq, dk, dv]);
    Ok((dq, dk, dv, dsinks))
}

//! Launches of `kernels/cuda/adamw.cu`: the in-place AdamW of a device-resident unit and the
//! deterministic partial sums of its gradient's squares (see `crate::device_optim`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, Shape, Tensor};
use mt_core::{StateDtype, Q8_BLOCK};
use mt_optim::Coeffs;

use super::nvrtc::note_device;
use super::sources::ADAMW;
use super::{grid_for, msg, with_bf16};

/// Blocks of the sum-of-squares reduction: fixed, so its order (and result) is too.
const SUMSQ_BLOCKS: usize = 1024;
const SUMSQ_THREADS: u32 = 256;

/// The fixed grid of the sum-of-squares reductions (their order, and so their result, depends on it).
fn sumsq_grid() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (SUMSQ_BLOCKS as u32, 1, 1),
        block_dim: (SUMSQ_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The module's PTX for `dev`'s architecture (these kernels also run where the fused ones do
/// not: a resident unit's AdamW with f32 weights).
fn ptx(dev: &candle_core::CudaDevice) -> candle_core::Result<&'static str> {
    note_device(dev);
    ADAMW.ptx()
}

/// The moments' encoding of a device update and its stochastic rounding's key
/// (`mt_optim::rounding_key`; unused for fp32).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Moments {
    pub(crate) dtype: StateDtype,
    pub(crate) key: u32,
}

/// `state = [master | m | v]` (f32 words, `StateDtype::state_words(n)`, the moments encoded as
/// `mom.dtype` says) updated in place from `grad` (f32, contiguous); with `weights` (a
/// contiguous bf16 tensor of n elements, not `state` nor `grad`), the new master weights are also
/// written there as bf16 in the same pass.
pub(crate) fn adamw(
    st: &mut CudaStorage,
    ls: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    c: &Coeffs,
    mom: Moments,
    weights: Option<&Tensor>,
) -> candle_core::Result<()> {
    let n = lg.shape().elem_count();
    if !ls.is_contiguous() || !lg.is_contiguous() || ls.shape().elem_count() != mom.dtype.state_words(n) {
        return Err(msg(format!(
            "device AdamW: state must be a contiguous [master | m | v] of {} {} words and the gradient contiguous [n]",
            mom.dtype.state_words(n),
            mom.dtype
        )));
    }
    if n >= 1 << 32 {
        return Err(msg(format!("device AdamW: {n} parameters in one unit; the rounding draws index 2^32")));
    }
    match weights {
        Some(w) if w.elem_count() != n => {
            Err(msg(format!("device AdamW: {} weights for {n} parameters", w.elem_count())))
        }
        Some(w) => with_bf16(w, |wv| {
            let stream = st.device().cuda_stream();
            let (ptr, _guard) = wv.device_ptr(&stream);
            launch_adamw(st, ls, g, lg, c, mom, n, ptr)
        }),
        None => launch_adamw(st, ls, g, lg, c, mom, n, 0),
    }
}

#[allow(clippy::too_many_arguments)]
fn launch_adamw(
    st: &mut CudaStorage,
    ls: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    c: &Coeffs,
    mom: Moments,
    n: usize,
    w_out: u64,
) -> candle_core::Result<()> {
    let dev = st.device().clone();
    let (kernel, cfg) = match mom.dtype {
        StateDtype::F32 => ("mt_adamw", grid_for(n)),
        StateDtype::Bf16 => ("mt_adamw_bf16", grid_for(n)),
        // One block of Q8_BLOCK threads per 8-bit block (the kernel's shared array and tree
        // assume that size).
        StateDtype::Int8 => (
            "mt_adamw_q8",
            LaunchConfig {
                grid_dim: (n.div_ceil(Q8_BLOCK).clamp(1, 1 << 20) as u32, 1, 1),
                block_dim: (Q8_BLOCK as u32, 1, 1),
                shared_mem_bytes: 0,
            },
        ),
    };
    let func = dev.get_or_load_custom_func(kernel, ADAMW.module, ptx(&dev)?)?;
    let gs = g.as_cuda_slice::<f32>()?.slice(lg.start_offset()..);
    let mut ss = st.as_cuda_slice_mut::<f32>()?.slice_mut(ls.start_offset()..);
    let (n64, lerp_small) = (n as i64, i32::from(c.lerp_small));
    let mut b = func.builder();
    b.arg(&mut ss);
    b.arg(&gs);
    b.arg(&n64);
    b.arg(&c.grad_scale);
    b.arg(&c.decay);
    b.arg(&lerp_small);
    b.arg(&c.lerp_coeff);
    b.arg(&c.beta2);
    b.arg(&c.one_minus_beta2);
    b.arg(&c.bc2_sqrt);
    b.arg(&c.eps);
    b.arg(&c.step_size);
    if mom.dtype != StateDtype::F32 {
        b.arg(&mom.key);
    }
    b.arg(&w_out);
    // SAFETY: the arguments match the kernel's signature (mt_adamw: float*, const float*, long
    // long, float, float, int, six floats, the weights' address; the bf16/q8 kernels: an unsigned
    // key before the address); the state holds `state_words(n)` f32 words laid out as the kernels
    // derive from n (`StateDtype::moment_bytes`), the gradient n (checked by `adamw`); `w_out` is 0
    // or n bf16 of a live buffer distinct from both, under `with_bf16`'s storage lock, written in
    // order with its readers by candle's one stream, onto which one thread issues every compute
    // op. mt_adamw_q8's blocks are Q8_BLOCK threads, as its shared array and tree assume.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

struct SumSq;

impl CustomOp1 for SumSq {
    cuda_only!("mt-sumsq", 1);

    fn cuda_fwd(&self, g: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        if !l.is_contiguous() {
            return Err(msg("sum of squares: needs a contiguous tensor"));
        }
        let dev = g.device();
        // SAFETY: each of the SUMSQ_BLOCKS blocks writes its own element below.
        let out = unsafe { dev.alloc::<f64>(SUMSQ_BLOCKS)? };
        let n = l.shape().elem_count() as i64;
        match g.dtype() {
            candle_core::DType::F32 => {
                let gs = g.as_cuda_slice::<f32>()?.slice(l.start_offset()..);
                let func = dev.get_or_load_custom_func("mt_sumsq", ADAMW.module, ptx(dev)?)?;
                let mut b = func.builder();
                b.arg(&gs);
                b.arg(&out);
                b.arg(&n);
                // SAFETY: signature (const float*, double*, long long); the kernel's shared array
                // holds SUMSQ_THREADS doubles (its tree reduction assumes that block size, a power
                // of two); g holds n elements; out SUMSQ_BLOCKS.
                unsafe { b.launch(sumsq_grid()) }.w()?;
            }
            candle_core::DType::BF16 => {
                let gs = g.as_cuda_slice::<half::bf16>()?.slice(l.start_offset()..);
                let func = dev.get_or_load_custom_func("mt_sumsq_bf16", ADAMW.module, ptx(dev)?)?;
                let mut b = func.builder();
                b.arg(&gs);
                b.arg(&out);
                b.arg(&n);
                // SAFETY: as above, with (const unsigned short*, double*, long long): bf16 as bits.
                unsafe { b.launch(sumsq_grid()) }.w()?;
            }
            other => return Err(msg(format!("sum of squares: f32 or bf16, not {other:?}"))),
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(SUMSQ_BLOCKS)))
    }
}

/// Per-block partial sums (f64) of `g²` (f32 or bf16), to be added in order.
pub(crate) fn sum_squares_partials(g: &Tensor) -> candle_core::Result<Tensor> {
    g.apply_op1_no_bwd(&SumSq)
}

/// `out = bf16(g)` in place (contiguous, one length), rounded as the host's land rounds.
pub(crate) fn narrow_bf16(
    out: &mut CudaStorage,
    lo: &Layout,
    g: &CudaStorage,
    lg: &Layout,
) -> candle_core::Result<()> {
    let n = lg.shape().elem_count();
    if !lo.is_contiguous() || !lg.is_contiguous() || lo.shape().elem_count() != n {
        return Err(msg("gradient narrowing: needs contiguous bf16 out and f32 gradient of one length"));
    }
    let dev = g.device().clone();
    let func = dev.get_or_load_custom_func("mt_narrow_bf16", ADAMW.module, ptx(&dev)?)?;
    let gs = g.as_cuda_slice::<f32>()?.slice(lg.start_offset()..);
    let mut os = out.as_cuda_slice_mut::<half::bf16>()?.slice_mut(lo.start_offset()..);
    let n64 = n as i64;
    let mut b = func.builder();
    b.arg(&gs);
    b.arg(&mut os);
    b.arg(&n64);
    // SAFETY: signature (const float*, unsigned short*, long long); g and out hold n elements
    // from their offsets (checked); each thread writes the out elements of its grid-stride set.
    unsafe { b.launch(grid_for(n)) }.w()?;
    Ok(())
}

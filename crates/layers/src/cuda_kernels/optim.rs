//! Launches of `kernels/adamw.cu`: the in-place AdamW of a device-resident unit and the
//! deterministic partial sums of its gradient's squares (see `crate::device_optim`).

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, Shape, Tensor};
use mt_optim::Coeffs;

use super::{compile, grid_for, msg, with_bf16, Compiled};

const SOURCE: &str = include_str!("../../../../kernels/adamw.cu");
const MODULE: &str = "mt_adamw";
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

fn ptx() -> candle_core::Result<&'static str> {
    static PTX: Compiled = OnceLock::new();
    compile(&PTX, SOURCE, "adamw.cu")
}

/// `state = [master | m | v]` updated in place from `grad` (both f32, contiguous); with
/// `weights` (a contiguous bf16 tensor of n elements, not `state` nor `grad`), the new master
/// weights are also written there as bf16 in the same pass.
pub(crate) fn adamw(
    st: &mut CudaStorage,
    ls: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    c: &Coeffs,
    weights: Option<&Tensor>,
) -> candle_core::Result<()> {
    let n = lg.shape().elem_count();
    if !ls.is_contiguous() || !lg.is_contiguous() || ls.shape().elem_count() != 3 * n {
        return Err(msg("device AdamW: state must be a contiguous [3 x n] and the gradient contiguous [n]"));
    }
    match weights {
        Some(w) if w.elem_count() != n => {
            Err(msg(format!("device AdamW: {} weights for {n} parameters", w.elem_count())))
        }
        Some(w) => with_bf16(w, |wv| {
            let stream = st.device().cuda_stream();
            let (ptr, _guard) = wv.device_ptr(&stream);
            launch_adamw(st, ls, g, lg, c, n, ptr)
        }),
        None => launch_adamw(st, ls, g, lg, c, n, 0),
    }
}

fn launch_adamw(
    st: &mut CudaStorage,
    ls: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    c: &Coeffs,
    n: usize,
    w_out: u64,
) -> candle_core::Result<()> {
    let dev = st.device().clone();
    let func = dev.get_or_load_custom_func("mt_adamw", MODULE, ptx()?)?;
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
    b.arg(&w_out);
    // SAFETY: the arguments match mt_adamw's signature (float*, const float*, long long, float,
    // float, int, six floats, the weights' address as unsigned long long); the state holds 3·n
    // f32, the gradient n (checked by `adamw`); `w_out` is 0 or the address of n bf16 of a live
    // buffer distinct from both, under `with_bf16`'s (read) storage lock. Writing through it is
    // sound because every compute op is issued from one thread onto candle's one stream, which
    // orders each reader or writer of the slot with this kernel. One thread per element.
    unsafe { b.launch(grid_for(n)) }.w()?;
    Ok(())
}

struct SumSq;

impl CustomOp1 for SumSq {
    cuda_only!("mt-sumsq", 1);

    fn cuda_fwd(&self, g: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        if !l.is_contiguous() {
            return Err(msg("sum of squares: needs a contiguous f32 tensor"));
        }
        let dev = g.device();
        let gs = g.as_cuda_slice::<f32>()?.slice(l.start_offset()..);
        let func = dev.get_or_load_custom_func("mt_sumsq", MODULE, ptx()?)?;
        // SAFETY: each of the SUMSQ_BLOCKS blocks writes its own element below.
        let out = unsafe { dev.alloc::<f64>(SUMSQ_BLOCKS)? };
        let n = l.shape().elem_count() as i64;
        let mut b = func.builder();
        b.arg(&gs);
        b.arg(&out);
        b.arg(&n);
        let cfg = sumsq_grid();
        // SAFETY: signature (const float*, double*, long long); the kernel's shared array holds
        // SUMSQ_THREADS doubles (its tree reduction assumes that block size, a power of two);
        // g holds n elements; out SUMSQ_BLOCKS.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(SUMSQ_BLOCKS)))
    }
}

/// Per-block partial sums (f64) of `g²`, to be added in order.
pub(crate) fn sum_squares_partials(g: &Tensor) -> candle_core::Result<Tensor> {
    g.apply_op1_no_bwd(&SumSq)
}

/// A zeroed buffer for [`narrow_bf16_sum_squares`]'s partial sums.
pub(crate) fn sum_squares_partials_buffer(dev: &candle_core::Device) -> candle_core::Result<Tensor> {
    Tensor::zeros(SUMSQ_BLOCKS, candle_core::DType::F64, dev)
}

/// `out = bf16(g)` (contiguous, `n` elements each) and the per-block partial sums (f64) of
/// `out²` into `partials` (`SUMSQ_BLOCKS` elements), to be added in order.
pub(crate) fn narrow_bf16_sum_squares(
    out: &mut CudaStorage,
    lo: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    partials: &CudaStorage,
    lp: &Layout,
) -> candle_core::Result<()> {
    let n = lg.shape().elem_count();
    if !lo.is_contiguous() || !lg.is_contiguous() || !lp.is_contiguous() || lo.shape().elem_count() != n {
        return Err(msg("gradient narrowing: needs contiguous bf16 out and f32 gradient of one length"));
    }
    if lp.shape().elem_count() != SUMSQ_BLOCKS {
        return Err(msg(format!("gradient narrowing: {SUMSQ_BLOCKS} partial sums expected")));
    }
    let dev = g.device().clone();
    let func = dev.get_or_load_custom_func("mt_narrow_sumsq_bf16", MODULE, ptx()?)?;
    let gs = g.as_cuda_slice::<f32>()?.slice(lg.start_offset()..);
    let mut os = out.as_cuda_slice_mut::<half::bf16>()?.slice_mut(lo.start_offset()..);
    let ps = partials.as_cuda_slice::<f64>()?.slice(lp.start_offset()..);
    let n64 = n as i64;
    let mut b = func.builder();
    b.arg(&gs);
    b.arg(&mut os);
    b.arg(&ps);
    b.arg(&n64);
    let cfg = sumsq_grid();
    // SAFETY: signature (const float*, unsigned short*, double*, long long); g and out hold n
    // elements from their offsets, partials SUMSQ_BLOCKS (checked above); each block writes its own
    // partial, each thread the out elements of its grid-stride set; the shared array holds
    // SUMSQ_THREADS doubles (the tree assumes that block size, a power of two). The partials are
    // written through a shared view: the op's caller allocated them for this launch alone, and
    // candle's one stream orders every later reader after the kernel.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

//! Our CUDA kernels (`kernels/*.cu`) as candle custom ops: compiled once per process with NVRTC
//! for the device's architecture (no nvcc at build time, so the CPU-only CI and the GPU machine
//! build the same way; one release binary serves compute capability 8.0 to 9.0), loaded through
//! candle's module cache and launched on candle's stream.
//!
//! - [`causal_softmax`]: scale + causal mask + softmax of bf16 scores in one pass (bf16 out, and
//!   each row's max and sum);
//! - [`softmax_backward`]: `c · P ⊙ (dP − rowsum(dP ⊙ P))` in one pass, P recomputed in f32 from
//!   the scores and the row statistics (bf16 out);
//! - [`accumulate_matmul_t`]: a weight gradient added into the f32 gradient buffer by one cuBLAS
//!   GEMM (`gemm.rs`);
//! - [`rows_add`]: the embedding backward's deterministic row scatter-add (`embed.rs`);
//! - [`rms_norm`] / [`rms_norm_backward`], [`swiglu`] / [`swiglu_backward`], [`rope`]: the
//!   decoder's elementwise work (`kernels/fused.cu`), each one or two passes instead of 5-12
//!   candle ops, with the same bf16 roundings as the candle sequence they replace.
//!
//! The softmax pair replaces ~10 candle passes over the `[b, heads, t, t]` score tensor each
//! (casts, scale, broadcast mask, max, subtract, exp, sum, divide) and the per-call upload of a
//! `t × t` mask.
//! This is the only module of mt-layers with `unsafe` (allocation and kernel launch).

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Storage, Tensor};
use half::bf16;

/// Device helpers every kernel file uses (`bf2f`, `f2bf`, ...), prepended to each source.
const COMMON: &str = include_str!("../../../../kernels/common.cuh");
const FUSED_SOURCE: &str = include_str!("../../../../kernels/fused.cu");
const FUSED: &str = "mt_fused";
const THREADS: u32 = 256;

type Compiled = OnceLock<std::result::Result<String, String>>;

/// NVRTC's target: the virtual architecture of the process's GPU ([`note_device`]; one GPU per
/// process), `compute_80` until a device is known (PTX that the driver compiles for any GPU of
/// compute capability 8.0 or later: right everywhere, if not tuned for newer ones).
static ARCH: OnceLock<&'static str> = OnceLock::new();

/// The virtual architecture NVRTC targets for a GPU of compute capability `major.minor`: the
/// newest of those our kernels are built and checked for that is not above it (A100 8.0, RTX 30xx
/// 8.6, RTX 40xx / L40S 8.9, H100 / H200 9.0); a newer GPU gets `compute_90`, whose PTX its
/// driver compiles forward.
pub(crate) fn nvrtc_arch(major: i32, minor: i32) -> &'static str {
    const ARCHS: [(i32, &str); 5] =
        [(75, "compute_75"), (80, "compute_80"), (86, "compute_86"), (89, "compute_89"), (90, "compute_90")];
    let cc = major * 10 + minor;
    ARCHS.iter().rev().find(|(a, _)| *a <= cc).map_or(ARCHS[0].1, |(_, name)| name)
}

/// Records the process's GPU for NVRTC ([`ARCH`]; the first device noted wins) and returns its
/// architecture. `MEGATRAIN_NVRTC_CC=80` (or 86, 89) compiles for that older capability instead:
/// the A100's PTX on an H100, so one Hopper machine checks the portable build's kernels.
pub(crate) fn note_device(dev: &candle_core::CudaDevice) -> &'static str {
    ARCH.get_or_init(|| {
        let found =
            dev.cuda_stream().context().compute_capability().ok().map(|(major, minor)| major * 10 + minor);
        let forced = std::env::var("MEGATRAIN_NVRTC_CC").ok().and_then(|s| s.trim().parse::<i32>().ok());
        let cc = match (found, forced) {
            (Some(d), Some(f)) => Some(d.min(f)),
            (d, f) => d.or(f),
        };
        cc.map_or("compute_80", |cc| nvrtc_arch(cc / 10, cc % 10))
    })
}

fn compile(cell: &'static Compiled, src: &str, name: &str) -> candle_core::Result<&'static str> {
    let r = cell.get_or_init(|| {
        // No FMA contraction: candle rounds every multiply and add separately, and the kernels
        // promise the same roundings (kernels/fused.cu).
        let opts = CompileOptions {
            arch: Some(ARCH.get().copied().unwrap_or("compute_80")),
            name: Some(name.into()),
            fmad: Some(false),
            ..Default::default()
        };
        // The shared helpers first; `#line` keeps NVRTC's messages pointing into the right file.
        let src = format!("#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{name}\"\n{src}");
        compile_ptx_with_opts(src, opts).map(|p| p.to_src()).map_err(|e| format!("{e:?}"))
    });
    r.as_deref().map_err(|e| msg(format!("NVRTC compiling kernels/{name}: {e}")))
}

fn fused_ptx() -> candle_core::Result<&'static str> {
    static PTX: Compiled = OnceLock::new();
    compile(&PTX, FUSED_SOURCE, "fused.cu")
}

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
/// argument is the op's arity (1, 2 or 3 inputs; `inplace3` for an `InplaceOp3`).
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

mod layout;
pub(crate) use layout::{add, add_row, swap12};
mod colsum;
pub(crate) use colsum::col_sums_add;
mod embed;
pub(crate) use embed::rows_add;
mod gemm;
pub(crate) use gemm::{accumulate_matmul_t, gemm_applies};
mod norm;
pub(crate) use norm::{rms_norm, rms_norm_backward};
mod optim;
pub(crate) use optim::{adamw, narrow_bf16, sum_squares_partials, Moments};
mod softmax;
pub(crate) use softmax::{causal_softmax, softmax_backward};
mod flash;
pub(crate) use flash::{flash_backward, flash_forward};

struct Swiglu;

impl CustomOp2 for Swiglu {
    cuda_only!("mt-swiglu", 2);
    fn cuda_fwd(
        &self,
        g: &CudaStorage,
        lg: &Layout,
        u: &CudaStorage,
        lu: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let total = lg.shape().elem_count();
        if lu.shape() != lg.shape() || !lg.is_contiguous() || !lu.is_contiguous() {
            return Err(msg("swiglu: gate and up must be contiguous and of one shape"));
        }
        let dev = g.device();
        let gs = g.as_cuda_slice::<bf16>()?.slice(lg.start_offset()..);
        let us = u.as_cuda_slice::<bf16>()?.slice(lu.start_offset()..);
        let func = dev.get_or_load_custom_func("mt_swiglu_fwd", FUSED, fused_ptx()?)?;
        // SAFETY: every element is written by the kernel below.
        let out = unsafe { dev.alloc::<bf16>(total)? };
        let tot = total as i64;
        let mut b = func.builder();
        b.arg(&gs);
        b.arg(&us);
        b.arg(&out);
        b.arg(&tot);
        // SAFETY: signature (bf16*, bf16*, bf16*, long long); all hold `total` elements.
        unsafe { b.launch(grid_for(total)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lg.shape().clone()))
    }
}

struct SwigluBwd;

impl CustomOp3 for SwigluBwd {
    cuda_only!("mt-swiglu-bwd", 3);
    fn cuda_fwd(
        &self,
        d: &CudaStorage,
        ld: &Layout,
        g: &CudaStorage,
        lg: &Layout,
        u: &CudaStorage,
        lu: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let total = lg.shape().elem_count();
        if ld.shape() != lg.shape()
            || lu.shape() != lg.shape()
            || !ld.is_contiguous()
            || !lg.is_contiguous()
            || !lu.is_contiguous()
        {
            return Err(msg("swiglu backward: inputs must be contiguous and of one shape"));
        }
        let dev = g.device();
        let ds = d.as_cuda_slice::<bf16>()?.slice(ld.start_offset()..);
        let gs = g.as_cuda_slice::<bf16>()?.slice(lg.start_offset()..);
        let us = u.as_cuda_slice::<bf16>()?.slice(lu.start_offset()..);
        let func = dev.get_or_load_custom_func("mt_swiglu_bwd", FUSED, fused_ptx()?)?;
        // SAFETY: every element of both halves is written by the kernel below.
        let out = unsafe { dev.alloc::<bf16>(2 * total)? };
        let tot = total as i64;
        let mut b = func.builder();
        b.arg(&ds);
        b.arg(&gs);
        b.arg(&us);
        b.arg(&out);
        b.arg(&tot);
        // SAFETY: signature (bf16*, bf16*, bf16*, bf16*, long long); out holds 2 * total.
        unsafe { b.launch(grid_for(total)) }.w()?;
        let mut dims = vec![2];
        dims.extend_from_slice(lg.dims());
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(dims)))
    }
}

struct Rope {
    sign: f32,
}

impl CustomOp3 for Rope {
    cuda_only!("mt-rope", 3);
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        c: &CudaStorage,
        lc: &Layout,
        s: &CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (t, heads, hd) = match lx.dims() {
            [_, t, h, d] => (*t, *h, *d),
            d => return Err(msg(format!("rope: x must be [b, t, heads, hd], found {d:?}"))),
        };
        if lc.dims() != [t, hd]
            || ls.dims() != [t, hd]
            || !lx.is_contiguous()
            || !lc.is_contiguous()
            || !ls.is_contiguous()
            || hd % 2 != 0
        {
            return Err(msg("rope: cos/sin must be contiguous [t, hd] (hd even) and x contiguous"));
        }
        let total = lx.shape().elem_count();
        let dev = x.device();
        let xs = x.as_cuda_slice::<bf16>()?.slice(lx.start_offset()..);
        let cs = c.as_cuda_slice::<bf16>()?.slice(lc.start_offset()..);
        let ss = s.as_cuda_slice::<bf16>()?.slice(ls.start_offset()..);
        // 16 bytes a thread when every 8-element group lies in one half of one head and every
        // view starts 16-byte aligned (candle's allocations are 256-byte aligned).
        let wide = hd % 16 == 0 && [lx, lc, ls].iter().all(|l| l.start_offset() % 8 == 0);
        let func =
            dev.get_or_load_custom_func(if wide { "mt_rope8" } else { "mt_rope" }, FUSED, fused_ptx()?)?;
        // SAFETY: every element is written by the kernel below.
        let out = unsafe { dev.alloc::<bf16>(total)? };
        let (tot, t32, h32, hd32, sign) = (total as i64, t as i32, heads as i32, hd as i32, self.sign);
        let mut b = func.builder();
        b.arg(&xs);
        b.arg(&cs);
        b.arg(&ss);
        b.arg(&out);
        b.arg(&tot);
        b.arg(&t32);
        b.arg(&h32);
        b.arg(&hd32);
        b.arg(&sign);
        // SAFETY: signature (bf16*, bf16*, bf16*, bf16*, long long, int, int, int, float) of
        // both kernels; mt_rope8's uint4 accesses are 16-byte aligned (checked above: hd % 16 ==
        // 0 and 8-element aligned starts) and in bounds (x and out hold total elements, cos/sin
        // t · hd); grid-stride loops.
        unsafe { b.launch(grid_for(if wide { total / 8 } else { total })) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lx.shape().clone()))
    }
}

/// Whether the fused bf16 kernels apply to `x`: a bf16 tensor on a CUDA device of compute
/// capability 8.0 or later (A100, RTX 30xx, RTX 40xx / L40S, H100 / H200). They use nothing newer
/// than sm_80 (flash attention's `cp.async`, `ldmatrix` and bf16 `mma.sync`; the rest plain CUDA
/// C), and every file compiles for sm_80, 86, 89 and 90 without spills beyond sm_90's
/// (`docs/decisions/0034-gpu-portability.md`); older GPUs use the candle path.
pub(crate) fn applies(x: &Tensor) -> bool {
    applies_on(x.device(), x.dtype())
}

/// [`applies`] for tensors of `dtype` on `device`.
pub(crate) fn applies_on(device: &candle_core::Device, dtype: DType) -> bool {
    static FUSED: OnceLock<bool> = OnceLock::new();
    match device {
        candle_core::Device::Cuda(d) if dtype == DType::BF16 => *FUSED.get_or_init(|| {
            note_device(d);
            d.cuda_stream().context().compute_capability().is_ok_and(|(major, _)| major >= 8)
        }),
        _ => false,
    }
}

/// `bf16(silu(gate)) * up`.
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    gate.contiguous()?.apply_op2_no_bwd(&up.contiguous()?, &Swiglu)
}

/// Backward of [`swiglu`] for `d = dL/d(mid)`: `(d_gate, d_up)`.
pub(crate) fn swiglu_backward(
    d: &Tensor,
    gate: &Tensor,
    up: &Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let out = d.contiguous()?.apply_op3_no_bwd(&gate.contiguous()?, &up.contiguous()?, &SwigluBwd)?;
    Ok((out.get(0)?, out.get(1)?))
}

/// RoPE of `x [b, t, heads, hd]` with `[t, hd]` tables; `inverse` applies the backward.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> candle_core::Result<Tensor> {
    let op = Rope { sign: if inverse { -1.0 } else { 1.0 } };
    x.contiguous()?.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)
}

struct CeLoss;

impl CustomOp2 for CeLoss {
    cuda_only!("mt-ce-loss", 2);
    fn cuda_fwd(
        &self,
        l: &CudaStorage,
        ll: &Layout,
        t: &CudaStorage,
        lt: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, v) = rows_and_t(ll, "cross-entropy logits")?;
        if lt.shape().elem_count() != rows || !lt.is_contiguous() {
            return Err(msg("cross-entropy: one contiguous target per row needed"));
        }
        let dev = l.device();
        let ls = l.as_cuda_slice::<bf16>()?.slice(ll.start_offset()..);
        let ts = t.as_cuda_slice::<u32>()?.slice(lt.start_offset()..);
        // 16-byte loads when every row starts 16-byte aligned (candle's allocations are).
        let vec8 = v.is_multiple_of(8) && ll.start_offset().is_multiple_of(8);
        let kernel = if vec8 { "mt_ce_loss8" } else { "mt_ce_loss" };
        let func = dev.get_or_load_custom_func(kernel, FUSED, fused_ptx()?)?;
        // SAFETY: every element is written by the kernel below (one per row).
        let out = unsafe { dev.alloc::<f32>(rows)? };
        let v32 = v as i32;
        let mut b = func.builder();
        b.arg(&ls);
        b.arg(&ts);
        b.arg(&out);
        b.arg(&v32);
        let cfg =
            LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: signature (bf16*, unsigned*, float*, int); one block per row of V logits; the
        // `8` kernel's 16-byte loads only with V % 8 == 0 and a view starting at a multiple of 8
        // elements of a 256-byte aligned allocation, so every row is 16-byte aligned.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(rows)))
    }
}

struct CeGrad;

impl CustomOp3 for CeGrad {
    cuda_only!("mt-ce-grad", 3);
    fn cuda_fwd(
        &self,
        l: &CudaStorage,
        ll: &Layout,
        t: &CudaStorage,
        lt: &Layout,
        w: &CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, v) = rows_and_t(ll, "cross-entropy logits")?;
        if lt.shape().elem_count() != rows
            || lw.shape().elem_count() != rows
            || !lt.is_contiguous()
            || !lw.is_contiguous()
        {
            return Err(msg("cross-entropy gradient: one contiguous target and weight per row needed"));
        }
        let dev = l.device();
        let ls = l.as_cuda_slice::<bf16>()?.slice(ll.start_offset()..);
        let ts = t.as_cuda_slice::<u32>()?.slice(lt.start_offset()..);
        let ws = w.as_cuda_slice::<f32>()?.slice(lw.start_offset()..);
        let vec8 = v.is_multiple_of(8) && ll.start_offset().is_multiple_of(8);
        let kernel = if vec8 { "mt_ce_grad8" } else { "mt_ce_grad" };
        let func = dev.get_or_load_custom_func(kernel, FUSED, fused_ptx()?)?;
        // SAFETY: every element is written by the kernel below.
        let out = unsafe { dev.alloc::<bf16>(rows * v)? };
        let v32 = v as i32;
        let mut b = func.builder();
        b.arg(&ls);
        b.arg(&ts);
        b.arg(&ws);
        b.arg(&out);
        b.arg(&v32);
        let cfg =
            LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: signature (bf16*, unsigned*, float*, bf16*, int); one block per row; the `8`
        // kernel's 16-byte loads and stores under the alignment conditions of `CeLoss` (`out` is
        // a fresh allocation, its rows as aligned as the logits').
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), ll.shape().clone()))
    }
}

/// Per-row cross-entropy `logsumexp(l) − l[target]` of bf16 logits `[rows, V]` (f32 `[rows]`).
pub(crate) fn ce_loss(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    logits.contiguous()?.apply_op2_no_bwd(&targets.contiguous()?, &CeLoss)
}

/// `d(w · ce)/dl = w (softmax(l) − onehot(target))` in bf16, `weights` f32 per row.
pub(crate) fn ce_grad(logits: &Tensor, targets: &Tensor, weights: &Tensor) -> candle_core::Result<Tensor> {
    logits.contiguous()?.apply_op3_no_bwd(&targets.contiguous()?, &weights.contiguous()?, &CeGrad)
}

#[cfg(test)]
mod ce_tests;

#[cfg(test)]
mod flash_tests;

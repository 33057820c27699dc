//! Flash attention on Hopper (`kernels/cuda/flash_attn_hopper.cu`): the same operation and
//! outputs as the portable kernels of `flash.rs`, on wgmma, TMA and warp-specialised CTAs, for
//! compute capability 9.0 and head dims 64 and 128. [`flash.rs`](super::flash) decides which runs.
//!
//! The source is compiled by NVRTC for `sm_90a` into a CUBIN (`nvrtc.rs`'s
//! [`compile_cubin`](super::nvrtc::compile_cubin), which refuses ptxas's warnings that the kernels
//! lost their Hopper features; a checked CUBIN is kept between processes by `cubin_cache.rs`), at
//! most once per process, and loaded once per GPU. Each launch describes Q, K, V and dO to
//! the copy engine as 4-d tensor maps (`cuTensorMapEncodeTiled`), passed by value. The backward
//! adds each query tile's dQ into an fp32 buffer `[b, heads, ⌈t / 64⌉, 64 × hd]` (what the planner
//! counts as the attention backward's extra workspace: [`crate::hopper_dq_buffer_bytes`]) in key-block order, so
//! two runs give the same bits. A call with GPT-OSS's window or sinks runs the `_ext` kernels
//! (the same code with those two arguments; the plain ones are compiled without them), and the
//! sinks' gradient by the portable file's kernel, which this CUBIN holds too.
//! `scripts/hopper_attention.py` launches the same kernels the same way for the kernel benchmark.

use candle_core::cuda_backend::cudarc::driver::sys::{
    self, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion,
    CUtensorMapSwizzle,
};
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, DevicePtr, DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Tensor};

use super::flash_launch::{
    allow_smem, backward_outputs, backward_tensors, forward_outputs, forward_tensors, launch_config, row_dot,
    sink_grad, Operands, Scalars,
};
use super::msg;
use super::nvrtc::{sm90a_runs, Cubin};
use super::sources::{COMMON, FLASH, FLASH_HOPPER, HOPPER};

/// Threads of the forward and backward kernels (`MT_HFA_THREADS`: a producer warpgroup and two
/// consumers).
const THREADS: u32 = 384;
/// Query rows of a forward CTA, keys of a backward CTA, query rows of a backward tile
/// (`MT_HFA_BM`, `MT_HFA_BN`, `MT_HFA_BQ`).
const BM: usize = 128;
const BN: usize = 128;
const BQ: usize = crate::HOPPER_BQ;
/// Forward K/V stages (`MT_HFA_FWD_STAGES`).
const FWD_STAGES: usize = 3;

/// Dynamic shared memory of the forward (`HfaFwd::SMEM`): Q, the K and V stages, barriers, the
/// tile number, and 1 KiB to align the start to 1024 bytes.
fn smem_fwd(hd: usize) -> u32 {
    let (tq, tk) = (BM * hd * 2, BN * hd * 2);
    (tq + 2 * FWD_STAGES * tk + 8 * (1 + 4 * FWD_STAGES) + 8 + 1024) as u32
}

/// Dynamic shared memory of the backward (`HfaBwd::SMEM`): K, V, two Q / dO stages, two dS^T
/// buffers, two dQ partials, the stages' LSE and D, barriers, the block number, alignment.
fn smem_bwd(hd: usize) -> u32 {
    let (tk, tq, ds, dq) = (BN * hd * 2, BQ * hd * 2, BN * BQ * 2, BQ * hd * 4);
    (2 * tk + 4 * tq + 2 * ds + 2 * dq + 4 * BQ * 4 + 8 * 9 + 8 + 1024) as u32
}

/// Whether the Hopper kernels run on `dev` for head dim `hd`: a GPU that runs sm_90a code
/// ([`sm90a_runs`]: compute capability 9.0, no `MEGATRAIN_NVRTC_CC` below 90) and head dim 64
/// or 128.
pub fn hopper_applies(dev: &CudaDevice, hd: usize) -> bool {
    sm90a_runs(dev) && matches!(hd, 64 | 128)
}

/// The CUBIN of the Hopper kernels.
static CUBIN: Cubin = Cubin::new("flash_attn_hopper.cu");

/// Its source: the portable file first (the Hopper file reuses its helpers and
/// `mt_flash_bwd_dot`), then the Hopper wrappers and the Hopper file.
fn source() -> String {
    format!(
        "#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{}\"\n{}\n#line 1 \"hopper.cuh\"\n{HOPPER}\n#line 1 \"{}\"\n{}",
        FLASH.file, FLASH.text, FLASH_HOPPER.file, FLASH_HOPPER.text
    )
}

/// The CUBIN, compiled once per process (for the test that it compiles cleanly).
#[cfg(test)]
pub(super) fn compiled_cubin() -> candle_core::Result<&'static [u8]> {
    CUBIN.bytes(source)
}

/// `name` of the module loaded on `dev`'s GPU (once per GPU of the process).
fn function(dev: &CudaDevice, name: &str) -> candle_core::Result<CudaFunction> {
    CUBIN.function(dev, name, source)
}

/// A CUtensorMap: 128 opaque bytes the kernel takes by value (`MtTmaMap`).
#[repr(C, align(128))]
#[derive(Clone, Copy)]
struct TmaMap([u64; 16]);

// SAFETY: plain bytes, `#[repr(C)]`, passed by value as the kernels' `const __grid_constant__
// MtTmaMap` parameters (128 bytes; the kernel's type is 64-byte aligned, this one more).
unsafe impl DeviceRepr for TmaMap {}

/// The tensor map of a `[b, t, heads, hd]` bf16 tensor at `ptr` for boxes of `rows` x 64:
/// dimensions {hd, heads, t, b} innermost first, 128-byte swizzle (the layout the kernels'
/// descriptors read), zeros past the end.
fn tensor_map(
    ptr: u64,
    b: usize,
    t: usize,
    heads: usize,
    hd: usize,
    rows: usize,
) -> candle_core::Result<TmaMap> {
    let mut map = TmaMap([0; 16]);
    let dims: [u64; 4] = [hd as u64, heads as u64, t as u64, b as u64];
    let strides: [u64; 3] = [(hd * 2) as u64, (heads * hd * 2) as u64, (t * heads * hd * 2) as u64];
    let boxes: [u32; 4] = [64, 1, rows as u32, 1];
    let elem_strides: [u32; 4] = [1; 4];
    // SAFETY: `map` is 128 writable bytes aligned to 128 (the driver asks for 64); the arrays are
    // the rank (4) long, strides rank - 1; `ptr` is a live device allocation of b·t·heads·hd bf16
    // (the caller's view), which the driver only records.
    let rc = unsafe {
        sys::cuTensorMapEncodeTiled(
            (&mut map as *mut TmaMap).cast(),
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            4,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if rc != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(msg(format!(
            "flash attention: the copy engine cannot describe a [{b}, {t}, {heads}, {hd}] tensor ({rc:?})"
        )));
    }
    Ok(map)
}

/// `name`'s function with its dynamic shared memory limit raised to `smem`.
fn kernel(dev: &CudaDevice, name: &str, smem: u32) -> candle_core::Result<CudaFunction> {
    let f = function(dev, name)?;
    allow_smem(&f, smem)?;
    Ok(f)
}

/// Forward (`flash.rs`'s contract): `(o [b, t, nh, hd] bf16, lse [b, nh, t] f32)`.
pub(super) fn forward(dev: &CudaDevice, operands: &Operands<'_>) -> candle_core::Result<(Tensor, Tensor)> {
    let shape @ (b, t, nh, nkv, hd) = operands.dims();
    let st = dev.cuda_stream();
    let x = operands.views()?;
    // SAFETY: every element is written by the kernel (rows < t of every head).
    let (o, lse) = unsafe { forward_outputs(dev, shape)? };
    // The CTAs take their tiles from this counter as they start.
    let counter = dev.alloc_zeros::<i32>(1)?;
    let (qp, _gq) = x.q.device_ptr(&st);
    let (kp, _gk) = x.k.device_ptr(&st);
    let (vp, _gv) = x.v.device_ptr(&st);
    let (tq, tk, tv) = (
        tensor_map(qp, b, t, nh, hd, BM)?,
        tensor_map(kp, b, t, nkv, hd, BN)?,
        tensor_map(vp, b, t, nkv, hd, BN)?,
    );
    let sm = smem_fwd(hd);
    let ext = operands.has_extras();
    let f = kernel(dev, &format!("mt_hfa_fwd{}_hd{hd}", if ext { "_ext" } else { "" }), sm)?;
    let s = Scalars::new(shape);
    let mut a = st.launch_builder(&f);
    a.arg(&tq);
    a.arg(&tk);
    a.arg(&tv);
    a.arg(&o);
    a.arg(&lse);
    x.push_starts(&mut a);
    if ext {
        x.push_sinks(&mut a);
        a.arg(&x.window);
    }
    s.push_sizes(&mut a, true);
    a.arg(&s.scale_log2);
    a.arg(&counter);
    let tiles = t.div_ceil(BM) * nh * b;
    let cfg = launch_config((tiles as u32, 1, 1), THREADS, sm);
    // SAFETY: signature (MtTmaMap Q, K, V by value, bf16* O, float* LSE, int* seg_lo or null,
    // with `_ext` float* sinks or null and int window, then int T, B, NH, NKV, float scale_log2,
    // int* counter); the maps describe q, k, v as checked by `views` (the views stay borrowed,
    // their guards alive, until after the launch); O holds b·t·nh·hd, LSE b·nh·t, seg_lo b·t,
    // sinks nh; one CTA per 128-row tile of each head, each taking a distinct tile from the
    // zeroed counter; `sm` bytes of shared memory, allowed above.
    unsafe { a.launch(cfg) }.w()?;
    Ok(forward_tensors(dev, shape, (o, lse)))
}

/// Backward (`flash.rs`'s contract): `(dq [b, t, nh, hd], dk, dv [b, t, nkv, hd])`, bf16, and
/// with sinks their gradient (f32 `[nh]`, a fixed order). With `ordered` each dQ tile takes its
/// key blocks' partials in block order (bitwise repeatable); without, in the order they arrive.
pub(super) fn backward(
    dev: &CudaDevice,
    operands: &Operands<'_>,
    ordered: bool,
) -> candle_core::Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    let shape @ (b, t, nh, nkv, hd) = operands.dims();
    let st = dev.cuda_stream();
    let x = operands.views()?;
    let (_, lv, dov) = x.grad()?;
    // D = rowsum(dO ⊙ O), the portable file's kernel.
    let d = row_dot(dev, &st, &function(dev, "mt_flash_bwd_dot")?, &x, shape)?;

    // The fp32 dQ buffer and, before it, the block counter and one turn counter per dQ tile.
    let nqt = t.div_ceil(BQ);
    let acc_len = b * nh * nqt * BQ * hd;
    let dq_acc = if ordered {
        // SAFETY: ordered, every tile's first adder (the lowest key block that sees it, which
        // always walks it) stores its whole 64 x hd partial before any other adds (the turn
        // counters order them), so no element is read before it is written.
        unsafe { dev.alloc::<f32>(acc_len)? }
    } else {
        dev.alloc_zeros::<f32>(acc_len)?
    };
    let sync = dev.alloc_zeros::<i32>(1 + b * nh * nqt)?;
    // SAFETY: every element of each is written by the kernels below (rows < t of every head): dk
    // and dv by the backward, dq by the convert kernel.
    let [dq, dk, dv] = unsafe { backward_outputs(dev, shape)? };
    let (qp, _gq) = x.q.device_ptr(&st);
    let (kp, _gk) = x.k.device_ptr(&st);
    let (vp, _gv) = x.v.device_ptr(&st);
    let (dop, _gdo) = dov.device_ptr(&st);
    let maps = [
        tensor_map(qp, b, t, nh, hd, BQ)?,
        tensor_map(kp, b, t, nkv, hd, BN)?,
        tensor_map(vp, b, t, nkv, hd, BN)?,
        tensor_map(dop, b, t, nh, hd, BQ)?,
    ];
    let s = Scalars::new(shape);
    let deterministic = i32::from(ordered);
    let sm = smem_bwd(hd);
    let ext = operands.has_extras();
    let f = kernel(dev, &format!("mt_hfa_bwd{}_hd{hd}", if ext { "_ext" } else { "" }), sm)?;
    let mut a = st.launch_builder(&f);
    for m in &maps {
        a.arg(m);
    }
    a.arg(lv);
    a.arg(&d);
    a.arg(&dq_acc);
    a.arg(&sync);
    a.arg(&dk);
    a.arg(&dv);
    x.push_bounds(&mut a)?;
    if ext {
        a.arg(&x.window);
    }
    s.push_sizes(&mut a, true);
    a.arg(&s.scale);
    a.arg(&s.scale_log2);
    a.arg(&deterministic);
    let blocks = t.div_ceil(BN) * nkv * b;
    let cfg = launch_config((blocks as u32, 1, 1), THREADS, sm);
    // SAFETY: signature (MtTmaMap Q, K, V, dO by value, float* LSE, D, dQ buffer, int* sync, bf16* dK,
    // dV, int* seg_lo, seg_hi (both or neither null), with `_ext` int window, then int T, B, NH, NKV,
    // float scale, scale_log2, int deterministic); the maps describe q, k, v, dO as checked by `views`
    // (their guards alive until after the launch); LSE and D hold b·nh·t, the dQ buffer b·nh·⌈t/64⌉·64·hd
    // (zeroed when unordered; ordered, each tile's first adder stores), sync 1 + b·nh·⌈t/64⌉ zeroed (the
    // block counter, then each tile's turn), dK/dV b·t·nkv·hd; one CTA per 128-key block of each KV head,
    // each taking a distinct block from the counter as it starts, so the ordered adds wait only for CTAs
    // already running; `sm` bytes of shared memory, allowed above.
    unsafe { a.launch(cfg) }.w()?;

    let groups = b * t * nh * hd / 8;
    let f = function(dev, &format!("mt_hfa_dq_convert_hd{hd}"))?;
    let mut a = st.launch_builder(&f);
    a.arg(&dq_acc);
    a.arg(&dq);
    a.arg(&s.t);
    a.arg(&s.nh);
    a.arg(&s.scale);
    let groups64 = groups as i64;
    a.arg(&groups64);
    let cfg = launch_config((groups.div_ceil(256) as u32, 1, 1), 256, 0);
    // SAFETY: signature (float* buffer, bf16* dQ, int T, NH, float scale, long long groups); one
    // thread per 8 elements of dQ (b·t·nh·hd of them), reading the buffer filled above.
    unsafe { a.launch(cfg) }.w()?;
    let dsinks = match &x.sinks {
        Some(sinks) => Some(sink_grad(dev, &function(dev, "mt_flash_sink_grad")?, &x, sinks, &d, &s)?),
        None => None,
    };
    let (dq, dk, dv) = backward_tensors(dev, shape, [dq, dk, dv]);
    Ok((dq, dk, dv, dsinks))
}

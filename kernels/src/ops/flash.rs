//! Flash attention: the forward (output and each row's log-sum-exp) and the deterministic
//! backward for bf16 `[b, t, heads, hd]` tensors, causal, grouped-query, with optional
//! packed-document bounds, by one of two sets of kernels ([`FlashKernel`]):
//! - the Hopper kernels (`flash_hopper.rs`: wgmma, TMA, warp specialisation; compute capability
//!   9.0, head dims 64 and 128), the choice wherever they run;
//! - the portable kernels here (`kernels/cuda/flash_attn.cu`: mma.sync, compute capability 8.0
//!   and later, head dims 16 to 128): `D = rowsum(dO ⊙ O)`, then dK/dV per key tile and dQ per
//!   query tile, no atomics. Launch geometry and shared memory as the kernels' header comment
//!   states.
//!
//! `scripts/attention_bench.py` launches both the same way.

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Shape, Storage, Tensor};
use half::bf16;

use super::flash_hopper;
use super::msg;
use super::sources::FLASH;
use crate::{flash_head_dim, FlashKernel};

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

pub(super) fn cuda_dev(t: &Tensor) -> candle_core::Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        _ => Err(msg("flash attention: tensors must be on a CUDA device")),
    }
}

/// A contiguous CUDA tensor's elements, checked for dtype and shape.
pub(super) fn view<'a, T: CudaDType>(
    st: &'a Storage,
    t: &Tensor,
    dtype: DType,
    dims: &[usize],
    what: &str,
) -> candle_core::Result<CudaView<'a, T>> {
    let l = t.layout();
    if t.dtype() != dtype || t.dims() != dims || !l.is_contiguous() {
        return Err(msg(format!(
            "flash attention: {what} must be a contiguous {dtype:?} tensor of shape {dims:?}, found {:?} {:?}",
            t.dtype(),
            t.dims()
        )));
    }
    match st {
        Storage::Cuda(cs) => Ok(cs.as_cuda_slice::<T>()?.slice(l.start_offset()..)),
        _ => Err(msg(format!("flash attention: {what} is not on the CUDA device"))),
    }
}

pub(super) fn wrap<T: CudaDType>(s: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// Raises `f`'s dynamic shared memory limit to `smem` bytes where it is above the default 48 KiB.
fn allow_smem(f: &CudaFunction, smem: u32) -> candle_core::Result<()> {
    if smem > 48 * 1024 {
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .w()?;
    }
    Ok(())
}

/// `(b, t, nh, nkv, hd)` of `q: [b, t, nh, hd]`, `k: [b, t, nkv, hd]`, checked.
fn dims(q: &Tensor, k: &Tensor) -> candle_core::Result<(usize, usize, usize, usize, usize)> {
    let (b, t, nh, hd) = q.dims4()?;
    let (_, _, nkv, _) = k.dims4()?;
    if nkv == 0 || nh % nkv != 0 || !flash_head_dim(hd) || t >= i32::MAX as usize || b > 65535 || nh > 65535 {
        return Err(msg(format!(
            "flash attention: {nh} query heads over {nkv} KV heads of head dim {hd} and {b} x {t} tokens are not supported (head dim 16, 32, 64 or 128; heads a multiple of KV heads)"
        )));
    }
    Ok((b, t, nh, nkv, hd))
}

pub(super) fn scales(hd: usize) -> (f32, f32) {
    let scale = 1.0 / (hd as f64).sqrt();
    (scale as f32, (scale * std::f64::consts::LOG2_E) as f32)
}

/// A null device pointer, for the absent document bounds.
pub(super) const NULL: u64 = 0;

/// Whether `kernel` means the Hopper kernels for `q`'s device and head dim `hd`; an error where
/// they were asked for and cannot run.
fn hopper(q: &Tensor, hd: usize, kernel: FlashKernel) -> candle_core::Result<bool> {
    let dev = cuda_dev(q)?;
    match kernel {
        FlashKernel::Portable => Ok(false),
        FlashKernel::Auto => Ok(flash_hopper::hopper_applies(&dev, hd)),
        FlashKernel::Hopper if flash_hopper::hopper_applies(&dev, hd) => Ok(true),
        FlashKernel::Hopper => Err(msg(format!(
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
    let (b, t, nh, nkv, hd) = dims(q, k)?;
    if hopper(q, hd, kernel)? {
        return flash_hopper::forward(q, k, v, docs, (b, t, nh, nkv, hd));
    }
    let dev = cuda_dev(q)?;
    let (qs, _) = q.storage_and_layout();
    let (ks, _) = k.storage_and_layout();
    let (vs, _) = v.storage_and_layout();
    let qv = view::<bf16>(&qs, q, DType::BF16, &[b, t, nh, hd], "q")?;
    let kv = view::<bf16>(&ks, k, DType::BF16, &[b, t, nkv, hd], "k")?;
    let vv = view::<bf16>(&vs, v, DType::BF16, &[b, t, nkv, hd], "v")?;
    let lo_st = docs.map(|(lo, _)| lo.storage_and_layout());
    let lo_v = match (&lo_st, docs) {
        (Some((st, _)), Some((lo, _))) => Some(view::<u32>(st, lo, DType::U32, &[b, t], "document starts")?),
        _ => None,
    };
    // SAFETY: every element of both is written by the kernel below (rows < t of every head).
    let o = unsafe { dev.alloc::<bf16>(b * t * nh * hd)? };
    // SAFETY: as above, one value per (sequence, head, row).
    let lse = unsafe { dev.alloc::<f32>(b * nh * t)? };
    let sm = smem("fwd", hd);
    let f = dev.get_or_load_custom_func(&format!("mt_flash_fwd_hd{hd}"), FLASH.module, FLASH.ptx()?)?;
    allow_smem(&f, sm)?;
    let (_, sl2) = scales(hd);
    let (t32, nh32, nkv32) = (t as i32, nh as i32, nkv as i32);
    let mut a = f.builder();
    a.arg(&qv);
    a.arg(&kv);
    a.arg(&vv);
    a.arg(&o);
    a.arg(&lse);
    match &lo_v {
        Some(lo) => a.arg(lo),
        None => a.arg(&NULL),
    };
    a.arg(&t32);
    a.arg(&nh32);
    a.arg(&nkv32);
    a.arg(&sl2);
    let cfg = LaunchConfig {
        grid_dim: (t.div_ceil(128) as u32, nh as u32, b as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: sm,
    };
    // SAFETY: signature (bf16* Q, K, V, O, float* LSE, int* seg_lo or null, int T, NH, NKV,
    // float); Q/O hold b·t·nh·hd, K/V b·t·nkv·hd, LSE b·nh·t, seg_lo b·t elements (checked
    // above), every index the kernel forms is below those (64-bit offsets); `sm` bytes of
    // shared memory as the kernel lays it out, allowed above.
    unsafe { a.launch(cfg) }.w()?;
    Ok((wrap(o, &dev, (b, t, nh, hd)), wrap(lse, &dev, (b, nh, t))))
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
    let (b, t, nh, nkv, hd) = dims(q, k)?;
    if hopper(q, hd, kernel)? {
        return flash_hopper::backward(q, k, v, o, lse, d_o, docs, (b, t, nh, nkv, hd));
    }
    let dev = cuda_dev(q)?;
    let (qs, _) = q.storage_and_layout();
    let (ks, _) = k.storage_and_layout();
    let (vs, _) = v.storage_and_layout();
    let (os, _) = o.storage_and_layout();
    let (ls, _) = lse.storage_and_layout();
    let (ds, _) = d_o.storage_and_layout();
    let qv = view::<bf16>(&qs, q, DType::BF16, &[b, t, nh, hd], "q")?;
    let kv = view::<bf16>(&ks, k, DType::BF16, &[b, t, nkv, hd], "k")?;
    let vv = view::<bf16>(&vs, v, DType::BF16, &[b, t, nkv, hd], "v")?;
    let ov = view::<bf16>(&os, o, DType::BF16, &[b, t, nh, hd], "o")?;
    let lv = view::<f32>(&ls, lse, DType::F32, &[b, nh, t], "lse")?;
    let dov = view::<bf16>(&ds, d_o, DType::BF16, &[b, t, nh, hd], "d_o")?;
    let lo_st = docs.map(|(lo, hi)| (lo.storage_and_layout(), hi.storage_and_layout()));
    let bounds = match (&lo_st, docs) {
        (Some(((lst, _), (hst, _))), Some((lo, hi))) => Some((
            view::<u32>(lst, lo, DType::U32, &[b, t], "document starts")?,
            view::<u32>(hst, hi, DType::U32, &[b, t], "document ends")?,
        )),
        _ => None,
    };
    let rows = b * t * nh;
    // SAFETY: one value per (sequence, token, head) row, every one written by the first kernel.
    let d = unsafe { dev.alloc::<f32>(rows)? };
    let (t32, nh32, nkv32, hd32, rows64) = (t as i32, nh as i32, nkv as i32, hd as i32, rows as i64);
    let f = dev.get_or_load_custom_func("mt_flash_bwd_dot", FLASH.module, FLASH.ptx()?)?;
    let mut a = f.builder();
    a.arg(&dov);
    a.arg(&ov);
    a.arg(&d);
    a.arg(&t32);
    a.arg(&nh32);
    a.arg(&hd32);
    a.arg(&rows64);
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil((THREADS / 32) as usize) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: signature (bf16* dO, O, float* D, int T, NH, HD, long long rows); one warp per
    // row of hd elements, `rows` of them in dO and O, D holds `rows`.
    unsafe { a.launch(cfg) }.w()?;

    let (scale, sl2) = scales(hd);
    // SAFETY: every element of each is written by the kernels below (rows < t of every head).
    let dq = unsafe { dev.alloc::<bf16>(b * t * nh * hd)? };
    // SAFETY: as above.
    let dk = unsafe { dev.alloc::<bf16>(b * t * nkv * hd)? };
    // SAFETY: as above.
    let dv = unsafe { dev.alloc::<bf16>(b * t * nkv * hd)? };
    let tiles = t.div_ceil(64) as u32;
    let sm = smem("dkdv", hd);
    let f = dev.get_or_load_custom_func(&format!("mt_flash_bwd_dkdv_hd{hd}"), FLASH.module, FLASH.ptx()?)?;
    allow_smem(&f, sm)?;
    let mut a = f.builder();
    a.arg(&qv);
    a.arg(&kv);
    a.arg(&vv);
    a.arg(&dov);
    a.arg(&lv);
    a.arg(&d);
    a.arg(&dk);
    a.arg(&dv);
    match &bounds {
        Some((lo, hi)) => {
            a.arg(lo);
            a.arg(hi);
        }
        None => {
            a.arg(&NULL);
            a.arg(&NULL);
        }
    }
    a.arg(&t32);
    a.arg(&nh32);
    a.arg(&nkv32);
    a.arg(&scale);
    a.arg(&sl2);
    let cfg = LaunchConfig {
        grid_dim: (tiles, nkv as u32, b as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: sm,
    };
    // SAFETY: signature (bf16* Q, K, V, dO, float* LSE, D, bf16* dK, dV, int* seg_lo, seg_hi
    // (both or neither null), int T, NH, NKV, float scale, scale_log2); sizes as checked above
    // (dK/dV b·t·nkv·hd, LSE and D b·nh·t); `sm` bytes of shared memory, allowed above.
    unsafe { a.launch(cfg) }.w()?;

    let sm = smem("dq", hd);
    let f = dev.get_or_load_custom_func(&format!("mt_flash_bwd_dq_hd{hd}"), FLASH.module, FLASH.ptx()?)?;
    allow_smem(&f, sm)?;
    let mut a = f.builder();
    a.arg(&qv);
    a.arg(&kv);
    a.arg(&vv);
    a.arg(&dov);
    a.arg(&lv);
    a.arg(&d);
    a.arg(&dq);
    match &bounds {
        Some((lo, _)) => a.arg(lo),
        None => a.arg(&NULL),
    };
    a.arg(&t32);
    a.arg(&nh32);
    a.arg(&nkv32);
    a.arg(&scale);
    a.arg(&sl2);
    let cfg = LaunchConfig {
        grid_dim: (tiles, nh as u32, b as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: sm,
    };
    // SAFETY: signature (bf16* Q, K, V, dO, float* LSE, D, bf16* dQ, int* seg_lo or null, int T,
    // NH, NKV, float scale, scale_log2); dQ holds b·t·nh·hd; `sm` bytes, allowed above.
    unsafe { a.launch(cfg) }.w()?;
    Ok((wrap(dq, &dev, (b, t, nh, hd)), wrap(dk, &dev, (b, t, nkv, hd)), wrap(dv, &dev, (b, t, nkv, hd))))
}

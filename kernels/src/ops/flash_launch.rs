//! What both flash attention kernel sets (the portable one of `flash.rs`, the Hopper one of
//! `flash_hopper.rs`) share around their launches: the shape check, the operands read-locked and
//! viewed with their dtype and shape checked, the document bounds or null pointers, the output
//! buffers, the launch configuration, and the backward's first kernel (`D = rowsum(dO ⊙ O)`,
//! which the Hopper module compiles from the portable file too). GPT-OSS's sliding window and
//! sink logits ([`FlashExtras`]) are checked and pushed here, and their gradient launched.

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Shape, Storage, StorageRef, Tensor};
use half::bf16;

use super::msg;
use crate::flash_head_dim;

/// GPT-OSS's additions to a flash attention call (none by default): a sliding window and a sink
/// logit per query head. The portable kernels take both; the Hopper ones neither yet.
#[derive(Debug, Clone, Copy, Default)]
pub struct FlashExtras<'a> {
    /// The keys a query sees, itself included: key `j` is visible to query `i` iff
    /// `i - window < j <= i` (and, with documents, in its document). `None`: every earlier key.
    pub window: Option<usize>,
    /// One logit per query head, f32 `[nh]` on the device (natural log, not scaled by
    /// `hd^-1/2`): one more term `e^{s_h}` in each of head `h`'s softmax denominators, with no
    /// value vector. The forward's LSE includes it; the backward returns its gradient.
    pub sinks: Option<&'a Tensor>,
}

impl FlashExtras<'_> {
    /// Whether the call has neither a window nor sinks.
    pub fn is_none(&self) -> bool {
        self.window.is_none() && self.sinks.is_none()
    }
}

/// `(b, t, nh, nkv, hd)`: sequences, tokens, query heads, KV heads, head dim.
pub(super) type Dims = (usize, usize, usize, usize, usize);

/// A null device pointer, for the absent document bounds.
const NULL: u64 = 0;

/// The CUDA device `t` is on, or an error saying the tensors must be on one.
pub(super) fn cuda_dev(t: &Tensor) -> candle_core::Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        _ => Err(msg("flash attention: tensors must be on a CUDA device")),
    }
}

/// The [`Dims`] of `q: [b, t, nh, hd]`, `k: [b, t, nkv, hd]`, checked against what the kernels
/// (both sets) take.
pub(super) fn dims(q: &Tensor, k: &Tensor) -> candle_core::Result<Dims> {
    let (b, t, nh, hd) = q.dims4()?;
    let (_, _, nkv, _) = k.dims4()?;
    if nkv == 0 || nh % nkv != 0 || !flash_head_dim(hd) || t >= i32::MAX as usize || b > 65535 || nh > 65535 {
        return Err(msg(format!(
            "flash attention: {nh} query heads over {nkv} KV heads of head dim {hd} and {b} x {t} tokens are not supported (head dim 16, 32, 64 or 128; heads a multiple of KV heads)"
        )));
    }
    Ok((b, t, nh, nkv, hd))
}

/// The scalar arguments of the kernels, in the C types they take.
pub(super) struct Scalars {
    pub(super) t: i32,
    pub(super) b: i32,
    pub(super) nh: i32,
    pub(super) nkv: i32,
    pub(super) hd: i32,
    /// The softmax scale `1 / sqrt(hd)`.
    pub(super) scale: f32,
    /// The same times `log2(e)` (the kernels' `exp2` domain).
    pub(super) scale_log2: f32,
}

impl Scalars {
    /// The scalars of a call of [`Dims`] (each below `i32::MAX`: [`dims`] checked them).
    pub(super) fn new((b, t, nh, nkv, hd): Dims) -> Self {
        let scale = 1.0 / (hd as f64).sqrt();
        Scalars {
            t: t as i32,
            b: b as i32,
            nh: nh as i32,
            nkv: nkv as i32,
            hd: hd as i32,
            scale: scale as f32,
            scale_log2: (scale * std::f64::consts::LOG2_E) as f32,
        }
    }

    /// Pushes `int T, NH, NKV`, or `int T, B, NH, NKV` for the Hopper kernels (whose grid is
    /// one-dimensional, the sequence counted in the tile number).
    pub(super) fn push_sizes<'b>(&'b self, a: &mut LaunchArgs<'b>, with_b: bool) {
        a.arg(&self.t);
        if with_b {
            a.arg(&self.b);
        }
        a.arg(&self.nh);
        a.arg(&self.nkv);
    }
}

/// A contiguous CUDA tensor's elements (`st`, its read-locked storage), checked for dtype and
/// shape; `op` and `what` name the operation and the argument in the error.
pub(super) fn view<'a, T: CudaDType>(
    st: &'a Storage,
    t: &Tensor,
    dtype: DType,
    dims: &[usize],
    (op, what): (&str, &str),
) -> candle_core::Result<CudaView<'a, T>> {
    let l = t.layout();
    if t.dtype() != dtype || t.dims() != dims || !l.is_contiguous() {
        return Err(msg(format!(
            "{op}: {what} must be a contiguous {dtype:?} tensor of shape {dims:?}, found {:?} {:?}",
            t.dtype(),
            t.dims()
        )));
    }
    match st {
        Storage::Cuda(cs) => Ok(cs.as_cuda_slice::<T>()?.slice(l.start_offset()..)),
        _ => Err(msg(format!("{op}: {what} is not on the CUDA device"))),
    }
}

/// A tensor with its storage read-locked, so that views of it live through the launches.
struct Held<'t> {
    t: &'t Tensor,
    st: StorageRef<'t>,
}

impl<'t> Held<'t> {
    fn new(t: &'t Tensor) -> Self {
        Held { t, st: t.storage_and_layout().0 }
    }

    fn view<T: CudaDType>(
        &self,
        dtype: DType,
        dims: &[usize],
        what: &str,
    ) -> candle_core::Result<CudaView<'_, T>> {
        view(&self.st, self.t, dtype, dims, ("flash attention", what))
    }
}

/// The operands of a forward and of a backward: q, k, v, the document bounds (`[b, t]` u32,
/// each token's document's first and one-past-last index), the window and the sinks of both;
/// o, lse and d_o of a backward.
pub(super) struct Operands<'t> {
    dims: Dims,
    q: Held<'t>,
    k: Held<'t>,
    v: Held<'t>,
    starts: Option<Held<'t>>,
    ends: Option<Held<'t>>,
    /// The kernels' `int window`: 0 for none, else the window clamped to `t` (the same mask).
    window: i32,
    sinks: Option<Held<'t>>,
    grad: Option<[Held<'t>; 3]>,
}

/// The checked views of [`Operands`] (`o`, `lse`, `d_o` only of a backward's).
pub(super) struct Views<'a> {
    pub(super) q: CudaView<'a, bf16>,
    pub(super) k: CudaView<'a, bf16>,
    pub(super) v: CudaView<'a, bf16>,
    starts: Option<CudaView<'a, u32>>,
    ends: Option<CudaView<'a, u32>>,
    /// The kernels' `int window` (0: none).
    pub(super) window: i32,
    pub(super) sinks: Option<CudaView<'a, f32>>,
    grad: Option<(CudaView<'a, bf16>, CudaView<'a, f32>, CudaView<'a, bf16>)>,
}

impl<'t> Operands<'t> {
    /// A forward's operands; an error for a window of no keys.
    pub(super) fn forward(
        q: &'t Tensor,
        k: &'t Tensor,
        v: &'t Tensor,
        docs: Option<(&'t Tensor, &'t Tensor)>,
        extras: FlashExtras<'t>,
        dims: Dims,
    ) -> candle_core::Result<Self> {
        let window = match extras.window {
            None => 0,
            Some(0) => {
                return Err(msg(
                    "flash attention: a sliding window must hold at least one key (the query's own)",
                ))
            }
            // `dims` checked t < i32::MAX; a window past the sequence masks nothing more.
            Some(w) => w.min(dims.1) as i32,
        };
        let (q, k, v, starts) = (Held::new(q), Held::new(k), Held::new(v), docs.map(|(lo, _)| Held::new(lo)));
        let sinks = extras.sinks.map(Held::new);
        Ok(Operands { dims, q, k, v, starts, ends: None, window, sinks, grad: None })
    }

    /// A backward's operands: the forward's, its output `o` and `lse`, and `d_o = dL/do`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward(
        q: &'t Tensor,
        k: &'t Tensor,
        v: &'t Tensor,
        o: &'t Tensor,
        lse: &'t Tensor,
        d_o: &'t Tensor,
        docs: Option<(&'t Tensor, &'t Tensor)>,
        extras: FlashExtras<'t>,
        dims: Dims,
    ) -> candle_core::Result<Self> {
        let fwd = Self::forward(q, k, v, docs, extras, dims)?;
        let grad = Some([Held::new(o), Held::new(lse), Held::new(d_o)]);
        Ok(Operands { ends: docs.map(|(_, hi)| Held::new(hi)), grad, ..fwd })
    }

    /// Whether the call has a window or sinks (the Hopper set's `_ext` kernels take them).
    pub(super) fn has_extras(&self) -> bool {
        self.window != 0 || self.sinks.is_some()
    }

    /// The call's shape.
    pub(super) fn dims(&self) -> Dims {
        self.dims
    }

    /// Every operand viewed, each checked to be a contiguous CUDA tensor of its dtype and shape:
    /// q, o, d_o `[b, t, nh, hd]` bf16, k, v `[b, t, nkv, hd]` bf16, lse `[b, nh, t]` f32, the
    /// document bounds `[b, t]` u32 (a forward reads only the starts), the sinks `[nh]` f32.
    pub(super) fn views(&self) -> candle_core::Result<Views<'_>> {
        let (b, t, nh, nkv, hd) = self.dims;
        let (bf, q_dims, kv_dims) = (DType::BF16, [b, t, nh, hd], [b, t, nkv, hd]);
        let q = self.q.view(bf, &q_dims, "q")?;
        let k = self.k.view(bf, &kv_dims, "k")?;
        let v = self.v.view(bf, &kv_dims, "v")?;
        let grad = match &self.grad {
            Some([o, lse, d_o]) => Some((
                o.view(bf, &q_dims, "o")?,
                lse.view(DType::F32, &[b, nh, t], "lse")?,
                d_o.view(bf, &q_dims, "d_o")?,
            )),
            None => None,
        };
        let starts =
            self.starts.as_ref().map(|h| h.view(DType::U32, &[b, t], "document starts")).transpose()?;
        let ends = self.ends.as_ref().map(|h| h.view(DType::U32, &[b, t], "document ends")).transpose()?;
        let sinks = self.sinks.as_ref().map(|h| h.view(DType::F32, &[nh], "sinks")).transpose()?;
        Ok(Views { q, k, v, starts, ends, window: self.window, sinks, grad })
    }
}

impl<'a> Views<'a> {
    /// A backward's `(o, lse, d_o)`.
    pub(super) fn grad(
        &self,
    ) -> candle_core::Result<&(CudaView<'a, bf16>, CudaView<'a, f32>, CudaView<'a, bf16>)> {
        self.grad.as_ref().ok_or_else(|| msg("flash attention: the forward's operands have no o, lse or d_o"))
    }

    /// Pushes the document starts, or a null pointer for sequences of one document.
    pub(super) fn push_starts<'b>(&'b self, a: &mut LaunchArgs<'b>) {
        match &self.starts {
            Some(lo) => a.arg(lo),
            None => a.arg(&NULL),
        };
    }

    /// Pushes the sinks, or a null pointer for none.
    pub(super) fn push_sinks<'b>(&'b self, a: &mut LaunchArgs<'b>) {
        match &self.sinks {
            Some(s) => a.arg(s),
            None => a.arg(&NULL),
        };
    }

    /// Pushes the document starts and ends, or two null pointers (a backward's views: a
    /// forward's hold no ends).
    pub(super) fn push_bounds<'b>(&'b self, a: &mut LaunchArgs<'b>) -> candle_core::Result<()> {
        match (&self.starts, &self.ends) {
            (Some(lo), Some(hi)) => {
                a.arg(lo);
                a.arg(hi);
            }
            (None, None) => {
                a.arg(&NULL);
                a.arg(&NULL);
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(msg("flash attention: document starts without ends (a forward's operands)"))
            }
        }
        Ok(())
    }
}

/// `grid` blocks of `threads` threads with `smem` bytes of dynamic shared memory.
pub(super) fn launch_config(grid: (u32, u32, u32), threads: u32, smem: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: smem }
}

/// Raises `f`'s dynamic shared memory limit to `smem` bytes where it is above the default 48 KiB.
pub(super) fn allow_smem(f: &CudaFunction, smem: u32) -> candle_core::Result<()> {
    if smem > 48 * 1024 {
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .w()?;
    }
    Ok(())
}

/// A forward's outputs, `(o [b, t, nh, hd] bf16, lse [b, nh, t] f32)`, not initialised.
///
/// # Safety
/// The caller's kernel writes every element of both (rows < t of every head) before anything
/// reads them.
pub(super) unsafe fn forward_outputs(
    dev: &CudaDevice,
    (b, t, nh, _, hd): Dims,
) -> candle_core::Result<(CudaSlice<bf16>, CudaSlice<f32>)> {
    // SAFETY: the caller's contract: every element is written before it is read.
    let o = unsafe { dev.alloc::<bf16>(b * t * nh * hd)? };
    // SAFETY: as above, one value per (sequence, head, row).
    let lse = unsafe { dev.alloc::<f32>(b * nh * t)? };
    Ok((o, lse))
}

/// A backward's outputs, `(dq [b, t, nh, hd], dk, dv [b, t, nkv, hd])` bf16, not initialised.
///
/// # Safety
/// The caller's kernels write every element of each (rows < t of every head) before anything
/// reads them.
pub(super) unsafe fn backward_outputs(
    dev: &CudaDevice,
    (b, t, nh, nkv, hd): Dims,
) -> candle_core::Result<[CudaSlice<bf16>; 3]> {
    // SAFETY: the caller's contract: every element is written before it is read.
    let dq = unsafe { dev.alloc::<bf16>(b * t * nh * hd)? };
    // SAFETY: as above.
    let dk = unsafe { dev.alloc::<bf16>(b * t * nkv * hd)? };
    // SAFETY: as above.
    let dv = unsafe { dev.alloc::<bf16>(b * t * nkv * hd)? };
    Ok([dq, dk, dv])
}

pub(super) fn wrap<T: CudaDType>(s: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// The forward's outputs as tensors.
pub(super) fn forward_tensors(
    dev: &CudaDevice,
    (b, t, nh, _, hd): Dims,
    (o, lse): (CudaSlice<bf16>, CudaSlice<f32>),
) -> (Tensor, Tensor) {
    (wrap(o, dev, (b, t, nh, hd)), wrap(lse, dev, (b, nh, t)))
}

/// The backward's outputs as tensors, `(dq, dk, dv)`.
pub(super) fn backward_tensors(
    dev: &CudaDevice,
    (b, t, nh, nkv, hd): Dims,
    [dq, dk, dv]: [CudaSlice<bf16>; 3],
) -> (Tensor, Tensor, Tensor) {
    (wrap(dq, dev, (b, t, nh, hd)), wrap(dk, dev, (b, t, nkv, hd)), wrap(dv, dev, (b, t, nkv, hd)))
}

/// The backward's first kernel, `D = rowsum(dO ⊙ O)`: one f32 per (sequence, token, head) row,
/// by `f` (`mt_flash_bwd_dot` of the module the caller loaded) on `stream`, one warp per row.
pub(super) fn row_dot(
    dev: &CudaDevice,
    stream: &CudaStream,
    f: &CudaFunction,
    x: &Views<'_>,
    shape @ (b, t, nh, _, _): Dims,
) -> candle_core::Result<CudaSlice<f32>> {
    let (o, _, d_o) = x.grad()?;
    let rows = b * t * nh;
    // SAFETY: one value per row, every one written by the kernel below.
    let d = unsafe { dev.alloc::<f32>(rows)? };
    let (s, rows64) = (Scalars::new(shape), rows as i64);
    let mut a = stream.launch_builder(f);
    a.arg(d_o);
    a.arg(o);
    a.arg(&d);
    a.arg(&s.t);
    a.arg(&s.nh);
    a.arg(&s.hd);
    a.arg(&rows64);
    const THREADS: u32 = 128;
    let cfg = launch_config((rows.div_ceil((THREADS / 32) as usize) as u32, 1, 1), THREADS, 0);
    // SAFETY: signature (bf16* dO, O, float* D, int T, NH, HD, long long rows); one warp per
    // row of hd elements, `rows` of them in dO and O (checked by `views`), D holds `rows`.
    unsafe { a.launch(cfg) }.w()?;
    Ok(d)
}

/// The sinks' gradient, f32 `[nh]`: `mt_flash_sink_grad` (`f`, from either set's module: both
/// hold it) over the forward's LSE and the backward's `d` (`D = rowsum(dO ⊙ O)`), one CTA per
/// head of `MT_FA_THREADS`.
pub(super) fn sink_grad(
    dev: &CudaDevice,
    f: &CudaFunction,
    x: &Views<'_>,
    sinks: &CudaView<'_, f32>,
    d: &CudaSlice<f32>,
    s: &Scalars,
) -> candle_core::Result<Tensor> {
    let (_, lse, _) = x.grad()?;
    let nh = s.nh as usize;
    // SAFETY: one value per head, every one written by the kernel below (one CTA per head).
    let dsinks = unsafe { dev.alloc::<f32>(nh)? };
    let st = dev.cuda_stream();
    let mut a = st.launch_builder(f);
    a.arg(lse);
    a.arg(d);
    a.arg(sinks);
    a.arg(&dsinks);
    a.arg(&s.b);
    a.arg(&s.t);
    a.arg(&s.nh);
    // 16 bytes of shared memory: the four warps' sums.
    let cfg = launch_config((nh as u32, 1, 1), 128, 16);
    // SAFETY: signature (float* LSE, D, sinks, dsink, int B, T, NH); LSE and D hold b·nh·t
    // (checked by `views`; `d` is `row_dot`'s), sinks and dsink nh; MT_FA_THREADS threads and
    // the 16 bytes of shared memory the kernel uses.
    unsafe { a.launch(cfg) }.w()?;
    Ok(wrap(dsinks, dev, nh))
}

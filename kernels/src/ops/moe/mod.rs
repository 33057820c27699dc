//! Mixture-of-experts on the device (`kernels/cuda/moe.cu`, decision 0047): the routing and the
//! stable grouping of the routed rows by expert ([`MoeRouting::route`]), the grouped GEMMs over
//! those rows (forward products, dX, and the expert weight gradients added into an f32 buffer),
//! SwiGLU over all rows at once, the combine back to token order and the router's backward.
//! Nothing is read back to the host: the per-expert offsets stay in device memory and the GEMMs
//! read them there. Deterministic (no float atomics).
//!
//! mt-layers' MoE device path chains them (decision 0049); `moe_tests.rs` checks them on a GPU
//! against an f64 evaluation, and `scripts/moe_bench.py` launches the same kernels with the same
//! geometry from PyTorch. Here: the routing, its grouping and the shared launch helpers;
//! `gemm.rs`: the grouped GEMMs; `kernels.rs`: their two kernel sets (mma.sync, and wgmma on
//! Hopper) and launch geometries; `rows.rs`: gather, combine, SwiGLU, the router's backward.

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchArgs, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Device, Tensor};
use half::bf16;

use super::flash_launch::{allow_smem, view, wrap};
use super::msg;
use super::sources::MOE;

/// Slots per sort chunk (`MT_MOE_CHUNK`).
const CHUNK: usize = 1024;
/// The largest top-k (`MT_MOE_MAX_K`) and expert count (a 32-bit mask of 32 experts per lane)
/// the kernels take.
const MAX_K: usize = 32;
const MAX_EXPERTS: usize = 1024;
/// A null device pointer, for an absent optional operand.
const NULL: u64 = 0;
/// The name errors give.
const OP: &str = "moe";

fn cfg(grid: (u32, u32, u32), threads: u32, smem: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: smem }
}

/// A grid-stride launch over `total` items of 256 threads (at most 32 blocks per SM of an H100).
fn grid_stride(total: usize) -> LaunchConfig {
    cfg((total.div_ceil(256).clamp(1, 132 * 32) as u32, 1, 1), 256, 0)
}

/// Pushes `v`, or a null pointer where it is absent.
fn arg_or_null<'a, V>(b: &mut LaunchArgs<'a>, v: Option<&'a V>)
where
    LaunchArgs<'a>: PushKernelArg<&'a V> + PushKernelArg<&'a u64>,
{
    match v {
        Some(v) => {
            <LaunchArgs<'a> as PushKernelArg<&'a V>>::arg(b, v);
        }
        None => {
            <LaunchArgs<'a> as PushKernelArg<&'a u64>>::arg(b, &NULL);
        }
    }
}

fn func(dev: &CudaDevice, name: &str) -> candle_core::Result<CudaFunction> {
    Ok(dev.get_or_load_custom_func(name, MOE.module, MOE.ptx()?)?.into_cuda_function())
}

fn cuda_dev(t: &Tensor) -> candle_core::Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        _ => Err(msg("moe: tensors must be on a CUDA device")),
    }
}

fn int(v: usize, what: &str) -> candle_core::Result<i32> {
    i32::try_from(v).map_err(|_| msg(format!("moe: {what} = {v} exceeds the kernels' int range")))
}

/// A token batch's routing, on the device: what [`MoeRouting::route`] computed from the router
/// logits, and the grouping of its `T·k` routed rows by expert (a stable counting sort: expert
/// `e`'s rows are `offsets[e]..offsets[e + 1]`, in ascending token order). Only `route` makes
/// one, so the offsets always cover every row once: what lets the GEMMs below promise to write
/// every output row.
pub struct MoeRouting {
    /// The grouped GEMM kernels its products run.
    gemm: GemmSet,
    tokens: usize,
    experts: usize,
    k: usize,
    normalise: bool,
    probs: Tensor,
    top: Tensor,
    weights: Tensor,
    counts: Tensor,
    offsets: Tensor,
    perm: Tensor,
    row_slot: Tensor,
}

/// How each expert's matrix is stored in a `[E, ·, ·]` weight tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertMatrix {
    /// `[E, N, K]` (`[out, in]`): the product is `x W[e]ᵀ` (the forward's projections).
    OutIn,
    /// `[E, K, N]`: the product is `x W[e]` (the backward's dX through an `[out, in]` matrix).
    InOut,
}

mod gemm;
mod kernels;
mod rows;
#[cfg(test)]
pub(super) use kernels::wgmma_cubin;
use kernels::GemmSet;
pub use kernels::MoeGemm;
pub use rows::{moe_swiglu, moe_swiglu_backward};

impl MoeRouting {
    /// Routes `logits: [T, E]` (bf16 or f32, the router's output) as the CPU engine does: the
    /// softmax in f64 rounded once to f32, the `k` largest probabilities in IEEE total order
    /// (ties to the lower expert), the weights those probabilities or (`normalise`) each divided
    /// by their f64 sum; then counts, offsets and the permutation of the `T·k` slots by expert.
    pub fn route(logits: &Tensor, k: usize, normalise: bool) -> candle_core::Result<Self> {
        let (t, e) = logits.dims2()?;
        if e == 0 || e > MAX_EXPERTS || k == 0 || k > e.min(MAX_K) {
            return Err(msg(format!(
                "moe: {e} experts, top-{k}: the kernels take 1 to {MAX_EXPERTS} experts and top-1 to top-{MAX_K} (at most the experts)"
            )));
        }
        let r = t * k;
        let (ti, ei, ki, ri) =
            (int(t, "tokens")?, int(e, "experts")?, int(k, "top-k")?, int(r, "routed rows")?);
        let norm = i32::from(normalise);
        let dev = cuda_dev(logits)?;
        let st = dev.cuda_stream();
        // SAFETY: every element is written by the kernels launched here before anything reads
        // it (one routing row per token, one entry per slot, expert or chunk); so for each
        // allocation below.
        let probs = unsafe { dev.alloc::<f32>(t * e)? };
        // SAFETY: as above.
        let top = unsafe { dev.alloc::<u32>(r)? };
        // SAFETY: as above.
        let weights = unsafe { dev.alloc::<f32>(r)? };
        {
            let (ls, _) = logits.storage_and_layout();
            let name = match logits.dtype() {
                DType::BF16 => "mt_moe_route_bf16",
                DType::F32 => "mt_moe_route_f32",
                d => return Err(msg(format!("moe: router logits of dtype {d:?}; bf16 or f32"))),
            };
            let f = func(&dev, name)?;
            let mut a = st.launch_builder(&f);
            let (lb, lf);
            if logits.dtype() == DType::BF16 {
                lb = view::<bf16>(&ls, logits, DType::BF16, &[t, e], (OP, "logits"))?;
                a.arg(&lb);
            } else {
                lf = view::<f32>(&ls, logits, DType::F32, &[t, e], (OP, "logits"))?;
                a.arg(&lf);
            }
            a.arg(&probs).arg(&top).arg(&weights).arg(&ti).arg(&ei).arg(&ki).arg(&norm);
            // SAFETY: signature (logits*, float* probs, int* top, float* weights, int T, E, K,
            // int normalise); logits hold T·E (checked), probs T·E, top and weights T·K; one warp
            // per token, 4 a block, 4·E doubles and 4·E floats of shared memory (E <= 1024).
            unsafe { a.launch(cfg((t.div_ceil(4) as u32, 1, 1), 128, (4 * e * 12) as u32)) }.w()?;
        }
        let chunks = r.div_ceil(CHUNK);
        let ci = int(chunks, "sort chunks")?;
        // SAFETY: as above.
        let rank = unsafe { dev.alloc::<u32>(r)? };
        // SAFETY: as above.
        let chunk_counts = unsafe { dev.alloc::<u32>(chunks * e)? };
        // SAFETY: as above.
        let chunk_base = unsafe { dev.alloc::<u32>(chunks * e)? };
        // SAFETY: as above.
        let counts = unsafe { dev.alloc::<u32>(e)? };
        // SAFETY: as above.
        let offsets = unsafe { dev.alloc::<u32>(e + 1)? };
        // SAFETY: as above.
        let perm = unsafe { dev.alloc::<u32>(r)? };
        // SAFETY: as above.
        let row_slot = unsafe { dev.alloc::<u32>(r)? };
        if r > 0 {
            let f = func(&dev, "mt_moe_sort_count")?;
            let mut a = st.launch_builder(&f);
            a.arg(&top).arg(&rank).arg(&chunk_counts).arg(&ri).arg(&ei);
            // SAFETY: signature (int* top, int* rank, int* chunk_counts, int N, int E); top holds
            // N expert indices below E (written by the routing above), rank N, chunk_counts
            // chunks·E; one warp per chunk, E ints of shared memory.
            unsafe { a.launch(cfg((chunks as u32, 1, 1), 32, (4 * e) as u32)) }.w()?;
        }
        {
            let f = func(&dev, "mt_moe_sort_scan")?;
            let mut a = st.launch_builder(&f);
            a.arg(&chunk_counts).arg(&chunk_base).arg(&counts).arg(&offsets).arg(&ci).arg(&ei);
            // SAFETY: signature (int* chunk_counts, int* chunk_base, int* counts, int* off, int
            // chunks, int E); sizes chunks·E, chunks·E, E, E + 1; one block, E ints of shared
            // memory.
            unsafe { a.launch(cfg((1, 1, 1), 256, (4 * e) as u32)) }.w()?;
        }
        if r > 0 {
            let f = func(&dev, "mt_moe_sort_scatter")?;
            let mut a = st.launch_builder(&f);
            a.arg(&top).arg(&rank).arg(&chunk_base).arg(&perm).arg(&row_slot).arg(&ri).arg(&ei);
            // SAFETY: signature (int* top, int* rank, int* chunk_base, int* perm, int* row_slot,
            // int N, int E); the rows it forms are a permutation of 0..N (a stable counting
            // sort: the chunk bases and ranks above), so every write lands inside perm and
            // row_slot (N each).
            unsafe { a.launch(grid_stride(r)) }.w()?;
        }
        Ok(MoeRouting {
            gemm: GemmSet::pick(MoeGemm::Auto, &dev)?,
            tokens: t,
            experts: e,
            k,
            normalise,
            probs: wrap(probs, &dev, (t, e)),
            top: wrap(top, &dev, (t, k)),
            weights: wrap(weights, &dev, (t, k)),
            counts: wrap(counts, &dev, e),
            offsets: wrap(offsets, &dev, e + 1),
            perm: wrap(perm, &dev, r),
            row_slot: wrap(row_slot, &dev, r),
        })
    }

    /// The same routing with its grouped GEMMs on the kernels `choice` names (the GPU's default,
    /// [`MoeGemm::Auto`], after [`MoeRouting::route`]); an error where they cannot run on this GPU.
    pub fn with_gemm(mut self, choice: MoeGemm) -> candle_core::Result<Self> {
        self.gemm = GemmSet::pick(choice, &cuda_dev(&self.offsets)?)?;
        Ok(self)
    }

    /// Router probabilities `[T, E]` f32.
    pub fn probs(&self) -> &Tensor {
        &self.probs
    }
    /// Each token's experts in top-k order, `[T, k]` u32.
    pub fn top(&self) -> &Tensor {
        &self.top
    }
    /// The routing weights `[T, k]` f32.
    pub fn weights(&self) -> &Tensor {
        &self.weights
    }
    /// Rows per expert `[E]` u32.
    pub fn counts(&self) -> &Tensor {
        &self.counts
    }
    /// Each expert's first permuted row, and the row count last: `[E + 1]` u32.
    pub fn offsets(&self) -> &Tensor {
        &self.offsets
    }
    /// The permuted row of each slot `t·k + j`, `[T·k]` u32.
    pub fn perm(&self) -> &Tensor {
        &self.perm
    }
    /// The slot of each permuted row, `[T·k]` u32.
    pub fn row_slot(&self) -> &Tensor {
        &self.row_slot
    }
    /// Routed rows, `T·k`.
    pub fn rows(&self) -> usize {
        self.tokens * self.k
    }
}

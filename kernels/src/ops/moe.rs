//! Mixture-of-experts on the device (`kernels/cuda/moe.cu`, decision 0047): the routing and the
//! stable grouping of the routed rows by expert ([`MoeRouting::route`]), the grouped GEMMs over
//! those rows (forward products, dX, and the expert weight gradients added into an f32 buffer),
//! SwiGLU over all rows at once, the combine back to token order and the router's backward.
//! Nothing is read back to the host: the per-expert offsets stay in device memory and the GEMMs
//! read them there. Deterministic (no float atomics).
//!
//! Phase 1 of the work: the engine's MoE layer does not call these yet (`moe_tests.rs` checks
//! them on a GPU against an f64 evaluation; `scripts/moe_bench.py` launches the same kernels with
//! the same geometry from PyTorch).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaDevice, CudaStorage, DType, Device, InplaceOp1, Layout, Tensor};
use half::bf16;

use super::flash_launch::{view, wrap};
use super::msg;
use super::sources::MOE;

/// Slots per sort chunk (`MT_MOE_CHUNK`).
const CHUNK: usize = 1024;
/// Rows and columns of a GEMM tile (`MT_MOE_BM`, `MT_MOE_BN`).
const TILE: usize = 128;
/// Threads of a GEMM CTA (`MT_MOE_THREADS`).
const GEMM_THREADS: u32 = 256;
/// Dynamic shared memory of a GEMM CTA: 3 stages of two 128 x 32 bf16 tiles (48 KiB, the
/// default limit).
const GEMM_SMEM: u32 = 3 * 2 * 128 * 32 * 2;
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

    /// The M-grouped product of each expert's rows with its matrix: row `p` of expert `e` is
    /// `a[p] W[e]ᵀ` ([`ExpertMatrix::OutIn`]) or `a[p] W[e]` ([`ExpertMatrix::InOut`]). `a` holds
    /// the `T·k` permuted rows, or (`gather`) the `T` token rows, read in permuted order through
    /// the routing (no permuted copy). bf16 in, f32 accumulation, `[T·k, N]` bf16 out.
    pub fn matmul(
        &self,
        a: &Tensor,
        gather: bool,
        w: &Tensor,
        layout: ExpertMatrix,
    ) -> candle_core::Result<Tensor> {
        let (e, d1, d2) = w.dims3()?;
        let (n, kk) = match layout {
            ExpertMatrix::OutIn => (d1, d2),
            ExpertMatrix::InOut => (d2, d1),
        };
        let name = match layout {
            ExpertMatrix::OutIn => "mt_moe_gemm_nk",
            ExpertMatrix::InOut => "mt_moe_gemm_kn",
        };
        self.gemm_m(a, gather, w, (e, n, kk), name, None)
    }

    /// The backward through the down projection `[E, h, f]`: `g = bf16(dy W_down[e])` for each
    /// routed row (dy `[T, h]`, the token rows), returned as `d_mid = bf16(g · w)` `[T·k, f]`
    /// with `w` the slot's weight rounded through bf16, and `[T·k, ⌈f / 128⌉]` f32 partial sums
    /// of `g · mid` per column tile, which [`MoeRouting::router_backward`] finishes into the
    /// routing weights' gradient.
    pub fn down_backward(
        &self,
        dy: &Tensor,
        w_down: &Tensor,
        mid: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (e, h, f) = w_down.dims3()?;
        let r = self.rows();
        let dev = cuda_dev(dy)?;
        // SAFETY: every row's partial of every column tile is written by the GEMM's epilogue (the
        // routing's offsets cover every row once).
        let partial = unsafe { dev.alloc::<f32>(r * f.div_ceil(TILE))? };
        let d_mid = self.gemm_m(dy, true, w_down, (e, f, h), "mt_moe_gemm_kn_dmid", Some((mid, &partial)))?;
        Ok((d_mid, wrap(partial, &dev, (r, f.div_ceil(TILE)))))
    }

    fn gemm_m(
        &self,
        a: &Tensor,
        gather: bool,
        w: &Tensor,
        (e, n, kk): (usize, usize, usize),
        name: &str,
        dmid: Option<(&Tensor, &CudaSlice<f32>)>,
    ) -> candle_core::Result<Tensor> {
        let r = self.rows();
        let a_rows = if gather { self.tokens } else { r };
        if e != self.experts || n % 8 != 0 || kk % 8 != 0 || n == 0 || kk == 0 {
            return Err(msg(format!(
                "moe: expert matrices {:?} for {} experts: their widths must be non-zero multiples of 8",
                w.dims(),
                self.experts
            )));
        }
        let dev = cuda_dev(a)?;
        let st = dev.cuda_stream();
        let (ni, ki, ei, div) =
            (int(n, "columns")?, int(kk, "inner size")?, int(e, "experts")?, int(self.k, "top-k")?);
        let (one, null) = (1i32, NULL);
        // SAFETY: each row of [0, T·k) lies in exactly one expert's segment (the routing's
        // offsets, made by `route` only), whose row tiles the grid covers: every element is
        // written by the GEMM below.
        let c = unsafe { dev.alloc::<bf16>(r * n)? };
        let (as_, _) = a.storage_and_layout();
        let (ws, _) = w.storage_and_layout();
        let (os, _) = self.offsets.storage_and_layout();
        let (rs, _) = self.row_slot.storage_and_layout();
        let (wts, _) = self.weights.storage_and_layout();
        let av = view::<bf16>(&as_, a, DType::BF16, &[a_rows, kk], (OP, "grouped GEMM input"))?;
        let wv = view::<bf16>(&ws, w, DType::BF16, w.dims(), (OP, "expert matrices"))?;
        let ov = view::<u32>(&os, &self.offsets, DType::U32, &[e + 1], (OP, "offsets"))?;
        let rv = view::<u32>(&rs, &self.row_slot, DType::U32, &[r], (OP, "row slots"))?;
        let wtv = view::<f32>(&wts, &self.weights, DType::F32, &[self.tokens, self.k], (OP, "weights"))?;
        let mid_st = dmid.map(|(m, _)| m.storage_and_layout());
        let mid_v = match (&mid_st, dmid) {
            (Some((ms, _)), Some((m, _))) => Some(view::<bf16>(ms, m, DType::BF16, &[r, n], (OP, "mid"))?),
            _ => None,
        };
        let f = func(&dev, name)?;
        let mut b = st.launch_builder(&f);
        b.arg(&av);
        if gather {
            b.arg(&rv).arg(&div);
        } else {
            b.arg(&null).arg(&one);
        }
        b.arg(&wv).arg(&ov).arg(&ei).arg(&ni).arg(&ki).arg(&c);
        if let (Some(mv), Some((_, partial))) = (&mid_v, dmid) {
            b.arg(&rv).arg(&wtv).arg(mv).arg(partial);
        }
        let grid = ((r.div_ceil(TILE) + e) as u32, n.div_ceil(TILE) as u32, 1);
        // SAFETY: signature (bf16* A, int* a_idx or null, int a_div, bf16* W, int* off, int E, N,
        // K, bf16* C[, int* row_slot, float* weights, bf16* mid, float* partial]); A holds
        // a_rows·K (checked; a gathered row index is a slot / k < T), W E·N·K, off E + 1 offsets
        // of a partition of 0..T·k, C and mid T·k·N, partial T·k·⌈N / 128⌉; 256 threads and
        // GEMM_SMEM bytes of shared memory as the kernel lays them out (48 KiB, no opt-in).
        unsafe { b.launch(cfg(grid, GEMM_THREADS, GEMM_SMEM)) }.w()?;
        Ok(wrap(c, &dev, (r, n)))
    }

    /// `src: [T, h]` token rows in permuted order, `[T·k, h]` bf16; each times its slot's weight
    /// rounded through bf16 (`bf16(x w)`) when `weighted`.
    pub fn gather(&self, src: &Tensor, weighted: bool) -> candle_core::Result<Tensor> {
        let (t, h) = src.dims2()?;
        let r = self.rows();
        if t != self.tokens || h % 8 != 0 {
            return Err(msg(format!(
                "moe: gather of {t} x {h} rows for {} tokens (width a multiple of 8)",
                self.tokens
            )));
        }
        let dev = cuda_dev(src)?;
        let (ri, hi, ki) = (int(r, "routed rows")?, int(h, "width")?, int(self.k, "top-k")?);
        // SAFETY: every element is written by the kernel below (grid-stride over all of them).
        let out = unsafe { dev.alloc::<bf16>(r * h)? };
        let (ss, _) = src.storage_and_layout();
        let (rs, _) = self.row_slot.storage_and_layout();
        let (wts, _) = self.weights.storage_and_layout();
        let sv = view::<bf16>(&ss, src, DType::BF16, &[t, h], (OP, "gathered rows"))?;
        let rv = view::<u32>(&rs, &self.row_slot, DType::U32, &[r], (OP, "row slots"))?;
        let wv = view::<f32>(&wts, &self.weights, DType::F32, &[t, self.k], (OP, "weights"))?;
        let f = func(&dev, "mt_moe_gather")?;
        let st = dev.cuda_stream();
        let mut b = st.launch_builder(&f);
        b.arg(&sv).arg(&rv);
        arg_or_null(&mut b, weighted.then_some(&wv));
        b.arg(&out).arg(&ri).arg(&hi).arg(&ki);
        // SAFETY: signature (bf16* src, int* row_slot, float* weights or null, bf16* out, int R,
        // H, K); src T·H, row_slot R slots < T·k, weights T·k, out R·H.
        unsafe { b.launch(grid_stride(r * h / 8)) }.w()?;
        Ok(wrap(out, &dev, (r, h)))
    }

    /// Each token's `k` rows of `src: [T·k, h]` summed in ascending permuted row (= ascending
    /// expert, the CPU engine's order) in f32 from zero, each times its weight rounded through
    /// bf16 when `weighted`, plus `base: [T, h]` when given: `[T, h]` bf16.
    pub fn combine(
        &self,
        src: &Tensor,
        weighted: bool,
        base: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let (r, h) = src.dims2()?;
        if r != self.rows() || h % 8 != 0 {
            return Err(msg(format!(
                "moe: combine of {r} x {h} rows for {} routed rows (width a multiple of 8)",
                self.rows()
            )));
        }
        let t = self.tokens;
        let dev = cuda_dev(src)?;
        let (ti, hi, ki) = (int(t, "tokens")?, int(h, "width")?, int(self.k, "top-k")?);
        // SAFETY: one block per token writes all of its row.
        let out = unsafe { dev.alloc::<bf16>(t * h)? };
        let (ss, _) = src.storage_and_layout();
        let (ps, _) = self.perm.storage_and_layout();
        let (wts, _) = self.weights.storage_and_layout();
        let bs = base.map(|b| b.storage_and_layout());
        let sv = view::<bf16>(&ss, src, DType::BF16, &[r, h], (OP, "expert rows"))?;
        let pv = view::<u32>(&ps, &self.perm, DType::U32, &[r], (OP, "permutation"))?;
        let wv = view::<f32>(&wts, &self.weights, DType::F32, &[t, self.k], (OP, "weights"))?;
        let bv = match (&bs, base) {
            (Some((st, _)), Some(b)) => Some(view::<bf16>(st, b, DType::BF16, &[t, h], (OP, "residual"))?),
            _ => None,
        };
        let f = func(&dev, "mt_moe_combine")?;
        let st = dev.cuda_stream();
        let mut b = st.launch_builder(&f);
        b.arg(&sv).arg(&pv);
        arg_or_null(&mut b, weighted.then_some(&wv));
        arg_or_null(&mut b, bv.as_ref());
        b.arg(&out).arg(&ti).arg(&hi).arg(&ki);
        if t > 0 {
            // SAFETY: signature (bf16* src, int* perm, float* weights or null, bf16* base or null,
            // bf16* out, int T, H, K); src R·H with every perm entry < R, weights T·k, base and
            // out T·H; K <= 32 (checked by `route`), the kernel's shared arrays.
            unsafe { b.launch(cfg((t as u32, 1, 1), 256, 0)) }.w()?;
        }
        Ok(wrap(out, &dev, (t, h)))
    }

    /// Adds the K-grouped weight gradient `grad[e] += aᵀ b` over each expert's rows (in ascending
    /// row order, f32) into `grad: [E, m, n]` f32: `a: [T·k, m]` permuted rows, `b: [T·k, n]`
    /// permuted rows or (`gather`) `[T, n]` token rows read in permuted order. An expert without
    /// rows adds nothing.
    pub fn weight_grad(
        &self,
        grad: &Tensor,
        a: &Tensor,
        b: &Tensor,
        gather: bool,
    ) -> candle_core::Result<()> {
        grad.inplace_op1(&WeightGrad { routing: self, a, b, gather })
    }

    /// `sums[e] += Σ_t probs[t, e]` (f64 `[E]`, the load-balancing loss's `P_e`), in a fixed order.
    pub fn prob_sums_add(&self, sums: &Tensor) -> candle_core::Result<()> {
        sums.inplace_op1(&ProbSums { routing: self })
    }

    /// The router's backward (the CPU engine's formulas in f64): from the down backward's
    /// `partial` and, when given, the load-balancing loss's `aux_dprob: [E]` f64 (`dL/dp[t, e]`
    /// for every row): `(dL/dlogits [T, E] bf16, dL/dw [T, k] f64)`.
    pub fn router_backward(
        &self,
        partial: &Tensor,
        aux_dprob: Option<&Tensor>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (t, e, k, r) = (self.tokens, self.experts, self.k, self.rows());
        let (pr, tiles) = partial.dims2()?;
        if pr != r {
            return Err(msg(format!("moe: {pr} rows of routing-weight partials for {r} routed rows")));
        }
        let dev = cuda_dev(partial)?;
        let (ti, ei, ki, tl) =
            (int(t, "tokens")?, int(e, "experts")?, int(k, "top-k")?, int(tiles, "tiles")?);
        let norm = i32::from(self.normalise);
        // SAFETY: one warp per token writes its k weight gradients and its E logit gradients.
        let dw = unsafe { dev.alloc::<f64>(r)? };
        // SAFETY: as above.
        let dlogit = unsafe { dev.alloc::<bf16>(t * e)? };
        let (ps, _) = self.probs.storage_and_layout();
        let (ts, _) = self.top.storage_and_layout();
        let (ms, _) = self.perm.storage_and_layout();
        let (qs, _) = partial.storage_and_layout();
        let xs = aux_dprob.map(|x| x.storage_and_layout());
        let pv = view::<f32>(&ps, &self.probs, DType::F32, &[t, e], (OP, "probabilities"))?;
        let tv = view::<u32>(&ts, &self.top, DType::U32, &[t, k], (OP, "top-k"))?;
        let mv = view::<u32>(&ms, &self.perm, DType::U32, &[r], (OP, "permutation"))?;
        let qv = view::<f32>(&qs, partial, DType::F32, &[r, tiles], (OP, "partials"))?;
        let xv = match (&xs, aux_dprob) {
            (Some((st, _)), Some(x)) => Some(view::<f64>(st, x, DType::F64, &[e], (OP, "aux dprob"))?),
            _ => None,
        };
        let f = func(&dev, "mt_moe_router_bwd")?;
        let st = dev.cuda_stream();
        let mut b = st.launch_builder(&f);
        b.arg(&pv).arg(&tv).arg(&mv).arg(&qv).arg(&tl);
        arg_or_null(&mut b, xv.as_ref());
        b.arg(&norm).arg(&dw).arg(&dlogit).arg(&ti).arg(&ei).arg(&ki);
        if t > 0 {
            // SAFETY: signature (float* probs, int* top, int* perm, float* partial, int tiles,
            // double* aux or null, int normalise, double* dw, bf16* dlogit, int T, E, K); sizes
            // T·E, T·k, T·k (entries < T·k), T·k·tiles, E, T·k, T·E; 4 warps a block, 4·E
            // doubles of shared memory.
            unsafe { b.launch(cfg((t.div_ceil(4) as u32, 1, 1), 128, (4 * e * 8) as u32)) }.w()?;
        }
        Ok((wrap(dlogit, &dev, (t, e)), wrap(dw, &dev, (t, k))))
    }
}

/// `mid = bf16(bf16(silu(gate)) up)` of every row of `gu: [R, 2f]` (gate columns, then up), in one
/// launch: `[R, f]` bf16.
pub fn moe_swiglu(gu: &Tensor) -> candle_core::Result<Tensor> {
    swiglu_pass(gu, None)
}

/// SwiGLU's backward over every row: `[d_gate | d_up]` `[R, 2f]` bf16 from `d_mid: [R, f]` and the
/// forward's `gu: [R, 2f]`, with the roundings of `fused.cu`'s backward.
pub fn moe_swiglu_backward(d_mid: &Tensor, gu: &Tensor) -> candle_core::Result<Tensor> {
    swiglu_pass(gu, Some(d_mid))
}

fn swiglu_pass(gu: &Tensor, d_mid: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let (r, f2) = gu.dims2()?;
    if f2 % 2 != 0 {
        return Err(msg(format!("moe: gate-and-up rows of odd width {f2}")));
    }
    let f = f2 / 2;
    let dev = cuda_dev(gu)?;
    let fi = int(f, "expert width")?;
    let rl = r as i64;
    let n = if d_mid.is_some() { r * f2 } else { r * f };
    // SAFETY: every element is written by the kernel below (grid-stride over R·f, two a step in
    // the backward).
    let out = unsafe { dev.alloc::<bf16>(n)? };
    let (gs, _) = gu.storage_and_layout();
    let gv = view::<bf16>(&gs, gu, DType::BF16, &[r, f2], (OP, "gate and up"))?;
    let ds = d_mid.map(|d| d.storage_and_layout());
    let dv = match (&ds, d_mid) {
        (Some((st, _)), Some(d)) => Some(view::<bf16>(st, d, DType::BF16, &[r, f], (OP, "d_mid"))?),
        _ => None,
    };
    let name = if dv.is_some() { "mt_moe_swiglu_bwd" } else { "mt_moe_swiglu" };
    let func_ = func(&dev, name)?;
    let st = dev.cuda_stream();
    let mut b = st.launch_builder(&func_);
    if let Some(d) = &dv {
        b.arg(d);
    }
    b.arg(&gv).arg(&out).arg(&rl).arg(&fi);
    // SAFETY: signature ([bf16* d_mid,] bf16* gu, bf16* out, long long R, int F); gu R·2F, d_mid
    // R·F (checked), out R·F (forward) or R·2F (backward).
    unsafe { b.launch(grid_stride(r * f)) }.w()?;
    let dims = if d_mid.is_some() { (r, f2) } else { (r, f) };
    Ok(wrap(out, &dev, dims))
}

/// [`MoeRouting::weight_grad`]'s in-place op on the f32 gradient.
struct WeightGrad<'a> {
    routing: &'a MoeRouting,
    a: &'a Tensor,
    b: &'a Tensor,
    gather: bool,
}

impl InplaceOp1 for WeightGrad<'_> {
    cuda_only!("mt-moe-weight-grad", inplace1);

    fn cuda_fwd(&self, g: &mut CudaStorage, lg: &Layout) -> candle_core::Result<()> {
        let rt = self.routing;
        let r = rt.rows();
        let &[e, m, n] = lg.dims() else {
            return Err(msg(format!("moe: weight gradient of shape {:?}; [E, m, n]", lg.dims())));
        };
        if !lg.is_contiguous() || e != rt.experts || m % 8 != 0 || n % 8 != 0 {
            return Err(msg(format!(
                "moe: weight gradient {:?} for {} experts: contiguous, widths multiples of 8",
                lg.dims(),
                rt.experts
            )));
        }
        let b_rows = if self.gather { rt.tokens } else { r };
        let dev = g.device().clone();
        let (mi, ni, div, one, null) = (int(m, "rows")?, int(n, "columns")?, int(rt.k, "top-k")?, 1i32, NULL);
        let mut gs = g.as_cuda_slice_mut::<f32>()?.slice_mut(lg.start_offset()..);
        let (as_, _) = self.a.storage_and_layout();
        let (bs, _) = self.b.storage_and_layout();
        let (os, _) = rt.offsets.storage_and_layout();
        let (rs, _) = rt.row_slot.storage_and_layout();
        let av = view::<bf16>(&as_, self.a, DType::BF16, &[r, m], (OP, "weight gradient's left rows"))?;
        let bv = view::<bf16>(&bs, self.b, DType::BF16, &[b_rows, n], (OP, "weight gradient's right rows"))?;
        let ov = view::<u32>(&os, &rt.offsets, DType::U32, &[e + 1], (OP, "offsets"))?;
        let rv = view::<u32>(&rs, &rt.row_slot, DType::U32, &[r], (OP, "row slots"))?;
        let f = func(&dev, "mt_moe_gemm_wgrad")?;
        let st = dev.cuda_stream();
        let mut b = st.launch_builder(&f);
        b.arg(&av).arg(&bv);
        if self.gather {
            b.arg(&rv).arg(&div);
        } else {
            b.arg(&null).arg(&one);
        }
        b.arg(&ov).arg(&mi).arg(&ni).arg(&mut gs);
        let grid = ((m.div_ceil(TILE) * n.div_ceil(TILE)) as u32, e as u32, 1);
        // SAFETY: signature (bf16* A, bf16* B, int* b_idx or null, int b_div, int* off, int M, N,
        // float* G); A holds R·M, B b_rows·N (checked; a gathered index is a slot / k < T), off a
        // partition of 0..R (the routing's), G E·M·N (checked contiguous from its offset), each
        // element written by one CTA only; 256 threads, GEMM_SMEM bytes of shared memory.
        unsafe { b.launch(cfg(grid, GEMM_THREADS, GEMM_SMEM)) }.w()?;
        Ok(())
    }
}

/// [`MoeRouting::prob_sums_add`]'s in-place op on the f64 sums.
struct ProbSums<'a> {
    routing: &'a MoeRouting,
}

impl InplaceOp1 for ProbSums<'_> {
    cuda_only!("mt-moe-prob-sums", inplace1);

    fn cuda_fwd(&self, s: &mut CudaStorage, ls: &Layout) -> candle_core::Result<()> {
        let rt = self.routing;
        let (t, e) = (rt.tokens, rt.experts);
        if !ls.is_contiguous() || ls.dims() != [e] {
            return Err(msg(format!("moe: probability sums of shape {:?}; [{e}] f64", ls.dims())));
        }
        let dev = s.device().clone();
        let (ti, ei) = (int(t, "tokens")?, int(e, "experts")?);
        let mut ss = s.as_cuda_slice_mut::<f64>()?.slice_mut(ls.start_offset()..);
        let (ps, _) = rt.probs.storage_and_layout();
        let pv = view::<f32>(&ps, &rt.probs, DType::F32, &[t, e], (OP, "probabilities"))?;
        let f = func(&dev, "mt_moe_prob_sums")?;
        let st = dev.cuda_stream();
        let mut b = st.launch_builder(&f);
        b.arg(&pv).arg(&mut ss).arg(&ti).arg(&ei);
        // SAFETY: signature (float* probs, double* sums, int T, int E); probs T·E, sums E (checked);
        // one block of 256 threads per expert writes its own sum.
        unsafe { b.launch(cfg((e as u32, 1, 1), 256, 0)) }.w()?;
        Ok(())
    }
}

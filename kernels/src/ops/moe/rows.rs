//! The row-wise kernels of a routing: the gather of token rows into expert order, the combine
//! back to token order, SwiGLU over all rows, the router's backward and the probabilities' sums.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp1, Layout, Tensor};
use half::bf16;

use super::{arg_or_null, cfg, cuda_dev, func, grid_stride, int, msg, view, wrap, MoeRouting, OP};

impl MoeRouting {
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

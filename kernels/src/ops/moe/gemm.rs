//! The grouped GEMMs of a routing: the M-grouped products over each expert's rows (forward,
//! dX, the down projection's backward with the routing weights' partial gradients) and the
//! K-grouped weight gradients added into the f32 gradient buffer.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp1, Layout, Tensor};
use half::bf16;

use super::{cfg, cuda_dev, int, msg, view, wrap, ExpertMatrix, MoeRouting, NULL, OP};

impl MoeRouting {
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
        let kind = match layout {
            ExpertMatrix::OutIn => "nk",
            ExpertMatrix::InOut => "kn",
        };
        self.gemm_m(a, gather, w, (e, n, kk), kind, None)
    }

    /// The backward through the down projection `[E, h, f]`: `g = bf16(dy W_down[e])` for each
    /// routed row (dy `[T, h]`, the token rows), returned as `d_mid = bf16(g · w)` `[T·k, f]`
    /// with `w` the slot's weight rounded through bf16, and `[T·k, tiles]` f32 partial sums of
    /// `g · mid`, one per column tile of the GEMM (`tiles` = ⌈f / its tile width⌉), which
    /// [`MoeRouting::router_backward`] finishes into the routing weights' gradient.
    pub fn down_backward(
        &self,
        dy: &Tensor,
        w_down: &Tensor,
        mid: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (e, h, f) = w_down.dims3()?;
        let r = self.rows();
        let dev = cuda_dev(dy)?;
        let tiles = f.div_ceil(self.gemm.bn);
        // SAFETY: every row's partial of every column tile is written by the GEMM's epilogue (the
        // routing's offsets cover every row once).
        let partial = unsafe { dev.alloc::<f32>(r * tiles)? };
        let d_mid = self.gemm_m(dy, true, w_down, (e, f, h), "kn_dmid", Some((mid, &partial)))?;
        Ok((d_mid, wrap(partial, &dev, (r, tiles))))
    }

    fn gemm_m(
        &self,
        a: &Tensor,
        gather: bool,
        w: &Tensor,
        (e, n, kk): (usize, usize, usize),
        kind: &str,
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
        let g = self.gemm;
        let f = g.func(&dev, kind)?;
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
        let grid = ((r.div_ceil(g.bm) + e) as u32, n.div_ceil(g.bn) as u32, 1);
        // SAFETY: signature (bf16* A, int* a_idx or null, int a_div, bf16* W, int* off, int E, N,
        // K, bf16* C[, int* row_slot, float* weights, bf16* mid, float* partial]); A holds
        // a_rows·K (checked; a gathered row index is a slot / k < T), W E·N·K, off E + 1 offsets
        // of a partition of 0..T·k, C and mid T·k·N, partial T·k·⌈N / g.bn⌉; the kernel set's
        // threads and shared memory as its kernels lay them out (allowed by `GemmSet::func`).
        unsafe { b.launch(cfg(grid, g.threads, g.smem)) }.w()?;
        Ok(wrap(c, &dev, (r, n)))
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
        let g = rt.gemm;
        let f = g.func(&dev, "wgrad")?;
        let st = dev.cuda_stream();
        let mut b = st.launch_builder(&f);
        b.arg(&av).arg(&bv);
        if self.gather {
            b.arg(&rv).arg(&div);
        } else {
            b.arg(&null).arg(&one);
        }
        b.arg(&ov).arg(&mi).arg(&ni).arg(&mut gs);
        let grid = ((m.div_ceil(g.bm) * n.div_ceil(g.bn)) as u32, e as u32, 1);
        // SAFETY: signature (bf16* A, bf16* B, int* b_idx or null, int b_div, int* off, int M, N,
        // float* G); A holds R·M, B b_rows·N (checked; a gathered index is a slot / k < T), off a
        // partition of 0..R (the routing's), G E·M·N (checked contiguous from its offset), each
        // element written by one CTA only; the kernel set's threads and shared memory (allowed by
        // `GemmSet::func`).
        unsafe { b.launch(cfg(grid, g.threads, g.smem)) }.w()?;
        Ok(())
    }
}

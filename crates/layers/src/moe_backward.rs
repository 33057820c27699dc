//! The mixture-of-experts MLP's backward, written out (no autograd), from what
//! [`crate::moe::forward`] saved.
//!
//! With `out_t = Σ_j w_tj · y_tj`, `y = down(silu(gate(c)) ⊙ up(c))` of expert `e_tj`:
//! - each expert's rows get `dy_e = dout ⊙ w`, and its weights `dW_down[e] += dy_eᵀ mid`,
//!   `dW_gate_up[e] += [d_gate | d_up]ᵀ c_e`; `dc` gathers `[d_gate | d_up] W_gate_up[e]` back
//!   to the rows (an expert with no rows gets an exact zero gradient: nothing is added);
//! - the routing weight of slot `(t, j)` gets `dw_tj = dout_t · y_tj = (dout_t W_down[e]) · mid_tj`;
//! - renormalised weights `w_j = p_j / S`, `S = Σ_{i ∈ top-k} p_i`, give
//!   `dp_j = (dw_j - Σ_i dw_i w_i) / S` (else `dp_j = dw_j`), zero off the top-k; the
//!   load-balancing loss adds `coef · E · c_e / N²` to every `dp[t, e]` ([`RouterGrad`]);
//! - softmax: `dlogit = p ⊙ (dp - Σ_e p_e dp_e)`; the router is a linear layer.
//!
//! The routing arithmetic runs on the host in f64; `dlogit` is rounded to the compute dtype once.

use candle_core::{DType, Tensor, D};

use crate::mlp::swiglu_backward;
use crate::moe::{MoeSaved, RouterGrad};
use crate::ops::{linear_backward, matmul_wide, wide_dtype};
use crate::weights::names;
use crate::{GradSink, Result};

/// Back-propagates `dy: [rows, h]` (the gradient of the MoE output) through one tile; returns
/// `dc`, the gradient of the post-attention-norm output `c`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    router: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
    c: &Tensor,
    s: MoeSaved,
    dy: &Tensor,
    grads: &GradSink,
    aux: Option<&RouterGrad>,
) -> Result<Tensor> {
    let (rows, h) = dy.dims2()?;
    let (dtype, dev) = (dy.dtype(), dy.device());
    let ne = router.dim(0)?;
    let k = s.top.len() / rows.max(1);
    let acc = wide_dtype(dy);
    let mut dc = Tensor::zeros((rows, h), acc, dev)?;
    // dL/dw for every slot (t, j).
    let mut dw = vec![0f64; rows * k];
    for ex in &s.experts {
        let e = ex.expert;
        let dy_e = dy.index_select(&ex.idx, 0)?;
        let w_down = down.get(e)?;
        // dout_e W_down[e], before the routing weight: `dw` is its dot with mid.
        let g = matmul_wide(&dy_e, &w_down)?;
        let dw_e = (&g * ex.mid.to_dtype(acc)?)?.sum(D::Minus1)?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        for (&slot, d) in ex.slots.iter().zip(dw_e) {
            dw[slot] = d;
        }
        let w = s.weight_column(&ex.slots, dtype, acc, dev)?;
        let d_mid = g.broadcast_mul(&w)?.to_dtype(dtype)?;
        drop(g);
        let dy_scaled = dy_e.to_dtype(acc)?.broadcast_mul(&w)?.to_dtype(dtype)?;
        grads.accumulate_matmul_expert(names::EXPERTS_DOWN, e, &dy_scaled, &ex.mid)?;
        drop((dy_scaled, dy_e));
        let (d_gate, d_up) = swiglu_backward(&d_mid, &ex.gate, &ex.up, ex.act.as_ref())?;
        let d_gu = Tensor::cat(&[&d_gate, &d_up], 1)?;
        drop((d_gate, d_up, d_mid));
        let c_e = c.index_select(&ex.idx, 0)?;
        grads.accumulate_matmul_expert(names::EXPERTS_GATE_UP, e, &d_gu, &c_e)?;
        let dc_e = matmul_wide(&d_gu, &gate_up.get(e)?)?;
        dc = dc.index_add(&ex.idx, &dc_e, 0)?;
    }
    let dlogit = router_backward(&s, &dw, ne, k, aux);
    let dlogit = Tensor::from_vec(dlogit, (rows, ne), dev)?.to_dtype(dtype)?;
    let dc_router = linear_backward(&dlogit, c, router, grads, names::ROUTER, None)?;
    Ok((dc + dc_router.to_dtype(acc)?)?.to_dtype(dtype)?)
}

/// `dL/dlogits` `[rows, E]` (row-major, f64) from the routing weights' gradient `dw`
/// `[rows, k]` and the load-balancing loss's `aux`.
fn router_backward(s: &MoeSaved, dw: &[f64], ne: usize, k: usize, aux: Option<&RouterGrad>) -> Vec<f64> {
    let normalise = s.normalised;
    let mut out = Vec::with_capacity(s.probs.len());
    let mut dp = vec![0f64; ne];
    for ((p, top), dw) in s.probs.chunks_exact(ne).zip(s.top.chunks_exact(k)).zip(dw.chunks_exact(k)) {
        match aux {
            Some(a) => dp.copy_from_slice(a.dprob()),
            None => dp.fill(0.0),
        }
        let sum: f64 = top.iter().map(|&x| f64::from(p[x as usize])).sum();
        let weighted: f64 = top.iter().zip(dw).map(|(&x, &d)| d * f64::from(p[x as usize]) / sum).sum();
        for (&x, &d) in top.iter().zip(dw) {
            dp[x as usize] += if normalise { (d - weighted) / sum } else { d };
        }
        let dot: f64 = p.iter().zip(&dp).map(|(&pi, &d)| f64::from(pi) * d).sum();
        out.extend(p.iter().zip(&dp).map(|(&pi, &d)| f64::from(pi) * (d - dot)));
    }
    out
}

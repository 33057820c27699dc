//! The portable mixture-of-experts MLP's backward, written out (no autograd), from what
//! [`super::host::forward`] saved.
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
//!
//! GPT-OSS ([`mt_core::ExpertKind::GptOss`]): `y` includes the down bias `b_down[e]`, so
//! `dw_tj = dout_t · y_tj` gains `dout_t · b_down[e]`; the biases' gradients are the column sums
//! of `dy_e ⊙ w` and `[d_gate | d_up]` (interleaved as the parameters); the matrices are stored
//! `[in, out]`, so their gradients are the transposed products (`midᵀ dy_e`, `c_eᵀ d_gu`); the
//! clamped GLU's backward is [`super::clamped_glu_backward`]; the router bias gets
//! `Σ_rows dlogit`.

use candle_core::{DType, Tensor, D};
use mt_core::ExpertKind;

use super::host::HostSaved;
use super::{clamped_glu_backward, Experts, RouterGrad};
use crate::mlp::swiglu_backward;
use crate::ops::{linear_backward, matmul_wide, wide_dtype};
use crate::weights::names;
use crate::{GradSink, Result};

/// Back-propagates `dy: [rows, h]` (the gradient of the MoE output) through one tile; returns
/// `dc`, the gradient of the post-attention-norm output `c`.
pub(crate) fn backward(
    ex: &Experts<'_>,
    c: &Tensor,
    s: HostSaved,
    dy: &Tensor,
    grads: &GradSink,
    aux: Option<&RouterGrad>,
) -> Result<Tensor> {
    let (rows, h) = dy.dims2()?;
    let (dtype, dev) = (dy.dtype(), dy.device());
    let ne = ex.router.dim(0)?;
    let gpt_oss = ex.gpt_oss();
    let k = s.top.len() / rows.max(1);
    let acc = wide_dtype(dy);
    let mut dc = Tensor::zeros((rows, h), acc, dev)?;
    // dL/dw for every slot (t, j).
    let mut dw = vec![0f64; rows * k];
    for x in &s.experts {
        let e = x.expert;
        let dy_e = dy.index_select(&x.idx, 0)?;
        // dout_e W_down[e], before the routing weight: `dw` is its dot with mid (plus, with a
        // down bias, its dot with that).
        let g = matmul_wide(&dy_e, &ex.down_out_in(e)?)?;
        let mut dw_e = (&g * x.mid.to_dtype(acc)?)?.sum(D::Minus1)?;
        if let Some(b) = ex.down_bias(e)? {
            dw_e = (dw_e + dy_e.to_dtype(acc)?.broadcast_mul(&b.to_dtype(acc)?)?.sum(D::Minus1)?)?;
        }
        for (&slot, d) in x.slots.iter().zip(dw_e.to_dtype(DType::F64)?.to_vec1::<f64>()?) {
            dw[slot] = d;
        }
        let w = s.weight_column(&x.slots, dtype, acc, dev)?;
        let d_mid = g.broadcast_mul(&w)?.to_dtype(dtype)?;
        drop(g);
        let dy_scaled = dy_e.to_dtype(acc)?.broadcast_mul(&w)?.to_dtype(dtype)?;
        if gpt_oss {
            grads.accumulate_matmul_expert(names::EXPERTS_DOWN, e, &x.mid, &dy_scaled)?;
            grads.accumulate_expert_col_sums(names::EXPERTS_DOWN_BIAS, e, &dy_scaled)?;
        } else {
            grads.accumulate_matmul_expert(names::EXPERTS_DOWN, e, &dy_scaled, &x.mid)?;
        }
        drop((dy_scaled, dy_e));
        let c_e = c.index_select(&x.idx, 0)?;
        let d_gu = match ex.kind {
            ExpertKind::SwiGlu => {
                let (d_gate, d_up) = swiglu_backward(&d_mid, &x.gate, &x.up, x.act.as_ref())?;
                let d_gu = Tensor::cat(&[&d_gate, &d_up], 1)?;
                grads.accumulate_matmul_expert(names::EXPERTS_GATE_UP, e, &d_gu, &c_e)?;
                d_gu
            }
            ExpertKind::GptOss(glu) => {
                let (d_gate, d_up) = clamped_glu_backward(glu, &d_mid, &x.gate, &x.up)?;
                // Back to alternate columns, as the parameters hold them.
                let d_gu =
                    Tensor::stack(&[&d_gate, &d_up], 2)?.reshape((d_gate.dim(0)?, 2 * d_gate.dim(1)?))?;
                grads.accumulate_matmul_expert(names::EXPERTS_GATE_UP, e, &c_e, &d_gu)?;
                grads.accumulate_expert_col_sums(names::EXPERTS_GATE_UP_BIAS, e, &d_gu)?;
                d_gu
            }
        };
        drop(d_mid);
        let dc_e = matmul_wide(&d_gu, &ex.gate_up_out_in(e)?)?;
        dc = dc.index_add(&x.idx, &dc_e, 0)?;
    }
    let aux = aux.map(RouterGrad::dprob).transpose()?;
    let dlogit = router_backward(&s, &dw, ne, k, aux.as_deref());
    let dlogit = Tensor::from_vec(dlogit, (rows, ne), dev)?.to_dtype(dtype)?;
    let (router, bias) =
        if gpt_oss { (names::GPT_OSS_ROUTER, Some(names::ROUTER_BIAS)) } else { (names::ROUTER, None) };
    let dc_router = linear_backward(&dlogit, c, ex.router, grads, router, bias)?;
    Ok((dc + dc_router.to_dtype(acc)?)?.to_dtype(dtype)?)
}

/// `dL/dlogits` `[rows, E]` (row-major, f64) from the routing weights' gradient `dw`
/// `[rows, k]` and the load-balancing loss's `aux` (`dL/dp[t, e]` for every row).
fn router_backward(s: &HostSaved, dw: &[f64], ne: usize, k: usize, aux: Option<&[f64]>) -> Vec<f64> {
    let normalise = s.normalised;
    let mut out = Vec::with_capacity(s.probs.len());
    let mut dp = vec![0f64; ne];
    for ((p, top), dw) in s.probs.chunks_exact(ne).zip(s.top.chunks_exact(k)).zip(dw.chunks_exact(k)) {
        match aux {
            Some(a) => dp.copy_from_slice(a),
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

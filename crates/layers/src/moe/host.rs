//! The portable MoE path: the routing decided on the host (the router's probabilities read back
//! once per tile; on a GPU a device-to-host copy inside the compute stream, which waits for the
//! copies queued before it), then each expert's rows gathered and run through its own GLU by
//! candle ops, the outputs weighted and added back with `index_add`. Every expert kind and dtype,
//! on every device; the reference the device kernels (`super::device`) are held to.

use candle_core::{DType, Tensor};
use mt_core::MoeConfig;

use super::{Experts, RouterStats};
use crate::ops::{linear, matmul_wide, wide_dtype};
use crate::Result;

/// What the backward needs of one tile of a MoE layer routed on the host.
pub(crate) struct HostSaved {
    /// Router probabilities `[rows, E]` (f32), on the host.
    pub(crate) probs: Vec<f32>,
    /// Each row's k experts in top-k order `[rows, k]`.
    pub(crate) top: Vec<u32>,
    /// Their routing weights (f32, before the cast to the compute dtype).
    pub(crate) weights: Vec<f32>,
    /// The weights are the top-k probabilities divided by their sum (`norm_topk_prob`).
    pub(crate) normalised: bool,
    /// The experts that received rows, in expert order.
    pub(crate) experts: Vec<ExpertSaved>,
}

/// One expert's share of a tile.
pub(crate) struct ExpertSaved {
    pub(crate) expert: usize,
    /// Its rows' slots `t·k + j` (row `t`, top-k position `j`), ascending in `t`.
    pub(crate) slots: Vec<usize>,
    /// The rows `t`, `[n_e]` u32 on the device.
    pub(crate) idx: Tensor,
    /// The gate and up projections (biases included), before any clamp, `[n_e, f_e]`.
    pub(crate) gate: Tensor,
    pub(crate) up: Tensor,
    /// `silu(gate)`, `None` on the fused CUDA path and for the clamped GLU (recomputed).
    pub(crate) act: Option<Tensor>,
    /// The GLU's output, the input of the down projection, `[n_e, f_e]`.
    pub(crate) mid: Tensor,
}

impl HostSaved {
    /// Bytes of its device tensors (what `DecoderLayer::kept_state_bytes` counts).
    pub(crate) fn bytes(&self) -> u64 {
        let t = |x: &Tensor| (x.elem_count() * x.dtype().size_in_bytes()) as u64;
        self.experts
            .iter()
            .map(|x| t(&x.idx) + t(&x.gate) + t(&x.up) + x.act.as_ref().map_or(0, t) + t(&x.mid))
            .sum()
    }

    /// The routing weights of `slots` as a column `[n, 1]` of `dtype`, rounded through the
    /// compute dtype `compute` first (transformers casts them to the model's dtype).
    pub(crate) fn weight_column(
        &self,
        slots: &[usize],
        compute: DType,
        dtype: DType,
        dev: &candle_core::Device,
    ) -> Result<Tensor> {
        let w: Vec<f32> = slots.iter().map(|&s| self.weights[s]).collect();
        let col = Tensor::from_vec(w, (slots.len(), 1), dev)?;
        Ok(col.to_dtype(compute)?.to_dtype(dtype)?)
    }
}

/// Softmax over each row of `logits` (`[rows, E]` row-major), evaluated in f64 and rounded to
/// f32 once.
fn softmax_rows(logits: &[f32], e: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(logits.len());
    for row in logits.chunks_exact(e) {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let exps: Vec<f64> = row.iter().map(|&x| (f64::from(x) - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        out.extend(exps.iter().map(|&x| (x / sum) as f32));
    }
    out
}

/// Each row's `k` largest probabilities (ties to the lower expert index) and their routing
/// weights: the probabilities themselves, or divided by their sum (in f64, rounded once) when
/// `normalise`.
fn top_k(probs: &[f32], e: usize, k: usize, normalise: bool) -> (Vec<u32>, Vec<f32>) {
    let mut top = Vec::with_capacity(probs.len() / e * k);
    let mut weights = Vec::with_capacity(top.capacity());
    let mut order: Vec<u32> = Vec::with_capacity(e);
    for row in probs.chunks_exact(e) {
        order.clear();
        order.extend(0..e as u32);
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        let chosen = &order[..k];
        let sum: f64 = chosen.iter().map(|&x| f64::from(row[x as usize])).sum();
        for &x in chosen {
            let p = row[x as usize];
            top.push(x);
            weights.push(if normalise { (f64::from(p) / sum) as f32 } else { p });
        }
    }
    (top, weights)
}

/// The MoE MLP of one tile routed on the host, from the post-attention-norm output `c: [rows, h]`: what the
/// backward needs and, when `want_out`, the tile's output `x1 + Σ_j w_j · expert_j(c)`. The
/// tile's router statistics are added to `stats` when given.
pub(crate) fn forward(
    m: &MoeConfig,
    ex: &Experts<'_>,
    c: &Tensor,
    x1: &Tensor,
    want_out: bool,
    stats: Option<&mut RouterStats>,
) -> Result<(Option<Tensor>, HostSaved)> {
    let (rows, h) = c.dims2()?;
    let (ne, k, fe) = (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size);
    let (dtype, dev) = (c.dtype(), c.device());
    let logits =
        linear(c, ex.router, ex.router_bias)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let probs = softmax_rows(&logits, ne);
    let (top, weights) = top_k(&probs, ne, k, m.norm_topk_prob);
    if let Some(s) = stats {
        s.add(&probs, &top);
    }
    let mut saved = HostSaved { probs, top, weights, normalised: m.norm_topk_prob, experts: Vec::new() };
    // Group the rows by expert (ascending rows within each).
    let mut slots: Vec<Vec<usize>> = vec![Vec::new(); ne];
    for (s, &x) in saved.top.iter().enumerate() {
        slots[x as usize].push(s);
    }
    let acc_dtype = wide_dtype(c);
    let mut acc = if want_out { Some(Tensor::zeros((rows, h), acc_dtype, dev)?) } else { None };
    for (expert, slots) in slots.into_iter().enumerate() {
        if slots.is_empty() {
            continue;
        }
        let rows_e: Vec<u32> = slots.iter().map(|&s| (s / k) as u32).collect();
        let n_e = rows_e.len();
        let idx = Tensor::from_vec(rows_e, n_e, dev)?;
        let ce = c.index_select(&idx, 0)?;
        let (gate, up) = ex.gate_up(expert, &ce, fe)?;
        let (act, mid) = ex.glu(&gate, &up)?;
        if let Some(acc) = acc.as_mut() {
            let y = matmul_wide(&mid, &ex.down_out_in(expert)?.t()?)?;
            // GPT-OSS: the down bias before the routing weight.
            let y = match ex.down_bias(expert)? {
                Some(b) => y.broadcast_add(&b.to_dtype(acc_dtype)?)?,
                None => y,
            };
            let w = saved.weight_column(&slots, dtype, acc_dtype, dev)?;
            *acc = acc.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
        saved.experts.push(ExpertSaved { expert, slots, idx, gate, up, act, mid });
    }
    let out = match acc {
        Some(acc) => Some((x1.to_dtype(acc_dtype)? + acc)?.to_dtype(dtype)?),
        None => None,
    };
    Ok((out, saved))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_picks_the_largest_and_renormalises() {
        let probs = [0.1f32, 0.4, 0.2, 0.3, 0.25, 0.25, 0.3, 0.2];
        let (top, w) = top_k(&probs, 4, 2, false);
        assert_eq!(top, [1, 3, 2, 0]);
        assert_eq!(w, [0.4, 0.3, 0.3, 0.25]);
        let (_, w) = top_k(&probs, 4, 2, true);
        assert!((w[0] - 4.0 / 7.0).abs() < 1e-7 && (w[2] - 0.3 / 0.55).abs() < 1e-7);
    }

    /// A non-finite router logit (a step the engine will skip) must not panic the routing: the
    /// step has to reach its end, where the skip is decided.
    #[test]
    fn a_nan_or_infinite_row_routes_without_a_panic() {
        let probs = softmax_rows(&[f32::NAN, 0.0, 1.0, 2.0, f32::INFINITY, 0.0, 1.0, 2.0], 4);
        let (top, w) = top_k(&probs, 4, 2, true);
        assert_eq!(top.len(), 4);
        assert!(w.iter().any(|x| !x.is_finite()));
    }
}

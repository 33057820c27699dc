//! The reference model's mixture-of-experts block, written densely: every expert runs on every
//! token and is weighted by a routing matrix that is zero off each token's top-k, so autograd
//! gives an expert that received no token an exact zero gradient. Shares no code with the
//! engine's grouped implementation (`mt-layers`' `moe.rs`), which it checks.

use candle_core::{Device, Tensor, D};
use mt_core::MoeConfig;

use crate::reference::{linear, silu, softmax_last_dim, ReferenceModel};
use crate::Result;

/// One MoE layer's routing: its router logits and probabilities `[n, E]` (on the autograd
/// graph) and how many of the layer's top-k picks went to each expert.
pub(crate) struct Routing {
    pub(crate) logits: Tensor,
    probs: Tensor,
    counts: Vec<f64>,
}

impl ReferenceModel {
    /// `Σ_e w[:, e] ⊙ expert_e(c)` for `c: [n, h]`, with `w` the router's softmax kept on each
    /// row's top-k (renormalised over them when `norm_topk_prob`), as transformers' modelling code.
    pub(crate) fn moe_block(&self, i: usize, c: &Tensor, m: &MoeConfig) -> Result<(Tensor, Routing)> {
        let (ne, k, f) = (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size);
        let logits = linear(c, self.layer_w(i, "mlp.gate.weight")?, None)?;
        let probs = softmax_last_dim(&logits)?;
        // The top-k mask, from the probabilities' values (no gradient flows through a choice).
        let values = probs.to_dtype(candle_core::DType::F64)?.to_vec2::<f64>()?;
        let mut mask = Vec::with_capacity(values.len() * ne);
        let mut counts = vec![0.0; ne];
        for row in &values {
            let mut order: Vec<usize> = (0..ne).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            let mut keep = vec![0.0f64; ne];
            for &e in &order[..k] {
                keep[e] = 1.0;
                counts[e] += 1.0;
            }
            mask.extend(keep);
        }
        let mask = Tensor::from_vec(mask, (values.len(), ne), &Device::Cpu)?.to_dtype(probs.dtype())?;
        let picked = (&probs * mask)?;
        let weights =
            if m.norm_topk_prob { picked.broadcast_div(&picked.sum_keepdim(D::Minus1)?)? } else { picked };
        let gate_up = self.layer_w(i, "mlp.experts.gate_up_proj")?;
        let down = self.layer_w(i, "mlp.experts.down_proj")?;
        let mut out = c.zeros_like()?;
        for e in 0..ne {
            let gu = gate_up.get(e)?;
            let gate = linear(c, &gu.narrow(0, 0, f)?, None)?;
            let up = linear(c, &gu.narrow(0, f, f)?, None)?;
            let y = linear(&(silu(&gate)? * up)?, &down.get(e)?, None)?;
            out = (out + y.broadcast_mul(&weights.narrow(1, e, 1)?)?)?;
        }
        Ok((out, Routing { logits, probs, counts }))
    }
}

/// transformers' `load_balancing_loss_func` over every layer's router rows (no attention mask):
/// `E · Σ_e (c_e / N) · (P_e / N)`, `c_e` the top-k picks of expert `e` and `P_e` the sum of its
/// probabilities over all `N` rows of all layers. On the autograd graph through `P_e` only.
pub(crate) fn load_balancing_loss(routing: &[Routing]) -> Result<Tensor> {
    let ne = routing[0].counts.len();
    let mut counts = vec![0.0; ne];
    let mut rows = 0usize;
    let mut prob_sum: Option<Tensor> = None;
    for r in routing {
        for (c, x) in counts.iter_mut().zip(&r.counts) {
            *c += x;
        }
        rows += r.probs.dim(0)?;
        let s = r.probs.sum(0)?;
        prob_sum = Some(match prob_sum {
            Some(p) => (p + s)?,
            None => s,
        });
    }
    let n = rows as f64;
    let p = prob_sum.expect("a MoE model has at least one layer");
    let c = Tensor::from_vec(counts, ne, &Device::Cpu)?.to_dtype(p.dtype())?;
    Ok(((c * p)?.sum_all()? * (ne as f64 / (n * n)))?)
}

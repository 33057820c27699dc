//! The reference model's mixture-of-experts block, written densely: every expert runs on every
//! token and is weighted by a routing matrix that is zero off each token's top-k, so autograd
//! gives an expert that received no token an exact zero gradient. Shares no code with the
//! engine's grouped implementation (`mt-layers`' `moe.rs`), which it checks. GPT-OSS's block
//! follows its modelling code literally: the top-k of the router logits, their softmax, and each
//! expert's interleaved, biased, clamped GLU.

use candle_core::{Device, Tensor, D};
use mt_core::{ClampedGlu, MoeConfig};

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

impl ReferenceModel {
    /// GPT-OSS's MoE block for `c: [n, h]`: `logits = c Wᵀ + b`, each row's top-k logits
    /// softmaxed among themselves (zero elsewhere), and for each expert `e`
    /// `gu = c · gate_up_proj[e] + gate_up_proj_bias[e]` (`[h, 2f]`: gate at even columns, up at
    /// odd ones), `g = min(gate, L)`, `u = clamp(up, -L, L)`,
    /// `y = ((u + 1) · g σ(α g)) · down_proj[e] + down_proj_bias[e]`. The clamps are masks taken
    /// from the values (no gradient where they bind).
    pub(crate) fn gpt_oss_moe_block(
        &self,
        i: usize,
        c: &Tensor,
        m: &MoeConfig,
        glu: ClampedGlu,
    ) -> Result<(Tensor, Routing)> {
        let (ne, k, f) = (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size);
        let n = c.dim(0)?;
        let logits =
            linear(c, self.layer_w(i, "mlp.router.weight")?, Some(self.layer_w(i, "mlp.router.bias")?))?;
        let values = logits.to_dtype(candle_core::DType::F64)?.to_vec2::<f64>()?;
        let mut keep = vec![0.0f64; n * ne];
        let mut counts = vec![0.0; ne];
        for (r, row) in values.iter().enumerate() {
            let mut order: Vec<usize> = (0..ne).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            for &e in &order[..k] {
                keep[r * ne + e] = 1.0;
                counts[e] += 1.0;
            }
        }
        let keep = Tensor::from_vec(keep, (n, ne), &Device::Cpu)?.to_dtype(logits.dtype())?;
        // Softmax over the kept logits only (the others contribute e^{-inf} = 0).
        let max = logits.max_keepdim(D::Minus1)?.detach();
        let e = (logits.broadcast_sub(&max)?.exp()? * keep)?;
        let weights = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let gate_up = self.layer_w(i, "mlp.experts.gate_up_proj")?;
        let gate_up_bias = self.layer_w(i, "mlp.experts.gate_up_proj_bias")?;
        let down = self.layer_w(i, "mlp.experts.down_proj")?;
        let down_bias = self.layer_w(i, "mlp.experts.down_proj_bias")?;
        let mut out = c.zeros_like()?;
        for x in 0..ne {
            let gu = c.matmul(&gate_up.get(x)?)?.broadcast_add(&gate_up_bias.get(x)?)?.reshape((n, f, 2))?;
            let gate = gu.narrow(2, 0, 1)?.squeeze(2)?;
            let up = gu.narrow(2, 1, 1)?.squeeze(2)?;
            let gate = clamp_to(&gate, None, glu.limit)?;
            let up = clamp_to(&up, Some(-glu.limit), glu.limit)?;
            let sig = ((gate.affine(-glu.alpha, 0.0)?.exp()? + 1.0)?).recip()?;
            let mid = ((up + 1.0)? * (gate * sig)?)?;
            let y = mid.matmul(&down.get(x)?)?.broadcast_add(&down_bias.get(x)?)?;
            out = (out + y.broadcast_mul(&weights.narrow(1, x, 1)?)?)?;
        }
        let probs = softmax_last_dim(&logits)?;
        Ok((out, Routing { logits, probs, counts }))
    }
}

/// `x` with values above `hi` (below `lo`) replaced by the bound, through masks of the values:
/// the gradient passes where `lo <= x <= hi` (torch's clamp) and nowhere else.
fn clamp_to(x: &Tensor, lo: Option<f64>, hi: f64) -> Result<Tensor> {
    let mut open = x.le(hi)?.to_dtype(x.dtype())?;
    if let Some(lo) = lo {
        open = (open * x.ge(lo)?.to_dtype(x.dtype())?)?;
    }
    let bound = x.ge(hi)?.to_dtype(x.dtype())?.affine(hi, 0.0)?;
    let bound = match lo {
        Some(lo) => (bound + x.le(lo)?.to_dtype(x.dtype())?.affine(lo, 0.0)?)?,
        None => bound,
    };
    let closed = open.affine(-1.0, 1.0)?;
    Ok(((x * &open)? + (bound * closed)?)?)
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

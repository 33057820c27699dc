//! The mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS), forward: a linear router,
//! softmax, top-k, each token's rows grouped by expert (no capacity limit: every token reaches
//! its k experts), one GLU per expert over its rows, the outputs weighted and summed per token;
//! and the statistics of the load-balancing loss.
//!
//! GPT-OSS's router has a bias and takes the softmax of the top-k logits, which is the top-k of
//! the softmax renormalised (`norm_topk_prob`), in value and in gradient; its experts have
//! biases, store their matrices `[in, out]` with gate and up in alternate columns, and apply the
//! clamped GLU `(clamp(up, ±L) + 1) · g σ(α g)`, `g = min(gate, L)` ([`ExpertKind::GptOss`]).
//!
//! Numerics, as transformers' modelling code: the router logits in the compute dtype, their
//! softmax, top-k and the renormalisation (`norm_topk_prob`, Mixtral always) in f32 (here
//! evaluated in f64 on the host and rounded to f32 once), the routing weights cast to the
//! compute dtype. On the CPU in f32 the expert outputs are weighted and summed with the
//! residual in f64 and rounded once (`ops::is_wide`); elsewhere summed in f32.
//!
//! The routing is decided on the host: the router's probabilities are read back once per tile
//! (on a GPU a device-to-host copy inside the compute stream, which waits for the copies queued
//! before it: correct, not yet fast; a device-side grouping is future work).

use candle_core::{DType, Tensor};
use mt_core::{ClampedGlu, ExpertKind, MoeConfig};

use crate::mlp::swiglu;
use crate::ops::{linear, matmul_wide, wide_dtype};
use crate::weights::MlpWeights;
use crate::Result;

/// The router statistics of a step's forwards, over every MoE layer and every chunk: per
/// expert, how many (token, top-k slot) routings chose it (`c_e`) and the sum of its router
/// probabilities (`P_e`), and how many router rows there were (`N` = tokens × MoE layers).
/// transformers' load-balancing loss is a function of these alone
/// ([`RouterStats::aux_loss`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RouterStats {
    counts: Vec<u64>,
    prob_sums: Vec<f64>,
    rows: u64,
}

/// The gradient of the weighted load-balancing loss with respect to every router probability
/// `p[t, e]` of every MoE layer: `dprob[e]` for every row (see [`RouterStats::grad`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RouterGrad {
    dprob: Vec<f64>,
}

impl RouterStats {
    /// Empty statistics for `n_experts` experts.
    pub fn new(n_experts: usize) -> Self {
        RouterStats { counts: vec![0; n_experts], prob_sums: vec![0.0; n_experts], rows: 0 }
    }

    /// Router rows seen so far (tokens × MoE layer forwards).
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Routings per expert so far (each token counts once for each of its k experts).
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// Adds one tile's rows: `probs` `[rows, E]` row-major, `top` `[rows, k]` expert indices.
    fn add(&mut self, probs: &[f32], top: &[u32]) {
        let e = self.counts.len();
        for row in probs.chunks_exact(e) {
            for (s, &p) in self.prob_sums.iter_mut().zip(row) {
                *s += f64::from(p);
            }
        }
        for &x in top {
            self.counts[x as usize] += 1;
        }
        self.rows += (probs.len() / e) as u64;
    }

    /// transformers' `load_balancing_loss_func` over the router logits of every layer
    /// concatenated, without an attention mask (every token of the batch counts, padding
    /// included, as when the model is called without `attention_mask`):
    /// `E · Σ_e (c_e / N) · (P_e / N)`. Zero before any row.
    pub fn aux_loss(&self) -> f64 {
        if self.rows == 0 {
            return 0.0;
        }
        let n = self.rows as f64;
        let e = self.counts.len() as f64;
        let dot: f64 = self.counts.iter().zip(&self.prob_sums).map(|(&c, &p)| c as f64 * p).sum();
        e * dot / (n * n)
    }

    /// The gradient of `coef · aux_loss` with respect to each router probability `p[t, e]`
    /// (any row, any layer): `coef · E · c_e / N²`. The counts are piecewise constant in the
    /// logits (transformers takes no gradient through them either).
    pub fn grad(&self, coef: f64) -> RouterGrad {
        let n = (self.rows.max(1)) as f64;
        let scale = coef * self.counts.len() as f64 / (n * n);
        RouterGrad { dprob: self.counts.iter().map(|&c| scale * c as f64).collect() }
    }
}

impl RouterGrad {
    /// `dL/dp[t, e]` for expert `e`, the same for every row.
    pub(crate) fn dprob(&self) -> &[f64] {
        &self.dprob
    }
}

/// What the backward needs of one tile of a MoE layer.
pub(crate) struct MoeSaved {
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

impl MoeSaved {
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

/// Views of one MoE layer's router and experts ([`MlpWeights::Moe`]) with their kind.
pub(crate) struct Experts<'a> {
    pub(crate) kind: ExpertKind,
    pub(crate) router: &'a Tensor,
    pub(crate) router_bias: Option<&'a Tensor>,
    gate_up: &'a Tensor,
    gate_up_bias: Option<&'a Tensor>,
    down: &'a Tensor,
    down_bias: Option<&'a Tensor>,
}

impl<'a> Experts<'a> {
    /// The experts of `w`, a MoE layer's MLP weights.
    pub(crate) fn of(m: &MoeConfig, w: &'a MlpWeights) -> Self {
        let MlpWeights::Moe { router, router_bias, gate_up, gate_up_bias, down, down_bias } = w else {
            unreachable!("MoE experts are bound only for a MoE config")
        };
        Experts {
            kind: m.experts,
            router,
            router_bias: router_bias.as_ref(),
            gate_up,
            gate_up_bias: gate_up_bias.as_ref(),
            down,
            down_bias: down_bias.as_ref(),
        }
    }

    /// Expert `e`'s gate-and-up matrix as `[2·f_e, h]` (`[out, in]`; GPT-OSS's transposed
    /// view, its rows alternating gate and up).
    pub(crate) fn gate_up_out_in(&self, e: usize) -> Result<Tensor> {
        let w = self.gate_up.get(e)?;
        Ok(if self.gpt_oss() { w.t()? } else { w })
    }

    /// Expert `e`'s down matrix as `[h, f_e]` (`[out, in]`).
    pub(crate) fn down_out_in(&self, e: usize) -> Result<Tensor> {
        let w = self.down.get(e)?;
        Ok(if self.gpt_oss() { w.t()? } else { w })
    }

    /// Expert `e`'s down bias `[h]` (GPT-OSS).
    pub(crate) fn down_bias(&self, e: usize) -> Result<Option<Tensor>> {
        Ok(self.down_bias.map(|b| b.get(e)).transpose()?)
    }

    pub(crate) fn gpt_oss(&self) -> bool {
        matches!(self.kind, ExpertKind::GptOss(_))
    }

    /// Expert `e`'s gate and up projections (biases added) of its rows `ce: [n_e, h]`.
    fn gate_up(&self, e: usize, ce: &Tensor, fe: usize) -> Result<(Tensor, Tensor)> {
        let bias = self.gate_up_bias.map(|b| b.get(e)).transpose()?;
        let gu = linear(ce, &self.gate_up_out_in(e)?, bias.as_ref())?;
        if self.gpt_oss() {
            // Alternate columns: gate at even, up at odd ones.
            let gu = gu.reshape((ce.dim(0)?, fe, 2))?;
            let pick = |j| -> Result<Tensor> { Ok(gu.narrow(2, j, 1)?.squeeze(2)?.contiguous()?) };
            return Ok((pick(0)?, pick(1)?));
        }
        Ok((gu.narrow(1, 0, fe)?.contiguous()?, gu.narrow(1, fe, fe)?.contiguous()?))
    }

    /// The GLU of `gate` and `up`: `(silu(gate) when kept, its output)`.
    fn glu(&self, gate: &Tensor, up: &Tensor) -> Result<(Option<Tensor>, Tensor)> {
        match self.kind {
            ExpertKind::SwiGlu => swiglu(gate, up),
            ExpertKind::GptOss(glu) => Ok((None, clamped_glu(glu, gate, up)?)),
        }
    }
}

/// GPT-OSS's GLU, `(clamp(up, -L, L) + 1) · g σ(α g)` with `g = min(gate, L)`, evaluated in
/// [`wide_dtype`] and rounded to `gate`'s dtype once.
fn clamped_glu(glu: ClampedGlu, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let wd = wide_dtype(gate);
    let g = gate.to_dtype(wd)?.minimum(glu.limit)?;
    let u = up.to_dtype(wd)?.clamp(-glu.limit, glu.limit)?;
    let sig = ((&g * -glu.alpha)?.exp()? + 1.0)?.recip()?;
    Ok(((u + 1.0)? * (g * sig)?)?.to_dtype(gate.dtype())?)
}

/// Backward of [`clamped_glu`] for `d = dL/d(out)`: with `s = σ(α g)`,
/// `∂out/∂up = g s` where `-L <= up <= L` (0 where the clamp binds: torch's clamp passes the
/// gradient on its bounds), `∂out/∂gate = (u + 1) (s + α g s (1 - s))` where `gate <= L`.
/// Returns `(d_gate, d_up)` in `d`'s dtype.
pub(crate) fn clamped_glu_backward(
    glu: ClampedGlu,
    d: &Tensor,
    gate: &Tensor,
    up: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let wd = wide_dtype(d);
    let (gate, up) = (gate.to_dtype(wd)?, up.to_dtype(wd)?);
    let g = gate.minimum(glu.limit)?;
    let u = up.clamp(-glu.limit, glu.limit)?;
    let sig = ((&g * -glu.alpha)?.exp()? + 1.0)?.recip()?;
    let gate_open = gate.le(glu.limit)?.to_dtype(wd)?;
    let up_open = (up.ge(-glu.limit)?.to_dtype(wd)? * up.le(glu.limit)?.to_dtype(wd)?)?;
    let ds = d.to_dtype(wd)?;
    let d_up = ((&ds * (&g * &sig)?)? * up_open)?;
    let slope = (&sig + ((&g * glu.alpha)? * (&sig * (1.0 - &sig)?)?)?)?;
    let d_gate = (((ds * (u + 1.0)?)? * slope)? * gate_open)?;
    Ok((d_gate.to_dtype(d.dtype())?, d_up.to_dtype(d.dtype())?))
}

/// The MoE MLP of one tile, from the post-attention-norm output `c: [rows, h]`: what the
/// backward needs and, when `want_out`, the tile's output `x1 + Σ_j w_j · expert_j(c)`. The
/// tile's router statistics are added to `stats` when given.
pub(crate) fn forward(
    m: &MoeConfig,
    w: &MlpWeights,
    c: &Tensor,
    x1: &Tensor,
    want_out: bool,
    stats: Option<&mut RouterStats>,
) -> Result<(Option<Tensor>, MoeSaved)> {
    let (rows, h) = c.dims2()?;
    let (ne, k, fe) = (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size);
    let (dtype, dev) = (c.dtype(), c.device());
    let ex = Experts::of(m, w);
    let logits =
        linear(c, ex.router, ex.router_bias)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let probs = softmax_rows(&logits, ne);
    let (top, weights) = top_k(&probs, ne, k, m.norm_topk_prob);
    if let Some(s) = stats {
        s.add(&probs, &top);
    }
    let mut saved = MoeSaved { probs, top, weights, normalised: m.norm_topk_prob, experts: Vec::new() };
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

    #[test]
    fn aux_loss_is_transformers_formula() {
        // 2 experts, 2 rows, top-1: both rows pick expert 0.
        let mut s = RouterStats::new(2);
        s.add(&[0.75, 0.25, 0.5, 0.5], &[0, 0]);
        // E · Σ_e (c_e/N)(P_e/N) = 2 · (2/2 · 1.25/2 + 0) = 1.25.
        assert!((s.aux_loss() - 1.25).abs() < 1e-15);
        let g = s.grad(0.1);
        assert_eq!(g.dprob(), [0.1 * 2.0 * 2.0 / 4.0, 0.0]);
        assert_eq!(RouterStats::new(3).aux_loss(), 0.0);
    }
}

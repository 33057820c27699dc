//! The router statistics of a step's forwards ([`RouterStats`]) and the gradient of the
//! load-balancing loss at the router probabilities ([`RouterGrad`]). Where the routing ran on the
//! host they are host numbers; where the device kernels routed (`super::device`) they stay on the
//! device, f64 `[E]` tensors added to tile by tile, so that nothing is read back mid-step: the
//! loss is a device scalar, read with the chunks' losses at the step's end, and its gradient a
//! device tensor the router's backward reads there.

use std::borrow::Cow;

use candle_core::{DType, Tensor};

use crate::Result;

/// The router statistics of a step's forwards, over every MoE layer and every chunk: per
/// expert, how many (token, top-k slot) routings chose it (`c_e`) and the sum of its router
/// probabilities (`P_e`), and how many router rows there were (`N` = tokens × MoE layers).
/// transformers' load-balancing loss is a function of these alone
/// ([`RouterStats::aux_loss`]).
#[derive(Debug, Clone)]
pub struct RouterStats {
    counts: Vec<u64>,
    prob_sums: Vec<f64>,
    rows: u64,
    /// The device-routed tiles' share: `(c_e, P_e)` as f64 `[E]` tensors (counts are exact in
    /// f64 up to 2^53).
    device: Option<(Tensor, Tensor)>,
}

/// The gradient of the weighted load-balancing loss with respect to every router probability
/// `p[t, e]` of every MoE layer: `dprob[e]` for every row (see [`RouterStats::grad`]), on the
/// host or, where the statistics were gathered there, on the device.
#[derive(Debug, Clone)]
pub struct RouterGrad {
    dprob: Dprob,
}

#[derive(Debug, Clone)]
enum Dprob {
    Host(Vec<f64>),
    /// f64 `[E]`.
    Device(Tensor),
}

impl RouterStats {
    /// Empty statistics for `n_experts` experts.
    pub fn new(n_experts: usize) -> Self {
        RouterStats { counts: vec![0; n_experts], prob_sums: vec![0.0; n_experts], rows: 0, device: None }
    }

    /// Router rows seen so far (tokens × MoE layer forwards).
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Routings per expert so far (each token counts once for each of its k experts); the
    /// device's share is read back.
    pub fn counts(&self) -> Result<Vec<u64>> {
        Ok(self.totals()?.0.iter().map(|&c| c as u64).collect())
    }

    /// Adds one tile's rows routed on the host: `probs` `[rows, E]` row-major, `top` `[rows, k]`
    /// expert indices.
    pub(super) fn add(&mut self, probs: &[f32], top: &[u32]) {
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

    /// Adds one tile routed on the device (`counts` u32 `[E]`, `probs` f32 `[rows, E]`): the
    /// counts are widened and added, the probabilities summed by `add_prob_sums` into the f64
    /// sums, all on the device.
    #[cfg(feature = "cuda")]
    pub(super) fn add_device(
        &mut self,
        counts: &Tensor,
        probs: &Tensor,
        add_prob_sums: impl FnOnce(&Tensor) -> Result<()>,
    ) -> Result<()> {
        let e = self.counts.len();
        let (rows, pe) = probs.dims2()?;
        if pe != e || counts.dims() != [e] {
            return Err(crate::Error::shape(
                "device router statistics",
                format!("[{e}] counts, [rows, {e}] probabilities"),
                probs.dims(),
            ));
        }
        let (c, p) = match self.device.take() {
            Some(acc) => acc,
            None => (
                Tensor::zeros(e, DType::F64, counts.device())?,
                Tensor::zeros(e, DType::F64, counts.device())?,
            ),
        };
        add_prob_sums(&p)?;
        let c = (c + counts.to_dtype(DType::F64)?)?;
        self.device = Some((c, p));
        self.rows += rows as u64;
        Ok(())
    }

    /// `(c_e, P_e)` of every row so far, the device's share read back.
    fn totals(&self) -> Result<(Vec<f64>, Vec<f64>)> {
        let mut counts: Vec<f64> = self.counts.iter().map(|&c| c as f64).collect();
        let mut sums = self.prob_sums.clone();
        if let Some((c, p)) = &self.device {
            for (x, d) in counts.iter_mut().zip(c.to_vec1::<f64>()?) {
                *x += d;
            }
            for (x, d) in sums.iter_mut().zip(p.to_vec1::<f64>()?) {
                *x += d;
            }
        }
        Ok((counts, sums))
    }

    /// transformers' `load_balancing_loss_func` over the router logits of every layer
    /// concatenated, without an attention mask (every token of the batch counts, padding
    /// included, as when the model is called without `attention_mask`):
    /// `E · Σ_e (c_e / N) · (P_e / N)`. Zero before any row. The device's share is read back.
    pub fn aux_loss(&self) -> Result<f64> {
        let (counts, sums) = self.totals()?;
        Ok(aux_loss(&counts, &sums, self.rows))
    }

    /// `coef · aux_loss` as an f64 scalar tensor: on the host, or, where the statistics are on
    /// the device, computed there (the same formula; nothing read back until the caller reads
    /// the scalar).
    pub fn weighted_loss(&self, coef: f64) -> Result<Tensor> {
        let Some((c, p)) = self.device_totals()? else {
            return Ok(Tensor::new(
                coef * aux_loss(&self.counts_f64(), &self.prob_sums, self.rows),
                &candle_core::Device::Cpu,
            )?);
        };
        if self.rows == 0 {
            return Ok(Tensor::zeros((), DType::F64, c.device())?);
        }
        let n = self.rows as f64;
        let e = self.counts.len() as f64;
        let dot = (c * p)?.sum_all()?;
        Ok(((dot * e)? * (coef / (n * n)))?)
    }

    /// The gradient of `coef · aux_loss` with respect to each router probability `p[t, e]`
    /// (any row, any layer): `coef · E · c_e / N²`. The counts are piecewise constant in the
    /// logits (transformers takes no gradient through them either). On the device where the
    /// statistics are.
    pub fn grad(&self, coef: f64) -> Result<RouterGrad> {
        let n = (self.rows.max(1)) as f64;
        let scale = coef * self.counts.len() as f64 / (n * n);
        let dprob = match self.device_totals()? {
            Some((c, _)) => Dprob::Device((c * scale)?),
            None => Dprob::Host(self.counts.iter().map(|&c| scale * c as f64).collect()),
        };
        Ok(RouterGrad { dprob })
    }

    fn counts_f64(&self) -> Vec<f64> {
        self.counts.iter().map(|&c| c as f64).collect()
    }

    /// The device's `(c_e, P_e)` with any host-routed tiles' added (the engine routes every
    /// layer one way, so there are none in a run), or `None` when nothing was routed there.
    fn device_totals(&self) -> Result<Option<(Tensor, Tensor)>> {
        let Some((c, p)) = &self.device else { return Ok(None) };
        if self.counts.iter().all(|&x| x == 0) {
            return Ok(Some((c.clone(), p.clone())));
        }
        let dev = c.device();
        let hc = Tensor::from_vec(self.counts_f64(), self.counts.len(), dev)?;
        let hp = Tensor::from_vec(self.prob_sums.clone(), self.prob_sums.len(), dev)?;
        Ok(Some(((c + hc)?, (p + hp)?)))
    }
}

/// `E · Σ_e c_e P_e / N²`, zero for `N = 0`.
fn aux_loss(counts: &[f64], sums: &[f64], rows: u64) -> f64 {
    if rows == 0 {
        return 0.0;
    }
    let n = rows as f64;
    let e = counts.len() as f64;
    let dot: f64 = counts.iter().zip(sums).map(|(&c, &p)| c * p).sum();
    e * dot / (n * n)
}

impl RouterGrad {
    /// `dL/dp[t, e]` for expert `e`, the same for every row, on the host (a device gradient is
    /// read back: the host-routed path's, which never meets one in a run).
    pub(crate) fn dprob(&self) -> Result<Cow<'_, [f64]>> {
        Ok(match &self.dprob {
            Dprob::Host(v) => Cow::Borrowed(v),
            Dprob::Device(t) => Cow::Owned(t.to_vec1::<f64>()?),
        })
    }

    /// `dprob` as an f64 `[E]` tensor on `dev` (a host gradient is uploaded).
    #[cfg(feature = "cuda")]
    pub(crate) fn on_device(&self, dev: &candle_core::Device) -> Result<Tensor> {
        Ok(match &self.dprob {
            Dprob::Host(v) => Tensor::from_slice(v, v.len(), dev)?,
            Dprob::Device(t) => t.to_device(dev)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aux_loss_is_transformers_formula() {
        // 2 experts, 2 rows, top-1: both rows pick expert 0.
        let mut s = RouterStats::new(2);
        s.add(&[0.75, 0.25, 0.5, 0.5], &[0, 0]);
        // E · Σ_e (c_e/N)(P_e/N) = 2 · (2/2 · 1.25/2 + 0) = 1.25.
        assert!((s.aux_loss().unwrap() - 1.25).abs() < 1e-15);
        let weighted = s.weighted_loss(0.1).unwrap().to_scalar::<f64>().unwrap();
        assert!((weighted - 0.125).abs() < 1e-15);
        assert_eq!(s.counts().unwrap(), [2, 0]);
        let g = s.grad(0.1).unwrap();
        assert_eq!(&*g.dprob().unwrap(), [0.1 * 2.0 * 2.0 / 4.0, 0.0]);
        assert_eq!(RouterStats::new(3).aux_loss().unwrap(), 0.0);
    }
}

//! The outer unit's template: token embedding, final RMSNorm, LM head and the chunked
//! cross-entropy loss with its backward (never more than `rows_per_block` rows of logits alive).

use candle_core::{DType, Tensor, D};
use mt_core::ModelConfig;

use crate::ops::{linear, matmul, matmul_wide, rms_norm, rms_norm_backward, wide_dtype, RmsCache};
use crate::weights::{names, OuterWeights};
use crate::{Error, GradSink, Result};

/// Template for the embedding, the final norm, the LM head and the loss. Stateless.
#[derive(Debug, Clone)]
pub struct Outer {
    cfg: ModelConfig,
    rows_per_block: usize,
}

impl Outer {
    /// A template computing the loss over at most `rows_per_block` tokens (rows of logits) at a
    /// time (0 is taken as 1).
    pub fn new(cfg: &ModelConfig, rows_per_block: usize) -> Self {
        Outer { cfg: cfg.clone(), rows_per_block: rows_per_block.max(1) }
    }

    /// Rows of logits per block.
    pub fn rows_per_block(&self) -> usize {
        self.rows_per_block
    }

    /// Embedding lookup: `ids: [b, t]` u32 → `[b, t, h]` in the weights' dtype.
    pub fn embed(&self, w: &OuterWeights, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = check_ids(ids)?;
        let x = w.embed.index_select(&ids.flatten_all()?, 0)?;
        Ok(x.reshape((b, t, self.cfg.hidden_size))?)
    }

    /// Backward of [`Outer::embed`]: adds row `dx[b, t]` into row `ids[b, t]` of the embedding
    /// gradient (repeated ids add up). Needs no weights. `ids` may live on the host (see
    /// [`GradSink::index_add_rows`]).
    pub fn embed_backward(&self, ids: &Tensor, dx: &Tensor, grads: &GradSink) -> Result<()> {
        let (b, t) = check_ids(ids)?;
        let h = self.cfg.hidden_size;
        if dx.dims() != [b, t, h] {
            return Err(Error::shape("embedding output gradient dx", format!("[{b}, {t}, {h}]"), dx.dims()));
        }
        grads.index_add_rows(names::EMBED, &ids.flatten_all()?, &dx.reshape((b * t, h))?)
    }

    /// Logits `[b, t, V]` in f32 (the head runs in the weights' dtype, then the result is cast,
    /// as transformers does). Materialises all logits: for tests and evaluation only.
    pub fn logits(&self, w: &OuterWeights, x: &Tensor) -> Result<Tensor> {
        let (b, t) = self.check_x(w, x)?;
        let h = self.cfg.hidden_size;
        let (xn, _) = rms_norm(
            &x.reshape((b * t, h))?,
            &w.norm,
            self.cfg.rms_norm_eps,
            self.cfg.norm_weight_before_cast(),
        )?;
        let logits = linear(&xn, w.head(), None)?.to_dtype(DType::F32)?;
        Ok(logits.reshape((b, t, self.cfg.vocab_size))?)
    }

    /// `Σ weight · CE` of one chunk, without gradients (evaluation).
    pub fn loss(&self, w: &OuterWeights, x: &Tensor, targets: &Tensor, weights: &Tensor) -> Result<f64> {
        Ok(self.run(w, x, targets, weights, None)?.loss.to_scalar::<f64>()?)
    }

    /// Loss of one chunk and its backward in one pass. `targets: [b, t]` u32 (any valid id where
    /// ignored), `weights: [b, t]` float, already normalised by the global count of targets
    /// (`1 / N_total`, or 0 where ignored). Returns `(Σ weight · CE` as f64, `dx: [b, t, h]` in
    /// `x`'s dtype`)` and accumulates the gradients of `model.norm.weight` and of the head
    /// (`lm_head.weight`, or `model.embed_tokens.weight` when tied).
    pub fn loss_backward(
        &self,
        w: &OuterWeights,
        x: &Tensor,
        targets: &Tensor,
        weights: &Tensor,
        grads: &GradSink,
    ) -> Result<(f64, Tensor)> {
        let (loss, dx) = self.loss_backward_deferred(w, x, targets, weights, grads)?;
        Ok((loss.to_scalar::<f64>()?, dx))
    }

    /// [`Outer::loss_backward`] with the loss left where it was computed, as an f64 scalar
    /// tensor. Reading a scalar off a GPU is a device-to-host copy, which queues on the copy
    /// engine behind every download already in flight (a streamed layer's state, 1.2 GB at
    /// 3.6B): a caller overlapping downloads with compute reads it once they are done.
    pub fn loss_backward_deferred(
        &self,
        w: &OuterWeights,
        x: &Tensor,
        targets: &Tensor,
        weights: &Tensor,
        grads: &GradSink,
    ) -> Result<(Tensor, Tensor)> {
        crate::profile::start(x.device());
        let pass = self.run(w, x, targets, weights, Some(grads))?;
        crate::profile::mark(x.device(), "loss (LM head GEMMs + cross-entropy)");
        let (b, t, h) = (pass.b, pass.t, self.cfg.hidden_size);
        let dxn = match pass.dxn.as_slice() {
            [] => Tensor::zeros((0, h), x.dtype(), x.device())?,
            blocks => Tensor::cat(blocks, 0)?,
        };
        let (dx, dnorm) = rms_norm_backward(&dxn, &w.norm, &pass.norm)?;
        grads.accumulate(names::FINAL_NORM, &dnorm)?;
        Ok((pass.loss, dx.reshape((b, t, h))?))
    }

    fn check_x(&self, w: &OuterWeights, x: &Tensor) -> Result<(usize, usize)> {
        let h = self.cfg.hidden_size;
        let (b, t) = match x.dims() {
            [b, t, hh] if *hh == h => (*b, *t),
            d => return Err(Error::shape("final hidden states x", format!("[b, t, {h}]"), d)),
        };
        if x.dtype() != w.dtype() {
            return Err(Error::dtype(
                "final hidden states x",
                format!("{:?} (the weights' dtype)", w.dtype()),
                x.dtype(),
            ));
        }
        Ok((b, t))
    }

    /// Loss (and, with a sink, the head's backward), block by block.
    ///
    /// Per row, with logits `l` (statistics dtype: f32 for bf16, f64 for f64 weights and for f32
    /// on the CPU, where the head's product is not rounded to f32 first), `z = Σ exp(l - m)`,
    /// `lse = m + ln z`, `CE = lse - l[target]`, `p = softmax(l)`:
    /// `d(weight · CE)/dl = weight · (p - onehot(target))`. Through the head `l = x̂ Hᵀ`:
    /// `dx̂ = dl H`, `dH += dlᵀ x̂` (the caller runs the final norm's backward on `dx̂`).
    fn run(
        &self,
        w: &OuterWeights,
        x: &Tensor,
        targets: &Tensor,
        weights: &Tensor,
        grads: Option<&GradSink>,
    ) -> Result<LossPass> {
        let (b, t) = self.check_x(w, x)?;
        if targets.dims() != [b, t] {
            return Err(Error::shape("targets", format!("[b, t] = [{b}, {t}] (as x)"), targets.dims()));
        }
        if targets.dtype() != DType::U32 {
            return Err(Error::dtype("targets", "u32", targets.dtype()));
        }
        if weights.dims() != [b, t] {
            return Err(Error::shape("loss weights", format!("[b, t] = [{b}, {t}] (as x)"), weights.dims()));
        }
        if !weights.dtype().is_float() {
            return Err(Error::dtype("loss weights", "a float dtype", weights.dtype()));
        }
        let (h, n) = (self.cfg.hidden_size, b * t);
        let dtype = x.dtype();
        let sd = wide_dtype(x);
        let head = w.head();
        let (xn, norm) = rms_norm(
            &x.reshape((n, h))?,
            &w.norm,
            self.cfg.rms_norm_eps,
            self.cfg.norm_weight_before_cast(),
        )?;
        let tg = targets.reshape((n, 1))?;
        let wt = weights.reshape((n, 1))?.to_dtype(sd)?;
        let mut loss = Tensor::zeros((), DType::F64, x.device())?;
        let mut dxn = Vec::new();
        let mut r0 = 0;
        while r0 < n {
            let r = self.rows_per_block.min(n - r0);
            let xb = xn.narrow(0, r0, r)?;
            let tb = tg.narrow(0, r0, r)?;
            let wb = wt.narrow(0, r0, r)?;
            #[cfg(feature = "cuda")]
            if mt_kernels::applies(&xb) {
                // Fused cross-entropy (kernels/cuda/fused.cu): bf16 logits are read, never cast.
                let logits = linear(&xb, head, None)?;
                let ce = mt_kernels::ce_loss(&logits, &tb)?.reshape((r, 1))?;
                let wce = (ce.to_dtype(DType::F64)? * wb.to_dtype(DType::F64)?)?;
                loss = (loss + wce.sum_all()?)?;
                if let Some(grads) = grads {
                    let dl = mt_kernels::ce_grad(&logits, &tb, &wb)?;
                    dxn.push(dl.matmul(head)?);
                    grads.accumulate_matmul(w.head_name(), &dl, &xb)?;
                }
                r0 += r;
                continue;
            }
            let logits = matmul_wide(&xb, &head.t()?)?;
            let m = logits.max_keepdim(D::Minus1)?;
            let e = logits.broadcast_sub(&m)?.exp()?;
            let z = e.sum_keepdim(D::Minus1)?;
            let lse = (m + z.log()?)?;
            let ce = (lse - logits.gather(&tb, 1)?)?;
            let wce = (ce.to_dtype(DType::F64)? * wb.to_dtype(DType::F64)?)?;
            loss = (loss + wce.sum_all()?)?;
            if let Some(grads) = grads {
                let p = e.broadcast_div(&z)?;
                let dl = p.broadcast_mul(&wb)?.scatter_add(&tb, &wb.neg()?, 1)?.to_dtype(dtype)?;
                dxn.push(matmul(&dl, head)?);
                grads.accumulate_matmul(w.head_name(), &dl, &xb)?;
            }
            r0 += r;
        }
        Ok(LossPass { loss, dxn, norm, b, t })
    }
}

/// Result of one pass of [`Outer::run`].
struct LossPass {
    /// `Σ weight · CE`, an f64 scalar on the device.
    loss: Tensor,
    /// Gradient of the normed hidden states, one `[rows, h]` tensor per block (empty without
    /// a sink).
    dxn: Vec<Tensor>,
    norm: RmsCache,
    b: usize,
    t: usize,
}

fn check_ids(ids: &Tensor) -> Result<(usize, usize)> {
    if ids.dtype() != DType::U32 {
        return Err(Error::dtype("token ids", "u32", ids.dtype()));
    }
    match ids.dims() {
        [b, t] => Ok((*b, *t)),
        d => Err(Error::shape("token ids", "[b, t]", d)),
    }
}

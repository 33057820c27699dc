//! LoRA adapters on a decoder layer's linear layers: their views in the layer's slot and the
//! adapted projection's forward and backward. The base weight is frozen: its gradient is not
//! formed (the layer's `GradSink` holds only the adapters: [`crate::GradSink::trainable`]).
//!
//! With `s` the scale and `u = x Aᵀ` `[N, r]`: `y = x Wᵀ + b + s · u Bᵀ`. Backwards, for
//! `dy: [N, out]` and `g = s · dy B` `[N, r]`: `dB = s · dyᵀ u`, `dA = gᵀ x`,
//! `dx = dy W + g A`. `u` is recomputed from `x` (an `[N, r]` product, cheap at small `r`), so the
//! forward keeps nothing more than the base projection does.

use candle_core::Tensor;
use mt_core::{LoraTarget, ModelConfig};

use crate::ops::{add, linear, linear_backward, matmul};
use crate::{GradSink, Result};

/// One projection's adapter: views of `A [r, in]` and `B [out, r]` in the slot.
#[derive(Debug, Clone)]
pub struct LoraPair {
    /// `lora_A.weight` `[r, in]`.
    pub a: Tensor,
    /// `lora_B.weight` `[out, r]`.
    pub b: Tensor,
}

/// A layer's adapters, by target, with their common scale.
#[derive(Debug, Clone)]
pub struct LoraWeights {
    /// `alpha / r` (rsLoRA: `alpha / √r`).
    pub scale: f64,
    pairs: Vec<(LoraTarget, LoraPair)>,
}

impl LoraWeights {
    /// Binds views of every adapter of `cfg.lora` in `slot` (`None` without LoRA). No copy.
    pub(crate) fn bind(
        cfg: &ModelConfig,
        view: impl Fn(&str, &[usize]) -> Result<Tensor>,
    ) -> Result<Option<Self>> {
        let Some(l) = &cfg.lora else { return Ok(None) };
        let pairs = l
            .targets
            .iter()
            .map(|&t| {
                let (out, inp) = t.dims(cfg);
                let pair =
                    LoraPair { a: view(t.a_name(), &[l.rank, inp])?, b: view(t.b_name(), &[out, l.rank])? };
                Ok((t, pair))
            })
            .collect::<Result<_>>()?;
        Ok(Some(LoraWeights { scale: l.scale(), pairs }))
    }

    /// The adapter of `t`, if `t` is a target.
    pub fn get(&self, t: LoraTarget) -> Option<&LoraPair> {
        self.pairs.iter().find(|(x, _)| *x == t).map(|(_, p)| p)
    }
}

/// A projection with its adapter, if any: what the layer's forward and backward call for each
/// of its linear layers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Adapted<'w> {
    target: LoraTarget,
    pair: Option<(&'w LoraPair, f64)>,
}

impl<'w> Adapted<'w> {
    /// `t` of the layer whose adapters are `lora`.
    pub(crate) fn of(lora: Option<&'w LoraWeights>, target: LoraTarget) -> Self {
        Adapted { target, pair: lora.and_then(|l| l.get(target).map(|p| (p, l.scale))) }
    }

    /// `y = x Wᵀ (+ b) (+ s · (x Aᵀ) Bᵀ)`.
    pub(crate) fn forward(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        let y = linear(x, w, b)?;
        let Some((p, s)) = self.pair else { return Ok(y) };
        let u = linear(x, &p.a, None)?;
        let delta = (linear(&u, &p.b, None)? * s)?;
        add(&y, &delta)
    }

    /// The backward of [`Adapted::forward`] for `dy: [N, out]` and its input `x: [N, in]`:
    /// accumulates `W`'s (and `b`'s) gradient where the sink holds them (not for a frozen base),
    /// `A`'s and `B`'s; returns `dx`.
    pub(crate) fn backward(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        grads: &GradSink,
        bias: Option<&str>,
    ) -> Result<Tensor> {
        let dx = linear_backward(dy, x, w, grads, self.target.weight(), bias)?;
        let Some((p, s)) = self.pair else { return Ok(dx) };
        let u = (linear(x, &p.a, None)? * s)?;
        grads.accumulate_matmul(self.target.b_name(), dy, &u)?;
        drop(u);
        let g = (matmul(dy, &p.b)? * s)?;
        grads.accumulate_matmul(self.target.a_name(), &g, x)?;
        add(&dx, &matmul(&g, &p.a)?)
    }
}

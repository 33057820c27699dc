//! Evaluation without training: logits and the summed loss of a batch under the store's current
//! weights, streamed layer by layer through one slot.

use candle_core::{DType, Tensor, D};
use mt_core::Unit;
use mt_layers::{LayerWeights, OuterWeights, Positions};
use mt_store::{decode_unit, Decoded};

use super::Engine;
use crate::backend::Backend;
use crate::batch::Batch;
use crate::{Error, Result};

impl<B: Backend> Engine<B> {
    /// Logits `[b, t, V]` (f32) of the store's current master weights, computed layer by layer
    /// without training (pending updates are not applied: flush first to see them).
    pub fn logits(&mut self, batch: &Batch) -> Result<Tensor> {
        Ok(self.evaluate(batch, false)?.0)
    }

    /// A mixture of experts' router logits `[b·t, E]` (the weights' dtype) of every layer under
    /// the store's current master weights, as [`Engine::logits`] computes them; none for a
    /// dense model.
    pub fn router_logits(&mut self, batch: &Batch) -> Result<Vec<Tensor>> {
        Ok(self.evaluate(batch, true)?.1)
    }

    /// The logits and, when `router`, each MoE layer's router logits.
    fn evaluate(&mut self, batch: &Batch, router: bool) -> Result<(Tensor, Vec<Tensor>)> {
        batch.validate(&self.cfg)?;
        self.ensure_rope(batch.seq)?;
        let device = self.backend.device().clone();
        let ids = Tensor::from_slice(&batch.input_ids, (batch.batch, batch.seq), &device)?;
        let load = |u: Unit, dst: &Tensor| -> Result<()> {
            let r = self.store.record(u);
            // A LoRA run's frozen base first (the values its encoding holds, rounded to the slot's
            // dtype as its upload's are), then its adapters (the slot's layout).
            let mut at = 0;
            // The outer unit's own slot holds its base already (`Engine::base_kept`): the
            // adapters alone. (Decoder layers are evaluated in ring slot 0, never their own.)
            if let Some(n) = self.base_kept(u).filter(|_| u == Unit::Outer) {
                at = n;
            } else if let Some(b) = self.opts.frozen_base.as_ref().filter(|b| b.encoding(u).elems() > 0) {
                let enc = b.encoding(u);
                let mut w = vec![0f32; enc.elems()];
                decode_unit(enc, &b.unit(u), Decoded::F32(&mut w));
                dst.slice_set(&Tensor::from_vec(w, enc.elems(), &device)?.to_dtype(dst.dtype())?, 0, 0)?;
                at = enc.elems();
            }
            // A LoRA run's outer unit has nothing that trains: no empty tensor is cast (candle's
            // CUDA cast of no elements is a launch of no blocks, an invalid argument).
            if !r.master().is_empty() {
                let t = Tensor::from_slice(r.master(), r.master().len(), &device)?;
                dst.slice_set(&t.to_dtype(dst.dtype())?, 0, at)?;
            }
            Ok(())
        };
        // A resident unit's slot holds its current weights already.
        if !self.opts.placement.resident_outer {
            load(Unit::Outer, &self.pool.outer_slot)?;
        }
        let ow = OuterWeights::bind(&self.cfg, &self.slot_layout.outer, &self.pool.outer_slot)?;
        let mut x = self.outer_t.embed(&ow, &ids)?;
        let rope = self.rope.as_ref().ok_or_else(|| Error::Schedule("rope table missing".into()))?;
        let pos = match &batch.positions {
            Some(p) => Positions::from_ids(rope, batch.batch, batch.seq, p)?,
            None => Positions::range(rope, 0, batch.seq)?,
        };
        let mut routers = Vec::new();
        for l in 0..self.layout.n_layers {
            // Likewise a resident layer's.
            let slot = match self.pool.resident.get(l) {
                Some(r) => r.slot.clone(),
                None => {
                    load(Unit::Layer(l), &self.pool.slots[0])?;
                    self.pool.slots[0].clone()
                }
            };
            let w = LayerWeights::bind(&self.cfg, &self.slot_layout.layer, &slot)?;
            let layer_t = self.layer_t.for_layer(l)?;
            if router {
                routers.extend(layer_t.router_logits(&w, &x, &pos)?);
            }
            x = layer_t.forward_pos(&w, &x, &pos)?;
        }
        let logits = self.outer_t.logits(&ow, &x)?;
        // The slots are read on the compute stream; the next step's uploads must not overtake.
        self.backend.synchronize()?;
        Ok((logits, routers))
    }

    /// Sum of the cross-entropy over the batch's targets (nats) and their count, under the
    /// store's current master weights: no gradients, no update (pending updates are not applied:
    /// flush first). For held-out evaluation. The log-sum-exp runs on the device in f32 over
    /// [`Engine::logits`] (so the batch's `[b, t, V]` f32 logits must fit there; on the CPU in
    /// f64), the rows' sum in f64; one scalar comes back.
    pub fn loss_sum(&mut self, batch: &Batch) -> Result<(f64, usize)> {
        let logits = self.logits(batch)?;
        let (v, rows) = (self.cfg.vocab_size, batch.batch * batch.seq);
        let device = logits.device().clone();
        // On the CPU the log-sum-exp over the vocabulary in f64, as the training loss's.
        let sd = if device.is_cpu() { DType::F64 } else { DType::F32 };
        let logits = logits.reshape((rows, v))?.to_dtype(sd)?;
        let keep: Vec<f64> =
            batch.targets.iter().map(|&t| f64::from(u8::from(t != crate::batch::IGNORE_INDEX))).collect();
        // Ignored rows gather column 0 and are multiplied by 0; `validate` checked 0 <= t < V.
        let idx: Vec<u32> = batch
            .targets
            .iter()
            .map(|&t| if t == crate::batch::IGNORE_INDEX { 0 } else { t as u32 })
            .collect();
        let keep = Tensor::from_vec(keep, rows, &device)?;
        let idx = Tensor::from_vec(idx, (rows, 1), &device)?;
        let m = logits.max_keepdim(D::Minus1)?;
        let lse = logits.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()?.add(&m)?;
        let picked = logits.gather(&idx, D::Minus1)?;
        // An f32 sum over the rows would drift by up to rows · 2^-24 of it.
        let ce = (lse - picked)?.squeeze(D::Minus1)?.to_dtype(DType::F64)?;
        let sum = ce.mul(&keep)?.sum_all()?.to_scalar::<f64>()?;
        Ok((sum, batch.n_targets()))
    }
}

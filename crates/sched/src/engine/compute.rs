//! The compute stream's side of the engine: what each compute op of the step program does
//! (embedding, layer forward and backward, loss, embedding backward, resident updates) with the
//! templates, the pool's buffers and the chunks.

use mt_core::Unit;
use mt_kernels::device_optim::SumSquares;
use mt_layers::{GradSink, LayerWeights, OuterWeights};
use mt_optim::StepArgs;
use mt_pool::DevicePool;

use super::Engine;
use crate::backend::Backend;
use crate::batch::Chunk;
use crate::program::{BackwardInput, Op, Slot};
use crate::{Error, Result};

impl<B: Backend> Engine<B> {
    pub(super) fn run_compute(
        &mut self,
        op: &Op,
        chunks: &[Chunk],
        losses: &mut Vec<candle_core::Tensor>,
        args: &StepArgs,
    ) -> Result<()> {
        let (cfg, layout, slots) = (&self.cfg, &self.layout, &self.slot_layout);
        // Gradients of what trains only: a LoRA run's base is frozen.
        let sink_of = |l, buf| sink(cfg.lora.is_some(), l, buf);
        let n_layers = layout.n_layers;
        match *op {
            Op::Embed => {
                let _s = tracing::debug_span!("embed").entered();
                DevicePool::zero(&self.pool.outer_grad)?;
                let w = OuterWeights::bind(cfg, &slots.outer, &self.pool.outer_slot)?;
                for (c, ch) in chunks.iter().enumerate() {
                    let x = self.outer_t.embed(&w, &ch.ids)?;
                    self.pool.put_checkpoint(0, c, x);
                }
            }
            Op::Forward { layer, slot, keep } => {
                let _s = tracing::debug_span!("forward", layer).entered();
                let w = LayerWeights::bind(cfg, &slots.layer, &self.slot_tensor(slot)?)?;
                let layer_t = self.layer_t.for_layer(layer)?;
                for c in 0..chunks.len() {
                    let x = self.pool.checkpoint(layer, c)?.clone();
                    let pos = self.positions.get(c).ok_or_else(|| missing_positions(c))?;
                    let y = if let Some(stats) = self.router_stats.as_mut() {
                        // A MoE model: the router statistics of the load-balancing loss too.
                        let (y, state) = layer_t.forward_routed(&w, &x, pos, keep, stats)?;
                        if let Some(state) = state {
                            self.kept_bytes += state.bytes();
                            *self
                                .kept
                                .get_mut(layer * chunks.len() + c)
                                .ok_or_else(|| no_kept(layer, c))? = Some(state);
                        }
                        y
                    } else if keep {
                        let (y, state) = layer_t.forward_keep_pos(&w, &x, pos)?;
                        let entry =
                            self.kept.get_mut(layer * chunks.len() + c).ok_or_else(|| no_kept(layer, c))?;
                        self.kept_bytes += state.bytes();
                        *entry = Some(state);
                        y
                    } else {
                        layer_t.forward_pos(&w, &x, pos)?
                    };
                    self.pool.put_checkpoint(layer + 1, c, y);
                }
            }
            Op::Loss => {
                let _s = tracing::debug_span!("loss").entered();
                let w = OuterWeights::bind(cfg, &slots.outer, &self.pool.outer_slot)?;
                let gbuf = self.pool.outer_grad.clone();
                let sink = sink_of(&layout.outer, &gbuf)?;
                // The load-balancing loss (transformers': over every layer's router rows) and
                // its gradient at the router probabilities, which every layer's backward adds.
                if let (Some(stats), Some(coef)) =
                    (&self.router_stats, cfg.moe.as_ref().and_then(|m| m.aux_coef()))
                {
                    // On the device where the routing ran there: read with the chunks' losses.
                    losses.push(stats.weighted_loss(coef)?);
                    self.router_grad = Some(stats.grad(coef)?);
                }
                for (c, ch) in chunks.iter().enumerate() {
                    let x = self.pool.checkpoint(n_layers, c)?.clone();
                    // Read at the step's end: a scalar read here would wait for the downloads
                    // queued on the copy engine before it.
                    let (l, dx) =
                        self.outer_t.loss_backward_deferred(&w, &x, &ch.targets, &ch.weights, &sink)?;
                    losses.push(l);
                    self.pool.put_act_grad(c, dx);
                }
                self.pool.drop_checkpoints(n_layers);
            }
            Op::Backward { layer, slot, grad_buf, input } => {
                let _s = tracing::debug_span!("backward", layer).entered();
                let gbuf = match grad_buf {
                    Some(k) => self.ring_grad(k)?,
                    None => self.resident_bufs(Unit::Layer(layer))?.grad,
                };
                DevicePool::zero(&gbuf)?;
                let sink = sink_of(&layout.layer, &gbuf)?;
                let w = LayerWeights::bind(cfg, &slots.layer, &self.slot_tensor(slot)?)?;
                let layer_t = self.layer_t.for_layer(layer)?;
                for (c, ch) in chunks.iter().enumerate() {
                    let dy = self.pool.take_act_grad(c).ok_or_else(|| missing_grad(layer, c))?;
                    let aux = self.router_grad.as_ref();
                    let dx = match input {
                        BackwardInput::Kept => {
                            let state = self
                                .kept
                                .get_mut(layer * chunks.len() + c)
                                .and_then(Option::take)
                                .ok_or_else(|| not_kept(layer, c))?;
                            layer_t.backward_kept_routed(&w, state, &dy, &sink, aux)?
                        }
                        BackwardInput::Checkpoint | BackwardInput::Reload(_) => {
                            let x = self.backward_input(layer, c, ch, input)?;
                            let pos = self.positions.get(c).ok_or_else(|| missing_positions(c))?;
                            layer_t.backward_routed(&w, &x, &dy, pos, &sink, aux)?
                        }
                    };
                    self.pool.put_act_grad(c, dx);
                }
                self.inject_gradient(Unit::Layer(layer), &gbuf)?;
                // Its last reader, unless it was spilled (freed after its forward).
                if !matches!(input, BackwardInput::Reload(_)) {
                    self.pool.drop_checkpoints(layer);
                }
            }
            Op::EmbedBackward => {
                let _s = tracing::debug_span!("embed_backward").entered();
                let gbuf = self.pool.outer_grad.clone();
                let sink = sink_of(&layout.outer, &gbuf)?;
                for (c, ch) in chunks.iter().enumerate() {
                    let dx = self.pool.take_act_grad(c).ok_or_else(|| missing_grad(0, c))?;
                    self.outer_t.embed_backward(&ch.host_ids, &dx, &sink)?;
                }
                self.inject_gradient(Unit::Outer, &gbuf)?;
            }
            Op::AllReduce { unit, grad_buf } => {
                let _s = tracing::debug_span!("all_reduce", ?unit).entered();
                let dp = self
                    .dp
                    .as_ref()
                    .ok_or_else(|| Error::Schedule(format!("{op:?} on an engine that trains alone")))?;
                // The gradient of the whole global batch, before it is narrowed or downloaded.
                dp.reduce.sum(&self.grad_buf(unit, grad_buf)?)?;
            }
            Op::SumSquares { unit, grad_buf } => {
                let _s = tracing::debug_span!("sum_squares", ?unit).entered();
                let gbuf = self.grad_buf(unit, grad_buf)?;
                // Read at the step's end, summed in unit order (deterministic).
                let ss = match grad_buf {
                    Some(k) => {
                        // bf16 landing: the share of the narrowed gradient, what the host would
                        // have taken as it landed.
                        let narrow = self.pool.grad_narrow.get(k).ok_or_else(|| {
                            Error::Schedule(format!(
                                "{op:?}: gradient buffer {k} has no bf16 twin to narrow into"
                            ))
                        })?;
                        mt_kernels::device_optim::narrow_bf16_sum_squares(&gbuf, narrow)?
                    }
                    // A resident unit's gradient never lands on the host.
                    None => mt_kernels::device_optim::sum_squares(&gbuf)?,
                };
                self.device_sumsq.push((unit, ss));
            }
            Op::UpdateStreamed { unit, buf, slot } => {
                let _s = tracing::debug_span!("update_streamed", ?unit).entered();
                let state = self.state_slot(buf)?;
                let dst = self.slot_tensor(slot)?;
                if self.store.applied_step(unit) >= args.step {
                    // A retried step: the record already holds the update (and the state slot
                    // what was uploaded from it).
                    mt_kernels::device_optim::cast_master_into(&state, &dst)?;
                } else {
                    let grad = self.state_grad_slot(buf)?;
                    // bf16 -> f32 is exact: the same gradient the host's update widens.
                    let grad = grad.to_dtype(candle_core::DType::F32)?;
                    let kind = self.state_kind(unit);
                    mt_kernels::device_optim::adamw_step_into(
                        &state,
                        &grad,
                        &self.opts.adamw,
                        args,
                        kind,
                        &dst,
                    )?;
                }
            }
            Op::CopyGrad { unit, grad_buf, buf, narrowed } => {
                let _s = tracing::debug_span!("copy_grad", ?unit).entered();
                // What the layer's download moves and its land stores: the bf16 twin or the f32
                // buffer, as the op says.
                let src = if narrowed {
                    self.pool.grad_narrow.get(grad_buf).ok_or_else(|| {
                        Error::Schedule(format!(
                            "{unit:?}'s copy: gradient buffer {grad_buf} has no bf16 twin"
                        ))
                    })?
                } else {
                    self.pool.grad_bufs.get(grad_buf).ok_or_else(|| no_grad_buf(grad_buf))?
                };
                let dst = self.state_grad_slot(buf)?;
                if src.dtype() != dst.dtype() || src.elem_count() != dst.elem_count() {
                    return Err(Error::Schedule(format!(
                        "{unit:?}'s device gradient ({:?}, {}) is not what its state slot keeps ({:?}, {})",
                        src.dtype(),
                        src.elem_count(),
                        dst.dtype(),
                        dst.elem_count()
                    )));
                }
                dst.slice_set(src, 0, 0)?;
            }
            Op::DropCheckpoint { boundary } => {
                let _s = tracing::debug_span!("drop_checkpoint", boundary).entered();
                self.pool.drop_checkpoints(boundary);
            }
            Op::UpdateResident { unit, if_finite } => {
                let _s = tracing::debug_span!("update_resident", ?unit).entered();
                // Lean mode: a unit whose gradient is not finite is not updated (`commit.rs`).
                if if_finite && !self.device_sum_squares(unit)?.is_finite() {
                    return Ok(());
                }
                self.update_resident(unit, args)?;
            }
            _ => return Err(Error::Schedule(format!("{op:?} is not a compute op"))),
        }
        Ok(())
    }
}

impl<B: Backend> Engine<B> {
    /// `unit`'s device gradient: ring buffer `grad_buf`, else its own (a resident layer's, the
    /// outer one).
    fn grad_buf(&self, unit: Unit, grad_buf: Option<usize>) -> Result<candle_core::Tensor> {
        match (grad_buf, unit) {
            (Some(k), _) => self.pool.grad_bufs.get(k).cloned().ok_or_else(|| no_grad_buf(k)),
            (None, Unit::Outer) => Ok(self.pool.outer_grad.clone()),
            (None, Unit::Layer(_)) => Ok(self.resident_bufs(unit)?.grad),
        }
    }

    /// `unit`'s share of the global norm taken on the device this step ([`Op::SumSquares`]), read
    /// now (and kept as read).
    fn device_sum_squares(&mut self, unit: Unit) -> Result<f64> {
        let (_, ss) = self.device_sumsq.iter_mut().find(|(u, _)| *u == unit).ok_or_else(|| {
            Error::Schedule(format!("{unit:?}'s share of the norm read before it was taken"))
        })?;
        let v = std::mem::replace(ss, SumSquares::Value(f64::NAN)).value()?;
        *ss = SumSquares::Value(v);
        Ok(v)
    }

    /// State slot `buf`'s `[master | m | v]`.
    pub(super) fn state_slot(&self, buf: usize) -> Result<candle_core::Tensor> {
        self.pool.state.get(buf).cloned().ok_or_else(|| no_state(buf))
    }

    /// State slot `buf`'s gradient.
    pub(super) fn state_grad_slot(&self, buf: usize) -> Result<candle_core::Tensor> {
        self.pool.state_grad.get(buf).cloned().ok_or_else(|| no_state(buf))
    }

    /// The device weights behind a compute slot.
    fn slot_tensor(&self, slot: Slot) -> Result<candle_core::Tensor> {
        Ok(match slot {
            Slot::Ring(k) => self.ring_slot(k)?,
            Slot::Outer => self.pool.outer_slot.clone(),
            Slot::Resident(l) => self.resident_bufs(Unit::Layer(l))?.slot,
            Slot::Held(l) => self.held_slot(l)?,
        })
    }

    /// The own slot of held layer `l`.
    pub(super) fn held_slot(&self, l: usize) -> Result<candle_core::Tensor> {
        let first = self.layout.n_layers - self.pool.held.len();
        l.checked_sub(first)
            .and_then(|i| self.pool.held.get(i))
            .cloned()
            .ok_or_else(|| Error::Schedule(format!("layer {l} is not held (layers {first}.. are)")))
    }
}

fn no_grad_buf(k: usize) -> Error {
    Error::Schedule(format!("gradient buffer {k} does not exist"))
}

fn no_state(buf: usize) -> Error {
    Error::Schedule(format!("state slot {buf} does not exist"))
}

fn no_kept(layer: usize, chunk: usize) -> Error {
    Error::Schedule(format!("no place to keep layer {layer}, chunk {chunk}"))
}

fn not_kept(layer: usize, chunk: usize) -> Error {
    Error::Schedule(format!(
        "layer {layer}, chunk {chunk}: a backward of kept activations its forward did not keep"
    ))
}

fn missing_positions(chunk: usize) -> Error {
    Error::Schedule(format!("positions of chunk {chunk} missing"))
}

fn missing_grad(layer: usize, chunk: usize) -> Error {
    Error::Schedule(format!("activation gradient for layer {layer}, chunk {chunk} missing"))
}

/// The gradient sink of a unit: over what trains ([`GradSink::trainable`]) in a LoRA run.
fn sink<'a>(
    lora: bool,
    l: &'a mt_core::UnitLayout,
    buf: &'a candle_core::Tensor,
) -> mt_layers::Result<GradSink<'a>> {
    if lora {
        GradSink::trainable(l, buf)
    } else {
        GradSink::new(l, buf)
    }
}

//! The resident units' side of the engine: the outer unit (`EngineOptions::resident_outer`) and
//! decoder layers `0..EngineOptions::resident_layers` keep their fp32 master weights and AdamW
//! moments on the compute device. This module loads that state from the host store, updates it
//! there, and writes it back into the store.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use mt_core::Unit;
use mt_kernels::device_optim::StateKind;
use mt_optim::{StepArgs, Upload};
use mt_store::GradMut;

use super::host::update_unit;
use super::Engine;
use crate::backend::Backend;
use crate::{Error, Result};

/// A resident unit's device buffers: weights slot, fp32 gradient, `[master | m | v]` (f32 words,
/// the moments in the store's encoding).
pub(super) struct ResidentBufs {
    pub(super) slot: Tensor,
    pub(super) grad: Tensor,
    pub(super) state: Tensor,
}

impl<B: Backend> Engine<B> {
    /// The units whose optimizer state lives on the device, in update order.
    pub(super) fn resident_units(&self) -> Vec<Unit> {
        let outer = self.opts.placement.resident_outer.then_some(Unit::Outer);
        outer.into_iter().chain((0..self.opts.placement.resident_layers).map(Unit::Layer)).collect()
    }

    /// How `unit`'s moments are held and whose draws round them (for a device update).
    pub(super) fn state_kind(&self, unit: Unit) -> StateKind {
        StateKind { dtype: self.store.state_dtype(), stream: unit.index() as u64 }
    }

    /// Whether `unit` is resident.
    pub(super) fn is_resident(&self, unit: Unit) -> bool {
        match unit {
            Unit::Outer => self.opts.placement.resident_outer,
            Unit::Layer(l) => l < self.opts.placement.resident_layers,
        }
    }

    pub(super) fn resident_bufs(&self, unit: Unit) -> Result<ResidentBufs> {
        let missing = || Error::Schedule(format!("{unit:?} is not resident on the device"));
        Ok(match unit {
            Unit::Outer => ResidentBufs {
                slot: self.pool.outer_slot.clone(),
                grad: self.pool.outer_grad.clone(),
                state: self.pool.outer_state.clone().ok_or_else(missing)?,
            },
            Unit::Layer(l) => {
                let r = self.pool.resident.get(l).ok_or_else(missing)?;
                ResidentBufs { slot: r.slot.clone(), grad: r.grad.clone(), state: r.state.clone() }
            }
        })
    }

    /// Refuses a store that a run with resident units left without writing them back (a crash):
    /// one still marked [`mt_store::HostStore::device_owned`] (set from a step's start until the
    /// write-back), or, for stores from before that mark, one with a record behind the store's
    /// step (every record is at the store's step, or one past mid-flush). Their updates since
    /// the last checkpoint or eval, or the gradient of a pending update, are lost, and training
    /// on would silently mix them up.
    pub(super) fn check_records(&self) -> Result<()> {
        let state = self.store.state();
        if self.store.device_owned() {
            return Err(Error::Options(
                "the host store was left by a run with GPU-resident units (--resident-outer / --resident-layers) \
                 that stopped without writing them back (a crash or kill): its records are not current; \
                 resume from a checkpoint (--resume) instead"
                    .into(),
            ));
        }
        for unit in self.layout.units() {
            let applied = self.store.record(unit).applied_step();
            if applied < state.step {
                return Err(Error::Options(format!(
                    "the host store's {unit:?} is at optimizer step {applied} but the store at step {}: \
                     it was left by a run with GPU-resident units (--resident-outer / --resident-layers) \
                     that stopped without writing them back (a crash or kill); resume from a checkpoint \
                     (--resume) instead",
                    state.step
                )));
            }
        }
        Ok(())
    }

    /// Brings each resident unit's record up to the store's step (a pending update not applied
    /// to it yet is applied on the host, from the record's gradient), then copies master, m and
    /// v to the device, casts the weights into the unit's slot and releases the record's host
    /// gradient pages (an anonymous store: 2 or 4 B per resident parameter less RSS).
    pub(super) fn load_resident(&mut self) -> Result<()> {
        let state = self.store.state();
        let device = self.backend.device().clone();
        for unit in self.resident_units() {
            let bufs = self.resident_bufs(unit)?;
            let mut r = self.store.record(unit);
            if state.pending_update {
                let args = StepArgs {
                    step: state.step + 1,
                    lr: state.pending_lr,
                    grad_scale: state.pending_grad_scale,
                };
                update_unit(unit, &mut r, &self.opts.adamw, &args, Upload::None)?;
            }
            // The record's master, m and v as the f32 words of the device state, in order.
            let mut at = 0;
            for part in state_words(&r) {
                bufs.state.slice_set(&Tensor::from_slice(part, part.len(), &device)?, 0, at)?;
                at += part.len();
            }
            self.applied[unit.index()] = r.applied_step();
            drop(r);
            // Its gradient lives on the device from now on; the host copy is written again only
            // to hand a pending update over (`sync_store`), so its pages go back to the kernel.
            self.store.release_grad(unit)?;
            cast_weights(&bufs)?;
        }
        self.dirty = false;
        self.backend.synchronize()?;
        Ok(())
    }

    /// AdamW step `args` on a resident unit (once: a retried step skips it), then its weights
    /// into its slot.
    pub(super) fn update_resident(&mut self, unit: Unit, args: &StepArgs) -> Result<()> {
        let bufs = self.resident_bufs(unit)?;
        if self.applied[unit.index()] < args.step {
            mt_kernels::device_optim::adamw_step_into(
                &bufs.state,
                &bufs.grad,
                &self.opts.adamw,
                args,
                self.state_kind(unit),
                &bufs.slot,
            )?;
            self.applied[unit.index()] = args.step;
            self.dirty = true;
            return Ok(());
        }
        cast_weights(&bufs)
    }

    /// Writes every resident unit's device state (master, m, v, the optimizer step it has
    /// applied, and its last gradient, which a pending update still needs) into the host store's
    /// records, so that checkpoints, exports, a later engine or a host-side flush see it. A no-op
    /// without resident units or when the store is already current.
    pub fn sync_store(&mut self) -> Result<()> {
        if !self.dirty {
            return Ok(());
        }
        let state = self.store.state();
        let units = self.resident_units();
        let largest = units.iter().map(|&u| self.layout.unit(u).len).max().unwrap_or(0);
        if largest == 0 {
            self.dirty = false;
            self.store.set_device_owned(false);
            return Ok(());
        }
        // Through the first landing buffer (page-locked on a GPU: DMA at bus speed), a piece of
        // its size at a time: each piece is copied into a device buffer of that size on the
        // compute stream, downloaded whole, and copied into the record on every core. (The
        // pieces used to go through candle's `to_vec1`: a fresh pageable vector per piece, ~1 GB/s,
        // two minutes for a 14B model's 16 resident layers.)
        let land =
            Arc::clone(self.landing.first().ok_or_else(|| Error::Schedule("no landing buffer".into()))?);
        // f32 values travel as raw bytes, whatever the landing buffer's own type.
        let piece = land.lock().unwrap_or_else(|p| p.into_inner()).bytes_as_f32().len();
        let staging = Tensor::zeros(piece, DType::F32, self.backend.device())?;
        let fetch = |src: &Tensor, o: usize, len: usize, dst: Upload<'_>| -> Result<()> {
            staging.narrow(0, 0, len)?.slice_set(&src.narrow(0, o, len)?, 0, 0)?;
            self.backend.synchronize()?;
            self.backend.download(&[], staging.clone(), Arc::clone(&land), "write-back".into());
            self.backend.synchronize()?;
            let landed = land.lock().unwrap_or_else(|p| p.into_inner());
            Ok(mt_optim::cast_into(&landed.bytes_as_f32()[..len], dst)?)
        };
        for unit in units {
            let bufs = self.resident_bufs(unit)?;
            let n = self.layout.unit(unit).len;
            let applied = self.applied[unit.index()];
            // The gradient is needed only by a pending update the device has not applied.
            let need_grad = state.pending_update && applied <= state.step;
            let pieces_of =
                |n: usize| (0..n).step_by(piece).map(|o| (o, piece.min(n - o))).collect::<Vec<_>>();
            let pieces = pieces_of(n);
            let mut r = self.store.record(unit);
            let p = r.parts();
            let mut at = 0;
            for dst in [p.master, bytemuck::cast_slice_mut(p.m), bytemuck::cast_slice_mut(p.v)] {
                for (o, len) in pieces_of(dst.len()) {
                    fetch(&bufs.state, at + o, len, Upload::F32(&mut dst[o..o + len]))?;
                }
                at += dst.len();
            }
            if need_grad {
                for &(o, len) in &pieces {
                    let stored = match r.grad_mut() {
                        Some(GradMut::F32(d)) => Upload::F32(&mut d[o..o + len]),
                        Some(GradMut::Bf16(d)) => Upload::Bf16(&mut d[o..o + len]),
                        None => Upload::None,
                    };
                    fetch(&bufs.grad, o, len, stored)?;
                }
            }
            r.set_applied_step(applied);
        }
        self.dirty = false;
        self.store.set_device_owned(false);
        Ok(())
    }
}

/// A record's master, m and v as f32 words (the moments' bytes reinterpreted: page-aligned
/// regions, a multiple of 4 bytes long): a device state's `[master | m | v]`, in order.
pub(crate) fn state_words<'r>(r: &'r mt_store::RecordGuard<'_>) -> [&'r [f32]; 3] {
    [r.master(), bytemuck::cast_slice(r.m()), bytemuck::cast_slice(r.v())]
}

/// A resident unit's master weights cast into its slot (compute stream).
fn cast_weights(b: &ResidentBufs) -> Result<()> {
    Ok(mt_kernels::device_optim::cast_master_into(&b.state, &b.slot)?)
}

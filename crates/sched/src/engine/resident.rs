//! The resident outer unit's side of the engine: loading its optimizer state onto the device,
//! updating it there, and writing it back into the host store (`EngineOptions::resident_outer`).

use candle_core::{DType, Tensor};
use mt_core::Unit;
use mt_optim::{StepArgs, Upload};
use mt_store::GradMut;

use super::{update_unit, Engine, SYNC_PIECE};
use crate::backend::Backend;
use crate::{Error, Result};

impl<B: Backend> Engine<B> {
    /// Refuses a store whose outer record is behind the store's step: every record is at the
    /// store's step (or one past, mid-flush), so an older outer record was left by a
    /// resident-outer run that stopped without writing it back (a crash): its updates since the
    /// last checkpoint or eval are lost, and training on would silently mix them up.
    pub(super) fn check_outer_record(&self) -> Result<()> {
        let state = self.store.state();
        let r = self.store.record(Unit::Outer);
        if r.applied_step() < state.step {
            return Err(Error::Options(format!(
                "the host store's outer unit (embedding, head) is at optimizer step {} but the store at step {}: \
                 it was left by a --resident-outer run that stopped without writing it back (a crash or kill); \
                 resume from a checkpoint (--resume) instead",
                r.applied_step(),
                state.step
            )));
        }
        Ok(())
    }

    /// Resident outer unit: brings its record up to the store's step (a pending update whose
    /// outer part was not applied yet is applied on the host, from the record's gradient), then
    /// copies master, m and v to the device and casts the weights into the outer slot.
    pub(super) fn load_resident_outer(&mut self) -> Result<()> {
        let Some(dev_state) = self.pool.outer_state.clone() else { return Ok(()) };
        let state = self.store.state();
        let mut r = self.store.record(Unit::Outer);
        if state.pending_update {
            let args =
                StepArgs { step: state.step + 1, lr: state.pending_lr, grad_scale: state.pending_grad_scale };
            update_unit(&mut r, &self.opts.adamw, &args, None, Upload::None)?;
        }
        let n = r.master().len();
        let device = self.backend.device().clone();
        let p = r.parts();
        for (k, part) in [&*p.master, &*p.m, &*p.v].into_iter().enumerate() {
            dev_state.slice_set(&Tensor::from_slice(part, n, &device)?, 0, k * n)?;
        }
        self.outer_applied = r.applied_step();
        drop(r);
        self.cast_resident_outer()?;
        self.outer_dirty = false;
        self.backend.synchronize()?;
        Ok(())
    }

    /// The resident outer master weights cast into the outer slot (compute stream).
    fn cast_resident_outer(&self) -> Result<()> {
        let Some(st) = &self.pool.outer_state else { return Ok(()) };
        let n = self.layout.outer.len;
        let slot = &self.pool.outer_slot;
        slot.slice_set(&st.narrow(0, 0, n)?.to_dtype(slot.dtype())?, 0, 0)?;
        Ok(())
    }

    /// AdamW step `args` on the resident outer unit (once: a retried step skips it), then its
    /// weights into the outer slot.
    pub(super) fn update_resident_outer(&mut self, args: &StepArgs) -> Result<()> {
        let Some(st) = self.pool.outer_state.clone() else { return Ok(()) };
        if self.outer_applied < args.step {
            mt_layers::device_optim::adamw_step(&st, &self.pool.outer_grad, &self.opts.adamw, args)?;
            self.outer_applied = args.step;
            self.outer_dirty = true;
        }
        self.cast_resident_outer()
    }

    /// Writes a resident outer unit's device state (master, m, v, the optimizer step it has
    /// applied, and its last gradient, which a pending update still needs) into the host store's
    /// record, so that checkpoints, exports, a later engine or a host-side flush see it. A no-op
    /// without a resident outer unit or when the store is already current.
    pub fn sync_store(&mut self) -> Result<()> {
        let Some(st) = self.pool.outer_state.clone() else { return Ok(()) };
        if !self.outer_dirty {
            return Ok(());
        }
        let n = self.layout.outer.len;
        let state = self.store.state();
        // The gradient is needed only by a pending update the device has not applied.
        let need_grad = state.pending_update && self.outer_applied <= state.step;
        let mut r = self.store.record(Unit::Outer);
        // In pieces, so the host holds at most SYNC_PIECE extra elements at a time. Each piece is
        // first copied into a small device buffer: candle's `to_vec1` of a view copies the view's
        // whole storage to the host (9.5 GB per piece at 3.6B).
        let pieces = |len: usize| (0..len).step_by(SYNC_PIECE).map(move |o| (o, SYNC_PIECE.min(len - o)));
        let staging = Tensor::zeros(SYNC_PIECE.min(n), DType::F32, st.device())?;
        let fetch = |src: &Tensor, o: usize, len: usize| -> Result<Vec<f32>> {
            let buf = staging.narrow(0, 0, len)?;
            buf.slice_set(&src.narrow(0, o, len)?, 0, 0)?;
            Ok(buf.to_vec1()?)
        };
        let p = r.parts();
        for (k, dst) in [p.master, p.m, p.v].into_iter().enumerate() {
            for (o, len) in pieces(n) {
                dst[o..o + len].copy_from_slice(&fetch(&st, k * n + o, len)?);
            }
        }
        if need_grad {
            for (o, len) in pieces(n) {
                let g = fetch(&self.pool.outer_grad, o, len)?;
                let stored = match r.grad_mut() {
                    Some(GradMut::F32(d)) => Upload::F32(&mut d[o..o + len]),
                    Some(GradMut::Bf16(d)) => Upload::Bf16(&mut d[o..o + len]),
                    None => Upload::None,
                };
                mt_optim::cast_into(&g, stored)?;
            }
        }
        r.set_applied_step(self.outer_applied);
        self.outer_dirty = false;
        Ok(())
    }
}

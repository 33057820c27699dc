//! The host stream's jobs: staging a unit (the cast into its upload buffer, with the pending
//! AdamW update fused in, exact mode) and landing a gradient (into the store record with its sum
//! of squares, lean mode's update fused in), issued as the step program says.

use std::sync::{Arc, Mutex};

use mt_core::{BaseDtype, StateDtype, Unit};
use mt_optim::{AdamW, Grad, Moments, StepArgs, Upload};
use mt_store::{decode_unit, Decoded, FrozenBase, GradMut, GradRef, RecordGuard, TransferBuf};

use super::{commit, Engine};
use crate::backend::{Backend, HostJob};
use crate::program::{HostBuf, Op};
use crate::{Error, Result};

fn grad_view(g: GradRef<'_>) -> Grad<'_> {
    match g {
        GradRef::F32(g) => Grad::F32(g),
        GradRef::Bf16(g) => Grad::Bf16(g),
    }
}

/// The moments of `unit`'s record in their encoding, rounding with the unit's draws.
fn moments_of<'r>(
    unit: Unit,
    n: usize,
    states: StateDtype,
    m: &'r mut [u8],
    v: &'r mut [u8],
) -> Result<Moments<'r>> {
    Ok(Moments::from_bytes(states, n, m, v, unit.index() as u64)?)
}

/// Applies optimizer step `args.step` to `unit` from the record's gradient buffer — once: if
/// the record says the update was already applied (a failed step is being retried), only the
/// upload copy is refreshed. (Lean mode updates as it lands: `mt_optim::land_and_step`.)
pub(super) fn update_unit(
    unit: Unit,
    r: &mut RecordGuard<'_>,
    hyper: &AdamW,
    args: &StepArgs,
    upload: Upload<'_>,
) -> Result<()> {
    if r.applied_step() >= args.step {
        mt_optim::cast_into(r.master(), upload)?;
        return Ok(());
    }
    let p = r.parts();
    let Some(g) = p.grad else {
        return Err(Error::Options("an exact-mode update needs a store with gradient buffers".into()));
    };
    let moments = moments_of(unit, p.master.len(), p.states, p.m, p.v)?;
    mt_optim::step_fused(hyper, args, grad_view(g), p.master, moments, upload)?;
    r.set_applied_step(args.step);
    Ok(())
}

fn upload_view(s: &mut TransferBuf, range: std::ops::Range<usize>) -> Upload<'_> {
    match s {
        TransferBuf::F32(v) => Upload::F32(&mut v[range]),
        TransferBuf::Bf16(v) => Upload::Bf16(&mut v[range]),
        TransferBuf::F16(v) => Upload::F16(&mut v[range]),
    }
}

/// Stages `unit`'s frozen base (a LoRA run's) into the start of its upload copy: its encoded
/// bytes where the device dequantises them (`mt_store::uploads_encoded`: an int8 or NF4 decoder
/// layer; the upload then says so, `copy.rs`), else its weights in the copy's dtype (an fp32
/// base cast as a master is, a bf16 one copied into bf16). Returns where the unit's trainable
/// record goes in the copy: after the base's elements (0 without a base).
pub(super) fn stage_base(base: Option<&FrozenBase>, unit: Unit, s: &mut TransferBuf) -> Result<usize> {
    let Some(b) = base else { return Ok(0) };
    let (enc, w) = (b.encoding(unit), b.unit(unit));
    let n = enc.elems();
    if mt_store::uploads_encoded(enc, s.dtype()) {
        mt_store::par_copy(&mut s.as_bytes_mut()[..w.len()], &w);
        return Ok(n);
    }
    match s {
        _ if b.dtype() == BaseDtype::F32 => {
            mt_optim::cast_into(bytemuck::cast_slice(&w), upload_view(s, 0..n))?
        }
        TransferBuf::F32(v) => decode_unit(enc, &w, Decoded::F32(&mut v[..n])),
        TransferBuf::Bf16(v) => decode_unit(enc, &w, Decoded::Bf16(&mut v[..n])),
        TransferBuf::F16(v) => {
            let mut f = vec![0f32; n];
            decode_unit(enc, &w, Decoded::F32(&mut f));
            mt_optim::cast_into(&f, Upload::F16(&mut v[..n]))?;
        }
    }
    Ok(n)
}

impl<B: Backend> Engine<B> {
    /// The frozen base elements at the head of `unit`'s slot that its stage and upload leave as
    /// they are: a LoRA run's held layer's or streamed outer unit's (slots no other unit uses)
    /// once a step has put the base there (`base_ready`); `None` otherwise.
    pub(super) fn base_kept(&self, unit: Unit) -> Option<usize> {
        let base = self.opts.frozen_base.as_ref().filter(|_| self.base_ready)?;
        let own_slot = match unit {
            Unit::Outer => !self.opts.placement.resident_outer,
            Unit::Layer(l) => l >= self.layout.n_layers - self.pool.held.len(),
        };
        own_slot.then(|| base.encoding(unit).elems())
    }

    /// The staging buffer an upload reads; a ring index the engine lacks is a scheduling error.
    pub(super) fn staging_of(&self, b: HostBuf) -> Result<Arc<Mutex<TransferBuf>>> {
        Ok(match b {
            HostBuf::Ring(k) => Arc::clone(ring(&self.staging, k, "staging buffer")?),
            HostBuf::Outer => Arc::clone(&self.outer_staging),
        })
    }

    /// The landing buffer a download writes; a ring index the engine lacks is a scheduling error.
    pub(super) fn landing_of(&self, b: HostBuf) -> Result<Arc<Mutex<TransferBuf>>> {
        Ok(match b {
            HostBuf::Ring(k) => Arc::clone(ring(&self.landing, k, "landing buffer")?),
            HostBuf::Outer => Arc::clone(&self.outer_landing),
        })
    }

    /// Ring slot `k`'s device weights.
    pub(super) fn ring_slot(&self, k: usize) -> Result<candle_core::Tensor> {
        ring(&self.pool.slots, k, "ring slot").cloned()
    }

    /// Gradient buffer `k`.
    pub(super) fn ring_grad(&self, k: usize) -> Result<candle_core::Tensor> {
        ring(&self.pool.grad_bufs, k, "gradient buffer").cloned()
    }

    /// Issues host-stream op `op` after `waits`.
    pub(super) fn issue_host(&self, op: &Op, waits: &[B::Event], args: StepArgs) -> Result<B::Event> {
        let name = format!("{op:?}");
        let hyper = self.opts.adamw;
        Ok(match *op {
            Op::Stage { unit, staging, update } => {
                let (store, st) = (Arc::clone(&self.store), self.staging_of(staging)?);
                let base = self.opts.frozen_base.clone();
                let kept = self.base_kept(unit);
                let job: HostJob = Box::new(move || {
                    let mut r = store.record(unit);
                    let mut s = st.lock().unwrap_or_else(|p| p.into_inner());
                    let at = match kept {
                        // Its slot holds the base already: the adapters alone go up.
                        Some(n) => n,
                        None => stage_base(base.as_deref(), unit, &mut s)?,
                    };
                    let up = upload_view(&mut s, at..at + r.master().len());
                    if update {
                        update_unit(unit, &mut r, &hyper, &args, up)
                    } else {
                        Ok(mt_optim::cast_into(r.master(), up)?)
                    }
                });
                self.backend.host(waits, job, name)
            }
            Op::Land { unit, landing, update } => {
                let (store, land, sumsq) =
                    (Arc::clone(&self.store), self.landing_of(landing)?, Arc::clone(&self.sumsq));
                let job: HostJob = Box::new(move || {
                    let src = land.lock().unwrap_or_else(|p| p.into_inner());
                    let mut r = store.record(unit);
                    if src.len() != r.master().len() {
                        return Err(Error::Stream {
                            stream: "host",
                            msg: format!(
                                "landed {} gradient elements for a {}-element record",
                                src.len(),
                                r.master().len()
                            ),
                        });
                    }
                    let src = match &*src {
                        TransferBuf::F32(v) => v,
                        TransferBuf::Bf16(v) => {
                            // Narrowed on the device, which also took its sum of squares: store it.
                            return match r.grad_mut() {
                                Some(GradMut::Bf16(g)) if !update => {
                                    mt_store::par_copy(g, v);
                                    Ok(())
                                }
                                _ => Err(Error::Stream {
                                    stream: "host",
                                    msg: "a bf16 landing is for exact mode's bf16 store gradients".into(),
                                }),
                            };
                        }
                        TransferBuf::F16(_) => {
                            return Err(Error::Stream { stream: "host", msg: "f16 gradient landing".into() })
                        }
                    };
                    // Store the gradient (parallel cast) and take Σg² of the gradient the
                    // optimizer will use: the stored (possibly bf16) one, in the same pass; in
                    // lean mode, which updates from the landed f32 gradient now, of that one,
                    // with the update in the same pass too (unless a retried step applied it).
                    let ss = if update && r.applied_step() < args.step {
                        // A non-finite gradient updates nothing (`commit.rs`): checked before
                        // the fused land + update writes the record.
                        let ss = mt_optim::sum_squares(Grad::F32(src));
                        if !ss.is_finite() {
                            commit::zero_grad(&mut r);
                            sumsq.lock().unwrap_or_else(|p| p.into_inner())[unit.index()] = ss;
                            return Ok(());
                        }
                        let p = r.parts_mut();
                        let stored = match p.grad {
                            Some(GradMut::F32(g)) => Upload::F32(g),
                            Some(GradMut::Bf16(g)) => Upload::Bf16(g),
                            None => Upload::None,
                        };
                        let moments = moments_of(unit, p.master.len(), p.states, p.m, p.v)?;
                        let ss = mt_optim::land_and_step(&hyper, &args, src, stored, p.master, moments)?;
                        r.set_applied_step(args.step);
                        ss
                    } else {
                        let stored = match r.grad_mut() {
                            Some(GradMut::F32(g)) => Upload::F32(g),
                            Some(GradMut::Bf16(g)) => Upload::Bf16(g),
                            None => Upload::None,
                        };
                        if update {
                            mt_optim::cast_into(src, stored)?;
                            mt_optim::sum_squares(Grad::F32(src))
                        } else {
                            mt_optim::cast_sum_squares(src, stored)?
                        }
                    };
                    sumsq.lock().unwrap_or_else(|p| p.into_inner())[unit.index()] = ss;
                    Ok(())
                });
                self.backend.host(waits, job, name)
            }
            _ => return Err(Error::Schedule(format!("{op:?} is not a host op"))),
        })
    }
}

/// Element `k` of one of the engine's rings, or the scheduling error naming what is missing (a
/// program built for a deeper ring than this engine's).
fn ring<'a, T>(items: &'a [T], k: usize, what: &str) -> Result<&'a T> {
    items
        .get(k)
        .ok_or_else(|| Error::Schedule(format!("{what} {k} does not exist (the engine has {})", items.len())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_index_beyond_the_ring_is_a_scheduling_error() {
        assert_eq!(ring(&[10, 11], 1, "ring slot").ok(), Some(&11));
        match ring(&[10, 11], 2, "ring slot") {
            Err(Error::Schedule(m)) => assert_eq!(m, "ring slot 2 does not exist (the engine has 2)"),
            other => panic!("expected a scheduling error, got {other:?}"),
        }
    }
}

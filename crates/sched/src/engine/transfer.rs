//! The engine's transfers and host jobs: staging (with the pending update), uploads, state
//! uploads and downloads, checkpoint spills, gradient downloads and landing (lean mode's update
//! with it), issued as the step program says.

use std::sync::{Arc, Mutex};

use mt_core::{StateDtype, Unit};
use mt_optim::{AdamW, Grad, Moments, StepArgs, Upload};
use mt_store::{GradMut, GradRef, RecordGuard, Staging};

use super::{faults, Engine};
use crate::backend::{Backend, HostJob};
use crate::program::{HostBuf, Op, Slot};
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

fn upload_view(s: &mut Staging, n: usize) -> Upload<'_> {
    match s {
        Staging::F32(v) => Upload::F32(&mut v[..n]),
        Staging::Bf16(v) => Upload::Bf16(&mut v[..n]),
        Staging::F16(v) => Upload::F16(&mut v[..n]),
    }
}

impl<B: Backend> Engine<B> {
    fn staging_of(&self, b: HostBuf) -> Arc<Mutex<Staging>> {
        match b {
            HostBuf::Ring(k) => Arc::clone(&self.staging[k]),
            HostBuf::Outer => Arc::clone(&self.outer_staging),
        }
    }

    fn landing_of(&self, b: HostBuf) -> Arc<Mutex<Staging>> {
        match b {
            HostBuf::Ring(k) => Arc::clone(&self.landing[k]),
            HostBuf::Outer => Arc::clone(&self.outer_landing),
        }
    }

    pub(super) fn issue_transfer(&self, op: &Op, waits: &[B::Event], args: StepArgs) -> Result<B::Event> {
        let name = format!("{op:?}");
        let hyper = self.opts.adamw;
        if !self.lands() && matches!(op, Op::Download { .. } | Op::Land { .. }) {
            // Rank 0 downloads and lands the summed gradient; here the op only keeps the
            // program's shape (and its waits).
            return Ok(self.backend.host(waits, Box::new(|| Ok(())), name));
        }
        Ok(match *op {
            Op::Stage { unit, staging, update } => {
                let (store, st) = (Arc::clone(&self.store), self.staging_of(staging));
                let job: HostJob = Box::new(move || {
                    let mut r = store.record(unit);
                    let mut s = st.lock().unwrap_or_else(|p| p.into_inner());
                    let up = upload_view(&mut s, r.master().len());
                    if update {
                        update_unit(unit, &mut r, &hyper, &args, up)
                    } else {
                        Ok(mt_optim::cast_into(r.master(), up)?)
                    }
                });
                self.backend.host(waits, job, name)
            }
            Op::Upload { staging, slot, .. } => {
                let dst = match slot {
                    Slot::Ring(k) => self.pool.slots[k].clone(),
                    Slot::Outer => self.pool.outer_slot.clone(),
                    Slot::Held(l) => self.held_slot(l)?,
                    Slot::Resident(l) => {
                        return Err(Error::Options(format!("upload into resident layer {l}'s slot")))
                    }
                };
                self.backend.upload(waits, self.staging_of(staging), dst, name)
            }
            Op::UploadState { unit, buf } => {
                let (state, grad) = match (self.pool.state.get(buf), self.pool.state_grad.get(buf)) {
                    (Some(s), Some(g)) => (s.clone(), g.clone()),
                    _ => {
                        return Err(Error::Options(format!(
                            "state slot {buf} does not exist (scheduling bug)"
                        )))
                    }
                };
                self.backend.upload_record(waits, Arc::clone(&self.store), unit, state, Some(grad), name)
            }
            Op::UploadMoments { unit, buf } => {
                let state = self.pool.state.get(buf).cloned().ok_or_else(|| {
                    Error::Options(format!("state slot {buf} does not exist (scheduling bug)"))
                })?;
                self.backend.upload_record(waits, Arc::clone(&self.store), unit, state, None, name)
            }
            Op::DownloadState { unit, buf } => {
                let state = self.pool.state.get(buf).cloned().ok_or_else(|| {
                    Error::Options(format!("state slot {buf} does not exist (scheduling bug)"))
                })?;
                self.backend.download_record(waits, state, Arc::clone(&self.store), unit, args.step, name)
            }
            Op::SpillCheckpoint { boundary } => self.issue_spill(boundary, waits, &name)?,
            Op::ReloadCheckpoint { boundary, slot } => self.issue_reload(boundary, slot, waits, &name)?,
            Op::Download { grad_buf, landing, .. } => {
                // A layer gradient narrowed to bf16 by its backward downloads from the twin.
                let src = match grad_buf {
                    Some(k) => self.pool.grad_narrow.get(k).unwrap_or(&self.pool.grad_bufs[k]).clone(),
                    None => self.pool.outer_grad.clone(),
                };
                self.backend.download(waits, src, self.landing_of(landing), name)
            }
            Op::Land { unit, landing, update } => {
                let (store, land, sumsq) =
                    (Arc::clone(&self.store), self.landing_of(landing), Arc::clone(&self.sumsq));
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
                        Staging::F32(v) => v,
                        Staging::Bf16(v) => {
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
                        Staging::F16(_) => {
                            return Err(Error::Stream { stream: "host", msg: "f16 gradient landing".into() })
                        }
                    };
                    // Store the gradient (parallel cast) and take Σg² of the gradient the
                    // optimizer will use: the stored (possibly bf16) one, in the same pass; in
                    // lean mode, which updates from the landed f32 gradient now, of that one,
                    // with the update in the same pass too (unless a retried step applied it).
                    let ss = if update && r.applied_step() < args.step {
                        // A non-finite gradient updates nothing (`faults.rs`): checked before
                        // the fused land + update writes the record.
                        let ss = mt_optim::sum_squares(Grad::F32(src));
                        if !ss.is_finite() {
                            faults::zero_grad(&mut r);
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
            _ => return Err(Error::Options(format!("{op:?} is not a transfer or host op"))),
        })
    }
}

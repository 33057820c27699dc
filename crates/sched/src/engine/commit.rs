//! The commit of a step once its gradients have landed: the global norm, whether the step is
//! skipped, and the store's new state.
//!
//! Non-finite steps: a step whose loss or global gradient norm is NaN or infinite applies no
//! update (`docs/decisions/0030-non-finite-steps.md`).
//!
//! Exact mode decides at the step's end, before anything of the step's own update exists: the
//! update the step computed is simply not made pending (its landed gradients are never read, and
//! the non-finite ones are zeroed, so the store holds no NaN), the store's step stays where the
//! previous step's update left it and [`HostStore::skipped_steps`] counts the step. The update of
//! the step before, which this step's forward applied, was a valid one: the store is then what
//! the run without the bad step would hold after [`Engine::flush_pending`], bitwise.
//!
//! Lean mode updates each unit as its gradient lands, before the global norm exists, so it
//! decides per unit: a unit whose landed gradient holds a NaN or infinity is not updated (its
//! master weights and moments stay as they were); resident units' lean updates come at the
//! program's end, once their own share of the norm is taken, and follow the same rule
//! (`Op::UpdateResident`). If no unit
//! was updated (a non-finite loss poisons every gradient, the usual case) the step is skipped
//! exactly as in exact mode; otherwise the store's step advances, the units that sat it out are
//! marked as having passed it, and the next step clips with the last finite norm.
//!
//! Data-parallel ranks (`crate::data_parallel`) take the same decision, from their loss shares and
//! a flag summed over the ranks (`Engine::agree_on_finite`); only the landing rank writes the store (its state, zeroed
//! gradients, skip count), after every rank's step has drained, so a skipped step leaves no
//! update pending for any rank's next step to apply.

use candle_core::Tensor;
use mt_core::Unit;
use mt_optim::StepArgs;
use mt_store::{GradMut, HostStore, RecordGuard, StoreState};

use super::Engine;
use crate::backend::Backend;
use crate::program::OptimMode;
use crate::Result;

/// Why a step applied no update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SkipCause {
    /// The loss was NaN or infinite.
    Loss(f64),
    /// The global gradient norm was NaN or infinite.
    GradNorm(f64),
}

impl std::fmt::Display for SkipCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SkipCause::Loss(x) => write!(f, "the loss is {x}"),
            SkipCause::GradNorm(x) => write!(f, "the global gradient norm is {x}"),
        }
    }
}

/// A step whose loss or gradient norm was not finite ([`crate::StepReport::skipped`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Skipped {
    /// The loss if it was not finite, else the gradient norm.
    pub cause: SkipCause,
    /// Units updated anyway: in lean mode, those whose gradient was finite, updated as it landed
    /// (before the norm existed); always 0 in exact mode.
    pub units_updated: usize,
    /// The units whose gradient held a NaN or infinity (none when only the loss was not finite).
    pub not_finite: Vec<Unit>,
}

/// Zeroes a record's stored gradient (a non-finite one that no update will read).
pub(super) fn zero_grad(r: &mut RecordGuard<'_>) {
    match r.grad_mut() {
        Some(GradMut::F32(g)) => g.fill(0.0),
        Some(GradMut::Bf16(g)) => g.fill(half::bf16::ZERO),
        None => {}
    }
}

impl<B: Backend> Engine<B> {
    /// Commits a step whose every stream has drained with `loss` (the chunks' sum): reads the
    /// device's shares of the global norm, sums it in unit order, adds an injected loss fault,
    /// agrees with the other ranks on whether the step is finite, and concludes it. Returns the
    /// loss, the norm and the skip.
    pub(super) fn commit(
        &mut self,
        state: StoreState,
        lr: f64,
        loss: f64,
        args: &StepArgs,
    ) -> Result<(f64, f64, Option<Skipped>)> {
        for (unit, ss) in std::mem::take(&mut self.device_sumsq) {
            let ss = ss.value()?;
            self.sumsq.lock().unwrap_or_else(|p| p.into_inner())[unit.index()] = ss;
        }
        let norm = self.sumsq.lock().unwrap_or_else(|p| p.into_inner()).iter().sum::<f64>().sqrt();
        let loss = self.inject_loss(loss);
        self.step_faults.clear();
        // Every rank takes the same decision, from the whole batch's loss and the summed norm.
        let (loss, norm) = self.agree_on_finite(loss, norm)?;
        let skipped = self.conclude_step(state, lr, loss, norm, args)?;
        Ok((loss, norm, skipped))
    }

    /// The loss and gradient norm a step reports and decides its skip from: the same on every
    /// rank. Alone, they are the step's own. A rank's loss is its share of the global batch's and
    /// only the landing ranks (each store's lead) have the norm (of the summed gradient; the others
    /// land nothing), so the ranks sum, through the same reduction as the gradients but in f64,
    /// their loss shares (the whole batch's loss on every rank, in every process: a share that is
    /// not finite makes it NaN or infinite) and a flag for "the norm is not finite" (only the
    /// landing ranks' count; flags sum exactly). A rank that lands nothing reports a norm of 0,
    /// or NaN where the flag says a landing rank's was not finite. The landing rank's norm is its
    /// own, bitwise the one engine's.
    pub(super) fn agree_on_finite(&self, loss: f64, norm: f64) -> Result<(f64, f64)> {
        let Some(dp) = &self.dp else { return Ok((loss, norm)) };
        let norm_bad = if self.lands() && !norm.is_finite() { 1f64 } else { 0f64 };
        let buf = Tensor::new(&[loss, norm_bad], self.backend.device())?;
        dp.reduce.sum(&buf)?;
        let all = buf.to_vec1::<f64>()?;
        let norm = match (all[1] > 0.0, self.lands()) {
            (_, true) => norm,
            (false, false) => 0.0,
            (true, false) => f64::NAN,
        };
        Ok((all[0], norm))
    }

    /// Ends a step whose gradients have landed: decides whether it is skipped (module docs) and
    /// writes the store's new state (lean mode's resident updates are the program's own ops).
    pub(super) fn conclude_step(
        &mut self,
        state: StoreState,
        lr: f64,
        loss: f64,
        norm: f64,
        args: &StepArgs,
    ) -> Result<Option<Skipped>> {
        let cause = if !loss.is_finite() {
            Some(SkipCause::Loss(loss))
        } else if !norm.is_finite() {
            Some(SkipCause::GradNorm(norm))
        } else {
            None
        };
        if !self.lands() {
            // A data-parallel rank that lands nothing updates nothing and leaves the store's
            // state to the landing rank, which took the same decision (`agree_on_finite`).
            return Ok(cause.map(|cause| Skipped { cause, units_updated: 0, not_finite: Vec::new() }));
        }
        let sumsq = self.sumsq.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let not_finite: Vec<Unit> = self.layout.units().filter(|u| !sumsq[u.index()].is_finite()).collect();
        let pending = u64::from(state.pending_update);
        match (self.opts.mode, cause) {
            (OptimMode::Exact, None) => {
                let coef = self.opts.clip.map_or(1.0, |c| mt_optim::clip_coef(norm, c));
                self.store.set_state(StoreState {
                    step: state.step + pending,
                    pending_update: true,
                    pending_grad_scale: coef,
                    pending_lr: lr,
                    grad_norm: norm,
                });
                Ok(None)
            }
            (OptimMode::Exact, Some(cause)) => {
                // The previous step's update (applied in this step's forward) stands; this
                // step's is never made pending.
                for &u in not_finite.iter().filter(|&&u| !self.is_resident(u)) {
                    zero_grad(&mut self.store.record(u));
                }
                self.store.set_state(StoreState {
                    step: state.step + pending,
                    pending_update: false,
                    pending_grad_scale: 1.0,
                    pending_lr: lr,
                    grad_norm: state.grad_norm,
                });
                count_skip(&self.store);
                Ok(Some(Skipped { cause, units_updated: 0, not_finite }))
            }
            (OptimMode::Lean, cause) => {
                // The resident units' updates ran at the program's end, each if its gradient
                // was finite (`Op::UpdateResident`).
                let updated = self.layout.n_units() - not_finite.len();
                let Some(cause) = cause else {
                    self.store.set_state(StoreState {
                        step: state.step + 1,
                        pending_update: false,
                        pending_grad_scale: 1.0,
                        pending_lr: lr,
                        grad_norm: norm,
                    });
                    return Ok(None);
                };
                if updated == 0 {
                    // Nothing was written: the store is the previous step's.
                    count_skip(&self.store);
                } else {
                    // The units that sat the step out have passed it too.
                    for &u in &not_finite {
                        if self.is_resident(u) {
                            self.applied[u.index()] = args.step;
                            self.dirty = true;
                        } else {
                            self.store.set_applied_step(u, args.step);
                        }
                    }
                    self.store.set_state(StoreState {
                        step: state.step + 1,
                        pending_update: false,
                        pending_grad_scale: 1.0,
                        pending_lr: lr,
                        grad_norm: if norm.is_finite() { norm } else { state.grad_norm },
                    });
                }
                Ok(Some(Skipped { cause, units_updated: updated, not_finite }))
            }
        }
    }
}

fn count_skip(store: &HostStore) {
    store.set_skipped_steps(store.skipped_steps() + 1);
}

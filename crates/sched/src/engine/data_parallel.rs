//! The engine as one rank of several data-parallel ones (`crate::data_parallel`): joining a
//! group, and a step on a share of a global batch.

use candle_core::Tensor;
use mt_core::Error as CoreError;

use super::Engine;
use crate::backend::Backend;
use crate::batch::Batch;
use crate::data_parallel::DataParallel;
use crate::{Error, Result, StepReport};

impl<B: Backend> Engine<B> {
    /// One step of a data-parallel rank ([`Engine::set_data_parallel`]) on its share `part` of a
    /// global batch with `global_targets` non-masked targets (the loss normaliser); the caller
    /// validated the global batch. Every rank of the group must call it for the same step.
    pub fn step_rank(&mut self, part: &Batch, global_targets: usize, lr: f64) -> Result<StepReport> {
        if self.dp.is_none() {
            return Err(Error::Options("step_rank needs a data-parallel engine (set_data_parallel)".into()));
        }
        part.validate_shape(&self.cfg)?;
        if global_targets == 0 {
            return Err(CoreError::NoTargetTokens.into());
        }
        self.step_inner(part, global_targets, lr, |_| {})
    }

    /// Makes this engine rank `dp.rank` of `dp.world` data-parallel ranks over its store. Refuses
    /// placements whose optimizer state lives on the device (resident units, GPU-updated layers:
    /// every rank would own a copy and write it back) and the MoE load-balancing loss (a function
    /// of the whole batch's router statistics, which no rank has).
    pub fn set_data_parallel(&mut self, dp: DataParallel) -> Result<()> {
        let o = &self.opts;
        if dp.world == 0 || dp.rank >= dp.world {
            return Err(Error::Options(format!("rank {} of {} ranks", dp.rank, dp.world)));
        }
        let p = &o.placement;
        let device_state = p.resident_outer || p.resident_layers > 0 || p.gpu_updated_layers > 0;
        if dp.world > 1 && device_state {
            return Err(Error::Options(
                "data parallel over several GPUs keeps every optimizer state in the one host store: use --resident-outer off --resident-layers 0 --gpu-updated-layers 0 with --gpus above 1".into(),
            ));
        }
        if dp.world > 1 && self.cfg.moe.as_ref().and_then(|m| m.aux_coef()).is_some() {
            return Err(Error::Options(
                "the mixture of experts' load-balancing loss needs the router statistics of the whole batch, which data parallel over several GPUs does not gather yet: train it with --gpus 1".into(),
            ));
        }
        self.dp = Some(dp);
        Ok(())
    }

    /// The loss and gradient norm a step's skip decision ([`Engine::conclude_step`]) is taken
    /// from: the same decision on every rank. Alone, they are the step's own. A rank's loss is its
    /// share of the batch's, and only the landing rank has the norm (of the summed gradient; the
    /// others land nothing), so the ranks sum, through the same reduction as the gradients, one
    /// flag each for "my share of the loss is not finite" and "the norm is not finite" (only the
    /// landing rank's counts). Flags sum exactly, so every rank reads the same two counts and
    /// decides from them alone: a value it does not have, or has finite while another rank's is
    /// not, is NaN for the decision ([`crate::Ranks::step`] reports the whole batch's loss as the
    /// cause). The landing rank's norm is its own, bitwise the one engine's.
    pub(super) fn agree_on_finite(&self, loss: f64, norm: f64) -> Result<(f64, f64)> {
        let Some(dp) = &self.dp else { return Ok((loss, norm)) };
        let flag = |bad: bool| if bad { 1f32 } else { 0f32 };
        let buf = Tensor::new(
            &[flag(!loss.is_finite()), flag(self.lands() && !norm.is_finite())],
            self.backend.device(),
        )?;
        dp.reduce.sum(&buf)?;
        let all = buf.to_vec1::<f32>()?;
        let (loss_bad, norm_bad) = (all[0] > 0.0, all[1] > 0.0);
        let loss = match (loss_bad, loss.is_finite()) {
            (true, true) => f64::NAN,
            _ => loss,
        };
        let norm = match (norm_bad, self.lands()) {
            (false, true) => norm,
            (false, false) => 0.0,
            (true, true) => norm,
            (true, false) => f64::NAN,
        };
        Ok((loss, norm))
    }

    /// This engine's rank, if it is one of several data-parallel ones.
    pub fn rank(&self) -> Option<(usize, usize)> {
        self.dp.as_ref().map(|d| (d.rank, d.world))
    }

    /// Whether this engine writes gradients into the store and sets its step state (it trains
    /// alone, or it is rank 0).
    pub(super) fn lands(&self) -> bool {
        self.dp.as_ref().is_none_or(|d| d.rank == 0)
    }
}

//! The engine as one rank of several data-parallel ones (`crate::data_parallel`): joining a
//! group, and a step on a share of a global batch. (What a rank's step does differently is in
//! its program: `ProgramSpec::rank`; how the ranks agree on a skip: `commit.rs`.)

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

    /// Makes this engine rank `dp.rank` of `dp.world` data-parallel ranks over its store (landed
    /// by rank `dp.lead`). Refuses
    /// placements whose optimizer state lives on the device (resident units, GPU-updated layers:
    /// every rank would own a copy and write it back) and the MoE load-balancing loss (a function
    /// of the whole batch's router statistics, which no rank has).
    pub fn set_data_parallel(&mut self, dp: DataParallel) -> Result<()> {
        let o = &self.opts;
        if dp.world == 0 || dp.rank >= dp.world || dp.lead > dp.rank {
            return Err(Error::Options(format!(
                "rank {} of {} ranks, its store's lead rank {}: the lead is one of the ranks before it or itself",
                dp.rank, dp.world, dp.lead
            )));
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

    /// `values` summed over every rank of the group (through the gradients' reduction, in f64):
    /// what the ranks must agree on before they step, such as the step each starts from. Every
    /// rank must call it together; alone, `values` themselves.
    pub fn sum_over_ranks(&self, values: &[f64]) -> Result<Vec<f64>> {
        let Some(dp) = &self.dp else { return Ok(values.to_vec()) };
        let buf = candle_core::Tensor::new(values, self.backend.device())?;
        dp.reduce.sum(&buf)?;
        Ok(buf.to_vec1::<f64>()?)
    }

    /// This engine's rank, if it is one of several data-parallel ones.
    pub fn rank(&self) -> Option<(usize, usize)> {
        self.dp.as_ref().map(|d| (d.rank, d.world))
    }

    /// The rank that lands this data-parallel engine's store ([`DataParallel::lead`]).
    pub fn lead(&self) -> Option<usize> {
        self.dp.as_ref().map(|d| d.lead)
    }

    /// Whether this engine writes gradients into the store and sets its step state (it trains
    /// alone, or it is its store's lead rank).
    pub(super) fn lands(&self) -> bool {
        self.dp.as_ref().is_none_or(|d| d.rank == d.lead)
    }
}

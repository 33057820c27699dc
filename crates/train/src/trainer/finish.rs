//! The end of a run ([`Trainer::finish`]): the last update applied, a final evaluation, the
//! checkpoint of the last step, the export (or, for a resumed run that trained nothing, the export
//! it finds recorded, left alone), and the summary; [`Trainer::export`] alone for a loop of
//! one's own.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::{global_flops, Trainer};
use crate::checkpoint::{self, export_record};
use crate::error::{Context, Error, Result};
use crate::host::{planned_host_bytes, rss_bytes};
use crate::observer::{notify, Event, Observer};
use crate::summary::TrainSummary;

impl<O: Observer> Trainer<O> {
    /// Writes the model as a Hugging Face directory (config.json last, so the directory is
    /// loadable exactly when it is complete), with the model directory's tokenizer files.
    pub fn export(&mut self, dir: &Path) -> Result<()> {
        let t = Instant::now();
        self.engine.flush_pending().context_with(|| "applying the update before the export".into())?;
        let opts = mt_hf::ExportOptions {
            dtype: self.config.export_dtype,
            max_shard_bytes: mt_hf::DEFAULT_MAX_SHARD_BYTES,
            copy_files_from: self.model.hf.as_ref().map(|h| h.dir.clone()),
            fail_after_bytes: self.config.inject_export_failure,
        };
        let (n_shards, bytes) = match &self.base {
            Some(_) => crate::lora::export(&self.config, &self.model, &self.store, dir, &opts)?,
            None => {
                let r = mt_hf::export(&self.store, &self.model.config_json, dir, &opts)
                    .context_with(|| format!("exporting the model to --out {}", dir.display()))?;
                (r.n_shards, r.bytes_written)
            }
        };
        let secs = t.elapsed().as_secs_f64();
        let event = Event::Exported { dir, kind: self.export_kind(), n_shards, bytes, secs };
        notify(&mut self.observer, &event)
    }

    /// Ends the run: the device profile (`MT_PROFILE=1`), the last pending update applied and
    /// the store written back, a final evaluation, a checkpoint of the last step (with a
    /// checkpoint directory: so a failed export loses no trained step), the export to `out`
    /// (process 0's alone in a job of several);
    /// returns the summary. A resumed run that was already complete trains nothing, evaluates
    /// nothing and leaves an export of its last step alone (exporting it if `out` lacks it).
    pub fn finish(mut self) -> Result<TrainSummary> {
        self.report_profile()?;
        let t = Instant::now();
        self.engine.flush_pending().context_with(|| "applying the last update".into())?;
        self.store.flush().context_with(|| "flushing the host store".into())?;
        notify(&mut self.observer, &Event::Flushed { secs: t.elapsed().as_secs_f64() })?;
        let trained = self.global_step() > self.start_step;
        if !self.eval_batches.is_empty() && trained {
            let e = self.evaluate()?;
            notify(&mut self.observer, &Event::Eval(e))?;
        }
        let checkpoint_failed = self.final_checkpoint()?;
        let mut export_kept = false;
        let exported = match self.config.out.clone().filter(|_| self.config.writes_outputs()) {
            Some(out) => {
                let dir = self.config.checkpoint_dir();
                let hash = checkpoint::hash_json(&self.defining);
                let step = self.global_step();
                // Only a run that trained nothing leaves an export alone: a retrained step may
                // differ in its last bits on a GPU.
                if !trained && dir.as_ref().is_some_and(|d| export_record::is_exported(d, step, &hash, &out))
                {
                    export_kept = true;
                    notify(&mut self.observer, &Event::ExportKept { dir: &out, step })?;
                } else {
                    self.export(&out).map_err(|e| self.export_failed(e, checkpoint_failed.as_ref()))?;
                    if let Some(dir) = &dir {
                        if let Err(e) = export_record::write(dir, step, &hash, &out) {
                            tracing::warn!("the export is complete but could not be recorded: {e}");
                        }
                    }
                }
                Some(out)
            }
            None => match checkpoint_failed {
                Some(e) => return Err(e),
                None => None,
            },
        };
        let mut summary = self.summary(exported);
        summary.export_kept = export_kept;
        Ok(summary)
    }

    /// A checkpoint of the last step, unless there is one already or no checkpoint directory.
    /// Its error is returned rather than raised: the export may still save the work.
    fn final_checkpoint(&mut self) -> Result<Option<Error>> {
        let none_due =
            self.config.checkpoint_dir().is_none() || self.checkpointed == Some(self.global_step());
        if none_due || !self.config.writes_outputs() {
            return Ok(None);
        }
        match self.save_checkpoint() {
            Ok(c) => {
                notify(&mut self.observer, &Event::FinalCheckpoint(&c))?;
                Ok(None)
            }
            Err(e) => {
                tracing::warn!("{e}");
                Ok(Some(e))
            }
        }
    }

    /// The error of a failed export, saying where the trained state is and how to finish.
    fn export_failed(&self, e: Error, checkpoint_failed: Option<&Error>) -> Error {
        let step = self.global_step();
        match (checkpoint_failed, self.config.checkpoint_dir()) {
            (None, Some(dir)) => Error::Checkpoint(format!(
                "{e}. No trained step is lost: the state of step {step} is in the checkpoint {}. Fix the \
                 cause (free space?) and run the same command with --resume: it finishes the export \
                 without training again",
                dir.join(format!("{}.json", checkpoint::stem(step))).display()
            )),
            (Some(c), _) => Error::Checkpoint(format!(
                "{e}; and before it, {c}: the state of step {step} could not be saved (the newest \
                 checkpoint, if any, is older; --resume continues from it)"
            )),
            (None, None) => e,
        }
    }

    fn report_profile(&mut self) -> Result<()> {
        if !mt_layers::profile::enabled() {
            return Ok(());
        }
        let sections = mt_layers::profile::take();
        let total: f64 = sections.iter().map(|s| s.2).sum();
        for (name, calls, secs) in sections {
            let share = secs / total.max(1e-12);
            notify(&mut self.observer, &Event::Profile { name, calls, secs, share })?;
        }
        Ok(())
    }

    /// What the export writes: the model, or a LoRA run's adapter (merged with `--merge`).
    fn export_kind(&self) -> crate::ExportKind {
        crate::ExportKind::of(self.base.is_some(), self.config.merge)
    }

    fn summary(&self, exported: Option<PathBuf>) -> TrainSummary {
        let c = &self.config;
        let later = &self.later_s;
        TrainSummary {
            model: self.model.name.clone(),
            n_params: self.layout.n_params(),
            n_layers: self.layout.n_layers,
            start_step: self.start_step,
            end_step: self.global_step(),
            first_loss: self.first_loss.unwrap_or(f64::NAN),
            last_loss: self.last_loss.unwrap_or(f64::NAN),
            tokens_per_step: c.batch_size * c.seq_len,
            train_s: self.train_s,
            wall_s: self.t0.elapsed().as_secs_f64(),
            store_bytes: self.store.bytes(),
            store_bytes_per_param: self.store.bytes_per_param(),
            frozen_base_bytes: self.base.as_ref().map_or(0, |b| b.bytes()),
            frozen_base_dtype: self.base.as_ref().map(|b| b.dtype()),
            optim_states: self.store.state_dtype(),
            rss_bytes: rss_bytes(),
            paging: self.store.paging_stats().map(|p| (p, self.store.bytes_in_memory().unwrap_or(0))),
            planned_host_bytes: planned_host_bytes(&self.plan, c.device),
            kept_bytes: (self.totals.kept_bytes(), self.plan.gpu.kept),
            device_peak: (self.totals.device_peak(), self.plan.gpu.total),
            flops_per_step: global_flops(&self.plan, &self.config),
            later_step_s: (!later.is_empty()).then(|| later.iter().sum::<f64>() / later.len() as f64),
            store_path: self.store.path().map(Path::to_owned),
            h2d_bytes_per_step: self.totals.h2d_bytes_per_step(),
            last_step_bytes: self.totals.last_step_bytes(),
            d2h_bytes_per_step: self.totals.d2h_bytes_per_step(),
            streams: self.totals.stream_means(),
            evals: self.evals.clone(),
            skipped_steps: self.skipped,
            exported,
            export_kind: self.export_kind(),
            export_kept: false,
            device: c.device.kind(),
        }
    }
}

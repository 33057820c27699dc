//! Progress and metrics as callbacks: an [`Observer`] hears each stage of a run as an [`Event`]
//! (whose `Display` is the line `megatrain train` prints for it) and each optimizer step as a
//! [`StepEvent`] (the engine's full [`StepReport`], with the evaluation and checkpoint that
//! followed it). The library prints nothing itself.

use std::fmt;
use std::path::{Path, PathBuf};

use mt_core::ModelConfig;
use mt_sched::placement::DeviceKind;
use mt_sched::plan::Plan;
use mt_sched::StepReport;

/// What an observer returns: an error stops the run ([`crate::Error::Observer`]).
pub type ObserverResult = std::result::Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Hears what a [`crate::Trainer`] does. Both methods default to doing nothing.
pub trait Observer {
    /// A stage of setting up, running or finishing the run.
    fn event(&mut self, event: &Event<'_>) -> ObserverResult {
        let _ = event;
        Ok(())
    }

    /// An optimizer step, after the evaluation and checkpoint due at it.
    fn step(&mut self, step: &StepEvent<'_>) -> ObserverResult {
        let _ = step;
        Ok(())
    }
}

/// The observer that hears nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Quiet;

impl Observer for Quiet {}

impl<O: Observer + ?Sized> Observer for &mut O {
    fn event(&mut self, event: &Event<'_>) -> ObserverResult {
        (**self).event(event)
    }

    fn step(&mut self, step: &StepEvent<'_>) -> ObserverResult {
        (**self).step(step)
    }
}

/// A held-out evaluation: mean loss over every target of the eval batches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    /// Global step of the weights evaluated.
    pub step: u64,
    /// Mean cross-entropy, nats.
    pub loss: f64,
    /// Targets it is the mean over.
    pub targets: usize,
    /// Seconds it took.
    pub secs: f64,
}

/// A checkpoint written.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointWritten {
    /// Its manifest.
    pub manifest: PathBuf,
    /// Seconds it took (the pending update applied, the snapshot written and synced).
    pub secs: f64,
}

/// One optimizer step.
#[derive(Debug)]
pub struct StepEvent<'a> {
    /// Global step number after this step (1-based).
    pub step: u64,
    /// Steps of this run so far, this one included.
    pub steps_done: u64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Model FLOPs per step (the planner's `6·N·T + attention`).
    pub flops_per_step: f64,
    /// What the engine measured: loss, gradient norm, time, bytes, stream statistics, spans;
    /// whether the step was skipped (`report.skipped`: a non-finite loss or gradient norm).
    pub report: &'a StepReport,
    /// Skipped steps in a row, this one included (0 when it was not skipped).
    pub skipped_in_row: u64,
    /// Steps skipped since the run began (resumed runs included: the store counts them).
    pub skipped_steps: u64,
    /// The evaluation due after this step, if any.
    pub eval: Option<EvalResult>,
    /// The checkpoint due after this step, if any.
    pub checkpoint: Option<CheckpointWritten>,
    /// A store paged from its file: the pager's counters so far (setup included).
    pub paging: Option<mt_store::PagingStats>,
}

impl StepEvent<'_> {
    /// Tokens per second of the step (0 when it took no measurable time).
    pub fn tokens_per_s(&self) -> f64 {
        if self.report.step_s > 0.0 {
            self.report.n_tokens as f64 / self.report.step_s
        } else {
            0.0
        }
    }
}

/// What a run is about to do, once everything is set up.
#[derive(Debug)]
pub struct RunStart<'a> {
    /// The model's config.
    pub cfg: &'a ModelConfig,
    /// Where the model came from (directory, config path, or `builtin:tiny_llama`).
    pub source: &'a str,
    /// Parameters.
    pub n_params: usize,
    /// Global step the run starts at (steps already in the store or checkpoint).
    pub start_step: u64,
    /// Global step it ends at.
    pub end_step: u64,
    /// Whether it continues a store or a checkpoint.
    pub resumed: bool,
    /// How it resumed, in words (`None` for a fresh run).
    pub resume_note: Option<String>,
    /// `--resume` was asked but there was no checkpoint yet.
    pub no_checkpoint_yet: bool,
    /// The training data, in words.
    pub data: String,
    /// Peak learning rate (resolved when `lr` was `None`).
    pub lr: f64,
    /// The host store: bytes, bytes per parameter, and its file (`None`: anonymous memory).
    pub store_bytes: usize,
    /// Host store bytes per parameter.
    pub store_bytes_per_param: f64,
    /// The store's file.
    pub store_path: Option<&'a Path>,
    /// A LoRA run's frozen base weights in host memory, bytes (`mt_store::FrozenBase::bytes`;
    /// 0 without LoRA).
    pub frozen_base_bytes: usize,
    /// How a LoRA run holds its frozen base (`--base-dtype`; `None` without LoRA).
    pub frozen_base_dtype: Option<mt_core::BaseDtype>,
    /// A LoRA run's base was initialised from the seed (a model given by `--config`), not
    /// imported: a run for measuring, with nothing to learn from the base.
    pub random_base: bool,
    /// Model FLOPs per step.
    pub flops_per_step: f64,
}

/// A stage of a run. `Display` gives the line `megatrain train` prints for it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Event<'a> {
    /// The GPU opened (CUDA only).
    Device(&'a str),
    /// The plan, in the words of the device it is for.
    Planned {
        /// The plan.
        plan: &'a Plan,
        /// The device.
        device: DeviceKind,
    },
    /// The host store's pages were populated before anything was written into it.
    Prefaulted {
        /// Bytes populated.
        bytes: usize,
        /// Seconds it took.
        secs: f64,
    },
    /// The store could not be pre-faulted (the run goes on).
    NotPrefaulted(String),
    /// Weights imported from a model directory.
    Imported {
        /// Tensors.
        n_tensors: usize,
        /// Parameters.
        n_params: usize,
        /// The directory.
        from: &'a str,
    },
    /// A seeded random initialisation written into the store.
    Initialised {
        /// Tensors.
        n_tensors: usize,
        /// The seed.
        seed: u64,
        /// Seconds it took.
        secs: f64,
    },
    /// The engine started.
    EngineReady {
        /// Seconds it took.
        secs: f64,
        /// The device.
        device: DeviceKind,
        /// Bytes of the store page-locked in place for GPU-updated layers.
        pinned_record_bytes: usize,
    },
    /// Training starts (after this, events are part of the run's log).
    Started(&'a RunStart<'a>),
    /// A held-out evaluation before the first step or after the last.
    Eval(EvalResult),
    /// `MT_PROFILE=1`: device time of one section of the layer over the run.
    Profile {
        /// Section.
        name: &'a str,
        /// Calls.
        calls: u64,
        /// Seconds.
        secs: f64,
        /// Share of all sections' time.
        share: f64,
    },
    /// `--resume` is reading a checkpoint whole to check it against its hashes.
    CheckingCheckpoint {
        /// Its manifest.
        manifest: &'a Path,
    },
    /// `--resume` found a checkpoint whose files do not match their hashes (or are missing): it
    /// was moved aside and the one before it tried.
    CheckpointDamaged {
        /// What is wrong, with which file.
        damaged: &'a crate::checkpoint::Damaged,
        /// Where its manifest went.
        moved_to: &'a Path,
    },
    /// The checkpoint of the last step, written before the export so that a failed export
    /// loses no trained step.
    FinalCheckpoint(&'a CheckpointWritten),
    /// A resumed run that was already complete found its export in place and left it alone.
    ExportKept {
        /// The directory.
        dir: &'a Path,
        /// The step it holds.
        step: u64,
    },
    /// The last pending update applied and the store written back.
    Flushed {
        /// Seconds it took.
        secs: f64,
    },
    /// The model exported as a Hugging Face directory.
    Exported {
        /// The directory.
        dir: &'a Path,
        /// What was written there.
        kind: crate::ExportKind,
        /// Safetensors files.
        n_shards: usize,
        /// Bytes written.
        bytes: u64,
        /// Seconds it took.
        secs: f64,
    },
}

impl Event<'_> {
    /// Whether this is part of setting the run up (before [`Event::Started`]).
    pub fn is_setup(&self) -> bool {
        matches!(
            self,
            Event::Device(_)
                | Event::Planned { .. }
                | Event::Prefaulted { .. }
                | Event::NotPrefaulted(_)
                | Event::Imported { .. }
                | Event::Initialised { .. }
                | Event::EngineReady { .. }
                | Event::CheckingCheckpoint { .. }
                | Event::CheckpointDamaged { .. }
        )
    }
}

impl fmt::Display for EvalResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {}: eval loss {:.6} over {} targets", self.step, self.loss, self.targets)
    }
}

impl fmt::Display for Event<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Device(d) => write!(f, "device: {d}"),
            Event::Planned { plan, device } => write!(f, "{}", plan.display_on(*device)),
            Event::Prefaulted { bytes, secs } => {
                write!(f, "host store: {} pre-faulted in {secs:.1} s", mt_core::units::bytes(*bytes as f64))
            }
            Event::NotPrefaulted(e) => {
                write!(f, "host store: not pre-faulted ({e}); the first update will fault its pages in")
            }
            Event::Imported { n_tensors, n_params, from } => {
                write!(f, "imported {n_tensors} tensors ({n_params} parameters) from {from}")
            }
            Event::Initialised { n_tensors, seed, secs } => {
                write!(f, "initialised {n_tensors} tensors (seed {seed}) in {secs:.1} s")
            }
            Event::EngineReady { secs, device, pinned_record_bytes } => {
                match device {
                    DeviceKind::Gpu => write!(
                        f,
                        "engine ready in {secs:.1} s (GPU memory pool, page-locked rings, resident units loaded)"
                    )?,
                    DeviceKind::Cpu => write!(f, "engine ready in {secs:.1} s (device buffers in host memory)")?,
                }
                if *pinned_record_bytes > 0 {
                    write!(
                        f,
                        "; the GPU-updated layers' store records page-locked in place ({}, part of the store)",
                        mt_core::units::bytes_binary(*pinned_record_bytes as f64)
                    )?;
                }
                Ok(())
            }
            Event::Started(s) => {
                if s.random_base {
                    writeln!(
                        f,
                        "LoRA base: initialised from the seed, as a full run's weights are without --model (a run \
                         for measuring speed and memory; give --model DIR to fine-tune a pretrained model)"
                    )?;
                }
                write!(f, "data: {}", s.data)?;
                if let Some(note) = &s.resume_note {
                    write!(f, "\n{note}")?;
                }
                if s.no_checkpoint_yet {
                    write!(f, "\n--resume: no checkpoint yet, starting from the beginning")?;
                }
                Ok(())
            }
            Event::Eval(e) => write!(f, "{e}"),
            Event::Profile { name, calls, secs, share } => write!(
                f,
                "profile {name:<42} {calls:>6} calls {:>9.1} ms {:>5.1}%",
                1e3 * secs,
                100.0 * share
            ),
            Event::CheckingCheckpoint { manifest } => {
                write!(f, "--resume: checking {} against its hashes", manifest.display())
            }
            Event::CheckpointDamaged { damaged, moved_to } => write!(
                f,
                "--resume: skipping {damaged}; moved aside to {} (delete it when you no longer need it)",
                moved_to.display()
            ),
            Event::FinalCheckpoint(c) => {
                write!(f, "checkpoint of the last step: {} ({:.1} s)", c.manifest.display(), c.secs)
            }
            Event::ExportKept { dir, step } => {
                write!(f, "{} already holds the export of step {step}: left as it is", dir.display())
            }
            Event::Flushed { secs } => {
                write!(f, "last update applied and the store written back in {secs:.1} s")
            }
            Event::Exported { dir, kind, n_shards, bytes, secs } => write!(
                f,
                "exported {} to {} ({n_shards} safetensors file(s), {}) in {secs:.1} s",
                kind.noun(),
                dir.display(),
                mt_core::units::bytes(*bytes as f64)
            ),
        }
    }
}

/// Tells `observer` of `event`; its refusal ends the run ([`crate::Error::Observer`]).
pub(crate) fn notify<O: Observer>(observer: &mut O, event: &Event<'_>) -> crate::Result<()> {
    observer.event(event).map_err(crate::Error::Observer)
}

/// Tells `observer` of a finished step; its refusal ends the run.
pub(crate) fn notify_step<O: Observer>(observer: &mut O, event: &StepEvent<'_>) -> crate::Result<()> {
    observer.step(event).map_err(crate::Error::Observer)
}

//! Training LLMs larger than GPU memory from Rust: the [`Trainer`] that `megatrain train` runs.
//!
//! ```no_run
//! use mt_train::{Quiet, TrainConfig, Trainer};
//!
//! let config = TrainConfig { steps: 20, batch_size: 8, seq_len: 32, ..TrainConfig::default() };
//! let summary = Trainer::new(config, Quiet)?.run()?;
//! println!("loss {:.3} -> {:.3}", summary.first_loss, summary.last_loss);
//! # Ok::<(), mt_train::Error>(())
//! ```
//!
//! A run is a [`TrainConfig`] (the model, the data, the optimizer, the device, checkpoints and the
//! placement overrides; the defaults are the command line's) and an [`Observer`] that hears each
//! stage ([`Event`]) and each optimizer step ([`StepEvent`]): the command line prints them, writes
//! metrics and traces from them; a program of one's own can do anything else. [`Trainer::new`]
//! sets the run up (model, data, plan, host store, weights, engine), [`Trainer::run`] trains,
//! evaluates, checkpoints and exports as configured; the pieces ([`Trainer::step`],
//! [`Trainer::evaluate`], [`Trainer::save_checkpoint`], [`Trainer::export`],
//! [`Trainer::finish`]) serve a loop of one's own.
//!
//! Architecture Invariant: this crate prints nothing; what a user sees is the observer's business.
#![forbid(unsafe_code)]

pub mod checkpoint;
mod checks;
mod config;
pub mod data;
mod device;
mod error;
pub mod host;
pub mod init;
pub mod lock;
mod lora;
mod model;
mod observer;
mod oom;
mod restore;
pub mod schedule;
mod states;
mod summary;
mod trainer;

pub use config::{
    auto_lr, grad_dtype_name, optim_mode_name, DataKind, DataSource, Device, JobPlace, ModelChoice,
    PlacementChoice, Precision, ScheduleKind, TrainConfig,
};
pub use device::nccl_unique_id;
pub use error::{Error, Result};
pub use host::{plan_for, DeviceKernels};
pub use model::{ModelSource, BUILTIN_MODEL};
pub use mt_core::StateDtype;
pub use mt_hf::ExportDtype;
pub use mt_layers::{FlashKernel, RopeAngles};
pub use mt_sched::placement::DeviceKind;
pub use mt_sched::{OptimMode, StepReport};
pub use mt_store::GradDtype;
pub use observer::{
    CheckpointWritten, EvalResult, Event, Observer, ObserverResult, Quiet, RunStart, StepEvent,
};
pub use summary::{stream_name, ExportKind, StepTotals, StreamMean, TrainSummary};
pub use trainer::Trainer;

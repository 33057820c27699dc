//! Stream scheduler: the layer-major step program (as data), the backend abstraction it runs on
//! (streams and events), the CPU backend, and the [`Engine`] that executes a training step.
//!
//! Data flows one way: host store → device pool → (this crate's schedule) → templates →
//! gradients back to the store → optimizer.
#![forbid(unsafe_code)]

pub mod backend;
pub mod batch;
pub mod cpu;
mod engine;
mod error;
pub mod program;
pub mod simulate;
pub mod stats;

pub use backend::Backend;
pub use batch::{Batch, IGNORE_INDEX};
pub use cpu::{CpuBackend, CpuOptions};
pub use engine::{load_params, Engine, EngineOptions, StepReport};
pub use error::{Error, Result};
pub use program::{OptimMode, Program};

#[cfg(test)]
mod program_tests;

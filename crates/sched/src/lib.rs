//! Stream scheduler: the layer-major step program (as data), the backend abstraction it runs on
//! (streams and events), the CPU backend, and the [`Engine`] that executes a training step.
//!
//! Data flows one way: host store → device pool → (this crate's schedule) → templates →
//! gradients back to the store → optimizer.
// `unsafe` only in `cuda_ffi` (CUDA driver calls), checked by the workspace tidy test.
#![deny(unsafe_code)]

pub mod backend;
pub mod batch;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda_ffi;
pub mod data_parallel;
mod engine;
mod error;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod placement;
pub mod plan;
pub mod program;
pub mod simulate;
pub mod stats;
mod worker;

pub use backend::{Backend, DevicePeak, EncodedBase, UploadHead};
pub use batch::{Batch, IGNORE_INDEX};
pub use cpu::{CpuBackend, CpuOptions};
#[cfg(feature = "cuda")]
pub use cuda::CudaBackend;
pub use data_parallel::{DataParallel, GradReduce, LocalReduce, Ranks};
#[doc(hidden)]
pub use engine::Fault;
pub use engine::{load_params, Engine, EngineOptions, SkipCause, Skipped, StepReport};
pub use error::{Error, Result};
#[cfg(feature = "nccl")]
pub use nccl::{NcclId, NcclReduce};
pub use placement::{Placement, PlacementChoice};
pub use program::{OptimMode, Program};

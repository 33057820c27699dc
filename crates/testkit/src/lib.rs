//! Test oracles for megatrain-rs: a resident reference model trained by candle autograd
//! ([`reference`]), the loader of the PyTorch golden fixtures ([`golden`]), named tolerances and
//! tensor-by-tensor reports ([`tol`]), and deterministic random parameters and batches
//! ([`init`]).
//!
//! Architecture Invariant: nothing here depends on the engine's crates (`mt-layers`, the store,
//! the scheduler). The reference is an independent implementation, so that it and the engine's
//! explicit-backward templates check each other.
#![forbid(unsafe_code)]

mod error;
pub mod golden;
pub mod init;
pub mod lora;
pub mod reference;
mod reference_moe;
pub mod tol;

pub use error::{Error, Result};
pub use reference::ReferenceModel;
pub use tol::{compare_maps, Report, Tolerance, VsReference};

#[cfg(test)]
mod golden_tests;
#[cfg(test)]
mod reference_tests;

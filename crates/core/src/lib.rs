//! Shared vocabulary of megatrain-rs: model configuration (parsed from a Hugging Face
//! `config.json`), the parameter layout table (names, shapes and offsets of every tensor in a
//! unit's flat record), and the error type used by the crates below the engine.
//!
//! Architecture Invariant: this crate knows nothing about tensors, devices, memory maps or
//! streams. It is pure data and arithmetic on sizes.
#![forbid(unsafe_code)]

mod config;
mod error;
mod gpt_oss;
mod hf_names;
mod layout;
mod moe;
pub mod names;
mod states;
pub mod units;

pub use config::{Arch, ModelConfig, RopeScaling};
pub use error::{Error, Result};
pub use gpt_oss::{ClampedGlu, LayerWindows};
pub use hf_names::{ExpertNames, HfPiece, MoeLayout};
pub use layout::{
    active_params, model_flops_per_step, ModelLayout, TensorSpec, Unit, UnitLayout, TENSOR_ALIGN_ELEMS,
};
pub use moe::{ExpertKind, MoeConfig};
pub use states::{StateDtype, Q8_BLOCK};

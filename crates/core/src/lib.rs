//! Shared vocabulary of megatrain-rs: model configuration (parsed from a Hugging Face
//! `config.json`), the parameter layout table (names, shapes and offsets of every tensor in a
//! unit's flat record), the placement (where a step keeps each unit: [`Placement`]), and the
//! error type used by the crates below the engine.
//!
//! Architecture Invariant: this crate knows nothing about tensors, devices, memory maps or
//! streams (a placement says which units live on "the device", a `DeviceKind` how a plan words
//! it; neither touches one). It is pure data and arithmetic on sizes and layer indices.
#![forbid(unsafe_code)]

mod base;
mod config;
mod error;
mod gpt_oss;
mod hf_names;
mod layout;
mod lora;
mod moe;
pub mod names;
pub mod placement;
mod states;
pub mod units;

pub use base::{BaseCode, BaseDtype, BaseEncoding, BaseSegment, BASE_BLOCK};
pub use config::{Arch, ModelConfig, RopeScaling};
pub use error::{Error, Result};
pub use gpt_oss::{ClampedGlu, LayerWindows};
pub use hf_names::{ExpertNames, HfPiece, MoeLayout};
pub use layout::{
    active_params, model_flops_per_step, ModelLayout, TensorSpec, Unit, UnitLayout, TENSOR_ALIGN_ELEMS,
};
pub use lora::{LoraConfig, LoraTarget};
pub use moe::{ExpertKind, MoeConfig};
pub use placement::{Placement, PlacementChoice};
pub use states::{StateDtype, Q8_BLOCK};

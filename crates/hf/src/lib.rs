//! Hugging Face model directories in and out of the host store: [`HfModelDir::open`] reads
//! `config.json` and the safetensors headers (single file or sharded with an index),
//! [`import_weights`] streams the weights into a [`mt_store::HostStore`] one tensor at a time
//! (GPT-OSS's MXFP4 experts dequantised expert by expert),
//! and [`export`] writes the store's master weights back as a directory that
//! `transformers.AutoModelForCausalLM.from_pretrained` loads unchanged.
//!
//! Architecture Invariant: this crate never holds a whole shard or model in memory. Tensor bytes
//! are read with plain file reads (no memory map) and written tensor by tensor; peak extra
//! memory is about one tensor.
#![forbid(unsafe_code)]

mod error;
mod export;
mod header;
mod import;
mod mxfp4;
pub mod peft;

pub use error::{Error, Result};
pub use export::{export, ExportDtype, ExportOptions, ExportReport, COPIED_FILES, DEFAULT_MAX_SHARD_BYTES};
pub use header::{header_from_bytes, read_header, ShardHeader, TensorEntry};
pub use import::{import_weights, import_weights_into, HfModelDir, ImportReport};
/// The safetensors element type, as found in [`TensorEntry::dtype`].
pub use safetensors::Dtype;

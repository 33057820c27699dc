//! Host parameter store: the one authoritative copy of a model's training state in host memory.
//!
//! One memmap2 arena, anonymous (RAM) or file-backed (the file *is* the checkpoint, and models
//! larger than RAM page from disk). After a header page come one record per unit (outer unit,
//! then decoder layers in order), each made of four page-aligned regions laid out by the unit's
//! [`mt_core::UnitLayout`]:
//!
//! ```text
//! [ header page ][ unit 0: meta page | master f32 | m f32 | v f32 | grad (f32|bf16|none) ][ unit 1: ... ]
//! ```
//!
//! Exact mode keeps a bf16 gradient buffer: 4 + 4 + 4 + 2 = 14 bytes per parameter; lean mode
//! keeps none: 12. A record's meta page holds the number of optimizer updates applied to the
//! unit, so an update is applied exactly once even if a step fails half-way and is retried.
//!
//! Architecture Invariant: the store knows nothing about devices, streams or tensors. It hands
//! out typed views of records under a per-record lock; ordering between records is the
//! scheduler's business.
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod arena;
mod header;
mod host_vec;
mod pinned;
mod snapshot;
mod staging;

pub use arena::{
    GradDtype, GradMut, GradRef, HostStore, RecordAddrs, RecordGuard, RecordParts, RecordPartsMut, StoreState,
};
pub use host_vec::{par_copy, HostVec, PinError};
pub use pinned::PinnedRecords;
pub use staging::{Staging, UploadDtype};

/// Size of a page; every record region starts on a page boundary (DMA-friendly).
pub const PAGE: usize = 4096;

//! Host parameter store: the one authoritative copy of a model's training state in host memory.
//!
//! One memmap2 arena, anonymous (RAM) or file-backed (the file *is* the checkpoint, and models
//! larger than RAM page from disk). After a header page come one record per unit (outer unit,
//! then decoder layers in order), each made of four page-aligned regions laid out by the unit's
//! [`mt_core::UnitLayout`]:
//!
//! ```text
//! [ header page ][ unit 0: meta page | master f32 | m | v | grad (f32|bf16|none) ][ unit 1: ... ]
//! ```
//!
//! The moments are the bytes of their encoding (`mt_core::StateDtype`, recorded in the header;
//! mt-optim reads and writes it): fp32, bf16 or 8-bit blockwise, `s` = 4, 2 or 1 byte a parameter
//! each (8-bit adds an f32 scale per 256). Exact mode keeps a bf16 gradient buffer: 4 + 2·s + 2 =
//! 14, 10 or 8 bytes per parameter; lean mode keeps none: 12, 8 or 6. A record's meta page holds the number of optimizer updates applied to the
//! unit, so an update is applied exactly once even if a step fails half-way and is retried.
//!
//! Architecture Invariant: the store knows nothing about devices, streams or tensors. It hands
//! out typed views of records under a per-record lock; ordering between records is the
//! scheduler's business.
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod arena;
mod base;
mod grad;
mod header;
mod host_vec;
mod pager;
mod pinned;
mod snapshot;
mod transfer_buf;

pub use arena::{HostStore, RecordAddrs, RecordGuard, RecordParts, RecordPartsMut, StoreState};
pub use base::{codec as base_codec, decode_unit, uploads_encoded, BaseUnit, Decoded, FrozenBase, ParamSink};
pub use grad::{GradDtype, GradMut, GradRef};
pub use host_vec::{par_copy, HostVec, PinError};
pub use pager::PagingStats;
pub use pinned::PinnedRecords;
pub use snapshot::SnapshotWritten;
pub use transfer_buf::{TransferBuf, TransferDtype};

/// Records a paged store may hold beyond its window, on their way to disk or from it (the
/// write-back of a record the window left overlaps the read-ahead of the one it took). Two
/// measured no faster than one on the development machine, with a smaller window for the same
/// memory (`docs/decisions/0036-disk-tier.md`).
pub const PAGED_IN_FLIGHT: u64 = 1;

/// Size of a page; every record region starts on a page boundary (DMA-friendly).
pub const PAGE: usize = 4096;

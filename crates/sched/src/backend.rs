//! The backend abstraction: streams that run operations in order, and events that order
//! operations across streams. The executor issues every instruction of a [`crate::Program`]
//! through it; nothing else in the engine knows how a stream is implemented.
//!
//! Architecture Invariant: ordering is only ever expressed as "wait for these events". A
//! backend may run streams truly concurrently (CUDA streams, CPU worker threads); a program
//! whose waits are complete gives the same bits on every backend and at every timing.

use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};
use mt_core::{BaseEncoding, Unit};
use mt_store::{HostStore, TransferBuf};

use crate::program::Stream;
use crate::Result;

/// What of an upload's staging buffer is a unit's frozen base in its encoding (a LoRA run's
/// int8 or NF4 decoder layer): its first `encoding.bytes` bytes go into `scratch` and are
/// dequantised into the slot's first `encoding.elems()` elements (bitwise
/// `mt_store::decode_unit`), and the rest of the slot's elements (the adapters) are copied from
/// the same elements of the staging buffer, as a plain upload copies them.
#[derive(Debug, Clone)]
pub struct EncodedBase {
    /// The unit's base encoding.
    pub encoding: Arc<BaseEncoding>,
    /// The device buffer the encoded bytes land in (`mt_pool::DevicePool::base_scratch`).
    pub scratch: Tensor,
}

/// What the first elements of an upload's slot receive.
#[derive(Debug, Clone)]
pub enum UploadHead {
    /// The staging buffer's same elements: the whole buffer is copied (a plain upload).
    Staged,
    /// A frozen base in its encoding, dequantised on the device ([`EncodedBase`]).
    Encoded(EncodedBase),
    /// Nothing: the slot's first `n` elements hold a LoRA run's frozen base already (uploaded by
    /// an earlier step into a slot no other unit uses; it never changes), and only the elements
    /// after them (the adapters) are copied from the same elements of the staging buffer.
    Kept(usize),
}

/// A CPU-side job for the host stream.
pub type HostJob = Box<dyn FnOnce() -> Result<()> + Send + 'static>;

/// One executed operation's time span, for busy fractions, idle gaps and traces.
#[derive(Debug, Clone)]
pub struct Span {
    /// Stream it ran on.
    pub stream: Stream,
    /// Short description.
    pub name: String,
    /// Start, seconds since the step began.
    pub start_s: f64,
    /// End, seconds since the step began.
    pub end_s: f64,
}

/// Streams, events and the transfers between host and device.
pub trait Backend {
    /// Completion marker of an operation.
    type Event: Clone + Send + Sync + 'static;

    /// The compute device (where slots, gradient buffers and checkpoints live).
    fn device(&self) -> &Device;

    /// H2D stream: copy a staging buffer into a device slot after `waits`; `head` says what the
    /// slot's first elements receive (the staged ones, an encoded frozen base dequantised on the
    /// same stream, or nothing: [`UploadHead`]).
    fn upload(
        &self,
        waits: &[Self::Event],
        src: Arc<Mutex<TransferBuf>>,
        dst: Tensor,
        head: UploadHead,
        name: String,
    ) -> Self::Event;

    /// D2H stream: copy a whole device buffer's bytes into a landing buffer of the same size in
    /// bytes after `waits` (a gradient into a landing buffer of its type; the write-back's f32
    /// pieces into whatever the first landing buffer holds, read back with
    /// [`TransferBuf::bytes_as_f32`]).
    fn download(
        &self,
        waits: &[Self::Event],
        src: Tensor,
        dst: Arc<Mutex<TransferBuf>>,
        name: String,
    ) -> Self::Event;

    /// H2D stream: copy `unit`'s fp32 master, m and v from its host record into `state`
    /// (`[master | m | v]`, `3 × len` f32) and its stored gradient into `grad` (`len` elements of
    /// the store's gradient dtype) after `waits`. The record is read in place; the step program
    /// keeps every write to it away until the copy is done.
    fn upload_record(
        &self,
        waits: &[Self::Event],
        store: Arc<HostStore>,
        unit: Unit,
        state: Tensor,
        grad: Option<Tensor>,
        name: String,
    ) -> Self::Event;

    /// D2H stream: copy `state`'s master, m and v into `unit`'s host record after `waits`; once
    /// they are there (the copy complete), record optimizer step `applied` as applied to it
    /// ([`HostStore::set_applied_step`]), so that a retried step never applies it twice.
    fn download_record(
        &self,
        waits: &[Self::Event],
        state: Tensor,
        store: Arc<HostStore>,
        unit: Unit,
        applied: u64,
        name: String,
    ) -> Self::Event;

    /// Host stream: run a CPU job after `waits`.
    fn host(&self, waits: &[Self::Event], job: HostJob, name: String) -> Self::Event;

    /// Whether staging and landing buffers should be page-locked ([`TransferBuf::pin`]) once at
    /// start (true for a real GPU: asynchronous DMA needs it).
    fn pins_host_buffers(&self) -> bool {
        false
    }

    /// Marks the start of a compute operation (the CUDA backend records a timing event).
    fn compute_begin(&self) {}

    /// Make the compute stream wait for `waits` (surfacing their errors).
    fn compute_wait(&self, waits: &[Self::Event]) -> Result<()>;

    /// Mark the compute stream's current position, after an operation named `name` that started
    /// at `start_s` (seconds since the step began).
    fn compute_record(&self, name: String, start_s: f64) -> Self::Event;

    /// Wait for every stream to drain; returns the first error any operation hit.
    fn synchronize(&self) -> Result<()>;

    /// Starts a new step's clock and clears recorded spans.
    fn begin_step(&self);

    /// Seconds since `begin_step`.
    fn now_s(&self) -> f64;

    /// Spans recorded since `begin_step`.
    fn spans(&self) -> Vec<Span>;

    /// Bytes actually copied host-to-device and device-to-host since `begin_step` (counted by
    /// the copy operations themselves, not derived from the program).
    fn transferred(&self) -> (u64, u64);

    /// High-water marks of device memory since the backend was made, if measurable (the CUDA
    /// backend: its stream-ordered memory pool's).
    fn device_peak(&self) -> Option<DevicePeak> {
        None
    }
}

/// High-water marks of device memory, running maxima since the backend was made (setup, steps
/// and evaluations alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct DevicePeak {
    /// The most memory in use by allocations at once.
    pub used: u64,
    /// The most memory the allocator held from the driver at once (used plus what it kept free:
    /// fragmentation); what runs out first.
    pub reserved: u64,
}

//! [`TransferBuf`]: a host buffer a copy between host and device goes through, typed by its
//! elements, page-locked on CUDA (registered once at start; ordinary memory on the CPU backend).
//!
//! Three rings use it. Upload staging: the low-precision copy of a unit's master weights that
//! crosses PCIe, written by the optimizer in the same pass as the update (exact mode, just ahead of
//! the upload), or by a re-fetch for backward that casts the unchanged master. Gradient landing,
//! the other way round: a download writes a unit's gradient into it (f32, or bf16 when exact
//! mode's store keeps bf16 gradients and the device narrows them), and the host's land reads it.
//! And the spilled checkpoints' host copies.

use half::{bf16, f16};

use crate::host_vec::{HostVec, PinError};

/// Element type of a transfer buffer: of the weights on the device (staging), of a landed
/// gradient, of an activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferDtype {
    /// fp32 (CPU tests, fp32-GEMM mode).
    F32,
    /// bf16 (GPU default).
    Bf16,
    /// fp16.
    F16,
}

impl TransferDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            TransferDtype::F32 => 4,
            TransferDtype::Bf16 | TransferDtype::F16 => 2,
        }
    }
}

/// One buffer of a ring (staging, landing or spill), sized for the largest unit it carries.
#[derive(Debug, Clone)]
pub enum TransferBuf {
    /// fp32 elements.
    F32(HostVec<f32>),
    /// bf16 elements.
    Bf16(HostVec<bf16>),
    /// fp16 elements.
    F16(HostVec<f16>),
}

impl TransferBuf {
    /// A zeroed buffer of `len` elements.
    pub fn new(dtype: TransferDtype, len: usize) -> Self {
        match dtype {
            TransferDtype::F32 => TransferBuf::F32(HostVec::zeroed(len)),
            TransferDtype::Bf16 => TransferBuf::Bf16(HostVec::zeroed(len)),
            TransferDtype::F16 => TransferBuf::F16(HostVec::zeroed(len)),
        }
    }

    /// Element type.
    pub fn dtype(&self) -> TransferDtype {
        match self {
            TransferBuf::F32(_) => TransferDtype::F32,
            TransferBuf::Bf16(_) => TransferDtype::Bf16,
            TransferBuf::F16(_) => TransferDtype::F16,
        }
    }

    /// Capacity in elements.
    pub fn len(&self) -> usize {
        match self {
            TransferBuf::F32(b) => b.len(),
            TransferBuf::Bf16(b) => b.len(),
            TransferBuf::F16(b) => b.len(),
        }
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Page-locks the buffer (CUDA; see [`HostVec::pin`]).
    pub fn pin(&mut self) -> Result<(), PinError> {
        match self {
            TransferBuf::F32(b) => b.pin(),
            TransferBuf::Bf16(b) => b.pin(),
            TransferBuf::F16(b) => b.pin(),
        }
    }

    /// The raw bytes (what an upload copies).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            TransferBuf::F32(b) => bytemuck::cast_slice(b),
            TransferBuf::Bf16(b) => bytemuck::cast_slice(b),
            TransferBuf::F16(b) => bytemuck::cast_slice(b),
        }
    }

    /// The bytes read as f32 (`len() * size / 4` values; the buffer is page-aligned): how a raw
    /// download of f32 data into a narrower buffer is read back.
    pub fn bytes_as_f32(&self) -> &[f32] {
        let b = self.as_bytes();
        bytemuck::cast_slice(&b[..b.len() / 4 * 4])
    }

    /// The raw bytes, writable (what a download fills).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            TransferBuf::F32(b) => bytemuck::cast_slice_mut(b),
            TransferBuf::Bf16(b) => bytemuck::cast_slice_mut(b),
            TransferBuf::F16(b) => bytemuck::cast_slice_mut(b),
        }
    }
}

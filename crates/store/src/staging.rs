//! Upload staging: the low-precision copy of a unit's master weights that crosses PCIe.
//!
//! The optimizer writes it in the same pass as the update (exact mode, just ahead of the
//! upload); a re-fetch for backward casts the unchanged master into it. On CUDA these buffers are
//! registered (page-locked) once at start; on CPU they are ordinary memory behind the same type.
//!
//! The gradient landing ring uses the same type the other way round: a download writes a unit's
//! gradient into it (f32, or bf16 when exact mode's store keeps bf16 gradients and the device
//! narrows them), and the host's land reads it.

use half::{bf16, f16};

use crate::host_vec::{HostVec, PinError};

/// Element type of weights on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadDtype {
    /// fp32 (CPU tests, fp32-GEMM mode).
    F32,
    /// bf16 (GPU default).
    Bf16,
    /// fp16.
    F16,
}

impl UploadDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            UploadDtype::F32 => 4,
            UploadDtype::Bf16 | UploadDtype::F16 => 2,
        }
    }
}

/// One staging buffer of a ring, sized for the largest unit.
#[derive(Debug, Clone)]
pub enum Staging {
    /// fp32 staging.
    F32(HostVec<f32>),
    /// bf16 staging.
    Bf16(HostVec<bf16>),
    /// fp16 staging.
    F16(HostVec<f16>),
}

impl Staging {
    /// A zeroed buffer of `len` elements.
    pub fn new(dtype: UploadDtype, len: usize) -> Self {
        match dtype {
            UploadDtype::F32 => Staging::F32(HostVec::zeroed(len)),
            UploadDtype::Bf16 => Staging::Bf16(HostVec::zeroed(len)),
            UploadDtype::F16 => Staging::F16(HostVec::zeroed(len)),
        }
    }

    /// Element type.
    pub fn dtype(&self) -> UploadDtype {
        match self {
            Staging::F32(_) => UploadDtype::F32,
            Staging::Bf16(_) => UploadDtype::Bf16,
            Staging::F16(_) => UploadDtype::F16,
        }
    }

    /// Capacity in elements.
    pub fn len(&self) -> usize {
        match self {
            Staging::F32(b) => b.len(),
            Staging::Bf16(b) => b.len(),
            Staging::F16(b) => b.len(),
        }
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Page-locks the buffer (CUDA; see [`HostVec::pin`]).
    pub fn pin(&mut self) -> Result<(), PinError> {
        match self {
            Staging::F32(b) => b.pin(),
            Staging::Bf16(b) => b.pin(),
            Staging::F16(b) => b.pin(),
        }
    }

    /// The raw bytes (what an upload copies).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Staging::F32(b) => bytemuck::cast_slice(b),
            Staging::Bf16(b) => bytemuck::cast_slice(b),
            Staging::F16(b) => bytemuck::cast_slice(b),
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
            Staging::F32(b) => bytemuck::cast_slice_mut(b),
            Staging::Bf16(b) => bytemuck::cast_slice_mut(b),
            Staging::F16(b) => bytemuck::cast_slice_mut(b),
        }
    }
}

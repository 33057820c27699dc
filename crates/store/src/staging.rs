//! Upload staging: the low-precision copy of a unit's master weights that crosses PCIe.
//!
//! The optimizer writes it in the same pass as the update (exact mode, just ahead of the
//! upload); a re-fetch for backward casts the unchanged master into it. On CUDA these buffers are
//! registered (page-locked) once at start; on CPU they are ordinary memory behind the same type.

use half::{bf16, f16};

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
    F32(Vec<f32>),
    /// bf16 staging.
    Bf16(Vec<bf16>),
    /// fp16 staging.
    F16(Vec<f16>),
}

impl Staging {
    /// A zeroed buffer of `len` elements.
    pub fn new(dtype: UploadDtype, len: usize) -> Self {
        match dtype {
            UploadDtype::F32 => Staging::F32(vec![0.0; len]),
            UploadDtype::Bf16 => Staging::Bf16(vec![bf16::ZERO; len]),
            UploadDtype::F16 => Staging::F16(vec![f16::ZERO; len]),
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
}

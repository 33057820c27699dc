//! A record's gradient buffer: its element type and typed views of it.

use half::bf16;

/// Element type of a record's gradient buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradDtype {
    /// fp32 gradients (16 B/param records): exact comparisons against references.
    F32,
    /// bf16 gradients (14 B/param records): the default for large models.
    Bf16,
    /// No gradient buffer (12 B/param records): lean mode updates straight from the landed
    /// gradient, so the store never holds one.
    None,
}

impl GradDtype {
    /// Bytes per element (0 for `None`).
    pub fn size(self) -> usize {
        match self {
            GradDtype::F32 => 4,
            GradDtype::Bf16 => 2,
            GradDtype::None => 0,
        }
    }
    pub(crate) fn code(self) -> u32 {
        match self {
            GradDtype::F32 => 1,
            GradDtype::Bf16 => 2,
            GradDtype::None => 3,
        }
    }
    pub(crate) fn from_code(c: u32) -> Option<Self> {
        match c {
            1 => Some(GradDtype::F32),
            2 => Some(GradDtype::Bf16),
            3 => Some(GradDtype::None),
            _ => None,
        }
    }
}

/// Mutable view of a record's gradient buffer.
#[derive(Debug)]
pub enum GradMut<'a> {
    /// fp32 gradients.
    F32(&'a mut [f32]),
    /// bf16 gradients.
    Bf16(&'a mut [bf16]),
}

/// Shared view of a record's gradient buffer.
#[derive(Debug, Clone, Copy)]
pub enum GradRef<'a> {
    /// fp32 gradients.
    F32(&'a [f32]),
    /// bf16 gradients.
    Bf16(&'a [bf16]),
}

impl GradMut<'_> {
    /// Read-only view.
    pub fn as_ref(&self) -> GradRef<'_> {
        match self {
            GradMut::F32(g) => GradRef::F32(g),
            GradMut::Bf16(g) => GradRef::Bf16(g),
        }
    }
}

impl GradRef<'_> {
    /// Copies elements `[start, start+n)` widened to f32.
    pub fn to_f32(&self, start: usize, n: usize) -> Vec<f32> {
        match self {
            GradRef::F32(g) => g[start..start + n].to_vec(),
            GradRef::Bf16(g) => g[start..start + n].iter().map(|x| x.to_f32()).collect(),
        }
    }
}

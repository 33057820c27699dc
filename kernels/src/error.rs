//! The error type of the device AdamW (the kernels themselves fail as candle ops, with
//! `candle_core::Error`).

use candle_core::DType;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong when updating a unit on the device or taking its gradient's sum of squares.
/// Messages say what was expected and what was found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error from the tensor library (a kernel launch included).
    #[error("tensor backend: {0}")]
    Candle(#[from] candle_core::Error),
    /// An optimizer setting the device AdamW refuses (as mt-optim's does).
    #[error("optimizer: {0}")]
    Optim(#[from] mt_optim::Error),
    /// A tensor has the wrong shape.
    #[error("shape mismatch for {what}: expected {expected}, found {found:?}")]
    Shape {
        /// Which tensor.
        what: String,
        /// The shape required, in words where it depends on other inputs.
        expected: String,
        /// The shape supplied.
        found: Vec<usize>,
    },
    /// A tensor has the wrong element type.
    #[error("dtype mismatch for {what}: expected {expected}, found {found:?}")]
    DType {
        /// Which tensor.
        what: String,
        /// The dtype(s) accepted.
        expected: String,
        /// The dtype supplied.
        found: DType,
    },
}

impl Error {
    pub(crate) fn shape(what: impl Into<String>, expected: impl Into<String>, found: &[usize]) -> Self {
        Error::Shape { what: what.into(), expected: expected.into(), found: found.to_vec() }
    }

    pub(crate) fn dtype(what: impl Into<String>, expected: impl Into<String>, found: DType) -> Self {
        Error::DType { what: what.into(), expected: expected.into(), found }
    }
}

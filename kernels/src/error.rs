//! The error type of the device AdamW (the kernels themselves fail as candle ops, with
//! `candle_core::Error`).

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
    /// A tensor handed to the device optimizer is not of the shape or element type it takes.
    #[error("{what}: expected {expected}, found {found}")]
    Tensor {
        /// Which tensor.
        what: String,
        /// What it must be (a shape in words where it depends on other inputs, or a dtype).
        expected: String,
        /// Its shape or dtype, as printed.
        found: String,
    },
}

impl Error {
    /// `what` should be `expected` but is `found` (its dims or its dtype).
    pub(crate) fn tensor(what: &str, expected: impl Into<String>, found: impl std::fmt::Debug) -> Self {
        Error::Tensor { what: what.into(), expected: expected.into(), found: format!("{found:?}") }
    }
}

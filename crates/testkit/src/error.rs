//! The error type of the test oracles.

use std::path::PathBuf;

/// Result alias for `mt-testkit`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while building a reference model or loading a golden fixture.
/// Messages say what was expected and what was found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error from the tensor library.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// An error from `mt-core` (config parsing, layout lookup).
    #[error(transparent)]
    Core(#[from] mt_core::Error),
    /// A tensor has the wrong shape.
    #[error("shape mismatch for {what}: expected {expected:?}, found {found:?}")]
    Shape {
        /// Which tensor (an HF parameter name or a fixture key).
        what: String,
        /// The shape the model layout or the fixture format requires.
        expected: Vec<usize>,
        /// The shape that was supplied.
        found: Vec<usize>,
    },
    /// A parameter the layout requires was not supplied.
    #[error("missing parameter `{0}` (the model layout requires it)")]
    MissingParam(String),
    /// A parameter name that the model layout does not have (for example `lm_head.weight` in a
    /// tied model).
    #[error("unknown parameter `{0}` (not in the model layout)")]
    UnknownParam(String),
    /// A golden fixture is missing or malformed.
    #[error("golden fixture {path}: {msg}")]
    Fixture {
        /// The fixture file concerned.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// Every target is the ignore index (-100), so the mean cross-entropy is undefined.
    #[error("the batch has no target tokens after masking (every target is -100); the loss is undefined")]
    NoTargetTokens,
    /// Input data is invalid (token ids out of range, wrong number of targets, ...).
    #[error("invalid input data: {0}")]
    Data(String),
    /// The request is well formed but the reference does not implement it (for example a dtype
    /// other than f32/f64).
    #[error("unsupported by the reference model: {0}")]
    Unsupported(String),
}

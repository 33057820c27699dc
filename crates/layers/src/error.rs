//! The error type of the layer templates.

use candle_core::DType;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong when binding weights or running a template. Messages say what was expected
/// and what was found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error from the tensor library.
    #[error("tensor backend: {0}")]
    Candle(#[from] candle_core::Error),
    /// An error from the shared core crate (unknown parameter, unsupported configuration, ...).
    #[error(transparent)]
    Core(#[from] mt_core::Error),
    /// A flat slot or gradient buffer is shorter than the unit's layout.
    #[error("{what} is too short: the layout needs at least {expected} elements, found {found}")]
    SlotTooShort {
        /// Which buffer (weight slot, gradient buffer).
        what: &'static str,
        /// `UnitLayout::len`.
        expected: usize,
        /// Length of the buffer supplied.
        found: usize,
    },
    /// A tensor has the wrong shape.
    #[error("shape mismatch for {what}: expected {expected}, found {found:?}")]
    Shape {
        /// Which tensor.
        what: String,
        /// The shape required, in words where it depends on other inputs (e.g. `[b, t] = [2, 8]`).
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
    /// The template was used in a way its model does not allow.
    #[error("{0}")]
    Options(String),
    /// Positions past the end of the precomputed RoPE table were requested.
    #[error(
        "positions {start}..{end} exceed the RoPE table of {max_t} positions; build the Rope with a larger max_t"
    )]
    Positions {
        /// First position requested.
        start: usize,
        /// One past the last position requested.
        end: usize,
        /// Positions in the table.
        max_t: usize,
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

//! The error type shared by the library crates below the engine.

use std::path::PathBuf;

/// Result alias for megatrain-rs library crates.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the engine's library crates. Messages say what was expected,
/// what was found, and (where it helps) what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read or written.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A JSON document could not be parsed.
    #[error("cannot parse JSON in {path}: {source}")]
    Json {
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        source: serde_json::Error,
    },
    /// A model configuration is malformed or inconsistent.
    #[error("invalid model config: field `{field}`: {msg}")]
    Config {
        /// The offending field of config.json.
        field: String,
        /// What is wrong with it.
        msg: String,
    },
    /// The configuration is well-formed but asks for something the engine does not implement.
    #[error("unsupported model config: {0}")]
    Unsupported(String),
    /// A tensor has the wrong shape.
    #[error("shape mismatch for {what}: expected {expected:?}, found {found:?}")]
    Shape {
        /// Which tensor.
        what: String,
        /// The shape the layout requires.
        expected: Vec<usize>,
        /// The shape that was supplied.
        found: Vec<usize>,
    },
    /// A named parameter does not exist in the layout.
    #[error("unknown parameter `{0}`")]
    UnknownParam(String),
    /// A batch has no target token left after masking, so the loss is undefined.
    #[error(
        "the batch has no target tokens after masking (every label is the ignore index); nothing to train on"
    )]
    NoTargetTokens,
    /// Input data is invalid (token ids out of range, ragged batches, ...).
    #[error("invalid input data: {0}")]
    Data(String),
    /// A memory or schedule plan cannot be carried out.
    #[error("impossible plan: {0}")]
    Plan(String),
    /// A host store file is malformed or belongs to another model.
    #[error("host store {path}: {msg}")]
    Store {
        /// The store file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// An error from the tensor library (candle).
    #[error("tensor backend: {0}")]
    Backend(String),
}

impl Error {
    /// Shorthand for [`Error::Config`].
    pub fn config(field: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Config { field: field.into(), msg: msg.into() }
    }
}

//! bench-harness: runs `megatrain train` and the Python baselines (resident PyTorch, DeepSpeed
//! ZeRO-3 offload) as subprocesses on the same machine in the same run, and writes one results
//! JSON (schema in [`schema`], documented in `results/README.md`) with figures beside it.
//!
//! Modules: [`schema`] (the results JSON), [`run`] (launch one system, parse its JSON Lines
//! metrics), [`suites`] (which runs each suite makes), [`longctx`] (the long-context suite),
//! [`extrapolate`] (the 120B entry from its measured slices), [`plot`] (figures), [`regress`]
//! (compare two results files).
#![forbid(unsafe_code)]

use std::path::PathBuf;

pub mod extrapolate;
pub mod longctx;
pub mod plot;
pub mod regress;
pub mod run;
pub mod schema;
pub mod suites;

/// Errors of the harness itself. A system that fails to run is not an error: it becomes a run
/// with status `failed` and the reason.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file is not the JSON it should be.
    #[error("{}: {msg}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was expected and what was found.
        msg: String,
    },
    /// A figure could not be drawn.
    #[error("figure {}: {msg}", path.display())]
    Plot {
        /// The figure's file.
        path: PathBuf,
        /// The backend's message.
        msg: String,
    },
    /// The options do not make sense together.
    #[error("{0}")]
    Options(String),
}

/// Result with the harness's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}

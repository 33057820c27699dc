//! Errors of the scheduler and engine.

/// Everything the engine can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Configuration, data or store error.
    #[error(transparent)]
    Core(#[from] mt_core::Error),
    /// Template (layer math) error.
    #[error("layer template: {0}")]
    Layers(#[from] mt_layers::Error),
    /// Device optimizer error (a unit updated on the device).
    #[error("device optimizer: {0}")]
    Kernels(#[from] mt_kernels::Error),
    /// Device buffer pool error.
    #[error(transparent)]
    Pool(#[from] mt_pool::Error),
    /// Optimizer error.
    #[error("optimizer: {0}")]
    Optim(#[from] mt_optim::Error),
    /// Tensor library error.
    #[error("tensor backend: {0}")]
    Candle(#[from] candle_core::Error),
    /// An operation on a stream failed; surfaced at the next synchronisation point.
    #[error("{stream} stream: {msg}")]
    Stream {
        /// Stream name.
        stream: &'static str,
        /// What failed.
        msg: String,
    },
    /// Page-locking a staging or landing buffer failed.
    #[error(transparent)]
    Pin(#[from] mt_store::PinError),
    /// A CUDA driver call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// Invalid engine options.
    #[error("invalid engine options: {0}")]
    Options(String),
    /// The step program and the engine disagree (a missing buffer, an op on the wrong stream, a
    /// value read before it was written): a bug in megatrain, never in the user's input.
    #[error("scheduling bug: {0}")]
    Schedule(String),
    /// A compute operation of the step program failed.
    #[error("{op}: {source}")]
    Op {
        /// The operation, as the program lists it (`Backward { layer: 12, .. }`).
        op: String,
        /// What went wrong.
        source: Box<Error>,
    },
}

impl Error {
    /// Whether the device ran out of memory (a CUDA allocation failed).
    pub fn is_out_of_memory(&self) -> bool {
        let text = match self {
            Error::Op { source, .. } => return source.is_out_of_memory(),
            other => other.to_string(),
        };
        text.contains("OUT_OF_MEMORY") || text.contains("out of memory")
    }

    /// The compute operation that failed, if one did.
    pub fn op(&self) -> Option<&str> {
        match self {
            Error::Op { op, .. } => Some(op),
            _ => None,
        }
    }
}

/// Result alias.
pub type Result<T> = std::result::Result<T, Error>;

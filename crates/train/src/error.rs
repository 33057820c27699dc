//! Errors of a training run: a refused option, the error of a layer below with what was being
//! done when it happened, too many skipped steps in a row, or an observer's own error.

/// Everything a [`crate::Trainer`] can fail with. Messages name the option to change (by its
/// `megatrain train` flag: the fields of [`crate::TrainConfig`] have the same names).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An option cannot work with this model, data, machine or build.
    #[error("{0}")]
    Options(String),
    /// A checkpoint cannot be resumed from, or written.
    #[error("{0}")]
    Checkpoint(String),
    /// The device ran out of memory in a step the planner accepted: what ran out, what the plan
    /// counted, and what to change, as one paragraph.
    #[error("{0}")]
    OutOfMemory(String),
    /// `--max-skipped-steps` steps in a row had a non-finite loss or gradient norm (each was
    /// skipped, no update applied).
    #[error(
        "training stopped at step {step}: {in_row} steps in a row were skipped, the last because {cause} \
         (no update was applied; the store holds the last good state): lower --lr, check the data, \
         or raise --max-skipped-steps"
    )]
    TooManySkipped {
        /// Global step (1-based) of the last skipped step.
        step: u64,
        /// Skipped steps in a row.
        in_row: u64,
        /// Why the last one was skipped.
        cause: String,
    },
    /// Model configuration, parameter layout or host store.
    #[error("{context}: {source}")]
    Core {
        /// What was being done.
        context: String,
        /// The error below.
        #[source]
        source: Box<mt_core::Error>,
    },
    /// A Hugging Face model directory (import, export).
    #[error("{context}: {source}")]
    Hf {
        /// What was being done.
        context: String,
        /// The error below.
        #[source]
        source: Box<mt_hf::Error>,
    },
    /// Training data (JSON Lines, tokenizer, chat template).
    #[error("{context}: {source}")]
    Data {
        /// What was being done.
        context: String,
        /// The error below.
        #[source]
        source: Box<mt_data::Error>,
    },
    /// The planner or the engine.
    #[error("{context}: {source}")]
    Engine {
        /// What was being done.
        context: String,
        /// The error below.
        #[source]
        source: Box<mt_sched::Error>,
    },
    /// A file.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, naming the file.
        context: String,
        /// The error below.
        #[source]
        source: std::io::Error,
    },
    /// A JSON document.
    #[error("{context}: {source}")]
    Json {
        /// What was being done, naming the document.
        context: String,
        /// The error below.
        #[source]
        source: serde_json::Error,
    },
    /// An [`crate::Observer`] failed (writing a metrics log, say); the run stops.
    #[error("{0}")]
    Observer(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Result alias.
pub type Result<T> = std::result::Result<T, Error>;

/// Attaches what was being done to an error of a layer below.
pub(crate) trait Context<T> {
    /// The error, as this crate's, with `context()` saying what was being done.
    fn context_with(self, context: impl FnOnce() -> String) -> Result<T>;
}

macro_rules! context_for {
    ($($source:ty => $variant:ident),* $(,)?) => {$(
        impl<T> Context<T> for std::result::Result<T, $source> {
            fn context_with(self, context: impl FnOnce() -> String) -> Result<T> {
                self.map_err(|source| Error::$variant { context: context(), source: source.into() })
            }
        }
    )*};
}

context_for! {
    mt_core::Error => Core,
    mt_hf::Error => Hf,
    mt_data::Error => Data,
    mt_sched::Error => Engine,
    std::io::Error => Io,
    serde_json::Error => Json,
}

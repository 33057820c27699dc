//! The crate's error type: one typed variant per way a data file, a tokenizer directory or an
//! option can be wrong, each message saying what was expected, what was found and what to do.

use std::path::PathBuf;

use crate::Format;

/// A boxed error from the `tokenizers` crate.
pub type TokenizersError = Box<dyn std::error::Error + Send + Sync>;

/// Everything that can go wrong while loading a tokenizer or a data file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read.
    #[error("cannot read {}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        error: std::io::Error,
    },
    /// A problem with one line of a data file (the inner error says which).
    #[error("{}:{line}: {error}", path.display())]
    AtLine {
        /// The data file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with that line.
        error: Box<Error>,
    },
    /// A line is not valid UTF-8.
    #[error("the line is not valid UTF-8")]
    InvalidUtf8,
    /// A line is not valid JSON.
    #[error("invalid JSON: {0}")]
    Json(serde_json::Error),
    /// A line is a JSON value but not an object with exactly one known key.
    #[error(
        "expected a JSON object with exactly one of the keys \"input_ids\", \"text\", \"messages\", found {found}"
    )]
    Keys {
        /// What was found instead (the keys, or the JSON type).
        found: String,
    },
    /// The value of a known key has the wrong shape.
    #[error("invalid \"{key}\": {error}")]
    Field {
        /// The key (`input_ids`, `text` or `messages`).
        key: &'static str,
        /// The deserialisation error.
        error: serde_json::Error,
    },
    /// A line uses another format than the file's first sample.
    #[error(
        "this is a \"{found}\" sample but the file's first sample (line {first_line}) is \"{expected}\"; \
         one file must use one format"
    )]
    MixedFormats {
        /// This line's format.
        found: Format,
        /// The format of the file's first sample.
        expected: Format,
        /// Line of the file's first sample.
        first_line: usize,
    },
    /// A sample is longer than the sequence length.
    #[error(
        "the sample has {len} tokens, more than the sequence length {seq_len}; samples are never split: \
         shorten it, raise the sequence length or pass --truncate to cut long samples to the sequence length"
    )]
    TooLong {
        /// Tokens in the sample.
        len: usize,
        /// The sequence length.
        seq_len: usize,
    },
    /// A token id is negative or not below the model's vocabulary size.
    #[error("token id {id} is outside the model's vocabulary (vocab_size {vocab_size})")]
    TokenOutOfVocab {
        /// The id.
        id: i64,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// A sample has no tokens at all.
    #[error("the sample has no tokens")]
    EmptySample,
    /// A conversation has no assistant message, so it has nothing to train on.
    #[error("the conversation has no message with role \"assistant\", so it has no target tokens")]
    NoAssistantTurn,
    /// A `text` or `messages` sample was given without a tokenizer.
    #[error("a \"{format}\" sample must be tokenised: pass a --model dir that contains tokenizer.json")]
    NeedsTokenizer {
        /// The sample's format.
        format: Format,
    },
    /// The chat template renders an earlier part of the conversation differently from the whole,
    /// so assistant characters cannot be located in the full rendering.
    #[error(
        "the chat template is not prefix-stable: the rendering {what} message {message_index} (an assistant \
         turn) is not a prefix of the rendering of the whole conversation, so the assistant tokens cannot be \
         masked"
    )]
    NotPrefixStable {
        /// Index of the assistant message.
        message_index: usize,
        /// `"up to"` or `"of the conversation before (with the generation prompt)"`.
        what: &'static str,
    },
    /// The model directory has no chat template.
    #[error(
        "{} has no chat template (neither chat_template.jinja nor a \"chat_template\" in tokenizer_config.json); \
         \"messages\" samples need one",
        dir.display()
    )]
    NoChatTemplate {
        /// The model directory.
        dir: PathBuf,
    },
    /// The tokenizer has no end-of-sequence token, which `text` samples need.
    #[error(
        "{} names no usable eos_token in tokenizer_config.json; \"text\" samples end with it",
        dir.display()
    )]
    NoEosToken {
        /// The model directory.
        dir: PathBuf,
    },
    /// The chat template failed to compile or to render (including `raise_exception`).
    #[error("chat template: {0}")]
    Template(minijinja::Error),
    /// `tokenizer.json` could not be loaded.
    #[error("cannot load tokenizer {}: {error}", path.display())]
    TokenizerLoad {
        /// The file.
        path: PathBuf,
        /// The tokenizers error.
        error: TokenizersError,
    },
    /// Encoding or decoding failed inside the tokenizer.
    #[error("tokenizer: {0}")]
    Tokenizer(TokenizersError),
    /// A token id has no token in the tokenizer's vocabulary.
    #[error("token id {0} is not in the tokenizer's vocabulary")]
    UnknownId(u32),
    /// `tokenizer_config.json` (or the template file) is malformed.
    #[error("{}: {what}", path.display())]
    TokenizerConfig {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// The data file holds no samples.
    #[error("{}: no samples (the file is empty or has only blank lines)", path.display())]
    Empty {
        /// The data file.
        path: PathBuf,
    },
    /// No training sequence has a single target token.
    #[error(
        "{}: the training samples have no target tokens (every sample has a single token, or no assistant \
         content); nothing to train on",
        path.display()
    )]
    NoTargets {
        /// The data file.
        path: PathBuf,
    },
    /// An eval split was asked for with fewer than two samples.
    #[error(
        "{}: eval_fraction {fraction} needs at least 2 samples (one for training, one for eval), found {n_samples}",
        path.display()
    )]
    TooFewForEval {
        /// The data file.
        path: PathBuf,
        /// The requested fraction.
        fraction: f64,
        /// Samples in the file.
        n_samples: usize,
    },
    /// A [`crate::DataOptions`] field is out of range.
    #[error("invalid data option {name} = {value}: expected {expected}")]
    InvalidOption {
        /// The option.
        name: &'static str,
        /// Its value.
        value: String,
        /// The valid range.
        expected: &'static str,
    },
}

impl Error {
    /// Attaches a data file line to an error.
    pub(crate) fn at_line(self, path: &std::path::Path, line: usize) -> Error {
        Error::AtLine { path: path.to_path_buf(), line, error: Box::new(self) }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

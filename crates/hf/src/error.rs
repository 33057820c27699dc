//! The error type of `mt-hf`: every variant names the file (and tensor) concerned, what was
//! expected and what was found, and where it helps, what to do.

use std::path::PathBuf;

/// Result alias for `mt-hf`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong reading or writing a Hugging Face model directory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file or directory could not be read, written, renamed or created.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A JSON document (config.json, the index) could not be parsed.
    #[error("cannot parse JSON in {path}: {source}")]
    Json {
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        source: serde_json::Error,
    },
    /// `config.json` is malformed or describes a model the engine does not implement.
    #[error("{path}: {source}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong with it (names the field, or the unsupported `model_type`).
        source: mt_core::Error,
    },
    /// The directory holds no safetensors weights.
    #[error("{dir}: no weights found: expected model.safetensors or model.safetensors.index.json{hint}")]
    NoWeights {
        /// The model directory.
        dir: PathBuf,
        /// Extra advice (e.g. when only PyTorch `.bin` files are present).
        hint: String,
    },
    /// `model.safetensors.index.json` is not a valid index.
    #[error("{path}: invalid safetensors index: {msg}")]
    BadIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// A shard named in the index does not exist.
    #[error("{index} names shard {shard:?}, but {path} does not exist; the download may be incomplete")]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// The shard's file name as written in the index.
        shard: String,
        /// Where it was looked for.
        path: PathBuf,
    },
    /// A shard's header is truncated or corrupt.
    #[error("{shard}: invalid safetensors header: {msg}; the file is damaged or not a safetensors file")]
    BadHeader {
        /// The shard file.
        shard: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// A shard's length does not match what its header describes (typically a truncated file).
    #[error(
        "{shard}: the header describes {expected} bytes of file, but the file has {found}; {}",
        if found < expected { "it is truncated (re-download or re-export it)" } else { "it has trailing garbage" }
    )]
    ShardSize {
        /// The shard file.
        shard: PathBuf,
        /// File length implied by the header.
        expected: u64,
        /// Actual file length.
        found: u64,
    },
    /// The index and the shards disagree about where a tensor lives.
    #[error("{index}: {msg}")]
    IndexMismatch {
        /// The index file.
        index: PathBuf,
        /// The disagreement, naming the tensor and the shards.
        msg: String,
    },
    /// A parameter of the model described by config.json is not in the weights.
    #[error(
        "parameter `{name}` is missing from the weights in {dir}; does config.json match the weights \
         (number of layers, tie_word_embeddings, attention biases)?"
    )]
    MissingTensor {
        /// HF name of the parameter.
        name: String,
        /// The model directory.
        dir: PathBuf,
    },
    /// A tensor in the weights is not a parameter of the model described by config.json.
    #[error(
        "{shard}: tensor `{name}` is not a parameter of the model described by config.json; \
         the config does not match the weights (or the architecture has parameters this engine does not implement)"
    )]
    UnexpectedTensor {
        /// The tensor's name.
        name: String,
        /// The shard holding it.
        shard: PathBuf,
    },
    /// A tensor's shape differs from the one config.json implies.
    #[error(
        "{shard}: tensor `{name}` has shape {found:?}, but config.json implies {expected:?}; \
         the config does not match the weights"
    )]
    Shape {
        /// The tensor's name.
        name: String,
        /// The shard holding it.
        shard: PathBuf,
        /// Shape implied by the config.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A tensor has an element type the importer does not convert.
    #[error("{shard}: tensor `{name}` has dtype {dtype}; only F32, BF16 and F16 weights can be imported")]
    Dtype {
        /// The tensor's name.
        name: String,
        /// The shard holding it.
        shard: PathBuf,
        /// The dtype found, as safetensors spells it.
        dtype: String,
    },
    /// Reading a tensor's bytes failed (short read: the file changed or was truncated since it
    /// was opened).
    #[error("{shard}: cannot read tensor `{name}`: {source}")]
    ReadTensor {
        /// The tensor's name.
        name: String,
        /// The shard holding it.
        shard: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A weight is NaN or infinite: training from it could only skip every step.
    #[error("{shard}: tensor `{name}` holds {value} at element {index}; the weights are corrupt")]
    NonFinite {
        /// The tensor's name.
        name: String,
        /// The shard holding it.
        shard: PathBuf,
        /// The first non-finite element (flat index).
        index: usize,
        /// Its value.
        value: f32,
    },
    /// An MXFP4 expert tensor (`*_blocks`, `*_scales`) that cannot be read as the released
    /// GPT-OSS checkpoints store them.
    #[error("{shard}: MXFP4 tensor `{name}`: {msg}")]
    Mxfp4 {
        /// The tensor's name.
        name: String,
        /// The shard holding it.
        shard: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// The model config and the host store describe different models (the store was built for
    /// another config.json).
    #[error("config.json does not describe the host store's model: {0}")]
    ConfigMismatch(String),
    /// A peft adapter directory cannot be read or written as this engine's LoRA needs it.
    #[error("{path}: {msg}")]
    Adapter {
        /// The file concerned.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// Export options are invalid.
    #[error("export: invalid option: {0}")]
    Options(String),
    /// The host store refused an access (unknown name, length mismatch).
    #[error("host store: {0}")]
    Store(#[from] mt_core::Error),
}

impl Error {
    /// Shorthand for [`Error::Io`].
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }
}

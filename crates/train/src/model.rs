//! The model a run trains: the built-in tiny Llama, a Hugging Face `config.json` (seeded random
//! initialisation) or a Hugging Face model directory (its weights and tokenizer), with the
//! `config.json` document an export writes back.

use mt_core::ModelConfig;

use crate::error::{Context, Result};
use crate::ModelChoice;

/// Name of the built-in model in summaries and metrics.
pub const BUILTIN_MODEL: &str = "builtin:tiny_llama";

/// The model a run trains: its config, where it came from, its `config.json` document (written
/// back on export) and, for a model directory, the directory its weights and tokenizer come from.
#[derive(Debug)]
pub struct ModelSource {
    /// The parsed config.
    pub cfg: ModelConfig,
    /// The model directory, the config path, or [`BUILTIN_MODEL`].
    pub name: String,
    /// The config.json document (the source's own, so an export keeps every key it has).
    pub config_json: serde_json::Value,
    /// The model directory, its headers checked.
    pub hf: Option<mt_hf::HfModelDir>,
}

impl ModelSource {
    /// Reads what `choice` names (for a model directory: its config and every safetensors
    /// header; no weights yet).
    pub fn load(choice: &ModelChoice) -> Result<Self> {
        match choice {
            ModelChoice::HfDir(dir) => {
                let hf = mt_hf::HfModelDir::open(dir)
                    .context_with(|| format!("cannot use --model {}", dir.display()))?;
                Ok(ModelSource {
                    cfg: hf.config.clone(),
                    name: dir.display().to_string(),
                    config_json: hf.config_json.clone(),
                    hf: Some(hf),
                })
            }
            ModelChoice::Config(p) => {
                let cfg = ModelConfig::from_file(p)
                    .context_with(|| format!("cannot use model config {}", p.display()))?;
                let text =
                    std::fs::read_to_string(p).context_with(|| format!("cannot read {}", p.display()))?;
                let config_json =
                    serde_json::from_str(&text).context_with(|| format!("{} is not JSON", p.display()))?;
                Ok(ModelSource { cfg, name: p.display().to_string(), config_json, hf: None })
            }
            ModelChoice::Builtin => {
                let cfg = ModelConfig::tiny_llama();
                Ok(ModelSource {
                    config_json: cfg.to_hf_json(),
                    cfg,
                    name: BUILTIN_MODEL.to_owned(),
                    hf: None,
                })
            }
        }
    }
}

//! Which checkpoint's state `--out` holds: `exported.json` in the checkpoint directory, written
//! after an export has completed. A resumed run that is already complete leaves an export that
//! this record names alone, and exports again otherwise (after a failed export, or an export of
//! an earlier step left in `--out`): the export is a pure function of the checkpoint, so doing it
//! twice changes nothing.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::write_atomic;
use crate::error::{Context, Result};

/// File name of the record, in the checkpoint directory.
pub const EXPORT_RECORD: &str = "exported.json";

/// An export that completed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportRecord {
    /// Global step of the state exported.
    pub step: u64,
    /// The run's defining options' hash (the manifest's `config_hash`).
    pub config_hash: String,
    /// The export directory, made absolute.
    pub out: PathBuf,
}

fn absolute(p: &Path) -> PathBuf {
    p.canonicalize().or_else(|_| std::path::absolute(p)).unwrap_or_else(|_| p.to_owned())
}

/// Records that `out` now holds the export of step `step` of the run `config_hash` names.
pub fn write(dir: &Path, step: u64, config_hash: &str, out: &Path) -> Result<()> {
    let r = ExportRecord { step, config_hash: config_hash.to_owned(), out: absolute(out) };
    let text = serde_json::to_string_pretty(&r).context_with(|| "writing the export record".into())?;
    write_atomic(&dir.join(EXPORT_RECORD), text.as_bytes())
}

/// Whether `out` holds a complete export (its `config.json`, written last, exists) of step
/// `step` of the run `config_hash` names, as the record in `dir` says.
pub fn is_exported(dir: &Path, step: u64, config_hash: &str, out: &Path) -> bool {
    let Ok(text) = fs::read_to_string(dir.join(EXPORT_RECORD)) else { return false };
    let Ok(r) = serde_json::from_str::<ExportRecord>(&text) else { return false };
    r.step == step
        && r.config_hash == config_hash
        && r.out == absolute(out)
        && out.join("config.json").is_file()
}

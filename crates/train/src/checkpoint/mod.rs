//! Crash-consistent checkpoints that prove their integrity: a store snapshot plus a small JSON
//! manifest, every K steps and at a run's end.
//!
//! A checkpoint of global step K is two files in the checkpoint directory:
//!
//! - `step-000000K.store`: the host store's training state ([`HostStore::write_snapshot`]:
//!   master weights, AdamW moments, per-unit update counters, the header with the step; 12
//!   bytes per parameter on disk with fp32 moments, in a file whose gradient region is a hole),
//!   written as `.tmp`, synced, renamed;
//! - `step-000000K.json`: the [`Manifest`], written the same way *after* the snapshot is durable.
//!   It records the snapshot's size and BLAKE3 hash, and the BLAKE3 hash of its own bytes
//!   ([`integrity`]).
//!
//! A checkpoint exists once its manifest does, so a crash (SIGKILL, power loss) at any moment
//! leaves either the previous checkpoints or the new one, never a half-written one under a final
//! name. `--resume` takes the newest checkpoint whose files match their hashes (a damaged one is
//! moved aside into `damaged/`, and the one before it tried), checks that the run's defining
//! options hash the same, restores the snapshot into the store and continues from step K: the
//! batch of step k is a function of the data options and k alone and the learning rate a
//! function of k, so on the CPU the resumed run is bitwise the uninterrupted one
//! (`tests/real_use.rs`, `tests/durability.rs`).

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{Context, Error, Result};
use mt_store::HostStore;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

pub mod export_record;
pub mod integrity;

pub use integrity::{move_aside, verify, Damaged, Verified};

/// Version of the manifest format: 2 records the BLAKE3 hashes; 1 (read, never written) did not.
pub const MANIFEST_SCHEMA: u32 = 2;

/// Where in the data a checkpoint stands (the first sequence of the next step).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCursor {
    /// Passes completed over the training sequences.
    pub epoch: u64,
    /// Position of the next sequence within the epoch's order.
    pub index: u64,
}

/// The manifest of one checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_SCHEMA`].
    pub schema_version: u32,
    /// Global steps completed: the optimizer updates applied to the snapshot, plus the steps
    /// skipped for a non-finite loss or gradient ([`Manifest::skipped_steps`]).
    pub step: u64,
    /// Of those, the steps skipped (no update applied); absent in manifests from before.
    #[serde(default)]
    pub skipped_steps: u64,
    /// File name of the snapshot, in the same directory.
    pub store_file: String,
    /// Its size in bytes (a shorter file is not a checkpoint).
    pub store_bytes: u64,
    /// BLAKE3 (hex) of the snapshot's bytes (absent in schema 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_blake3: Option<String>,
    /// Data cursor after `step` steps.
    pub data_cursor: Option<DataCursor>,
    /// The random state. Every random choice of a run (initialisation, shuffling, the built-in
    /// sampler) is a pure function of the seed and the step or epoch, so the seed is the state.
    pub rng_seed: u64,
    /// SHA-256 (hex) of `defining`.
    pub config_hash: String,
    /// The options that must not change across a resume, by name (the model config, batch
    /// shape, precision, optimizer and schedule, data file and its options).
    pub defining: Value,
    /// The megatrain version that wrote it.
    pub megatrain_version: String,
    /// BLAKE3 (hex) of this manifest's bytes with these 64 digits written as zeros (absent in
    /// schema 1): [`integrity::manifest_text`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_blake3: Option<String>,
}

/// SHA-256 (hex) of a JSON value's canonical text (serde_json writes object keys sorted when
/// built from a `BTreeMap`-backed `Map`, which is the default).
pub fn hash_json(v: &Value) -> String {
    let text = serde_json::to_string(v).unwrap_or_default();
    hex(&Sha256::digest(text.as_bytes()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 (hex) of a file's contents (the data file identity in the manifest).
pub fn hash_file(path: &Path) -> Result<String> {
    use std::io::Read;
    let mut f = fs::File::open(path).context_with(|| format!("cannot read {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).context_with(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// `step-000000K`: the name of step K's files, without extension.
pub fn stem(step: u64) -> String {
    format!("step-{step:09}")
}

/// Writes the checkpoint of `store` (no update may be pending) into `dir` and removes all but
/// the newest `keep` checkpoints. Returns the manifest path. Files already at this step's names
/// are not a checkpoint of this run (a run never reaches a step it has an intact checkpoint of):
/// a snapshot without manifest is debris of an interrupted save and replaced, a manifest is moved
/// aside into `damaged/` with its snapshot, and a warning says so.
pub fn save(
    dir: &Path,
    store: &HostStore,
    data_cursor: Option<DataCursor>,
    rng_seed: u64,
    defining: &Value,
    keep: usize,
) -> Result<PathBuf> {
    fs::create_dir_all(dir)
        .context_with(|| format!("cannot create checkpoint directory {}", dir.display()))?;
    let skipped_steps = store.skipped_steps();
    let step = store.state().step + skipped_steps;
    let store_file = format!("{}.store", stem(step));
    let store_path = dir.join(&store_file);
    let manifest_path = dir.join(format!("{}.json", stem(step)));
    if manifest_path.exists() {
        let moved = move_aside(dir, step)?;
        tracing::warn!(
            "{} was in the way of this run's checkpoint of step {step}: moved to {}",
            manifest_path.display(),
            moved.display()
        );
    }
    // A snapshot without a manifest is debris of an interrupted save: replace it.
    if store_path.exists() {
        fs::remove_file(&store_path).context_with(|| format!("cannot remove {}", store_path.display()))?;
    }
    let written = store.write_snapshot(&store_path).context_with(|| "writing the store snapshot".into())?;
    sync_dir(dir)?;
    let manifest = Manifest {
        schema_version: MANIFEST_SCHEMA,
        step,
        skipped_steps,
        store_file,
        store_bytes: written.len,
        store_blake3: Some(written.blake3.to_hex().to_string()),
        data_cursor,
        rng_seed,
        config_hash: hash_json(defining),
        defining: defining.clone(),
        megatrain_version: env!("CARGO_PKG_VERSION").to_owned(),
        manifest_blake3: None,
    };
    let text = integrity::manifest_text(&manifest)?;
    write_atomic(&manifest_path, text.as_bytes())?;
    sync_dir(dir)?;
    prune(dir, keep)?;
    Ok(manifest_path)
}

/// Writes `bytes` to `path` through `path.tmp`, synced, then renamed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = fs::File::create(&tmp).context_with(|| format!("cannot create {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .context_with(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, path).context_with(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .context_with(|| format!("cannot sync directory {}", dir.display()))
}

/// The manifests in `dir` (files named `step-K.json`), oldest first, by the step their name
/// says: whether they parse or not, whether their snapshot is there or not.
pub fn manifests(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => {
            return Err(e).context_with(|| format!("cannot list checkpoint directory {}", dir.display()));
        }
    };
    for e in entries {
        let p = e.context_with(|| format!("cannot list checkpoint directory {}", dir.display()))?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let step =
            name.strip_prefix("step-").and_then(|r| r.strip_suffix(".json")).and_then(|d| d.parse().ok());
        if let Some(step) = step {
            out.push((step, p));
        }
    }
    out.sort();
    Ok(out)
}

/// Complete checkpoints in `dir`, oldest first: manifests that match their own hash and whose
/// snapshot exists with the recorded size (the snapshot's hash is checked by [`verify`], which
/// reads it whole: `--resume` and `megatrain verify` do).
pub fn list(dir: &Path) -> Result<Vec<(PathBuf, Manifest)>> {
    let mut out = Vec::new();
    for (_, p) in manifests(dir)? {
        match integrity::check_manifest(&p) {
            Ok(m) => out.push((p, m)),
            Err(d) => tracing::warn!("ignoring {d}"),
        }
    }
    Ok(out)
}

/// The newest complete checkpoint in `dir`.
pub fn latest(dir: &Path) -> Result<Option<(PathBuf, Manifest)>> {
    Ok(list(dir)?.pop())
}

fn prune(dir: &Path, keep: usize) -> Result<()> {
    let all = list(dir)?;
    let n = all.len().saturating_sub(keep.max(1));
    let kept: Vec<String> = all[n..].iter().flat_map(|(p, m)| [file_name(p), m.store_file.clone()]).collect();
    for (p, m) in all.into_iter().take(n) {
        // Manifest first: without it the snapshot is no longer a checkpoint.
        fs::remove_file(&p).context_with(|| format!("cannot remove {}", p.display()))?;
        let _ = fs::remove_file(dir.join(&m.store_file));
    }
    // Debris of interrupted saves (a snapshot without manifest, a .tmp): everything named
    // step-* that is not part of a kept checkpoint. Saves never run concurrently.
    let entries =
        fs::read_dir(dir).context_with(|| format!("cannot list checkpoint directory {}", dir.display()))?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("step-") && !kept.contains(&name) {
            let _ = fs::remove_file(e.path());
        }
    }
    Ok(())
}

pub(crate) fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Refuses a resume whose defining options differ from the checkpoint's, naming each one.
pub fn check_same_run(m: &Manifest, defining: &Value) -> Result<()> {
    if !(1..=MANIFEST_SCHEMA).contains(&m.schema_version) {
        return Err(Error::Checkpoint(format!(
            "checkpoint manifest schema {} is not one this build reads (1 to {MANIFEST_SCHEMA}): it was \
             written by a newer megatrain",
            m.schema_version
        )));
    }
    if hash_json(defining) == m.config_hash {
        return Ok(());
    }
    let (Some(old), Some(new)) = (m.defining.as_object(), defining.as_object()) else {
        return Err(Error::Checkpoint("the checkpoint was written by a differently configured run".into()));
    };
    let mut diffs = Vec::new();
    for k in old.keys().chain(new.keys().filter(|k| !old.contains_key(*k))) {
        let (a, b) = (old.get(k), new.get(k));
        if a != b {
            let show = |v: Option<&Value>| match v {
                None => "(absent)".to_owned(),
                Some(v) => {
                    let s = v.to_string();
                    if s.chars().count() > 80 {
                        format!("{}...", s.chars().take(77).collect::<String>())
                    } else {
                        s
                    }
                }
            };
            diffs.push(format!("{k}: checkpoint {} vs now {}", show(a), show(b)));
        }
    }
    Err(Error::Checkpoint(format!(
        "the checkpoint at step {} was written by a run with different options ({}); resume with the \
         options it was written with, or start a new run in another directory",
        m.step,
        diffs.join("; ")
    )))
}

#[cfg(test)]
mod tests {
    use mt_core::{ModelConfig, ModelLayout};
    use mt_store::GradDtype;
    use serde_json::json;

    use super::*;

    fn store(step: u64) -> HostStore {
        let s = HostStore::anonymous(&ModelLayout::new(&ModelConfig::tiny_llama()), GradDtype::Bf16).unwrap();
        s.set_state(mt_store::StoreState { step, ..s.state() });
        s
    }

    #[test]
    fn save_keeps_the_newest_and_latest_finds_it() {
        let d = tempfile::tempdir().unwrap();
        let def = json!({"lr": 0.001, "batch_size": 2});
        for step in [2, 4, 6] {
            save(d.path(), &store(step), Some(DataCursor { epoch: 0, index: step * 2 }), 7, &def, 2).unwrap();
        }
        let all = list(d.path()).unwrap();
        assert_eq!(all.iter().map(|(_, m)| m.step).collect::<Vec<_>>(), vec![4, 6]);
        assert!(!d.path().join("step-000000002.store").exists());
        let (_, m) = latest(d.path()).unwrap().unwrap();
        assert_eq!((m.step, m.rng_seed, m.data_cursor.unwrap().index), (6, 7, 12));
        check_same_run(&m, &def).unwrap();
    }

    #[test]
    fn a_checkpoint_without_its_full_snapshot_is_not_one() {
        let d = tempfile::tempdir().unwrap();
        let def = json!({});
        save(d.path(), &store(3), None, 0, &def, 5).unwrap();
        save(d.path(), &store(5), None, 0, &def, 5).unwrap();
        // Truncate the newest snapshot (a crash of a filesystem that reorders, or a bad copy).
        let f = fs::OpenOptions::new().write(true).open(d.path().join("step-000000005.store")).unwrap();
        f.set_len(100).unwrap();
        assert_eq!(latest(d.path()).unwrap().unwrap().1.step, 3);
        // A snapshot whose manifest never got written is ignored, and replaced by the next save.
        fs::remove_file(d.path().join("step-000000003.json")).unwrap();
        assert!(latest(d.path()).unwrap().is_none());
        save(d.path(), &store(3), None, 0, &def, 5).unwrap();
        assert_eq!(latest(d.path()).unwrap().unwrap().1.step, 3);
        // Debris is swept by the next save: the truncated step-5 files and a stray .tmp.
        fs::write(d.path().join("step-000000004.store.tmp"), b"x").unwrap();
        save(d.path(), &store(7), None, 0, &def, 5).unwrap();
        let mut names: Vec<String> =
            fs::read_dir(d.path()).unwrap().map(|e| file_name(&e.unwrap().path())).collect();
        names.sort();
        assert_eq!(
            names,
            ["step-000000003.json", "step-000000003.store", "step-000000007.json", "step-000000007.store"]
        );
    }

    #[test]
    fn a_resume_with_other_options_names_them() {
        let d = tempfile::tempdir().unwrap();
        save(d.path(), &store(1), None, 0, &json!({"lr": 0.001, "seq_len": 16}), 1).unwrap();
        let (_, m) = latest(d.path()).unwrap().unwrap();
        let e = check_same_run(&m, &json!({"lr": 0.002, "seq_len": 16})).unwrap_err().to_string();
        assert!(e.contains("lr: checkpoint 0.001 vs now 0.002") && !e.contains("seq_len"), "{e}");
    }
}

//! Whether a checkpoint's files are the bytes that were written: the manifest carries the BLAKE3
//! hash of the snapshot and of its own bytes; [`verify`] checks both, [`move_aside`] takes a
//! damaged checkpoint out of the way into `damaged/`.
//!
//! The manifest hashes itself: it is written with `manifest_blake3` set to 64 zeros, hashed, and
//! the zeros replaced by the hash ([`manifest_text`]); a reader puts the zeros back and hashes
//! again. Every byte of the file is covered (whitespace included), so any change is found, not
//! only one that changes what the JSON says.

use std::fmt;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::{file_name, stem, sync_dir, Manifest};
use crate::error::{Context, Error, Result};

/// 64 hex digits of zeros: where the manifest's own hash goes while it is hashed.
const ZERO_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

fn self_hash_field(hex: &str) -> String {
    format!("\"manifest_blake3\": \"{hex}\"")
}

/// The text of `m` as a manifest file: pretty JSON whose `manifest_blake3` is the BLAKE3 of the
/// text with that field's value written as zeros.
pub fn manifest_text(m: &Manifest) -> Result<String> {
    let mut m = m.clone();
    m.manifest_blake3 = Some(ZERO_HASH.to_owned());
    let mut text =
        serde_json::to_string_pretty(&m).context_with(|| "writing the checkpoint manifest".into())?;
    text.push('\n');
    let hash = blake3::hash(text.as_bytes()).to_hex();
    Ok(text.replacen(&self_hash_field(ZERO_HASH), &self_hash_field(&hash), 1))
}

/// A checkpoint file that is not what was written (or is missing), and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damaged {
    /// The checkpoint's manifest (the checkpoint's name).
    pub manifest: PathBuf,
    /// The file found wrong: the manifest or the snapshot.
    pub file: PathBuf,
    /// What is wrong with it.
    pub why: String,
}

impl fmt::Display for Damaged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "checkpoint {}: {} {}", self.manifest.display(), self.file.display(), self.why)
    }
}

/// What [`verify`] read of an intact checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    /// The manifest.
    pub manifest: Manifest,
    /// Whether the snapshot's hash was checked (schema 1 manifests record none).
    pub hashed: bool,
    /// Bytes of the snapshot read and hashed.
    pub bytes: u64,
    /// Seconds it took.
    pub secs: f64,
}

/// The manifest at `path`, if its bytes match the hash it records, it names its own step's
/// snapshot and that snapshot has the recorded size. Reads only the manifest and the snapshot's
/// size (cheap: the listing and pruning of checkpoints use it).
pub fn check_manifest(path: &Path) -> std::result::Result<Manifest, Damaged> {
    let damaged =
        |file: &Path, why: String| Damaged { manifest: path.to_owned(), file: file.to_owned(), why };
    let bytes = fs::read(path).map_err(|e| damaged(path, format!("cannot be read ({e})")))?;
    let text = std::str::from_utf8(&bytes).map_err(|_| damaged(path, "is not UTF-8 text".into()))?;
    let m: Manifest = serde_json::from_str(text)
        .map_err(|e| damaged(path, format!("does not parse as a checkpoint manifest ({e})")))?;
    // A manifest that carries the field is checked whatever its schema says: a flipped schema
    // digit must not turn the check off.
    match &m.manifest_blake3 {
        Some(recorded) => {
            let field = self_hash_field(recorded);
            if text.matches(&field).count() != 1 {
                return Err(damaged(path, "records its own hash in an unreadable form".into()));
            }
            let zeroed = text.replacen(&field, &self_hash_field(ZERO_HASH), 1);
            let actual = blake3::hash(zeroed.as_bytes()).to_hex();
            if actual.as_str() != recorded {
                return Err(damaged(
                    path,
                    format!(
                        "does not match the BLAKE3 hash it records ({recorded}; its bytes hash to {actual})"
                    ),
                ));
            }
        }
        None if m.schema_version >= 2 => {
            return Err(damaged(path, "records no hash of itself (its schema says it must)".into()));
        }
        None => {}
    }
    let name = file_name(path);
    if name != format!("{}.json", stem(m.step)) || m.store_file != format!("{}.store", stem(m.step)) {
        return Err(damaged(
            path,
            format!("says it is the checkpoint of step {} with snapshot {:?}", m.step, m.store_file),
        ));
    }
    let snapshot = path.with_file_name(&m.store_file);
    match fs::metadata(&snapshot) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(damaged(&snapshot, "is missing".into())),
        Err(e) => Err(damaged(&snapshot, format!("cannot be read ({e})"))),
        Ok(md) if md.len() != m.store_bytes => Err(damaged(
            &snapshot,
            format!("is {} bytes, its manifest records {} (truncated or replaced)", md.len(), m.store_bytes),
        )),
        Ok(_) => Ok(m),
    }
}

/// The checkpoint whose manifest is at `path`, checked whole: the manifest as
/// [`check_manifest`] does, then every byte of the snapshot against the hash it records.
pub fn verify(path: &Path) -> std::result::Result<Verified, Damaged> {
    let t = Instant::now();
    let m = check_manifest(path)?;
    let snapshot = path.with_file_name(&m.store_file);
    let Some(recorded) = m.store_blake3.clone() else {
        return Ok(Verified { manifest: m, hashed: false, bytes: 0, secs: t.elapsed().as_secs_f64() });
    };
    let damaged = |why: String| Damaged { manifest: path.to_owned(), file: snapshot.clone(), why };
    let (actual, bytes) = hash_file(&snapshot).map_err(|e| damaged(format!("cannot be read ({e})")))?;
    if bytes != m.store_bytes {
        return Err(damaged(format!("is {bytes} bytes, its manifest records {}", m.store_bytes)));
    }
    if actual.to_hex().as_str() != recorded {
        return Err(damaged(format!(
            "does not match the BLAKE3 hash its manifest records ({recorded}; its bytes hash to {}): it \
             changed after it was written",
            actual.to_hex()
        )));
    }
    Ok(Verified { manifest: m, hashed: true, bytes, secs: t.elapsed().as_secs_f64() })
}

/// BLAKE3 of a file's bytes and their count, read in large blocks hashed on every core.
fn hash_file(path: &Path) -> std::io::Result<(blake3::Hash, u64)> {
    let mut f = fs::File::open(path)?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 16 << 20];
    let mut total = 0u64;
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            match f.read(&mut buf[filled..])? {
                0 => break,
                n => filled += n,
            }
        }
        if filled == 0 {
            break;
        }
        hasher.update_rayon(&buf[..filled]);
        total += filled as u64;
    }
    Ok((hasher.finalize(), total))
}

/// Moves step `step`'s checkpoint files (manifest first: without it the rest is no checkpoint)
/// from `dir` into `dir/damaged/`, numbering a name already there; returns where the manifest
/// went (or would have gone, if only the snapshot was there).
pub fn move_aside(dir: &Path, step: u64) -> Result<PathBuf> {
    let aside = dir.join("damaged");
    fs::create_dir_all(&aside).context_with(|| format!("cannot create {}", aside.display()))?;
    let free = |name: &str| {
        (0..)
            .map(|i| if i == 0 { aside.join(name) } else { aside.join(format!("{name}.{i}")) })
            .find(|p| !p.exists())
            .unwrap_or_else(|| aside.join(name))
    };
    let stem = stem(step);
    let mut moved_manifest = None;
    for ext in ["json", "store"] {
        let name = format!("{stem}.{ext}");
        let from = dir.join(&name);
        let to = free(&name);
        match fs::rename(&from, &to) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(Error::Checkpoint(format!(
                    "cannot move {} aside to {} ({e}); move or delete it by hand",
                    from.display(),
                    to.display()
                )));
            }
        }
        if ext == "json" {
            moved_manifest = Some(to);
        }
    }
    sync_dir(dir)?;
    Ok(moved_manifest.unwrap_or_else(|| aside.join(format!("{stem}.json"))))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use mt_core::{ModelConfig, ModelLayout};
    use mt_store::{GradDtype, HostStore};
    use serde_json::json;

    use super::*;

    /// SplitMix64: the flips' offsets and masks, from a seed.
    fn next(x: &mut u64) -> u64 {
        *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn checkpoint(dir: &Path) -> PathBuf {
        let s = HostStore::anonymous(&ModelLayout::new(&ModelConfig::tiny_llama()), GradDtype::Bf16).unwrap();
        s.set_state(mt_store::StoreState { step: 4, ..s.state() });
        super::super::save(dir, &s, None, 1, &json!({"lr": 0.001}), 2).unwrap()
    }

    /// The property: one byte changed anywhere in either file of a checkpoint (offsets and XOR
    /// masks drawn at random; whitespace of the manifest included) is refused, naming that file;
    /// put back, the checkpoint verifies again.
    #[test]
    fn any_flipped_byte_of_either_file_is_refused_naming_the_file() {
        let d = tempfile::tempdir().unwrap();
        let manifest = checkpoint(d.path());
        let snapshot = manifest.with_file_name("step-000000004.store");
        let v = verify(&manifest).unwrap();
        assert!(v.hashed && v.bytes == fs::metadata(&snapshot).unwrap().len());
        let mut seed = 2026;
        let (text, size) = (fs::read(&manifest).unwrap(), fs::metadata(&snapshot).unwrap().len());
        let spaces: Vec<u64> = (0..text.len() as u64).filter(|&i| text[i as usize] == b' ').collect();
        for trial in 0..200 {
            let file = if trial % 2 == 0 { &manifest } else { &snapshot };
            // Every third manifest flip is aimed at its whitespace, which the JSON does not see.
            let at = match (trial % 6, file == &manifest) {
                (0, _) => spaces[(next(&mut seed) % spaces.len() as u64) as usize],
                (_, true) => next(&mut seed) % text.len() as u64,
                (_, false) => next(&mut seed) % size,
            };
            let f = fs::OpenOptions::new().read(true).write(true).open(file).unwrap();
            let mut byte = [0u8];
            f.read_exact_at(&mut byte, at).unwrap();
            let was = byte[0];
            f.write_all_at(&[was ^ (next(&mut seed) % 255 + 1) as u8], at).unwrap();
            let e = verify(&manifest).expect_err("a flipped byte must be refused");
            assert_eq!(&e.file, file, "trial {trial}, offset {at}: {e}");
            assert!(e.to_string().contains(&file.display().to_string()), "{e}");
            f.write_all_at(&[was], at).unwrap();
        }
        verify(&manifest).unwrap();
    }

    #[test]
    fn a_truncated_or_missing_snapshot_is_named() {
        let d = tempfile::tempdir().unwrap();
        let manifest = checkpoint(d.path());
        let snapshot = manifest.with_file_name("step-000000004.store");
        fs::OpenOptions::new().write(true).open(&snapshot).unwrap().set_len(4096).unwrap();
        let e = verify(&manifest).unwrap_err();
        assert!(e.file == snapshot && e.why.contains("truncated or replaced"), "{e}");
        fs::remove_file(&snapshot).unwrap();
        let e = verify(&manifest).unwrap_err();
        assert!(e.file == snapshot && e.why.contains("missing"), "{e}");
        let moved = move_aside(d.path(), 4).unwrap();
        assert_eq!(moved, d.path().join("damaged/step-000000004.json"));
        assert!(moved.exists() && !manifest.exists());
    }
}

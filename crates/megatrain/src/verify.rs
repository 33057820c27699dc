//! `megatrain verify DIR`: every checkpoint in a checkpoint directory (or in an `--out`
//! directory's `checkpoints/`) read whole and checked against the hashes its manifest records,
//! one line each; a damaged one is named with the file at fault and what to do. Reads only: the
//! directory's lock is held meanwhile, so no run writes there during the check.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::Args;
use mt_core::units;
use mt_train::checkpoint;
use mt_train::lock::Lock;

/// Options of `megatrain verify`.
#[derive(Debug, Clone, Args)]
pub struct VerifyArgs {
    /// A checkpoint directory, or an --out directory (its checkpoints/ are checked).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
}

/// What `megatrain verify` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The directory checked.
    pub dir: PathBuf,
    /// One line per checkpoint, oldest first, then the notes.
    pub lines: Vec<String>,
    /// Checkpoints whose files match their hashes.
    pub intact: usize,
    /// Checkpoints that do not.
    pub damaged: usize,
}

/// The checkpoint directory `dir` names: itself if it holds manifests, else its `checkpoints/`.
fn checkpoint_dir(dir: &Path) -> Result<PathBuf> {
    if !dir.is_dir() {
        bail!("{} is not a directory: give a checkpoint directory or an --out directory", dir.display());
    }
    let inner = dir.join("checkpoints");
    if checkpoint::manifests(dir)?.is_empty() && inner.is_dir() {
        return Ok(inner);
    }
    Ok(dir.to_owned())
}

/// Checks every checkpoint in `args.dir`.
pub fn verify(args: &VerifyArgs) -> Result<Report> {
    let dir = checkpoint_dir(&args.dir)?;
    // Held while reading, so that no run prunes or writes a checkpoint under us; a directory we
    // cannot write a lock file into (read-only media) is checked without.
    let _lock = match Lock::dir(&dir, "the checkpoint directory", &mt_train::lock::this_process()) {
        Ok(l) => Some(l),
        Err(mt_train::Error::Io { .. }) => None,
        Err(e) => return Err(e.into()),
    };
    let mut report = Report { dir: dir.clone(), lines: Vec::new(), intact: 0, damaged: 0 };
    for (step, path) in checkpoint::manifests(&dir)? {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        match checkpoint::verify(&path) {
            Ok(v) if v.hashed => {
                report.intact += 1;
                report.lines.push(format!(
                    "step {step}: intact ({name} and {}: {} hashed in {:.1} s)",
                    v.manifest.store_file,
                    units::bytes(v.bytes as f64),
                    v.secs
                ));
            }
            Ok(v) => {
                report.intact += 1;
                report.lines.push(format!(
                    "step {step}: readable, not verifiable ({name} was written by megatrain {}, before \
                     checkpoints were hashed)",
                    v.manifest.megatrain_version
                ));
            }
            Err(d) => {
                report.damaged += 1;
                let file = d.file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                report.lines.push(format!(
                    "step {step}: DAMAGED: {file} {}. Delete (or move away) {} and {}: --resume skips \
                     it by itself and continues from the newest intact checkpoint",
                    d.why,
                    name,
                    checkpoint::stem(step) + ".store"
                ));
            }
        }
    }
    let debris = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-") && (n.ends_with(".tmp") || n.ends_with(".store")))
        .filter(|n| !n.ends_with(".store") || !dir.join(n.replace(".store", ".json")).exists())
        .count();
    if debris > 0 {
        report.lines.push(format!(
            "{debris} file(s) of an interrupted checkpoint write (no manifest): not checkpoints; the next \
             checkpoint removes them"
        ));
    }
    if dir.join("damaged").is_dir() {
        report.lines.push(format!(
            "{}: checkpoints an earlier --resume found damaged and moved aside",
            dir.join("damaged").display()
        ));
    }
    Ok(report)
}

/// The command: prints the report; fails if a checkpoint is damaged or there is none.
#[allow(clippy::print_stdout)] // the CLI crate prints its results
pub fn run(args: &VerifyArgs) -> Result<()> {
    let r = verify(args)?;
    for line in &r.lines {
        println!("{line}");
    }
    match (r.intact, r.damaged) {
        (0, 0) => bail!("no checkpoint in {}", r.dir.display()),
        (n, 0) => {
            println!("{n} checkpoint(s) in {}: all intact", r.dir.display());
            Ok(())
        }
        (n, d) => bail!("{d} of the {} checkpoint(s) in {} are damaged (see above)", n + d, r.dir.display()),
    }
}

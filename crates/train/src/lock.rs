//! One writer per output: a run holds an exclusive advisory lock (`flock`, which the kernel
//! releases when the process dies, however it dies) on a lock file in `--out`, in the checkpoint
//! directory and beside the `--store` file from its start to its end. A second run on any of
//! them is refused at once, naming the holder, which each lock file describes in one line.
//!
//! The lock files are removed at the orderly end of a run (a killed run's stays: the next run
//! takes it over), and so is a directory that only the lock made and that is still empty (a run
//! refused at its start leaves nothing behind). Removing a lock file while another process may
//! have it open is safe because a taker checks, once it holds the lock, that the path still names
//! the file it locked, and tries again if not.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Name of the lock file inside a locked directory.
pub const LOCK_FILE: &str = ".megatrain.lock";

/// A held lock; released (and its file removed) on drop.
#[derive(Debug)]
pub struct Lock {
    file: File,
    path: PathBuf,
    /// Directories made to hold the lock file, deepest first.
    made: Vec<PathBuf>,
}

/// The directories a run writes into, locked.
#[derive(Debug, Default)]
pub struct RunLocks {
    locks: Vec<Lock>,
}

impl RunLocks {
    /// Locks `out`, `checkpoints` and the store file `store` (each when given), in that order.
    /// `who` describes this process (its command line) for a refused run to name.
    pub fn take(
        out: Option<&Path>,
        checkpoints: Option<&Path>,
        store: Option<&Path>,
        who: &str,
    ) -> Result<Self> {
        // Pushed as taken: a refusal drops those already taken in reverse order.
        let mut run = RunLocks::default();
        if let Some(out) = out {
            run.locks.push(Lock::dir(out, "--out", who)?);
        }
        if let Some(dir) = checkpoints {
            run.locks.push(Lock::dir(dir, "the checkpoint directory", who)?);
        }
        if let Some(store) = store {
            let mut name = store.as_os_str().to_owned();
            name.push(".lock");
            run.locks.push(Lock::file(&PathBuf::from(name), store, "--store", who)?);
        }
        Ok(run)
    }
}

impl Drop for RunLocks {
    /// The last taken first, so that a directory made for an outer lock is empty by its turn.
    fn drop(&mut self) {
        while let Some(l) = self.locks.pop() {
            drop(l);
        }
    }
}

/// This process, in one line: pid, host and command line.
pub fn this_process() -> String {
    let host =
        fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default();
    let args: Vec<String> = std::env::args().collect();
    format!(
        "pid {} on {} ({})",
        std::process::id(),
        if host.is_empty() { "this host" } else { &host },
        args.join(" ")
    )
}

impl Lock {
    /// Locks directory `dir` (made if missing) through its [`LOCK_FILE`].
    pub fn dir(dir: &Path, what: &str, who: &str) -> Result<Self> {
        let made = make_dirs(dir)?;
        let lock = Lock::file(&dir.join(LOCK_FILE), dir, what, who);
        match lock {
            Ok(mut l) => {
                l.made = made;
                Ok(l)
            }
            Err(e) => {
                remove_empty(&made);
                Err(e)
            }
        }
    }

    /// Locks through the lock file `path`, which stands for `target` (`what`, in a refusal).
    fn file(path: &Path, target: &Path, what: &str, who: &str) -> Result<Self> {
        let cannot = |source: std::io::Error| Error::Io {
            context: format!("{what} {}: cannot create its lock file {}", target.display(), path.display()),
            source,
        };
        // A few tries: a holder that ends removes the file between our open and our lock.
        for _ in 0..8 {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
                .map_err(cannot)?;
            match file.try_lock() {
                Ok(()) => {}
                Err(fs::TryLockError::WouldBlock) => {
                    let holder = fs::read_to_string(path).unwrap_or_default();
                    let holder = holder.trim();
                    let holder = if holder.is_empty() { "another megatrain process" } else { holder };
                    return Err(Error::Options(format!(
                        "{what} {} is in use by another run: {holder} (lock file {}). Wait for it to end, \
                         or write elsewhere",
                        target.display(),
                        path.display()
                    )));
                }
                Err(fs::TryLockError::Error(e)) => return Err(cannot(e)),
            }
            let same = match (file.metadata(), fs::metadata(path)) {
                (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
                _ => false,
            };
            if !same {
                continue;
            }
            let mut l = Lock { file, path: path.to_owned(), made: Vec::new() };
            l.describe(who).map_err(cannot)?;
            return Ok(l);
        }
        Err(Error::Options(format!(
            "{what} {}: its lock file {} kept changing under us; is something removing it?",
            target.display(),
            path.display()
        )))
    }

    fn describe(&mut self, who: &str) -> std::io::Result<()> {
        self.file.set_len(0)?;
        self.file.write_all(format!("{who}\n").as_bytes())?;
        self.file.flush()
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        // Still holding the lock: nobody else can have taken this file.
        let _ = fs::remove_file(&self.path);
        let _ = self.file.unlock();
        remove_empty(&self.made);
    }
}

/// Makes `dir` and its missing ancestors; returns those it made, deepest first.
fn make_dirs(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut missing = Vec::new();
    let mut d = dir;
    while !d.as_os_str().is_empty() && !d.exists() {
        missing.push(d.to_owned());
        match d.parent() {
            Some(p) => d = p,
            None => break,
        }
    }
    fs::create_dir_all(dir)
        .map_err(|source| Error::Io { context: format!("cannot create {}", dir.display()), source })?;
    Ok(missing)
}

/// Removes the directories `made` (deepest first) that are empty.
fn remove_empty(made: &[PathBuf]) {
    for d in made {
        if fs::remove_dir(d).is_err() {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_nothing_is_left_after() {
        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("a/out");
        let first =
            RunLocks::take(Some(&out), Some(&out.join("checkpoints")), None, "pid 1 (first run)").unwrap();
        let e = Lock::dir(&out, "--out", "second").unwrap_err().to_string();
        assert!(e.contains("--out") && e.contains("in use by another run: pid 1 (first run)"), "{e}");
        let e = Lock::dir(&out.join("checkpoints"), "the checkpoint directory", "second")
            .unwrap_err()
            .to_string();
        assert!(e.contains("pid 1 (first run)"), "{e}");
        drop(first);
        assert!(!t.path().join("a").exists(), "the directories only the locks made are gone");
        // Free again; a directory that holds something stays.
        let again = Lock::dir(&out, "--out", "third").unwrap();
        fs::write(out.join("config.json"), b"{}").unwrap();
        drop(again);
        assert!(out.join("config.json").exists() && !out.join(LOCK_FILE).exists());
    }

    #[test]
    fn a_store_is_locked_through_a_file_beside_it() {
        let t = tempfile::tempdir().unwrap();
        let store = t.path().join("run.store");
        let held = RunLocks::take(None, None, Some(&store), "pid 7 (store run)").unwrap();
        let e = RunLocks::take(None, None, Some(&store), "other").unwrap_err().to_string();
        assert!(e.contains("--store") && e.contains("pid 7 (store run)"), "{e}");
        drop(held);
        RunLocks::take(None, None, Some(&store), "other").unwrap();
    }
}

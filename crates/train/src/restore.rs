//! The phases of a run's set-up that decide what its host store starts from: the store opened
//! (anonymous, a new or an existing `--store` file, refused if a killed run left it mid-step),
//! pre-faulted, and filled from the newest intact checkpoint (`--resume`: each one's files
//! checked against their hashes, a damaged one moved aside), the store file's own state, the
//! model directory's weights or a seeded initialisation.

use std::path::{Path, PathBuf};
use std::time::Instant;

use mt_core::ModelLayout;
use mt_store::HostStore;
use serde_json::Value;

use crate::checkpoint::{self, Manifest, Verified};
use crate::data::TrainData;
use crate::error::{Context, Error, Result};
use crate::init::init_store;
use crate::observer::notify;
use crate::observer::{Event, Observer};
use crate::{ModelSource, TrainConfig};

/// How the run's first step was reached.
pub(crate) struct Restored {
    pub(crate) resumed: bool,
    pub(crate) note: Option<String>,
    pub(crate) no_checkpoint_yet: bool,
    /// The step of the checkpoint restored.
    pub(crate) checkpoint_step: Option<u64>,
}

/// How the store was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Opened {
    /// Anonymous, or a new file: zeroed.
    New,
    /// An existing --store file, to continue from.
    Continued,
    /// An existing --store file under --resume: a working copy, restored from the newest
    /// checkpoint or, without one, initialised afresh.
    Reused,
}

/// Phase: the `store` file (opened if it exists, else created) or an anonymous store. An existing
/// file that a killed run left mid-step is refused unless `resume` restores a checkpoint into it.
pub(crate) fn open_store(c: &TrainConfig, layout: &ModelLayout) -> Result<(HostStore, Opened)> {
    let Some(path) = &c.store else {
        let s = HostStore::anonymous_with(layout, c.grad_dtype(), c.optim_states)
            .context_with(|| "allocating the host store".into())?;
        return Ok((s, Opened::New));
    };
    if path.exists() {
        let s = HostStore::open(path, layout).context_with(|| {
            format!("cannot resume from --store {} (is it for this model?)", path.display())
        })?;
        crate::states::check_store(path, &s, c.optim_states)?;
        if c.resume {
            return Ok((s, Opened::Reused));
        }
        if s.run_open() {
            return Err(Error::Options(format!(
                "--store {} was left by a run that was killed mid-step (or whose machine crashed): it \
                 may hold a half-applied update. Rerun with --resume to restore the newest checkpoint \
                 into it (--save-every with --out or --checkpoint-dir), or delete it to start afresh",
                path.display()
            )));
        }
        Ok((s, Opened::Continued))
    } else {
        let s = HostStore::create_with(path, layout, c.grad_dtype(), c.optim_states)
            .context_with(|| format!("cannot create --store {}", path.display()))?;
        Ok((s, Opened::New))
    }
}

/// Phase: the store's pages populated on every core before anything writes it (an import or
/// initialisation into unpopulated memory would take each page fault on the writing thread).
pub(crate) fn prefault<O: Observer>(store: &HostStore, observer: &mut O) -> Result<()> {
    let t = Instant::now();
    match store.prefault() {
        Ok(0) => Ok(()),
        Ok(bytes) => notify(observer, &Event::Prefaulted { bytes, secs: t.elapsed().as_secs_f64() }),
        Err(e) => notify(observer, &Event::NotPrefaulted(e.to_string())),
    }
}

/// Phase: the weights the run starts from: the newest checkpoint (with `resume`), the store
/// file's own (a reopened `--store`), the model directory's, or a seeded initialisation.
pub(crate) fn restore_or_initialise<O: Observer>(
    c: &TrainConfig,
    model: &ModelSource,
    store: &HostStore,
    data: &TrainData,
    defining: &Value,
    opened: Opened,
    observer: &mut O,
) -> Result<Restored> {
    let latest = match (c.checkpoint_dir(), c.resume) {
        (Some(dir), true) => newest_intact(&dir, observer)?,
        _ => None,
    };
    if let Some((path, v)) = &latest {
        let m = &v.manifest;
        restore_checkpoint(c, store, data, defining, path, m)?;
        let checked = if v.hashed {
            format!(
                "its files match their hashes: {} read in {:.1} s",
                mt_core::units::bytes(v.bytes as f64),
                v.secs
            )
        } else {
            "written before checkpoints were hashed: not verified".to_owned()
        };
        let note = format!("resumed from checkpoint {} at step {} ({checked})", path.display(), m.step);
        return Ok(Restored {
            resumed: true,
            note: Some(note),
            no_checkpoint_yet: false,
            checkpoint_step: Some(m.step),
        });
    }
    let no_checkpoint_yet = c.resume;
    if opened == Opened::Reused {
        // No checkpoint yet: start afresh over whatever a killed run left in the file.
        reset_store(store);
    }
    if opened == Opened::Continued {
        let note =
            c.store.as_ref().map(|p| format!("resumed from {} at step {}", p.display(), store.state().step));
        return Ok(Restored { resumed: true, note, no_checkpoint_yet, checkpoint_step: None });
    }
    if model.cfg.lora.is_some() {
        let n = crate::lora::init_adapters(c, store)?;
        notify(observer, &Event::Initialised { n_tensors: n, seed: c.seed, secs: 0.0 })?;
        return Ok(Restored { resumed: false, note: None, no_checkpoint_yet, checkpoint_step: None });
    }
    match &model.hf {
        Some(hf) => {
            let r = mt_hf::import_weights(hf, store)
                .context_with(|| format!("importing the weights of {}", model.name))?;
            let event = Event::Imported { n_tensors: r.n_tensors, n_params: r.n_params, from: &model.name };
            notify(observer, &event)?;
        }
        None => {
            let t = Instant::now();
            let n = init_store(store, c.seed).context_with(|| "initialising the model".into())?;
            let event = Event::Initialised { n_tensors: n, seed: c.seed, secs: t.elapsed().as_secs_f64() };
            notify(observer, &event)?;
        }
    }
    Ok(Restored { resumed: false, note: None, no_checkpoint_yet, checkpoint_step: None })
}

/// The newest checkpoint in `dir` whose files match their hashes; each damaged one newer than
/// it is moved aside into `damaged/` (so the run that retrains its steps can write them again),
/// and the observer told which, why, and where it went.
fn newest_intact<O: Observer>(dir: &Path, observer: &mut O) -> Result<Option<(PathBuf, Verified)>> {
    for (step, path) in checkpoint::manifests(dir)?.into_iter().rev() {
        notify(observer, &Event::CheckingCheckpoint { manifest: &path })?;
        match checkpoint::verify(&path) {
            Ok(v) => return Ok(Some((path, v))),
            Err(damaged) => {
                let moved_to = checkpoint::move_aside(dir, step)?;
                notify(observer, &Event::CheckpointDamaged { damaged: &damaged, moved_to: &moved_to })?;
            }
        }
    }
    Ok(None)
}

/// Zeroes everything of a store that a run writes (moments, gradients, update marks, the header's
/// state and counts), for a fresh start in a reused --store file; the weights are written next.
fn reset_store(store: &HostStore) {
    for u in store.layout().units() {
        let mut r = store.record(u);
        let p = r.parts();
        p.m.fill(0);
        p.v.fill(0);
        match r.grad_mut() {
            Some(mt_store::GradMut::F32(g)) => g.fill(0.0),
            Some(mt_store::GradMut::Bf16(g)) => g.fill(Default::default()),
            None => {}
        }
        r.set_applied_step(0);
    }
    store.set_state(mt_store::StoreState { pending_grad_scale: 1.0, ..Default::default() });
    store.set_skipped_steps(0);
    store.set_device_owned(false);
}

/// A checkpoint's snapshot restored into `store`, once its options and data cursor are this run's.
fn restore_checkpoint(
    c: &TrainConfig,
    store: &HostStore,
    data: &TrainData,
    defining: &Value,
    path: &Path,
    m: &Manifest,
) -> Result<()> {
    let refused = |why: String| Error::Checkpoint(format!("cannot resume from {}: {why}", path.display()));
    // The optimizer states first, in words.
    if let Some(why) = crate::states::checkpoint_refusal(m, c.optim_states) {
        return Err(refused(why));
    }
    checkpoint::check_same_run(m, defining).map_err(|e| refused(e.to_string()))?;
    // A --store file reused under --resume may carry a killed run's marks; the snapshot is whole.
    store.set_device_owned(false);
    let snap = path.with_file_name(&m.store_file);
    let restored = store.restore_snapshot(&snap).context_with(|| format!("restoring {}", snap.display()))?;
    if restored.step + store.skipped_steps() != m.step {
        return Err(refused(format!(
            "its snapshot holds {} updates and {} skipped steps, not the {} steps its manifest names",
            restored.step,
            store.skipped_steps(),
            m.step
        )));
    }
    let here = data.cursor(m.step, c.batch_size);
    if m.data_cursor != here {
        return Err(refused(format!(
            "its data cursor {:?} is not where this data puts step {} ({here:?}); was --data changed?",
            m.data_cursor, m.step
        )));
    }
    Ok(())
}

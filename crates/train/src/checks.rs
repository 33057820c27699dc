//! The checks of a run's options against the model and the file system, made before any memory
//! is allocated or any step runs: each refusal names the option to change. Everything a run
//! writes at its end (the export) or along the way (checkpoints, a new --store file) is checked
//! here too: its directory takes a file, its file system has room.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use mt_core::{ModelConfig, ModelLayout};
use mt_sched::OptimMode;
use mt_store::GradDtype;

use crate::checkpoint;
use crate::error::{Context, Error, Result};
use crate::TrainConfig;

macro_rules! refuse {
    ($($arg:tt)*) => { return Err(Error::Options(format!($($arg)*))) };
}

/// Refuses output options that cannot work, before any work is done: an `--out` that is a
/// file, checkpoints with nowhere to go.
pub(crate) fn check_outputs(args: &TrainConfig) -> Result<()> {
    if let Some(out) = &args.out {
        if out.exists() && !out.is_dir() {
            refuse!("--out {} exists and is not a directory", out.display());
        }
        existing_ancestor(out).map_err(|e| Error::Options(format!("--out {}: {e}", out.display())))?;
    }
    if let Some(dir) = &args.checkpoint_dir {
        existing_ancestor(dir)
            .map_err(|e| Error::Options(format!("--checkpoint-dir {}: {e}", dir.display())))?;
    }
    if let (Some(out), crate::ModelChoice::HfDir(model)) = (&args.out, &args.model) {
        let same = match (out.canonicalize(), model.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        if same {
            refuse!("--out {} is the --model directory: export into another directory", out.display());
        }
    }
    if (args.save_every > 0 || args.resume) && args.checkpoint_dir().is_none() {
        refuse!("--save-every and --resume need --out DIR or --checkpoint-dir DIR (where checkpoints live)");
    }
    Ok(())
}

/// Refuses a run that is not `--resume` where another run's checkpoints are (checked once the
/// run holds the directory's lock, so a run in progress is named as such instead). A run that
/// continues an existing `--store` file continues the run those checkpoints are of.
pub(crate) fn check_fresh_start(args: &TrainConfig) -> Result<()> {
    if args.store.as_ref().is_some_and(|s| s.is_file()) {
        return Ok(());
    }
    if let (Some(dir), false) = (args.checkpoint_dir(), args.resume) {
        if let Some((path, m)) = checkpoint::latest(&dir)? {
            refuse!(
                "{} holds a checkpoint of step {} ({}): continue that run with --resume, or start a new \
                 one with another --out or --checkpoint-dir",
                dir.display(),
                m.step,
                path.display()
            );
        }
    }
    Ok(())
}

/// Refuses option combinations the model or the engine cannot run, naming the option to change.
pub(crate) fn check_sizes(args: &TrainConfig, cfg: &ModelConfig) -> Result<()> {
    cfg.check_train_seq_len(args.seq_len).context_with(|| "--seq-len".into())?;
    if args.device == crate::Device::Cuda {
        mt_layers::check_gpu(cfg, args.precision.dtype(), args.attention)
            .context_with(|| "--device cuda".into())?;
    }
    if let Some(c) = args.chunks.filter(|&c| c > args.batch_size) {
        refuse!(
            "--chunks {c} exceeds --batch-size {}: each chunk holds at least one whole sequence",
            args.batch_size
        );
    }
    check_gpus(args, cfg)?;
    if args.grad_dtype() == GradDtype::None && args.optim_mode == OptimMode::Exact {
        refuse!(
            "--grad-dtype none needs --optim-mode lean: exact mode keeps each step's gradient in the \
             store until the next step"
        );
    }
    Ok(())
}

/// One thing a run will write into a directory: what, and how many bytes at most.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Output {
    /// The directory (it may not exist yet).
    pub(crate) dir: PathBuf,
    /// What goes there, as the refusal names it.
    pub(crate) what: String,
    /// Bytes it takes on disk at its largest.
    pub(crate) bytes: u64,
}

/// Everything a run of `cfg` will write, with its size: the export into `--out` (the weights in
/// the export dtype; a LoRA run's adapters in f32, or with `--merge` the base model), the
/// checkpoints (`--keep-checkpoints` + 1 snapshots of 12, 8 or 6 B/param of what trains at once,
/// less those already there; without `--save-every`, the one of the last step) and a new
/// `--store` file.
pub(crate) fn outputs(c: &TrainConfig, cfg: &ModelConfig) -> Vec<Output> {
    let layout = &ModelLayout::trainable(cfg);
    let mut out = Vec::new();
    if let Some(dir) = &c.out {
        let per = match c.export_dtype {
            mt_hf::ExportDtype::F32 => 4,
            mt_hf::ExportDtype::Bf16 => 2,
        };
        let bytes = match &cfg.lora {
            Some(_) if !c.merge => 4 * layout.n_params() as u64,
            _ => per * ModelLayout::new(&crate::lora::base_config(cfg)).n_params() as u64,
        };
        out.push(Output { dir: dir.clone(), what: "the export (--out)".into(), bytes });
    }
    if let Some(dir) = c.checkpoint_dir() {
        let snapshot = mt_sched::plan::store_bytes(layout, GradDtype::None, c.optim_states);
        let there: u64 = std::fs::read_dir(&dir)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("step-"))
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        let n = if c.save_every > 0 { c.keep_checkpoints as u64 + 1 } else { 1 };
        out.push(Output {
            dir,
            what: if c.save_every > 0 {
                format!(
                    "{n} checkpoints (--keep-checkpoints {} and the one being written)",
                    c.keep_checkpoints
                )
            } else {
                "the checkpoint of the last step".into()
            },
            bytes: (n * snapshot).saturating_sub(there),
        });
    }
    if let Some(store) = c.store.as_ref().filter(|p| !p.exists()) {
        let dir = match store.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
            _ => PathBuf::from("."),
        };
        out.push(Output {
            dir,
            what: "the --store file".into(),
            bytes: mt_sched::plan::store_bytes(layout, c.grad_dtype(), c.optim_states),
        });
    }
    out
}

/// The nearest existing directory at or above `dir`, where it will be created.
fn existing_ancestor(dir: &Path) -> Result<PathBuf> {
    let mut d = dir;
    loop {
        if d.exists() {
            if !d.is_dir() {
                refuse!("{} is not a directory, so {} cannot be made in it", d.display(), dir.display());
            }
            return Ok(d.to_owned());
        }
        d = match d.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
    }
}

/// Refuses a run whose outputs cannot be written, before anything is done, rather than after its
/// last step: each output's directory (or the one it will be created in) must take a new file,
/// and each file system must have room for everything that goes onto it.
pub(crate) fn check_room(outputs: &[Output]) -> Result<()> {
    // (file system, free bytes, its outputs)
    let mut per_fs: Vec<(u64, u64, Vec<&Output>)> = Vec::new();
    for o in outputs {
        let at = existing_ancestor(&o.dir)?;
        let probe = at.join(format!(".megatrain-probe-{}", std::process::id()));
        if let Err(e) = std::fs::File::create(&probe) {
            refuse!("{} cannot be written in {} ({e})", o.what, at.display());
        }
        let _ = std::fs::remove_file(&probe);
        let dev = std::fs::metadata(&at).context_with(|| format!("cannot stat {}", at.display()))?.dev();
        let free = fs2::available_space(&at)
            .context_with(|| format!("cannot read the free space of {}", at.display()))?;
        match per_fs.iter_mut().find(|(d, _, _)| *d == dev) {
            Some((_, _, v)) => v.push(o),
            None => per_fs.push((dev, free, vec![o])),
        }
    }
    for (_, free, outs) in per_fs {
        if let Some(why) = room_refusal(&outs, free) {
            refuse!("{why}");
        }
    }
    Ok(())
}

/// Why `outs`, all on one file system with `free` bytes available, do not fit (`None` if they do).
pub(crate) fn room_refusal(outs: &[&Output], free: u64) -> Option<String> {
    let need: u64 = outs.iter().map(|o| o.bytes).sum();
    if need <= free {
        return None;
    }
    let gb = |b: u64| mt_core::units::bytes(b as f64);
    let parts: Vec<String> =
        outs.iter().map(|o| format!("{} {} in {}", o.what, gb(o.bytes), o.dir.display())).collect();
    Some(format!(
        "not enough free space: {} need {} on one file system, which has {} free; free some, or write \
         elsewhere (--out, --checkpoint-dir, --store), fewer --keep-checkpoints or --export-dtype bf16",
        parts.join(", "),
        gb(need),
        gb(free)
    ))
}

/// Refuses `--gpus` (and a job of several processes) where data parallel cannot run: 0 GPUs, the
/// CPU backend, fewer sequences than ranks, and the placements that keep optimizer state on a GPU
/// (every GPU would own a copy).
fn check_gpus(args: &TrainConfig, cfg: &ModelConfig) -> Result<()> {
    let n = args.gpus;
    if n == 0 {
        refuse!("--gpus 0: train on at least one GPU");
    }
    let ranks = args.ranks();
    if ranks == 1 {
        return Ok(());
    }
    let what = match &args.job {
        None => format!("--gpus {n}"),
        Some(j) => format!("--gpus {n} in each of {} processes ({ranks} GPUs)", j.processes),
    };
    if args.device == crate::Device::Cpu {
        refuse!(
            "{what} needs --device cuda: the CPU backend trains as one rank (its data-parallel path is tested with simulated ranks)"
        );
    }
    if args.batch_size < ranks {
        refuse!(
            "--batch-size {} is smaller than {what}: each GPU needs at least one sequence",
            args.batch_size
        );
    }
    if let Some(flag) = args.placement.device_state_asked() {
        refuse!(
            "{flag} keeps optimizer state on the GPU, which {what} does not support yet (every GPU would own a copy): leave it at auto or 0"
        );
    }
    if cfg.moe.as_ref().and_then(|m| m.aux_coef()).is_some() {
        refuse!(
            "{what}: the mixture of experts' load-balancing loss needs the whole batch's router statistics, which data parallel does not gather yet; use --gpus 1"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use mt_core::StateDtype;

    fn o(what: &str, bytes: u64) -> Output {
        Output { dir: PathBuf::from("/x"), what: what.into(), bytes }
    }

    #[test]
    fn outputs_that_do_not_fit_are_named_with_their_sizes() {
        let (a, b) = (o("the export (--out)", 3_000_000_000), o("the --store file", 2_000_000_000));
        assert_eq!(room_refusal(&[&a, &b], 5_000_000_000), None);
        let why = room_refusal(&[&a, &b], 4_000_000_000).unwrap();
        assert!(why.contains("the export (--out) 3.00 GB in /x, the --store file 2.00 GB in /x"), "{why}");
        assert!(why.contains("need 5.00 GB on one file system, which has 4.00 GB free"), "{why}");
    }

    #[test]
    fn an_unwritable_place_is_refused_before_anything_runs() {
        let t = tempfile::tempdir().unwrap();
        let file = t.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let under_file = Output { dir: file.join("out"), what: "the export (--out)".into(), bytes: 1 };
        let e = check_room(&[under_file]).unwrap_err().to_string();
        assert!(e.contains("is not a directory"), "{e}");
        let fine = Output { dir: t.path().join("a/b"), what: "the export (--out)".into(), bytes: 1 };
        check_room(&[fine]).unwrap();
        assert!(!t.path().join("a").exists(), "the check creates nothing");
    }

    #[test]
    fn checkpoints_count_the_snapshots_kept_plus_the_one_being_written() {
        let c = TrainConfig {
            out: Some(PathBuf::from("/nonexistent/out")),
            save_every: 10,
            keep_checkpoints: 2,
            ..TrainConfig::default()
        };
        let layout = ModelLayout::new(&ModelConfig::tiny_llama());
        let outs = outputs(&c, &ModelConfig::tiny_llama());
        let snapshot = mt_sched::plan::store_bytes(&layout, GradDtype::None, StateDtype::F32);
        assert_eq!(outs.len(), 2);
        assert_eq!(outs[0].bytes, 4 * layout.n_params() as u64);
        assert_eq!(outs[1].bytes, 3 * snapshot);
        assert_eq!(outs[1].dir, PathBuf::from("/nonexistent/out/checkpoints"));
        // With 8-bit moments each snapshot is the smaller store's.
        let int8 = outputs(&TrainConfig { optim_states: StateDtype::Int8, ..c }, &ModelConfig::tiny_llama());
        assert_eq!(
            int8[1].bytes,
            3 * mt_sched::plan::store_bytes(&layout, GradDtype::None, StateDtype::Int8)
        );
        assert!(int8[1].bytes < outs[1].bytes / 2 + outs[1].bytes / 8);
    }
}

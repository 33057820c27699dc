//! `megatrain train`'s checks of its options against the model and the file system, run before
//! any memory is allocated or any step runs: each refusal names the option to change.

use std::path::Path;

use anyhow::{bail, Context, Result};
use mt_core::ModelConfig;

use crate::checkpoint;
use crate::cli::{GradDtypeArg, OptimModeArg, TrainArgs};
use crate::train::checkpoint_dir;

/// Refuses output options that cannot work, before any work is done: an `--out` that is a
/// file, checkpoints with nowhere to go.
pub(crate) fn check_outputs(args: &TrainArgs) -> Result<()> {
    if let Some(out) = &args.out {
        if out.exists() && !out.is_dir() {
            bail!("--out {} exists and is not a directory", out.display());
        }
    }
    if let (Some(out), Some(model)) = (&args.out, &args.model) {
        let same = match (out.canonicalize(), model.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        if same {
            bail!("--out {} is the --model directory: export into another directory", out.display());
        }
    }
    if (args.save_every > 0 || args.resume) && checkpoint_dir(args).is_none() {
        bail!("--save-every and --resume need --out DIR or --checkpoint-dir DIR (where checkpoints live)");
    }
    if let (Some(dir), false) = (checkpoint_dir(args), args.resume) {
        if let Some((path, m)) = checkpoint::latest(&dir)? {
            bail!(
                "{} holds a checkpoint of step {} ({}): continue that run with --resume, or start a new \
                 one with another --out or --checkpoint-dir",
                dir.display(),
                m.step,
                path.display()
            );
        }
    }
    if args.resume && args.store.is_some() {
        bail!("--resume restores a checkpoint into the store; with --store, rerun with the same --store instead");
    }
    Ok(())
}

/// The step of this invocation (1-based) that `--trace` records: `--trace-step`, else 2 (the
/// first step is a warm-up: buffers are allocated and worker threads start), or 1 for a
/// one-step run. Refuses a step past `--steps` and a trace path whose directory is missing,
/// before any training step runs.
pub(crate) fn check_trace(args: &TrainArgs) -> Result<usize> {
    let step = args.trace_step.unwrap_or(if args.steps >= 2 { 2 } else { 1 });
    if step > args.steps {
        bail!(
            "--trace-step {step} is past the last step of this run (--steps {}); use 1..={}",
            args.steps,
            args.steps
        );
    }
    if let Some(path) = &args.trace {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            bail!("--trace {}: directory {} does not exist; create it first", path.display(), dir.display());
        }
    }
    Ok(step)
}

/// Refuses option combinations the model or the engine cannot run, naming the option to change.
pub(crate) fn check_sizes(args: &TrainArgs, cfg: &ModelConfig) -> Result<()> {
    if args.seq_len > cfg.max_position_embeddings {
        bail!(
            "--seq-len {} exceeds the model's max_position_embeddings ({}); use a shorter sequence",
            args.seq_len,
            cfg.max_position_embeddings
        );
    }
    cfg.check_seq_len(args.seq_len).context("--seq-len")?;
    if let Some(c) = args.chunks.filter(|&c| c > args.batch_size) {
        bail!(
            "--chunks {c} exceeds --batch-size {}: each chunk holds at least one whole sequence",
            args.batch_size
        );
    }
    if args.grad_dtype() == GradDtypeArg::None && args.optim_mode == OptimModeArg::Exact {
        bail!(
            "--grad-dtype none needs --optim-mode lean: exact mode keeps each step's gradient in the \
             store until the next step"
        );
    }
    Ok(())
}

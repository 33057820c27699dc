//! The checks of a run's options against the model and the file system, made before any memory
//! is allocated or any step runs: each refusal names the option to change.

use mt_core::ModelConfig;
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
    if args.resume && args.store.is_some() {
        refuse!("--resume restores a checkpoint into the store; with --store, rerun with the same --store instead");
    }
    Ok(())
}

/// Refuses option combinations the model or the engine cannot run, naming the option to change.
pub(crate) fn check_sizes(args: &TrainConfig, cfg: &ModelConfig) -> Result<()> {
    if args.seq_len > cfg.max_position_embeddings {
        refuse!(
            "--seq-len {} exceeds the model's max_position_embeddings ({}); use a shorter sequence",
            args.seq_len,
            cfg.max_position_embeddings
        );
    }
    cfg.check_seq_len(args.seq_len).context_with(|| "--seq-len".into())?;
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

/// Refuses `--gpus` where data parallel cannot run: 0 GPUs, the CPU backend, fewer sequences than
/// GPUs, and the placements that keep optimizer state on a GPU (every GPU would own a copy).
fn check_gpus(args: &TrainConfig, cfg: &ModelConfig) -> Result<()> {
    let n = args.gpus;
    if n == 0 {
        refuse!("--gpus 0: train on at least one GPU");
    }
    if n == 1 {
        return Ok(());
    }
    if args.device == crate::Device::Cpu {
        refuse!(
            "--gpus {n} needs --device cuda: the CPU backend trains as one rank (its data-parallel path is tested with simulated ranks)"
        );
    }
    if args.batch_size < n {
        refuse!(
            "--batch-size {} is smaller than --gpus {n}: each GPU needs at least one sequence",
            args.batch_size
        );
    }
    let p = &args.placement;
    let on_gpu = [
        ("--resident-outer", p.resident_outer == Some(true)),
        ("--resident-layers", p.resident_layers.is_some_and(|k| k > 0)),
        ("--gpu-updated-layers", p.gpu_updated_layers.is_some_and(|k| k > 0)),
        ("--late-state-downloads", p.late_state_downloads.is_some_and(|k| k > 0)),
        ("--early-state-uploads", p.early_state_uploads.is_some_and(|k| k > 0)),
    ];
    if let Some((flag, _)) = on_gpu.iter().find(|(_, on)| *on) {
        refuse!(
            "{flag} keeps optimizer state on the GPU, which --gpus {n} does not support yet (every GPU would own a copy): leave it at auto or 0"
        );
    }
    if cfg.moe.as_ref().and_then(|m| m.aux_coef()).is_some() {
        refuse!(
            "--gpus {n}: the mixture of experts' load-balancing loss needs the whole batch's router statistics, which data parallel does not gather yet; use --gpus 1"
        );
    }
    Ok(())
}

//! `megatrain train`: the command line's options as an [`mt_train::TrainConfig`], run by an
//! [`mt_train::Trainer`] whose observer is the terminal, the `--metrics` log and the `--trace`
//! ([`crate::report::CliObserver`]).

use std::path::Path;

use anyhow::{bail, Result};
use mt_train::{TrainConfig, TrainSummary, Trainer};

use crate::cli::TrainArgs;
use crate::report::CliObserver;

/// Runs `megatrain train`: progress and log lines go to the terminal, the summary is returned.
/// Started by torchrun or Slurm as one of several processes, it first joins the others
/// ([`join_job`]); only process 0 writes `--metrics`, `--trace` and the run's outputs.
pub fn train(args: &TrainArgs) -> Result<TrainSummary> {
    let trace_step = check_trace(args)?;
    let mut config = args.to_config();
    let watchdog = join_job(&mut config)?;
    let quiet = TrainArgs { metrics: None, trace: None, ..args.clone() };
    let observer = CliObserver::new(if config.writes_outputs() { args } else { &quiet }, trace_step);
    let summary = Trainer::new(config, observer)?.run()?;
    if let Some(w) = watchdog {
        w.goodbye();
    }
    Ok(summary)
}

/// A job of several processes (the launcher's variables: torchrun's `RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` or Slurm's): the rendezvous at rank 0's address,
/// which checks that every process runs the same command and ships process 0's NCCL id, fills in
/// `config.job`; the watchdog then ends this process with a sentence naming the process that
/// died or went silent (a silent one is declared after 30 s and every process hears of a failure
/// within 60 s: [`mt_dist::WatchOptions`]), rather than waiting in a collective forever. `None`
/// when this process is the whole job.
fn join_job(config: &mut TrainConfig) -> Result<Option<mt_dist::Watchdog>> {
    let launch = mt_dist::Launch::from_env()?;
    if !launch.is_distributed() {
        return Ok(None);
    }
    // Refused here, before this process waits for the others at the rendezvous.
    if config.device != mt_train::Device::Cuda {
        bail!("{launch}: a job of several processes trains on GPUs, in one NCCL group: add --device cuda");
    }
    if !cfg!(feature = "nccl") {
        bail!(
            "{launch}: a job of several processes needs a megatrain built with the nccl feature (cargo build --release -p megatrain --features megatrain/nccl)"
        );
    }
    let spec = mt_dist::JobSpec::new(&launch, fingerprint());
    // Process 0's id, made before it listens: the others receive it.
    let id = if launch.rank == 0 { mt_train::nccl_unique_id()? } else { Vec::new() };
    let joined = mt_dist::rendezvous(&launch, &spec, move || id)?;
    joined.watchdog.on_failure(|f| {
        #[allow(clippy::print_stderr)] // the CLI crate prints; the process ends here
        {
            eprintln!("error: process {f}; this process stops (the job cannot go on without it)");
        }
        std::process::exit(1);
    });
    config.job = Some(mt_train::JobPlace {
        process: launch.rank,
        processes: launch.world_size,
        first_gpu: launch.local_rank * config.gpus,
        nccl_id: joined.blob,
    });
    Ok(Some(joined.watchdog))
}

/// What every process of a job must run alike: this megatrain's version and its arguments.
fn fingerprint() -> String {
    let args: Vec<String> = std::env::args_os().skip(1).map(|a| a.to_string_lossy().into_owned()).collect();
    format!("megatrain {} {}", env!("CARGO_PKG_VERSION"), args.join(" "))
}

/// The step of this invocation (1-based) that `--trace` records: `--trace-step`, else 2 (the
/// first step is a warm-up: buffers are allocated and worker threads start), or 1 for a
/// one-step run. Refuses a step past `--steps` and a trace path whose directory is missing,
/// before anything is read or allocated.
fn check_trace(args: &TrainArgs) -> Result<usize> {
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

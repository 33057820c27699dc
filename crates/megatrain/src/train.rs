//! `megatrain train`: the command line's options as an [`mt_train::TrainConfig`], run by an
//! [`mt_train::Trainer`] whose observer is the terminal, the `--metrics` log and the `--trace`
//! ([`crate::report::CliObserver`]).

use std::path::Path;

use anyhow::{bail, Result};
use mt_train::{TrainSummary, Trainer};

use crate::cli::TrainArgs;
use crate::report::CliObserver;

/// Runs `megatrain train`: progress and log lines go to the terminal, the summary is returned.
pub fn train(args: &TrainArgs) -> Result<TrainSummary> {
    let trace_step = check_trace(args)?;
    let observer = CliObserver::new(args, trace_step);
    Ok(Trainer::new(args.to_config(), observer)?.run()?)
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

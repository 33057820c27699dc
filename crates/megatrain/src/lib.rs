//! The `megatrain` command line, a thin layer over [`mt_train`]: option parsing ([`cli`]), the
//! observer that shows a run and writes its metrics and trace ([`report`], [`metrics`],
//! [`trace`]), `train` ([`train()`]), `estimate` ([`estimate`]), `init`, `verify`
//! ([`verify`]) and `launch-info` (the launcher's environment, [`mt_dist::Launch`]). `src/main.rs` only
//! parses, sets up logging and calls [`run`].
//!
//! Architecture Invariant: this is the only crate that prints to the terminal, and the only one
//! that uses `anyhow`; everything below it returns typed errors and logs through `tracing`.
#![forbid(unsafe_code)]
#![recursion_limit = "256"]

pub mod cli;
pub mod estimate;
pub mod metrics;
pub mod report;
pub mod trace;
pub mod train;
pub mod verify;

pub use cli::{Cli, Command, TrainArgs};
pub use mt_train::TrainSummary;
pub use train::train;

/// Runs a parsed command line.
#[allow(clippy::print_stdout)] // the CLI crate prints its results
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(args) => print!("{}", train(&args)?),
        Command::Estimate(args) => {
            let e = estimate::estimate(&args)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&e.to_json(&args))?);
            } else {
                println!("{e}");
            }
        }
        Command::Init(args) => {
            let r =
                mt_train::init::init_model_dir(&args.config, &args.out, args.seed, args.export_dtype.into())?;
            println!(
                "wrote {} ({} shard(s), {})",
                args.out.display(),
                r.n_shards,
                mt_core::units::bytes(r.bytes_written as f64)
            );
        }
        Command::Verify(args) => verify::run(&args)?,
        Command::LaunchInfo => {
            let launch = mt_dist::Launch::from_env()?;
            println!("{launch}\nthis host: {}", mt_dist::host_name());
        }
    }
    Ok(())
}

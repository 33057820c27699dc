//! The `megatrain` command line as a library: option parsing ([`cli`]), training data
//! ([`data`]), seeded initialisation ([`init`]), the learning-rate schedule ([`schedule`]), the
//! training loop ([`train`]), the JSON Lines metrics log ([`metrics`]), the Chrome trace of one
//! step ([`trace`]) and what the user sees ([`report`]). `src/main.rs` only parses, sets up
//! logging and calls [`run`].
//!
//! Architecture Invariant: this is the only crate that prints to the terminal, and the only one
//! that uses `anyhow`; everything below it returns typed errors and logs through `tracing`.
#![forbid(unsafe_code)]
#![recursion_limit = "256"]

pub mod checkpoint;
mod checks;
pub mod cli;
pub mod data;
pub mod estimate;
pub mod init;
pub mod metrics;
mod oom;
pub mod report;
pub mod schedule;
pub mod trace;
pub mod train;

pub use cli::{Cli, Command, TrainArgs};
pub use report::TrainSummary;
pub use train::train;

/// Runs a parsed command line.
#[allow(clippy::print_stdout)] // the CLI crate prints its results
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(args) => train(&args)?.print(),
        Command::Estimate(args) => {
            let e = estimate::estimate(&args)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&e.to_json(&args))?);
            } else {
                println!("{e}");
            }
        }
        Command::Init(args) => {
            let r = init::init_command(&args)?;
            println!(
                "wrote {} ({} shard(s), {:.2} GB)",
                args.out.display(),
                r.n_shards,
                r.bytes_written as f64 / 1e9
            );
        }
    }
    Ok(())
}

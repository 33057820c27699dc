//! A megatrain rank's place in a job of several processes, on one host or many: the launcher's
//! environment ([`Launch`]: torchrun's or Slurm's variables), the TCP rendezvous that ships
//! rank 0's blob (NCCL's unique id) to every rank ([`rendezvous()`]), and the watchdog on the
//! same connections that names a rank that dies or hangs ([`Watchdog`]).
//!
//! Architecture Invariant: this crate knows nothing about CUDA, NCCL or the engine. It moves
//! an opaque blob and control messages only; gradients never cross its connections.
#![forbid(unsafe_code)]

mod error;
pub mod launch;
mod rendezvous;
pub mod watchdog;
mod wire;

pub use error::DistError;
pub use launch::{Launch, LaunchError, Launcher, Master, DEFAULT_PORT};
pub use rendezvous::{host_name, join, rendezvous, serve, JobSpec, Joined, DEFAULT_RENDEZVOUS_TIMEOUT};
pub use watchdog::{Cause, Failure, WatchOptions, Watchdog};

//! The crate's error type: each variant a sentence naming the rank, the host or address, and
//! what to do.

use std::io;

use crate::launch::LaunchError;
use crate::watchdog::Failure;

/// What went wrong joining or running a job of several processes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// The launcher's environment does not describe a place in a job.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// Rank 0 could not listen.
    #[error("rank 0 could not listen on {addr}: {source} (is another job using the port? set MASTER_PORT to a free one)")]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        source: io::Error,
    },
    /// A rank could not reach rank 0 before its timeout.
    #[error(
        "rank {rank} could not reach rank 0 at {addr} within {waited_s:.1} s (last: {last}): is rank 0 running, and \
         are MASTER_ADDR and MASTER_PORT the same for every rank?"
    )]
    Unreachable {
        /// The rank that tried.
        rank: usize,
        /// Rank 0's address.
        addr: String,
        /// How long it tried, in seconds.
        waited_s: f64,
        /// The last attempt's error.
        last: String,
    },
    /// Rank 0's timeout passed before every rank joined.
    #[error(
        "rank 0 waited {waited_s:.1} s at {addr} for rank(s) {missing} of a job of {world_size} (joined: {joined}): \
         start every rank, with the same world size and MASTER_ADDR/MASTER_PORT"
    )]
    Incomplete {
        /// Where rank 0 listened.
        addr: String,
        /// How long it waited, in seconds.
        waited_s: f64,
        /// The ranks that never joined.
        missing: String,
        /// The ranks that did.
        joined: String,
        /// Ranks in the job.
        world_size: usize,
    },
    /// A rank's hello disagrees with rank 0's job.
    #[error("rank {rank} (host {host}) {theirs}, but rank 0 {ours}: every rank must run the same build with the same configuration")]
    Mismatch {
        /// The rank that disagrees.
        rank: usize,
        /// Its host.
        host: String,
        /// What it says, as a phrase (`runs job "..."`).
        theirs: String,
        /// What rank 0 says.
        ours: String,
    },
    /// Two processes claimed one rank.
    #[error("two processes claim rank {rank} (hosts {first} and {second}): each process needs its own rank")]
    DuplicateRank {
        /// The rank.
        rank: usize,
        /// The first claimant's host.
        first: String,
        /// The second's.
        second: String,
    },
    /// Rank 0 refused this rank's job (its reason, as rank 0 said it).
    #[error("rank 0 at {addr} refused the job: {reason}")]
    Refused {
        /// Rank 0's address.
        addr: String,
        /// Rank 0's sentence.
        reason: String,
    },
    /// A connection failed during the rendezvous.
    #[error("{during}: {problem}")]
    Connection {
        /// What was going on, naming the peer.
        during: String,
        /// What happened.
        problem: String,
    },
    /// Another rank died or stopped responding: this rank must stop.
    #[error("{0}; stopping this rank")]
    RankFailed(Failure),
}

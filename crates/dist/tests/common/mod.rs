//! A job of several ranks as threads of one test, on 127.0.0.1 and a port the kernel picks (no
//! fixed port: tests run in parallel).

#![allow(dead_code, unreachable_pub)] // each test file uses its part

use std::net::TcpListener;
use std::time::Duration;

use mt_dist::{join, serve, DistError, JobSpec, Joined, WatchOptions};

/// Rank `rank`'s spec in a job of `world_size`, on host `host{rank}`.
pub fn spec(rank: usize, world_size: usize) -> JobSpec {
    JobSpec {
        rank,
        world_size,
        fingerprint: "megatrain test job".into(),
        host: format!("host{rank}"),
        timeout: Duration::from_secs(10),
        watch: WatchOptions { interval: Duration::from_millis(50), timeout: Duration::from_secs(10) },
    }
}

/// Rank 0's blob: 128 bytes, as NCCL's unique id is.
pub fn blob() -> Vec<u8> {
    (0..128u32).map(|i| (i * 37 + 11) as u8).collect()
}

/// Runs the rendezvous of `specs` (rank 0's first) on threads; each rank's outcome, by rank.
pub fn job(specs: Vec<JobSpec>) -> Vec<Result<Joined, DistError>> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut specs = specs.into_iter();
    let spec0 = specs.next().unwrap();
    let rank0 = std::thread::spawn(move || serve(listener, &spec0, blob()));
    let others: Vec<_> = specs
        .map(|s| {
            let addr = addr.clone();
            std::thread::spawn(move || join(&addr, &s))
        })
        .collect();
    let mut out = vec![rank0.join().unwrap()];
    out.extend(others.into_iter().map(|t| t.join().unwrap()));
    out
}

/// A job of `world_size` ranks with the same `watch` options, every rank joined.
pub fn joined(world_size: usize, watch: WatchOptions) -> Vec<Joined> {
    let specs = (0..world_size).map(|r| JobSpec { watch, ..spec(r, world_size) }).collect();
    job(specs).into_iter().map(|j| j.unwrap()).collect()
}

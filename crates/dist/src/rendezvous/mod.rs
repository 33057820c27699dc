//! The rendezvous: rank 0 listens, every other rank connects (retrying until its timeout) and
//! says hello (protocol version, rank, world size, the job's fingerprint, its host); once every
//! rank has joined and agrees, rank 0 sends each the blob (NCCL's unique id, to the engine) and
//! every rank's host, and each rank's [`Watchdog`] starts on the same connection. Only the blob
//! and control messages cross it: the collectives are NCCL's.

use std::io;
use std::net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::launch::Launch;
use crate::watchdog::{WatchOptions, Watchdog};
use crate::wire::{read_msg, write_msg, Hello, Msg, ReadError, VERSION};
use crate::DistError;

#[cfg(test)]
pub(crate) mod tests;

/// How long a rank waits for the others by default: long enough for a cluster's ranks to start
/// one after another (a container pulled, a library loaded), short enough that a rank that never
/// comes is reported the same hour.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// How long rank 0 waits for a hello on an accepted connection: a real rank writes it at once;
/// a stranger that connects and says nothing is dropped after this, and the wait goes on.
const HELLO_WAIT: Duration = Duration::from_secs(10);

/// Longest pause between a rank's attempts to reach rank 0.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// What a rank says about itself and the job it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSpec {
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// What every rank must agree on, readable (a hash of the configuration and the build's
    /// version, say): a rank whose fingerprint differs from rank 0's is refused, both named.
    pub fingerprint: String,
    /// This rank's host, as the others will name it.
    pub host: String,
    /// How long to wait for the other ranks.
    pub timeout: Duration,
    /// The watchdog's heartbeat and timeout.
    pub watch: WatchOptions,
}

impl JobSpec {
    /// The spec of `launch`'s rank, on this host, with the default timeouts.
    pub fn new(launch: &Launch, fingerprint: impl Into<String>) -> Self {
        JobSpec {
            rank: launch.rank,
            world_size: launch.world_size,
            fingerprint: fingerprint.into(),
            host: host_name(),
            timeout: DEFAULT_RENDEZVOUS_TIMEOUT,
            watch: WatchOptions::default(),
        }
    }
}

/// A joined rank: rank 0's blob, every rank's host by rank, and the running watchdog.
#[derive(Debug)]
pub struct Joined {
    /// The bytes rank 0 passed (NCCL's unique id, to the engine).
    pub blob: Vec<u8>,
    /// Every rank's host, by rank.
    pub hosts: Vec<String>,
    /// The watchdog on the rendezvous's connections.
    pub watchdog: Watchdog,
}

/// This host's name, as the kernel has it (`HOSTNAME` elsewhere): how the other ranks name it.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "unnamed host".into())
}

/// Joins `launch`'s job: rank 0 listens on every interface at the master's port and passes
/// `blob()` (called on rank 0 only); the others connect to the master. A process alone joins
/// at once, with its own blob.
pub fn rendezvous(
    launch: &Launch,
    spec: &JobSpec,
    blob: impl FnOnce() -> Vec<u8>,
) -> Result<Joined, DistError> {
    let Some(master) = launch.master.as_ref().filter(|_| launch.is_distributed()) else {
        return Ok(Joined { blob: blob(), hosts: vec![spec.host.clone()], watchdog: Watchdog::alone() });
    };
    if launch.rank == 0 {
        // Every interface: the master's name may resolve to a loopback address on its own host
        // (a hosts file's `127.0.1.1 name`), which the other hosts cannot reach.
        let any: SocketAddr = match master.host.trim_matches(['[', ']']).parse::<Ipv6Addr>() {
            Ok(_) => (Ipv6Addr::UNSPECIFIED, master.port).into(),
            Err(_) => ([0, 0, 0, 0], master.port).into(),
        };
        let listener =
            TcpListener::bind(any).map_err(|source| DistError::Listen { addr: any.to_string(), source })?;
        serve(listener, spec, blob())
    } else {
        join(&master.addr(), spec)
    }
}

/// Rank 0's side: accepts every other rank on `listener`, checks its hello against `spec`,
/// then sends each `blob` and the hosts.
pub fn serve(listener: TcpListener, spec: &JobSpec, blob: Vec<u8>) -> Result<Joined, DistError> {
    let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| "its port".into());
    let start = Instant::now();
    let deadline = start + spec.timeout;
    let mut peers: Vec<Option<(TcpStream, String)>> = (0..spec.world_size).map(|_| None).collect();
    let mut joined = 1;
    listener.set_nonblocking(true).map_err(|e| conn_error(format!("rank 0 setting up {addr}"), e))?;
    while joined < spec.world_size {
        let (stream, from) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(incomplete(&peers, &addr, start));
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(conn_error(format!("rank 0 accepting on {addr}"), e)),
        };
        match hello_of(&stream, deadline) {
            Ok(hello) => {
                if let Err(refusal) = check_hello(&hello, spec, &peers) {
                    refuse(&mut peers, stream, &refusal);
                    return Err(refusal);
                }
                let rank = hello.rank as usize;
                tracing::info!(rank, host = hello.host, %from, "joined");
                peers[rank] = Some((stream, hello.host));
                joined += 1;
            }
            Err(ReadError::Version { rank, version }) => {
                let refusal = DistError::Mismatch {
                    rank: rank as usize,
                    host: from.ip().to_string(),
                    theirs: format!("speaks rendezvous protocol {version}"),
                    ours: format!("speaks {VERSION}"),
                };
                refuse(&mut peers, stream, &refusal);
                return Err(refusal);
            }
            // Not a rank (a port scanner, a health check) or one that vanished: drop it; a rank
            // that lost its connection fails on its side.
            Err(e) => tracing::warn!(%from, "dropped a connection to {addr}: {e}"),
        }
    }
    let mut hosts = vec![spec.host.clone()];
    let mut links = Vec::new();
    for (rank, peer) in peers.into_iter().enumerate().skip(1) {
        let (stream, host) = peer.expect("every rank joined");
        hosts.push(host.clone());
        links.push((rank, host, stream));
    }
    let welcome = Msg::Welcome { blob: blob.clone(), hosts: hosts.clone() };
    for (rank, host, stream) in &mut links {
        write_msg(stream, &welcome)
            .map_err(|e| conn_error(format!("rank 0 welcoming rank {rank} (host {host})"), e))?;
    }
    Ok(Joined { blob, hosts, watchdog: Watchdog::start(0, spec.watch, links) })
}

/// Another rank's side: connects to rank 0 at `addr` (retrying with backoff until the spec's
/// timeout), says hello and waits for the blob.
pub fn join(addr: &str, spec: &JobSpec) -> Result<Joined, DistError> {
    let start = Instant::now();
    let deadline = start + spec.timeout;
    let mut stream = connect(addr, spec.rank, start, deadline)?;
    let during = |what: &str| format!("rank {} {what} rank 0 at {addr}", spec.rank);
    let _ = stream.set_nodelay(true);
    let hello = Hello {
        rank: spec.rank as u32,
        world_size: spec.world_size as u32,
        fingerprint: spec.fingerprint.clone(),
        host: spec.host.clone(),
    };
    write_msg(&mut stream, &Msg::Hello(hello)).map_err(|e| conn_error(during("saying hello to"), e))?;
    // Rank 0 answers once every rank has joined, within its own timeout.
    stream.set_read_timeout(Some(spec.timeout)).map_err(|e| conn_error(during("waiting for"), e))?;
    match read_msg(&mut stream) {
        Ok(Msg::Welcome { blob, hosts }) if hosts.len() == spec.world_size => Ok(Joined {
            blob,
            hosts: hosts.clone(),
            watchdog: Watchdog::start(spec.rank, spec.watch, vec![(0, hosts[0].clone(), stream)]),
        }),
        Ok(Msg::Welcome { hosts, .. }) => Err(DistError::Mismatch {
            rank: spec.rank,
            host: spec.host.clone(),
            theirs: format!("expects {} ranks", spec.world_size),
            ours: format!("welcomed {}", hosts.len()),
        }),
        Ok(Msg::Refused { reason }) => Err(DistError::Refused { addr: addr.to_owned(), reason }),
        Ok(other) => Err(DistError::Connection {
            during: during("waiting for the job's start from"),
            problem: format!("rank 0 sent {other:?}"),
        }),
        Err(e) if e.is_timeout() => Err(DistError::Connection {
            during: during("waiting for the job's start from"),
            problem: format!("no answer in {} s", spec.timeout.as_secs()),
        }),
        Err(e) => Err(DistError::Connection {
            during: during("waiting for the job's start from"),
            problem: format!("{e} (rank 0 gave up or refused another rank: see its log)"),
        }),
    }
}

/// Connects to `addr`, resolving it afresh at each attempt (a host's name may appear in DNS
/// after its rank starts), pausing 50 ms, then twice as long each time up to 2 s.
fn connect(addr: &str, rank: usize, start: Instant, deadline: Instant) -> Result<TcpStream, DistError> {
    let mut pause = Duration::from_millis(50);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let last = match addr.to_socket_addrs() {
            Ok(resolved) => {
                let mut last = format!("{addr} resolves to no address");
                for a in resolved {
                    match TcpStream::connect_timeout(&a, left.clamp(Duration::from_millis(1), MAX_BACKOFF)) {
                        Ok(s) => return Ok(s),
                        Err(e) => last = e.to_string(),
                    }
                }
                last
            }
            Err(e) => e.to_string(),
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(DistError::Unreachable {
                rank,
                addr: addr.to_owned(),
                waited_s: (now - start).as_secs_f64(),
                last,
            });
        }
        tracing::debug!(rank, addr, "rank 0 not reached yet: {last}");
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(MAX_BACKOFF);
    }
}

fn hello_of(stream: &TcpStream, deadline: Instant) -> Result<Hello, ReadError> {
    stream.set_nonblocking(false)?;
    let left = deadline.saturating_duration_since(Instant::now());
    stream.set_read_timeout(Some(left.clamp(Duration::from_millis(100), HELLO_WAIT)))?;
    let _ = stream.set_nodelay(true);
    match read_msg(&mut &*stream)? {
        Msg::Hello(h) => Ok(h),
        other => Err(ReadError::Garbled(format!("{other:?} where a hello was due"))),
    }
}

fn check_hello(h: &Hello, spec: &JobSpec, peers: &[Option<(TcpStream, String)>]) -> Result<(), DistError> {
    let (rank, host) = (h.rank as usize, h.host.clone());
    if h.world_size as usize != spec.world_size {
        return Err(DistError::Mismatch {
            rank,
            host,
            theirs: format!("says the job has {} ranks", h.world_size),
            ours: format!("says {}", spec.world_size),
        });
    }
    if rank == 0 || rank >= spec.world_size {
        let first = if rank == 0 { spec.host.clone() } else { "none".into() };
        return match rank {
            0 => Err(DistError::DuplicateRank { rank, first, second: host }),
            _ => Err(DistError::Mismatch {
                rank,
                host,
                theirs: "has a rank outside the job".into(),
                ours: format!("says the job has ranks 0 to {}", spec.world_size - 1),
            }),
        };
    }
    if h.fingerprint != spec.fingerprint {
        return Err(DistError::Mismatch {
            rank,
            host,
            theirs: format!("runs job {:?}", h.fingerprint),
            ours: format!("runs {:?}", spec.fingerprint),
        });
    }
    if let Some((_, first)) = &peers[rank] {
        return Err(DistError::DuplicateRank { rank, first: first.clone(), second: host });
    }
    Ok(())
}

/// Tells every rank that joined, and the one refused, why the job is refused.
fn refuse(peers: &mut [Option<(TcpStream, String)>], mut offender: TcpStream, why: &DistError) {
    let msg = Msg::Refused { reason: why.to_string() };
    tracing::error!("{why}");
    let _ = write_msg(&mut offender, &msg);
    for (stream, _) in peers.iter_mut().flatten() {
        let _ = write_msg(stream, &msg);
    }
}

fn incomplete(peers: &[Option<(TcpStream, String)>], addr: &str, start: Instant) -> DistError {
    let list = |want: bool| {
        let ranks: Vec<String> = (0..peers.len())
            .filter(|&r| (r == 0 || peers[r].is_some()) == want)
            .map(|r| r.to_string())
            .collect();
        ranks.join(", ")
    };
    DistError::Incomplete {
        addr: addr.to_owned(),
        waited_s: start.elapsed().as_secs_f64(),
        missing: list(false),
        joined: list(true),
        world_size: peers.len(),
    }
}

fn conn_error(during: String, e: io::Error) -> DistError {
    DistError::Connection { during, problem: e.to_string() }
}

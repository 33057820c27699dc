//! The watchdog on the rendezvous's connections: every rank heartbeats rank 0 and rank 0 every
//! rank; a connection that drops, or a peer silent for the timeout, is a dead rank. Rank 0
//! tells every live rank which rank died; a rank sees rank 0's death itself. The first failure a
//! rank learns of is its [`Failure`]: polled ([`Watchdog::failure`], [`Watchdog::check`]),
//! waited for, or handed to a callback ([`Watchdog::on_failure`]) on the watchdog's thread.
//! A rank that finishes says goodbye ([`Watchdog::goodbye`]) and is not reported.
//!
//! Architecture Invariant: the watchdog never blocks the training loop. It runs on its own
//! threads; the loop polls a flag or is called back. A rank blocked in a collective never polls:
//! its callback must abort the collective or end the process.

use std::fmt;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::wire::{read_msg, write_msg, Msg};
use crate::DistError;

#[cfg(test)]
mod tests;

/// How often a rank says it is alive, and how long a silence means it is dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchOptions {
    /// Between heartbeats.
    pub interval: Duration,
    /// A peer silent this long is dead. A process that exits is seen at once (its connection
    /// closes); a host that hangs or drops off the network, after this.
    pub timeout: Duration,
}

impl Default for WatchOptions {
    /// 5 s heartbeats, 30 s timeout: a silent rank is declared within 30 s and relayed at once,
    /// so every rank learns of any failure within the 60 s the job promises.
    fn default() -> Self {
        WatchOptions { interval: Duration::from_secs(5), timeout: Duration::from_secs(30) }
    }
}

/// How a rank failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// Its connection closed or broke without a goodbye: the process exited or was killed.
    Exited,
    /// No heartbeat for this long: the process hangs, or its host is gone.
    Silent {
        /// The silence, in milliseconds.
        after_ms: u64,
    },
}

/// A rank that died or stopped responding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The rank.
    pub rank: usize,
    /// Its host, as it said in its hello.
    pub host: String,
    /// How it failed.
    pub cause: Cause,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} (host {}) ", self.rank, self.host)?;
        match self.cause {
            Cause::Exited => f.write_str("exited or lost its connection without finishing"),
            Cause::Silent { after_ms } => {
                write!(f, "stopped responding: no heartbeat for {:.1} s", after_ms as f64 / 1000.0)
            }
        }
    }
}

/// One connection the watchdog watches: to rank 0, or (on rank 0) to another rank.
struct Link {
    rank: usize,
    host: String,
    writer: Mutex<TcpStream>,
    /// Said goodbye, or declared dead: no longer watched or written to.
    done: AtomicBool,
}

type Callback = Box<dyn FnOnce(&Failure) + Send>;

struct Shared {
    rank: usize,
    opts: WatchOptions,
    links: Vec<Link>,
    failure: Mutex<Option<Failure>>,
    failed: Condvar,
    callback: Mutex<Option<Callback>>,
    /// This rank is saying goodbye or dropping its watchdog: what its connections do from here
    /// on is its own doing, not a failure.
    closing: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking callback must not take the watchdog down with it: the data is still whole.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Records `f` if it is the first failure, wakes the waiters and runs the callback; true
    /// if it was the first.
    fn declare(&self, f: Failure) -> bool {
        {
            let mut failure = lock(&self.failure);
            if failure.is_some() {
                tracing::debug!(rank = self.rank, "after the first failure: {f}");
                return false;
            }
            tracing::error!(rank = self.rank, "{f}");
            *failure = Some(f.clone());
            self.failed.notify_all();
        }
        if let Some(cb) = lock(&self.callback).take() {
            cb(&f);
        }
        true
    }

    fn send(&self, link: &Link, msg: &Msg) {
        if let Err(e) = write_msg(&mut *lock(&link.writer), msg) {
            // The reader of the same connection sees the failure and reports it.
            tracing::debug!(rank = self.rank, peer = link.rank, "writing {msg:?}: {e}");
        }
    }
}

/// A rank's watchdog, running from the rendezvous's end until [`Watchdog::goodbye`] or drop.
/// Dropping it without a goodbye closes its connections: the other ranks report this rank.
pub struct Watchdog {
    shared: Arc<Shared>,
    stop: Option<mpsc::Sender<()>>,
    threads: Vec<JoinHandle<()>>,
}

impl fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watchdog")
            .field("rank", &self.shared.rank)
            .field("peers", &self.shared.links.iter().map(|l| l.rank).collect::<Vec<_>>())
            .field("failure", &self.failure())
            .finish()
    }
}

impl Watchdog {
    /// The watchdog of a process alone: nothing to watch, never fails.
    pub(crate) fn alone() -> Self {
        Self::start(0, WatchOptions::default(), Vec::new())
    }

    /// Starts watching `peers` (rank, host, connection): rank 0 passes every other rank's, the
    /// others rank 0's alone.
    pub(crate) fn start(rank: usize, opts: WatchOptions, peers: Vec<(usize, String, TcpStream)>) -> Self {
        let mut readers = Vec::new();
        let mut links = Vec::new();
        for (peer, host, stream) in peers {
            // Failing to set a timeout leaves the kernel's defaults: only a hang goes unseen.
            let _ = stream.set_read_timeout(Some(opts.timeout));
            let _ = stream.set_write_timeout(Some(opts.timeout));
            match stream.try_clone() {
                Ok(reader) => readers.push(Some(reader)),
                Err(e) => {
                    tracing::warn!(rank, peer, "cannot watch the connection: {e}");
                    readers.push(None);
                }
            }
            links.push(Link { rank: peer, host, writer: Mutex::new(stream), done: AtomicBool::new(false) });
        }
        let shared = Arc::new(Shared {
            rank,
            opts,
            links,
            failure: Mutex::new(None),
            failed: Condvar::new(),
            callback: Mutex::new(None),
            closing: AtomicBool::new(false),
        });
        let mut threads = Vec::new();
        for (i, reader) in readers.into_iter().enumerate() {
            let Some(reader) = reader else {
                // A connection that cannot be read is as good as lost.
                let link = &shared.links[i];
                link.done.store(true, Ordering::SeqCst);
                shared.declare(Failure { rank: link.rank, host: link.host.clone(), cause: Cause::Exited });
                continue;
            };
            let shared = Arc::clone(&shared);
            threads.push(spawn(format!("mt-dist-watch-{}", shared.links[i].rank), move || {
                watch(&shared, i, reader)
            }));
        }
        let (stop, stopped) = mpsc::channel::<()>();
        if !shared.links.is_empty() {
            let shared = Arc::clone(&shared);
            threads.push(spawn("mt-dist-heartbeat".into(), move || heartbeat(&shared, &stopped)));
        }
        Watchdog { shared, stop: Some(stop), threads }
    }

    /// This rank's rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The first failure this rank has learnt of, if any (cheap: poll it each step).
    pub fn failure(&self) -> Option<Failure> {
        lock(&self.shared.failure).clone()
    }

    /// `Err` naming the failed rank once one has failed.
    pub fn check(&self) -> Result<(), DistError> {
        match self.failure() {
            Some(f) => Err(DistError::RankFailed(f)),
            None => Ok(()),
        }
    }

    /// Waits up to `timeout` for a failure.
    pub fn wait_for_failure(&self, timeout: Duration) -> Option<Failure> {
        let failure = lock(&self.shared.failure);
        let (failure, _) = self
            .shared
            .failed
            .wait_timeout_while(failure, timeout, |f| f.is_none())
            .unwrap_or_else(PoisonError::into_inner);
        failure.clone()
    }

    /// Runs `callback` once, on a watchdog thread, with the first failure: at once if there is
    /// one already. It replaces an earlier callback not yet run. Where the training loop may be
    /// blocked (in a collective), this is how it is stopped: the callback aborts the collective
    /// or ends the process. It must not call back into this watchdog.
    pub fn on_failure(&self, callback: impl FnOnce(&Failure) + Send + 'static) {
        let mut slot = lock(&self.shared.callback);
        match self.failure() {
            Some(f) => callback(&f),
            None => *slot = Some(Box::new(callback)),
        }
    }

    /// This rank finished normally: tells its peers, so they do not report it, and stops.
    pub fn goodbye(self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        for link in &self.shared.links {
            if !link.done.load(Ordering::SeqCst) {
                self.shared.send(link, &Msg::Goodbye);
            }
        }
        // Drop closes the connections: the goodbye is read before the close.
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        for link in &self.shared.links {
            // Wakes this rank's reader and shows the peer the connection closing.
            let _ = lock(&link.writer).shutdown(Shutdown::Both);
        }
        self.stop.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> JoinHandle<()> {
    std::thread::Builder::new().name(name).spawn(f).expect("spawning a watchdog thread")
}

/// Heartbeats every live link each interval until the watchdog stops.
fn heartbeat(shared: &Shared, stopped: &mpsc::Receiver<()>) {
    loop {
        match stopped.recv_timeout(shared.opts.interval) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        for link in &shared.links {
            if !link.done.load(Ordering::SeqCst) && !shared.closing.load(Ordering::SeqCst) {
                shared.send(link, &Msg::Heartbeat);
            }
        }
    }
}

/// Reads link `i` until its peer says goodbye, fails, or this rank stops. On rank 0 a failed
/// peer is relayed to every other live rank.
fn watch(shared: &Shared, i: usize, mut stream: TcpStream) {
    let link = &shared.links[i];
    let cause = loop {
        match read_msg(&mut stream) {
            Ok(Msg::Heartbeat) => {}
            Ok(Msg::Goodbye) => {
                link.done.store(true, Ordering::SeqCst);
                return;
            }
            Ok(Msg::Dead(f)) if shared.rank != 0 => {
                shared.declare(f);
            }
            Ok(other) => {
                tracing::warn!(
                    rank = shared.rank,
                    peer = link.rank,
                    "unexpected {other:?}: taking the link as lost"
                );
                break Cause::Exited;
            }
            Err(e) if e.is_timeout() => {
                break Cause::Silent { after_ms: shared.opts.timeout.as_millis() as u64 };
            }
            Err(e) => {
                tracing::debug!(rank = shared.rank, peer = link.rank, "reading: {e}");
                break Cause::Exited;
            }
        }
    };
    if shared.closing.load(Ordering::SeqCst) || link.done.swap(true, Ordering::SeqCst) {
        return;
    }
    let failure = Failure { rank: link.rank, host: link.host.clone(), cause };
    if shared.declare(failure.clone()) && shared.rank == 0 {
        let dead = Msg::Dead(failure);
        for other in &shared.links {
            if !other.done.load(Ordering::SeqCst) {
                shared.send(other, &dead);
            }
        }
    }
    // A silent peer may still be connected: close the link so it sees it has been given up.
    let _ = stream.shutdown(Shutdown::Both);
}

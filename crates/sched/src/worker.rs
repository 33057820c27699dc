//! Worker-thread streams shared by the backends: each stream is one thread that runs its jobs in
//! submission order, each after the events it waits for; [`CpuEvent`] is the completion marker.
//! The CPU backend runs everything but compute on these threads; the CUDA backend runs the host
//! (optimizer) stream on one and uses two more only to *issue* copies onto CUDA streams.
//!
//! An optional random delay before every job shakes the timing so that a missing wait shows up
//! in tests as a wrong result instead of passing by luck.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::{HostJob, Span};
use crate::program::Stream;
use crate::{Error, Result};

pub(crate) type Outcome = std::result::Result<(), String>;

#[derive(Debug, Default)]
struct EventInner {
    state: Mutex<Option<Outcome>>,
    cv: Condvar,
}

/// Completion of an operation: signalled once, waited on by any number of threads.
#[derive(Debug, Clone, Default)]
pub struct CpuEvent(Arc<EventInner>);

impl CpuEvent {
    pub(crate) fn completed() -> Self {
        let e = CpuEvent::default();
        e.signal(Ok(()));
        e
    }

    pub(crate) fn signal(&self, r: Outcome) {
        let mut s = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        *s = Some(r);
        self.0.cv.notify_all();
    }

    pub(crate) fn wait(&self) -> Outcome {
        let mut s = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        while s.is_none() {
            s = self.0.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.clone().unwrap_or(Ok(()))
    }
}

/// Options of the worker streams. Each sleeps a random time in `[max/2, max]` microseconds
/// before every job (0 = never), to shake out missing waits in tests.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuOptions {
    /// Delay bound of the host stream.
    pub host_delay_us: u64,
    /// Delay bound of the H2D stream.
    pub h2d_delay_us: u64,
    /// Delay bound of the D2H stream.
    pub d2h_delay_us: u64,
    /// Seed of the delays.
    pub seed: u64,
}

impl CpuOptions {
    /// The same delay bound on every worker stream.
    pub fn uniform(max_delay_us: u64, seed: u64) -> Self {
        CpuOptions {
            host_delay_us: max_delay_us,
            h2d_delay_us: max_delay_us,
            d2h_delay_us: max_delay_us,
            seed,
        }
    }

    fn delay_of(&self, s: Stream) -> u64 {
        match s {
            Stream::Host => self.host_delay_us,
            Stream::H2D => self.h2d_delay_us,
            Stream::D2H => self.d2h_delay_us,
            Stream::Compute => 0,
        }
    }
}

/// Step clock, byte counters, spans and the first error of any stream.
#[derive(Debug)]
pub(crate) struct Clock {
    pub(crate) h2d_bytes: AtomicU64,
    pub(crate) d2h_bytes: AtomicU64,
    start: Mutex<Instant>,
    spans: Mutex<Vec<Span>>,
    first_error: Mutex<Option<String>>,
}

impl Clock {
    fn new() -> Self {
        Clock {
            h2d_bytes: AtomicU64::new(0),
            d2h_bytes: AtomicU64::new(0),
            start: Mutex::new(Instant::now()),
            spans: Mutex::new(Vec::new()),
            first_error: Mutex::new(None),
        }
    }

    /// Seconds since the step began.
    pub(crate) fn now(&self) -> f64 {
        self.start.lock().unwrap_or_else(|p| p.into_inner()).elapsed().as_secs_f64()
    }

    /// Records a span that started at `start_s` and ends now.
    pub(crate) fn record(&self, stream: Stream, name: String, start_s: f64) {
        let end_s = self.now();
        self.push(Span { stream, name, start_s, end_s });
    }

    pub(crate) fn push(&self, span: Span) {
        self.spans.lock().unwrap_or_else(|p| p.into_inner()).push(span);
    }

    pub(crate) fn fail(&self, msg: &str) {
        let mut e = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_none() {
            *e = Some(msg.to_owned());
        }
    }

    pub(crate) fn take_error(&self) -> Option<String> {
        self.first_error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Restarts the clock and clears spans and byte counters.
    pub(crate) fn begin_step(&self) {
        self.h2d_bytes.store(0, Ordering::Relaxed);
        self.d2h_bytes.store(0, Ordering::Relaxed);
        *self.start.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.spans.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    pub(crate) fn transferred(&self) -> (u64, u64) {
        (self.h2d_bytes.load(Ordering::Relaxed), self.d2h_bytes.load(Ordering::Relaxed))
    }

    pub(crate) fn spans(&self) -> Vec<Span> {
        let mut v = self.spans.lock().unwrap_or_else(|p| p.into_inner()).clone();
        v.retain(|s| s.name != "sync");
        v
    }
}

struct Job {
    waits: Vec<CpuEvent>,
    run: HostJob,
    done: CpuEvent,
    name: String,
}

struct Worker {
    tx: Option<Sender<Job>>,
    handle: Option<JoinHandle<()>>,
}

/// Short lowercase name of a stream (thread names, messages, traces).
pub(crate) fn stream_name(s: Stream) -> &'static str {
    match s {
        Stream::Host => "host",
        Stream::H2D => "h2d",
        Stream::Compute => "compute",
        Stream::D2H => "d2h",
    }
}

/// One worker thread per non-compute stream.
pub(crate) struct Workers {
    workers: Vec<(Stream, Worker)>,
    pub(crate) clock: Arc<Clock>,
}

impl Workers {
    /// Starts the host, H2D and D2H threads. Jobs of streams in `timed` get a wall-clock span.
    pub(crate) fn start(opts: CpuOptions, timed: &[Stream]) -> Self {
        let clock = Arc::new(Clock::new());
        let workers = [Stream::Host, Stream::H2D, Stream::D2H]
            .into_iter()
            .enumerate()
            .map(|(i, stream)| {
                let (tx, rx) = channel::<Job>();
                let clock = Arc::clone(&clock);
                let mut rng = StdRng::seed_from_u64(opts.seed.wrapping_add(i as u64 * 0x9e37_79b9));
                let max_delay_us = opts.delay_of(stream);
                let timed = timed.contains(&stream);
                let handle = std::thread::Builder::new()
                    .name(format!("mt-{}", stream_name(stream)))
                    .spawn(move || {
                        for job in rx {
                            let dep = job.waits.iter().map(CpuEvent::wait).find_map(|r| r.err());
                            let outcome = match dep {
                                Some(e) => Err(format!("skipped {} (a dependency failed: {e})", job.name)),
                                None => {
                                    if max_delay_us > 0 {
                                        let us = rng.random_range(max_delay_us / 2..=max_delay_us);
                                        std::thread::sleep(Duration::from_micros(us));
                                    }
                                    let t0 = clock.now();
                                    let r = (job.run)().map_err(|e| format!("{}: {e}", job.name));
                                    if timed {
                                        clock.record(stream, job.name, t0);
                                    }
                                    r
                                }
                            };
                            if let Err(e) = &outcome {
                                clock.fail(&format!("{} stream: {e}", stream_name(stream)));
                            }
                            job.done.signal(outcome);
                        }
                    })
                    .expect("spawning a stream worker thread");
                (stream, Worker { tx: Some(tx), handle: Some(handle) })
            })
            .collect();
        Workers { workers, clock }
    }

    /// Queues `run` on `stream`'s thread, to start after every event in `waits`.
    pub(crate) fn submit(
        &self,
        stream: Stream,
        waits: Vec<CpuEvent>,
        run: HostJob,
        name: String,
    ) -> CpuEvent {
        let done = CpuEvent::default();
        let job = Job { waits, run, done: done.clone(), name };
        let worker = self.workers.iter().find(|(s, _)| *s == stream).map(|(_, w)| w);
        match worker.and_then(|w| w.tx.as_ref()) {
            Some(tx) => {
                if let Err(e) = tx.send(job) {
                    e.0.done.signal(Err("stream worker has stopped".into()));
                }
            }
            None => done.signal(Err(format!("no worker for stream {stream:?}"))),
        }
        done
    }

    /// Waits until every worker has run everything queued so far; returns the first error any
    /// job hit since the last call.
    pub(crate) fn drain(&self) -> Result<()> {
        let marks: Vec<CpuEvent> = self
            .workers
            .iter()
            .map(|(s, _)| self.submit(*s, Vec::new(), Box::new(|| Ok(())), "sync".into()))
            .collect();
        for m in marks {
            let _ = m.wait();
        }
        match self.clock.take_error() {
            Some(msg) => Err(Error::Stream { stream: "worker", msg }),
            None => Ok(()),
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for (_, w) in &mut self.workers {
            drop(w.tx.take());
            if let Some(h) = w.handle.take() {
                let _ = h.join();
            }
        }
    }
}

//! The CPU backend: the compute stream is the calling thread; the host, H2D and D2H streams are
//! worker threads that run their jobs in order, each after its events. An optional random delay
//! before every worker job shakes the timing so that a missing wait shows up in tests as a wrong
//! gradient instead of passing by luck.
//!
//! The same backend also runs over candle's CUDA device ([`CpuBackend::on_device`], `cuda`
//! feature): every copy and kernel is then enqueued on candle's one CUDA stream, in the order the
//! waits allow, so results are correct but copies do not overlap compute. It exists to check the
//! GPU numerics against the CPU engine; the overlapped backend (dedicated cudarc streams, events,
//! page-locked staging) is separate work.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use mt_store::Staging;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::{Backend, HostJob, Span};
use crate::program::Stream;
use crate::{Error, Result};

type Outcome = std::result::Result<(), String>;

#[derive(Debug, Default)]
struct EventInner {
    state: Mutex<Option<Outcome>>,
    cv: Condvar,
}

/// Completion of an operation: signalled once, waited on by any number of threads.
#[derive(Debug, Clone, Default)]
pub struct CpuEvent(Arc<EventInner>);

impl CpuEvent {
    fn completed() -> Self {
        let e = CpuEvent::default();
        e.signal(Ok(()));
        e
    }

    fn signal(&self, r: Outcome) {
        let mut s = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        *s = Some(r);
        self.0.cv.notify_all();
    }

    fn wait(&self) -> Outcome {
        let mut s = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        while s.is_none() {
            s = self.0.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.clone().unwrap_or(Ok(()))
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

/// Options of the CPU backend. Each worker stream sleeps a random time in `[max/2, max]`
/// microseconds before every job (0 = never), to shake out missing waits in tests.
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

struct Clock {
    h2d_bytes: AtomicU64,
    d2h_bytes: AtomicU64,
    start: Mutex<Instant>,
    spans: Mutex<Vec<Span>>,
    first_error: Mutex<Option<String>>,
}

impl Clock {
    fn now(&self) -> f64 {
        self.start.lock().unwrap_or_else(|p| p.into_inner()).elapsed().as_secs_f64()
    }
    fn record(&self, stream: Stream, name: String, start_s: f64) {
        let end_s = self.now();
        self.spans.lock().unwrap_or_else(|p| p.into_inner()).push(Span { stream, name, start_s, end_s });
    }
    fn fail(&self, msg: &str) {
        let mut e = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_none() {
            *e = Some(msg.to_owned());
        }
    }
}

/// CPU implementation of [`Backend`].
pub struct CpuBackend {
    device: Device,
    workers: Vec<(Stream, Worker)>,
    clock: Arc<Clock>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend").finish_non_exhaustive()
    }
}

fn stream_name(s: Stream) -> &'static str {
    match s {
        Stream::Host => "host",
        Stream::H2D => "h2d",
        Stream::Compute => "compute",
        Stream::D2H => "d2h",
    }
}

impl CpuBackend {
    /// Starts the worker threads; tensors live on the CPU.
    pub fn new(opts: CpuOptions) -> Self {
        Self::on_device(Device::Cpu, opts)
    }

    /// Starts the worker threads; tensors (slots, gradient buffers, checkpoints) live on `device`.
    pub fn on_device(device: Device, opts: CpuOptions) -> Self {
        let clock = Arc::new(Clock {
            h2d_bytes: AtomicU64::new(0),
            d2h_bytes: AtomicU64::new(0),
            start: Mutex::new(Instant::now()),
            spans: Mutex::new(Vec::new()),
            first_error: Mutex::new(None),
        });
        let workers = [Stream::Host, Stream::H2D, Stream::D2H]
            .into_iter()
            .enumerate()
            .map(|(i, stream)| {
                let (tx, rx) = channel::<Job>();
                let clock = Arc::clone(&clock);
                let mut rng = StdRng::seed_from_u64(opts.seed.wrapping_add(i as u64 * 0x9e37_79b9));
                let max_delay_us = opts.delay_of(stream);
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
                                    clock.record(stream, job.name, t0);
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
        CpuBackend { device, workers, clock }
    }

    fn submit(&self, stream: Stream, waits: &[CpuEvent], run: HostJob, name: String) -> CpuEvent {
        let done = CpuEvent::default();
        let job = Job { waits: waits.to_vec(), run, done: done.clone(), name };
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
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        for (_, w) in &mut self.workers {
            drop(w.tx.take());
            if let Some(h) = w.handle.take() {
                let _ = h.join();
            }
        }
    }
}

impl Backend for CpuBackend {
    type Event = CpuEvent;

    fn device(&self) -> &Device {
        &self.device
    }

    fn upload(&self, waits: &[CpuEvent], src: Arc<Mutex<Staging>>, dst: Tensor, name: String) -> CpuEvent {
        let device = self.device.clone();
        let clock = Arc::clone(&self.clock);
        let job: HostJob = Box::new(move || {
            let staging = src.lock().unwrap_or_else(|p| p.into_inner());
            let t = match &*staging {
                Staging::F32(v) => Tensor::from_slice(v, v.len(), &device)?,
                Staging::Bf16(v) => Tensor::from_slice(v, v.len(), &device)?,
                Staging::F16(v) => Tensor::from_slice(v, v.len(), &device)?,
            };
            dst.slice_set(&t, 0, 0)?;
            clock.h2d_bytes.fetch_add((t.elem_count() * t.dtype().size_in_bytes()) as u64, Ordering::Relaxed);
            Ok(())
        });
        self.submit(Stream::H2D, waits, job, name)
    }

    fn download(&self, waits: &[CpuEvent], src: Tensor, dst: Arc<Mutex<Vec<f32>>>, name: String) -> CpuEvent {
        let clock = Arc::clone(&self.clock);
        let job: HostJob = Box::new(move || {
            clock
                .d2h_bytes
                .fetch_add((src.elem_count() * src.dtype().size_in_bytes()) as u64, Ordering::Relaxed);
            let v = src.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
            let mut d = dst.lock().unwrap_or_else(|p| p.into_inner());
            d.clear();
            d.extend_from_slice(&v);
            Ok(())
        });
        self.submit(Stream::D2H, waits, job, name)
    }

    fn host(&self, waits: &[CpuEvent], job: HostJob, name: String) -> CpuEvent {
        self.submit(Stream::Host, waits, job, name)
    }

    fn compute_wait(&self, waits: &[CpuEvent]) -> Result<()> {
        for w in waits {
            w.wait().map_err(|msg| Error::Stream { stream: "compute (waiting)", msg })?;
        }
        Ok(())
    }

    fn compute_record(&self, name: String, start_s: f64) -> CpuEvent {
        self.clock.record(Stream::Compute, name, start_s);
        CpuEvent::completed()
    }

    fn synchronize(&self) -> Result<()> {
        let marks: Vec<CpuEvent> = self
            .workers
            .iter()
            .map(|(s, _)| self.submit(*s, &[], Box::new(|| Ok(())), "sync".into()))
            .collect();
        for m in marks {
            let _ = m.wait();
        }
        let mut e = self.clock.first_error.lock().unwrap_or_else(|p| p.into_inner());
        match e.take() {
            Some(msg) => Err(Error::Stream { stream: "worker", msg }),
            None => Ok(()),
        }
    }

    fn begin_step(&self) {
        self.clock.h2d_bytes.store(0, Ordering::Relaxed);
        self.clock.d2h_bytes.store(0, Ordering::Relaxed);
        *self.clock.start.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.clock.spans.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    fn now_s(&self) -> f64 {
        self.clock.now()
    }

    fn transferred(&self) -> (u64, u64) {
        (self.clock.h2d_bytes.load(Ordering::Relaxed), self.clock.d2h_bytes.load(Ordering::Relaxed))
    }

    fn spans(&self) -> Vec<Span> {
        let mut v = self.clock.spans.lock().unwrap_or_else(|p| p.into_inner()).clone();
        v.retain(|s| s.name != "sync");
        v
    }
}

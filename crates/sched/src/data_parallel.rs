//! Data parallelism over several engines ("ranks"): in one process over one host store, or (one
//! process per host) this process's ranks over its own store, the job's other ranks in other
//! processes ([`Ranks::start_part`]; each store has its lead rank, [`DataParallel::lead`]). Here:
//! the global batch split over the ranks, the gradient sum between ranks ([`GradReduce`]: NCCL on
//! GPUs, [`LocalReduce`] as the in-memory stand-in the CPU tests use), and [`Ranks`], which runs
//! one engine per rank on a thread of its own and steps them together.
//!
//! What a rank does differently: its chunks' loss weights are `1 / (targets of the GLOBAL
//! batch)`; its step program (`ProgramSpec::rank`) sums each gradient buffer over the ranks on the
//! device right after the layer's or the embedding's backward (`Op::AllReduce`, run by
//! [`GradReduce::sum`]) before it is narrowed or downloaded, and only its store's lead (rank 0 in
//! one process) downloads and lands gradients (so only the lead writes gradients into its store,
//! takes Σg² — of the summed gradient, hence the exact global norm — and sets the store's step
//! state). Every rank stages and uploads every streamed layer from its store; a pending exact-mode update is applied by whichever
//! rank stages the unit first (the record lock and its applied-step mark make the others only cast).
//! After their step the ranks sum their loss shares (every rank, in every process, reports the
//! whole batch's loss) and a flag for a norm that is not finite: a step whose loss or norm is not
//! finite is skipped by every rank alike (`engine/commit.rs`), and only the lead writes its store's
//! state.
//!
//! Architecture Invariant: a rank reads no record another rank writes before that write is
//! complete. The lead's Land of a unit waits for its own Stage of the unit (which applied or found
//! applied the pending update, so no rank applies it from the new gradient), and its Download waits
//! for the reduction, which completes only after every rank's backward of the unit, which read
//! that rank's upload of it. Steps are barriers: [`Ranks::step`] returns only after every rank's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier, Mutex};
use std::thread::JoinHandle;

use candle_core::{Device, Tensor};
use mt_core::{Error as CoreError, ModelConfig};

use crate::backend::Backend;
use crate::batch::{chunk_ranges, Batch};
use crate::engine::{Engine, StepReport};
use crate::{Error, Result};

/// The sum of a gradient buffer over all ranks, in place.
pub trait GradReduce {
    /// Replaces `buf` (a whole, contiguous buffer on this rank's device: f32 for gradients, f64
    /// for the step's loss and skip flag) by its sum over all ranks, ordered after everything
    /// issued to the compute stream before it and before everything issued after it. Every rank
    /// calls it for the same buffers in the same order.
    fn sum(&self, buf: &Tensor) -> Result<()>;
}

/// An engine's place among data-parallel ranks.
pub struct DataParallel {
    /// This rank, `0..world`.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// The rank that downloads and lands the summed gradients into this rank's host store and
    /// updates it: the first of the ranks that share the store (`lead..=rank` do). 0 where one
    /// process holds every rank over one store; with one process per host, each host's first
    /// rank, so every host's store takes the same update from the same summed gradients.
    pub lead: usize,
    /// How gradients are summed over the ranks.
    pub reduce: Box<dyn GradReduce>,
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("DataParallel");
        d.field("rank", &self.rank).field("world", &self.world).field("lead", &self.lead).finish()
    }
}

/// The global batch split over `world` ranks: rank `r` gets the `r`-th of `world` near-equal
/// contiguous groups of sequences (`chunk_ranges`), so the split is a pure function of the batch
/// and the rank count. Refuses fewer sequences than ranks.
pub fn split_batch(b: &Batch, world: usize) -> Result<Vec<Batch>> {
    if world == 0 || b.batch < world {
        return Err(CoreError::Data(format!(
            "a batch of {} sequences cannot be split over {world} ranks: use a --batch-size of at least the number of GPUs",
            b.batch
        ))
        .into());
    }
    Ok(chunk_ranges(b.batch, world)
        .into_iter()
        .map(|r| {
            let (lo, hi) = (r.start * b.seq, r.end * b.seq);
            Batch {
                batch: r.len(),
                seq: b.seq,
                input_ids: b.input_ids[lo..hi].to_vec(),
                targets: b.targets[lo..hi].to_vec(),
                positions: b.positions.as_ref().map(|p| p[lo..hi].to_vec()),
            }
        })
        .collect())
}

/// The in-memory stand-in for NCCL's all-reduce between ranks on the CPU backend, one per rank of
/// a group made by [`LocalReduce::group`]: each rank's buffer is summed in rank order (so the
/// result is the same bits on every rank, and the same as one engine accumulating the ranks'
/// chunks in order). For tests and simulations only: GPUs sum through NCCL.
pub struct LocalReduce {
    rank: usize,
    shared: Arc<LocalShared>,
}

struct LocalShared {
    bufs: Mutex<Vec<Option<Tensor>>>,
    barrier: Barrier,
}

impl LocalReduce {
    /// One reducer per rank of a group of `world`.
    pub fn group(world: usize) -> Vec<LocalReduce> {
        let shared =
            Arc::new(LocalShared { bufs: Mutex::new(vec![None; world]), barrier: Barrier::new(world) });
        (0..world).map(|rank| LocalReduce { rank, shared: Arc::clone(&shared) }).collect()
    }
}

impl GradReduce for LocalReduce {
    fn sum(&self, buf: &Tensor) -> Result<()> {
        let mine = buf.to_device(&Device::Cpu)?.copy()?;
        self.shared.bufs.lock().unwrap_or_else(|p| p.into_inner())[self.rank] = Some(mine);
        self.shared.barrier.wait();
        let total = {
            let bufs = self.shared.bufs.lock().unwrap_or_else(|p| p.into_inner());
            let mut it = bufs.iter();
            let first = it.next().and_then(Option::as_ref).ok_or_else(missing)?.clone();
            it.try_fold(first, |acc, b| -> Result<Tensor> { Ok((acc + b.as_ref().ok_or_else(missing)?)?) })?
        };
        // Nobody overwrites its entry before every rank has read them all.
        self.shared.barrier.wait();
        buf.slice_set(&total.to_device(buf.device())?, 0, 0)?;
        Ok(())
    }
}

fn missing() -> Error {
    Error::Schedule("a rank's gradient is missing from the in-memory reduction".into())
}

/// How long the ranks may take to open their GPUs, join the NCCL group and build their engines.
const START_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

type Job<B> = Box<dyn FnOnce(&mut Engine<B>) + Send>;

/// One engine per rank of this process, each on a thread of its own (where it is built, so a
/// backend bound to its thread never moves), stepped together over one global batch: every rank
/// of the job ([`Ranks::start`]), or this process's ranks `first..first + n` of `world`
/// ([`Ranks::start_part`]: one process per host, each over its own store).
pub struct Ranks<B: Backend> {
    cfg: ModelConfig,
    /// This process's first rank, and the ranks of the whole job.
    first: usize,
    world: usize,
    senders: Vec<mpsc::Sender<Job<B>>>,
    threads: Vec<JoinHandle<()>>,
    /// A step failed: other ranks may be blocked in a collective, so they are not joined.
    failed: AtomicBool,
}

impl<B: Backend> std::fmt::Debug for Ranks<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ranks").field("world", &self.senders.len()).finish_non_exhaustive()
    }
}

impl<B: Backend + 'static> Ranks<B> {
    /// Starts `world` rank threads, every rank of the job in this process; rank `r`'s engine
    /// (on GPU `r`) is `make(r)`, which must give it its [`DataParallel`] place. Returns the
    /// first rank's error if any engine fails to start (without waiting for ranks that may be
    /// blocked joining a collective group).
    pub fn start<F>(cfg: &ModelConfig, world: usize, make: F) -> Result<Self>
    where
        F: Fn(usize) -> Result<Engine<B>> + Send + Sync + 'static,
    {
        Self::start_part(cfg, 0, world, world, make)
    }

    /// Starts this process's `n` rank threads, ranks `first..first + n` of a job of `world`
    /// (other processes start the rest): rank `first + i`'s engine (on this host's GPU `i`) is
    /// `make(first + i)`, with its [`DataParallel`] place (lead `first` where the process's ranks
    /// share one store). Every process then steps the same global batches ([`Ranks::step`]).
    pub fn start_part<F>(cfg: &ModelConfig, first: usize, n: usize, world: usize, make: F) -> Result<Self>
    where
        F: Fn(usize) -> Result<Engine<B>> + Send + Sync + 'static,
    {
        if n == 0 || first + n > world {
            return Err(Error::Options(format!(
                "ranks {first}..{} of a job of {world}: a process runs at least one of the job's ranks",
                first + n
            )));
        }
        let make = Arc::new(make);
        let (ready_tx, ready_rx) = mpsc::channel::<(usize, Result<()>)>();
        let mut senders = Vec::with_capacity(n);
        let mut threads = Vec::with_capacity(n);
        for gpu in 0..n {
            let rank = first + gpu;
            let (tx, rx) = mpsc::channel::<Job<B>>();
            let (make, ready) = (Arc::clone(&make), ready_tx.clone());
            let t = std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || {
                    let mut engine = match make(rank).and_then(|e| match e.lead() {
                        // This process's ranks share one store, landed by its first rank.
                        Some(lead) if lead == first => Ok(e),
                        lead => Err(Error::Options(format!(
                            "rank {rank}'s store lead is {lead:?}, not this process's first rank {first}: every rank of a process shares its store, which its first rank lands"
                        ))),
                    }) {
                        Ok(e) => e,
                        Err(e) => {
                            let _ = ready.send((gpu, Err(e)));
                            return;
                        }
                    };
                    let _ = ready.send((gpu, Ok(())));
                    while let Ok(job) = rx.recv() {
                        job(&mut engine);
                    }
                })
                .map_err(|e| Error::Options(format!("cannot start the thread of rank {rank}: {e}")))?;
            senders.push(tx);
            threads.push(t);
        }
        for _ in 0..n {
            match ready_rx.recv_timeout(START_TIMEOUT) {
                Ok((_, Ok(()))) => {}
                Ok((gpu, Err(e))) => {
                    return Err(Error::Options(format!("rank {} (GPU {gpu}) could not start: {e}", first + gpu)))
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(Error::Options(format!(
                        "the {n} ranks did not all start within {} s (a GPU busy, or NCCL unable to connect them: NCCL_DEBUG=INFO says why)",
                        START_TIMEOUT.as_secs()
                    )))
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Error::Options("a rank thread ended before its engine started".into()))
                }
            }
        }
        Ok(Ranks { cfg: cfg.clone(), first, world, senders, threads, failed: AtomicBool::new(false) })
    }

    /// Number of ranks in the whole job.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Runs `f` on this process's first rank's engine (evaluation, flushing the pending update,
    /// reading options): rank 0's where one process holds every rank.
    pub fn with_rank0<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Engine<B>) -> R + Send + 'static,
    ) -> Result<R> {
        let (tx, rx) = mpsc::channel();
        self.senders[0]
            .send(Box::new(move |e| {
                let _ = tx.send(f(e));
            }))
            .map_err(|_| gone(self.first))?;
        rx.recv().map_err(|_| gone(self.first))
    }

    /// `values` summed over every rank of the job ([`Engine::sum_over_ranks`], which each of this
    /// process's ranks runs; the other processes' ranks must call it too).
    pub fn sum_over_ranks(&self, values: &[f64]) -> Result<Vec<f64>> {
        let n = self.senders.len();
        let (tx, rx) = mpsc::channel();
        for (gpu, sender) in self.senders.iter().enumerate() {
            let (tx, values) = (tx.clone(), values.to_vec());
            sender
                .send(Box::new(move |e| {
                    let _ = tx.send((gpu, e.sum_over_ranks(&values)));
                }))
                .map_err(|_| gone(self.first + gpu))?;
        }
        drop(tx);
        let mut first = None;
        for _ in 0..n {
            let (gpu, r) = rx.recv().map_err(|_| gone(self.first))?;
            let sums =
                r.map_err(|e| Error::Op { op: format!("rank {}", self.first + gpu), source: Box::new(e) })?;
            if gpu == 0 {
                first = Some(sums);
            }
        }
        first.ok_or_else(|| gone(self.first))
    }

    /// One optimizer step of this process's ranks on their shares of `batch` (validated whole:
    /// the global target count normalises every rank's loss; the batch is split over the whole
    /// job's ranks, [`split_batch`]). The report is this process's first rank's (its loss the
    /// whole batch's, summed over every rank of the job: `Engine::agree_on_finite`), with the
    /// tokens and targets of the whole batch, the bytes this process's ranks copied and the
    /// slowest one's time.
    pub fn step(&self, batch: &Batch, lr: f64) -> Result<StepReport> {
        batch.validate(&self.cfg)?;
        let n = self.senders.len();
        let parts = split_batch(batch, self.world)?;
        let global = batch.n_targets();
        let (tx, rx) = mpsc::channel();
        for (gpu, part) in parts.into_iter().skip(self.first).take(n).enumerate() {
            let tx = tx.clone();
            self.senders[gpu]
                .send(Box::new(move |e| {
                    let _ = tx.send((gpu, e.step_rank(&part, global, lr)));
                }))
                .map_err(|_| gone(self.first + gpu))?;
        }
        drop(tx);
        let mut reports: Vec<Option<StepReport>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            let (gpu, r) = rx.recv().map_err(|_| gone(self.first))?;
            match r {
                Ok(rep) => reports[gpu] = Some(rep),
                Err(e) if self.world > 1 => {
                    self.failed.store(true, Ordering::Relaxed);
                    return Err(Error::Op { op: format!("rank {}", self.first + gpu), source: Box::new(e) });
                }
                Err(e) => return Err(e),
            }
        }
        let reports: Vec<StepReport> =
            reports.into_iter().map(|r| r.ok_or_else(|| gone(self.first))).collect::<Result<_>>()?;
        let mut out = reports[0].clone();
        out.n_tokens = batch.batch * batch.seq;
        out.n_targets = global;
        out.h2d_bytes = reports.iter().map(|r| r.h2d_bytes).sum();
        out.d2h_bytes = reports.iter().map(|r| r.d2h_bytes).sum();
        out.step_s = reports.iter().map(|r| r.step_s).fold(0.0, f64::max);
        Ok(out)
    }
}

fn gone(rank: usize) -> Error {
    Error::Options(format!("rank {rank}'s thread has stopped (an earlier error or panic on it)"))
}

impl<B: Backend> Drop for Ranks<B> {
    fn drop(&mut self) {
        // Closing the channels ends every rank's loop; each engine drops on its own thread.
        self.senders.clear();
        if self.failed.load(Ordering::Relaxed) {
            // Left running: the process exits with the step's error.
            return;
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

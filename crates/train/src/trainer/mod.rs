//! [`Trainer`]: a training run from Rust. [`Trainer::new`] sets the run up in named phases (the
//! model read, the options checked, the data loaded, the device opened and the step planned, the
//! host store opened, the weights restored, imported or initialised, the engine started);
//! [`Trainer::run`] trains to the last step with the configured evaluations and checkpoints and
//! finishes (the last update applied, a final evaluation, the export). [`Trainer::step`],
//! [`Trainer::evaluate`], [`Trainer::save_checkpoint`], [`Trainer::export`] and
//! [`Trainer::finish`] are the same pieces, for a loop of one's own.

use std::sync::Arc;
use std::time::Instant;

use mt_core::ModelLayout;
use mt_sched::plan::Plan;
use mt_sched::{Batch, EngineOptions, StepReport};
use mt_store::HostStore;
use serde_json::Value;

use crate::checkpoint;
use crate::data::TrainData;
use crate::device::{DeviceEngine, OpenedDevice};
use crate::error::{Context, Error, Result};
use crate::host::{available_bytes, gib_to_bytes};
use crate::lock::RunLocks;
use crate::observer::{
    notify, notify_step, CheckpointWritten, EvalResult, Event, Observer, RunStart, StepEvent,
};
use crate::restore::{open_store, prefault, restore_or_initialise};
use crate::schedule::LrSchedule;
use crate::summary::{StepTotals, TrainSummary};
use crate::{checks, plan_for, ModelSource, TrainConfig};

mod finish;

/// A training run, set up and ready to step. The observer `O` hears every stage and step.
pub struct Trainer<O: Observer> {
    config: TrainConfig,
    model: ModelSource,
    layout: ModelLayout,
    data: TrainData,
    plan: Plan,
    store: Arc<HostStore>,
    /// A LoRA run's frozen base weights.
    base: Option<Arc<mt_store::FrozenBase>>,
    engine: DeviceEngine,
    observer: O,
    schedule: LrSchedule,
    /// The options a checkpoint is valid for.
    defining: Value,
    eval_batches: Vec<Batch>,
    start_step: u64,
    /// Global steps completed, skipped ones included (the store's header counts the updates
    /// applied and the steps skipped).
    step: u64,
    /// Skipped steps in a row, up to the last step ([`TrainConfig::max_skipped_steps`]).
    skipped_in_row: u64,
    /// Skipped steps of this run.
    skipped: u64,
    end_step: u64,
    t0: Instant,
    // What the run has done so far.
    totals: StepTotals,
    first_loss: Option<f64>,
    last_loss: Option<f64>,
    train_s: f64,
    later_s: Vec<f64>,
    evals: Vec<(u64, f64)>,
    /// Global step of the newest checkpoint of this run (written or resumed from).
    checkpointed: Option<u64>,
    /// The locks on `--out`, the checkpoint directory and the store: released last.
    _locks: RunLocks,
}

impl<O: Observer> std::fmt::Debug for Trainer<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("model", &self.model.name)
            .field("step", &self.global_step())
            .field("end_step", &self.end_step)
            .finish_non_exhaustive()
    }
}

impl<O: Observer> Trainer<O> {
    /// Sets up the run `config` describes, telling `observer` each stage; refuses options that
    /// cannot work before anything large is allocated.
    pub fn new(config: TrainConfig, mut observer: O) -> Result<Self> {
        let t0 = Instant::now();
        let mut model = ModelSource::load(&config.model)?;
        model.cfg.lora = crate::lora::resolve(&config, &model)?;
        checks::check_sizes(&config, &model.cfg)?;
        // The outputs are process 0's alone in a job of several (the others only read a
        // checkpoint to resume from).
        let writes = config.writes_outputs();
        if writes {
            checks::check_outputs(&config)?;
        }
        // One run per output, from here to the end (`Drop`); refused at once if another holds one.
        let locks = RunLocks::take(
            config.out.as_deref().filter(|_| writes),
            config.checkpoint_dir().as_deref().filter(|_| writes),
            config.store.as_deref(),
            &crate::lock::this_process(),
        )?;
        if writes {
            checks::check_fresh_start(&config)?;
            checks::check_room(&checks::outputs(&config, &model.cfg))?;
        }
        let model_dir = model.hf.as_ref().map(|h| h.dir.as_path());
        let data = TrainData::new(&config, model.cfg.vocab_size, model_dir)?;
        let backend = OpenedDevice::open(&config)?;
        let plan = plan_run(&config, &model, &backend, &mut observer)?;
        // What trains: every parameter, or a LoRA run's adapters (its base is frozen, apart).
        let layout = ModelLayout::trainable(&model.cfg);
        let defining = defining_options(&config, &model)?;
        let base = match &model.cfg.lora {
            Some(_) => Some(crate::lora::load_base(&model, config.seed)?),
            None => None,
        };
        let mut opts = engine_options(&config, &model, &plan);
        opts.frozen_base = base.clone();
        let (store, opened) = open_store(&config, &layout)?;
        let store = Arc::new(store);
        if let Some(window) = plan.host.store_window {
            // The disk tier, before anything writes the store: a bounded RAM window from here on.
            let order = opts
                .host_access_order(&layout, config.grad_dtype())
                .context_with(|| "checking the engine options".into())?;
            store
                .start_paging(&order, window)
                .context_with(|| "paging the --store file through RAM".into())?;
        }
        prefault(&store, &mut observer)?;
        let restored =
            restore_or_initialise(&config, &model, &store, &data, &defining, opened, &mut observer)?;
        let checkpointed = restored.checkpoint_step;
        // Until the run's orderly end (`Drop`): a kill leaves the mark in a --store file.
        store.set_run_open(true);
        let engine = start_engine(&config, &model, opts, backend, &store, &mut observer)?;
        // Updates applied and steps skipped (no update is pending once the engine has started).
        let start_step = store.state().step + store.skipped_steps();
        let end_step = if config.resume {
            (config.steps as u64).max(start_step)
        } else {
            start_step + config.steps as u64
        };
        let lr = config.lr_for(&model.cfg);
        let schedule = LrSchedule {
            peak: lr,
            warmup: config.warmup as u64,
            total: config.schedule_total(end_step),
            kind: config.schedule,
        };
        // Evaluation materialises a batch's [b, t, V] f32 logits (the training loss keeps at most
        // `rows_per_block` rows alive): as many sequences as fit in that many rows, at least one.
        let eval_seqs = plan.seqs_per_chunk.min((config.rows_per_block / config.seq_len).max(1));
        let eval_batches = data.eval_batches(eval_seqs);
        let start = RunStart {
            cfg: &model.cfg,
            source: &model.name,
            n_params: layout.n_params(),
            start_step,
            end_step,
            resumed: restored.resumed,
            resume_note: restored.note,
            no_checkpoint_yet: restored.no_checkpoint_yet,
            data: data.describe(),
            lr,
            store_bytes: store.bytes(),
            store_bytes_per_param: store.bytes_per_param(),
            store_path: store.path(),
            frozen_base_bytes: base.as_ref().map_or(0, |b| b.bytes()),
            frozen_base_dtype: base.as_ref().map(|b| b.dtype()),
            random_base: base.is_some() && model.hf.is_none(),
            flops_per_step: global_flops(&plan, &config),
        };
        notify(&mut observer, &Event::Started(&start))?;
        Ok(Trainer {
            config,
            model,
            layout,
            data,
            plan,
            store,
            base,
            engine,
            observer,
            schedule,
            defining,
            eval_batches,
            start_step,
            step: start_step,
            skipped_in_row: 0,
            skipped: 0,
            end_step,
            t0,
            totals: StepTotals::default(),
            first_loss: None,
            last_loss: None,
            train_s: 0.0,
            later_s: Vec::new(),
            evals: Vec::new(),
            checkpointed,
            _locks: locks,
        })
    }

    /// Trains from the current step to the last, evaluating and checkpointing as configured,
    /// then [`Trainer::finish`]es.
    pub fn run(mut self) -> Result<TrainSummary> {
        if !self.eval_batches.is_empty() && self.global_step() < self.end_step {
            // The starting point, so the log shows the eval loss falling (or not) from the first step.
            let e = self.evaluate()?;
            notify(&mut self.observer, &Event::Eval(e))?;
        }
        while self.global_step() < self.end_step {
            self.step()?;
        }
        self.finish()
    }

    /// One optimizer step, then the evaluation and checkpoint due after it; the observer hears
    /// of all three at once. Returns the step's loss.
    ///
    /// A step whose loss or gradient norm is not finite applies no update (the engine skips it;
    /// in lean mode, no update to the units whose gradient is not finite) and is reported in its
    /// [`StepEvent`]; the run stops with [`Error::TooManySkipped`] at the
    /// [`TrainConfig::max_skipped_steps`]-th skipped step in a row.
    pub fn step(&mut self) -> Result<f64> {
        let k = self.global_step();
        let _span = tracing::info_span!("step", step = k + 1).entered();
        let c = &self.config;
        let batch = self.data.batch(c.seed, k, c.batch_size, c.seq_len);
        let lr = self.schedule.lr(k);
        for &(_, fault) in c.inject_faults.iter().filter(|(s, _)| *s == k + 1) {
            self.engine.inject(fault).context_with(|| "injecting a fault".into())?;
        }
        let r = self.engine.step(&batch, lr).map_err(|e| crate::oom::step_error(e, k + 1, &self.plan))?;
        self.record(&r, k);
        self.step = k + 1;
        let done = self.step;
        if let Some(s) = &r.skipped {
            self.skipped += 1;
            self.skipped_in_row += 1;
            tracing::warn!(step = done, "step skipped: {}", s.cause);
            if self.skipped_in_row >= self.config.max_skipped_steps as u64 {
                let event = self.step_event(done, lr, &r, None, None);
                notify_step(&mut self.observer, &event)?;
                return Err(Error::TooManySkipped {
                    step: done,
                    in_row: self.skipped_in_row,
                    cause: s.cause.to_string(),
                });
            }
        } else {
            self.skipped_in_row = 0;
        }
        let c = &self.config;
        let eval_due = c.eval_every > 0 && done.is_multiple_of(c.eval_every as u64) && done < self.end_step;
        let eval = if !self.eval_batches.is_empty() && eval_due { Some(self.evaluate()?) } else { None };
        let checkpoint = match self.config.save_every {
            k if k > 0 && done.is_multiple_of(k as u64) && self.config.writes_outputs() => {
                Some(self.save_checkpoint()?)
            }
            _ => None,
        };
        let event = self.step_event(done, lr, &r, eval, checkpoint);
        notify_step(&mut self.observer, &event)?;
        Ok(r.loss)
    }

    fn step_event<'r>(
        &self,
        done: u64,
        lr: f64,
        report: &'r StepReport,
        eval: Option<EvalResult>,
        checkpoint: Option<CheckpointWritten>,
    ) -> StepEvent<'r> {
        StepEvent {
            step: done,
            steps_done: done - self.start_step,
            lr,
            flops_per_step: global_flops(&self.plan, &self.config),
            report,
            skipped_in_row: self.skipped_in_row,
            skipped_steps: self.store.skipped_steps(),
            eval,
            checkpoint,
            paging: self.store.paging_stats(),
        }
    }

    fn record(&mut self, r: &StepReport, k: u64) {
        if r.skipped.is_none() {
            self.first_loss.get_or_insert(r.loss);
            self.last_loss = Some(r.loss);
        }
        self.train_s += r.step_s;
        if k > self.start_step {
            self.later_s.push(r.step_s);
        }
        self.totals.add(r);
    }

    /// Mean loss over every target of the held-out batches under the store's weights (the
    /// pending update applied first); `None`-like (`NaN`, 0 targets) without held-out data.
    pub fn evaluate(&mut self) -> Result<EvalResult> {
        let t = Instant::now();
        let what = || "evaluating the held-out loss".to_string();
        self.engine.flush_pending().context_with(what)?;
        let (mut sum, mut n) = (0.0, 0);
        for b in self.eval_batches.iter().filter(|b| b.n_targets() > 0) {
            let (s, k) = self.engine.loss_sum(b).context_with(what)?;
            sum += s;
            n += k;
        }
        let loss = if n > 0 { sum / n as f64 } else { f64::NAN };
        let e = EvalResult { step: self.global_step(), loss, targets: n, secs: t.elapsed().as_secs_f64() };
        self.evals.push((e.step, e.loss));
        Ok(e)
    }

    /// Writes a checkpoint of the current step into the checkpoint directory (the pending update
    /// applied first), keeping the newest `keep_checkpoints`.
    pub fn save_checkpoint(&mut self) -> Result<CheckpointWritten> {
        let done = self.global_step();
        let Some(dir) = self.config.checkpoint_dir() else {
            return Err(Error::Options("a checkpoint needs --out DIR or --checkpoint-dir DIR".into()));
        };
        let t = Instant::now();
        self.engine.flush_pending().context_with(|| "applying the update before a checkpoint".into())?;
        let cursor = self.data.cursor(done, self.config.batch_size);
        let keep = self.config.keep_checkpoints;
        let manifest = checkpoint::save(&dir, &self.store, cursor, self.config.seed, &self.defining, keep)
            .map_err(|e| Error::Checkpoint(format!("writing the checkpoint of step {done}: {e}")))?;
        self.checkpointed = Some(done);
        Ok(CheckpointWritten { manifest, secs: t.elapsed().as_secs_f64() })
    }

    /// Global optimizer steps completed.
    pub fn global_step(&self) -> u64 {
        self.step
    }

    /// The global step the run ends at.
    pub fn end_step(&self) -> u64 {
        self.end_step
    }

    /// The plan the run follows.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The run's options.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// The model being trained.
    pub fn model(&self) -> &ModelSource {
        &self.model
    }

    /// The host store (fp32 master weights and AdamW moments; current after
    /// [`Trainer::evaluate`], [`Trainer::save_checkpoint`] or [`Trainer::export`]).
    pub fn store(&self) -> &HostStore {
        &self.store
    }

    /// The observer.
    pub fn observer(&mut self) -> &mut O {
        &mut self.observer
    }
}

impl<O: Observer> Drop for Trainer<O> {
    /// An orderly end (finished, or stopped by an error): the store is consistent (a failed step
    /// is retried without applying an update twice), so a --store file loses the mark of a run
    /// in progress. Only a kill (or a crash of the machine) leaves it.
    fn drop(&mut self) {
        self.store.set_run_open(false);
        if let Err(e) = self.store.flush() {
            tracing::error!("could not flush the host store: {e}");
        }
    }
}

/// Phase: the step planned for this device and machine (chunking, ring depth, placement, bytes
/// per place, PCIe bytes); an impossible plan is refused before anything is allocated.
fn plan_run<O: Observer>(
    c: &TrainConfig,
    model: &ModelSource,
    backend: &OpenedDevice,
    observer: &mut O,
) -> Result<Plan> {
    if let Some(d) = backend.describe() {
        notify(observer, &Event::Device(&d))?;
    }
    let host = c.host_mem_gib.map_or_else(available_bytes, gib_to_bytes);
    let device = c.gpu_mem_gib.map_or(backend.memory_bytes(available_bytes())?, gib_to_bytes);
    let p = plan_for(
        c,
        &model.cfg,
        device,
        host,
        backend.kernels(&model.cfg, c.precision.dtype(), c.flash_kernel, c.moe_kernels),
    )?;
    notify(observer, &Event::Planned { plan: &p, device: c.device.kind() })?;
    Ok(p)
}

/// Model FLOPs of a step of the whole batch: the plan's are one GPU's share with `--gpus`.
fn global_flops(plan: &Plan, c: &TrainConfig) -> f64 {
    let (whole, share) = (c.batch_size * c.seq_len, plan.batch * plan.seq);
    if whole == share {
        return plan.flops_per_step;
    }
    plan.flops_per_step * whole as f64 / share.max(1) as f64
}

/// How the engine runs: the plan's placement and chunking, the configuration's optimizer.
fn engine_options(c: &TrainConfig, model: &ModelSource, plan: &Plan) -> EngineOptions {
    let mut opts = EngineOptions {
        weight_dtype: c.precision.dtype(),
        ring_depth: plan.ring_depth,
        n_chunks: plan.n_chunks,
        mode: c.optim_mode,
        clip: (c.clip > 0.0).then_some(c.clip),
        overlap_optimizer: c.overlap_optimizer,
        rows_per_block: c.rows_per_block,
        flash_attention: plan.flash_attention,
        flash_kernel: c.flash_kernel,
        mlp_rows: plan.mlp_rows,
        rope_angles: c.rope_angles,
        moe_kernels: c.moe_kernels,
        placement: plan.placement,
        ..EngineOptions::default()
    };
    opts.adamw.lr = c.lr_for(&model.cfg);
    opts.adamw.weight_decay = c.weight_decay;
    opts.adamw.beta1 = c.beta1;
    opts.adamw.beta2 = c.beta2;
    opts.adamw.eps = c.eps;
    opts
}

/// Phase: the engine started with `opts`, and an update a crashed exact-mode run left pending
/// applied (bitwise what the next step would do).
fn start_engine<O: Observer>(
    c: &TrainConfig,
    model: &ModelSource,
    opts: EngineOptions,
    backend: OpenedDevice,
    store: &Arc<HostStore>,
    observer: &mut O,
) -> Result<DeviceEngine> {
    let t = Instant::now();
    let cpu = mt_sched::CpuOptions::uniform(c.delay_us, c.seed);
    let mut engine = backend.start(&model.cfg, Arc::clone(store), opts, c, cpu)?;
    let event = Event::EngineReady {
        secs: t.elapsed().as_secs_f64(),
        device: c.device.kind(),
        pinned_record_bytes: engine.pinned_record_bytes(),
    };
    notify(observer, &event)?;
    engine.flush_pending().context_with(|| "applying the update a previous run left pending".into())?;
    if c.job.is_some() {
        check_same_start(c, &engine, store)?;
    }
    Ok(engine)
}

/// In a job of several processes, every process must start from the same step (a resume reads
/// process 0's checkpoints): otherwise their stores differ and their steps would not pair up.
fn check_same_start(c: &TrainConfig, engine: &DeviceEngine, store: &HostStore) -> Result<()> {
    let step = store.state().step + store.skipped_steps();
    let sum = engine
        .sum_over_ranks(&[step as f64])
        .context_with(|| "checking that every process of the job starts from the same step".into())?;
    let ranks = c.ranks() as f64;
    if sum[0] != step as f64 * ranks {
        return Err(Error::Options(format!(
            "this process starts from step {step}, but the job's {ranks} GPUs do not all start there (their steps average {:.1}): every process must resume from the same checkpoint, so put --out (or --checkpoint-dir) on a file system every host sees",
            sum[0] / ranks
        )));
    }
    Ok(())
}

/// The options a checkpoint is only valid for: a resume with any of them changed is refused.
fn defining_options(c: &TrainConfig, model: &ModelSource) -> Result<Value> {
    use crate::config::DataSource;
    use crate::config::{grad_dtype_name, optim_mode_name};
    use crate::data::describe_source;
    // A file is identified by its contents (hashed only when checkpoints are in use: a large
    // file takes a while), not by how its path is spelled.
    let (data, data_sha256) = match &c.data {
        DataSource::File(p) if c.checkpoint_dir().is_some() => {
            (p.file_name().map(|n| n.to_string_lossy().into_owned()), Some(checkpoint::hash_file(p)?))
        }
        DataSource::File(p) => (p.file_name().map(|n| n.to_string_lossy().into_owned()), None),
        other => (Some(describe_source(other)), None),
    };
    let mut defining = serde_json::json!({
        "model_config": model.cfg.to_hf_json(),
        "batch_size": c.batch_size,
        "seq_len": c.seq_len,
        "precision": c.precision.name(),
        "optim_mode": optim_mode_name(c.optim_mode),
        "grad_dtype": grad_dtype_name(c.grad_dtype()),
        "data": data,
        "data_sha256": data_sha256,
        "shuffle": c.shuffle,
        "pack": c.pack,
        "truncate": c.truncate,
        "eval_fraction": c.eval_fraction,
        "seed": c.seed,
        "lr": c.lr_for(&model.cfg),
        "schedule": c.schedule.name(),
        "schedule_steps": c.schedule_steps,
        "steps_if_scheduled": (c.schedule != crate::ScheduleKind::Constant && c.schedule_steps.is_none())
            .then_some(c.steps),
        "warmup": c.warmup,
        "weight_decay": c.weight_decay,
        "clip": c.clip,
        "beta1": c.beta1,
        "beta2": c.beta2,
        "eps": c.eps,
    });
    crate::states::define(&mut defining, c.optim_states);
    if let Some(l) = &model.cfg.lora {
        let targets: Vec<&str> = l.targets.iter().map(|t| t.module()).collect();
        defining["lora"] = serde_json::json!({
            "rank": l.rank, "alpha": l.alpha, "targets": targets, "dropout": l.dropout, "rslora": l.rslora,
        });
        // The base's encoding where it changes what the device computes with: not an fp32 base,
        // nor a bf16 one under bf16 weights (the upload rounds an fp32 base to the same bits),
        // so the checkpoints of runs that held the base in fp32 resume as they were.
        let lossless = l.base == mt_core::BaseDtype::F32
            || (l.base == mt_core::BaseDtype::Bf16 && c.precision == crate::Precision::Bf16);
        if !lossless {
            defining["lora"]["base_dtype"] = l.base.name().into();
        }
    }
    Ok(defining)
}

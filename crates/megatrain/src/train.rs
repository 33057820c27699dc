//! `megatrain train`: checks the options against the model, opens or creates the host store
//! (initialising a new one, resuming an existing one), runs the engine step by step with the
//! learning-rate schedule, logs metrics, writes the `--trace` of one step, applies the last
//! pending update and summarises.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use mt_core::{ModelConfig, ModelLayout};
use mt_sched::plan::{plan, Plan, PlanInput};
use mt_sched::{Backend, CpuBackend, CpuOptions, Engine, EngineOptions, StepReport};
use mt_store::HostStore;

use crate::checkpoint;
use crate::checks;
use crate::cli::{DeviceKind, ExportDtypeArg, TrainArgs};
use crate::data::{describe_source, TrainData};
use crate::init::init_store;
use crate::metrics::{self, MetricsLog, RunInfo};
use crate::report::{Progress, StepLine, StepTotals, TrainSummary};
use crate::schedule::LrSchedule;
use crate::trace::write_chrome_trace;

/// Name of the built-in model in summaries and metrics.
pub const BUILTIN_MODEL: &str = "builtin:tiny_llama";

/// The model a run trains: its config, where it came from, its `config.json` document (written
/// back on export) and, for `--model`, the HF directory its weights and tokenizer come from.
#[derive(Debug)]
pub struct ModelSource {
    /// The parsed config.
    pub cfg: ModelConfig,
    /// `--model` dir, `--config` path or [`BUILTIN_MODEL`].
    pub name: String,
    /// The config.json document (the source's own, so export keeps every key transformers wrote).
    pub config_json: serde_json::Value,
    /// The `--model` directory, its headers checked.
    pub hf: Option<mt_hf::HfModelDir>,
}

impl ModelSource {
    /// `--model`, `--config` or the built-in tiny Llama.
    pub fn from_args(model: Option<&Path>, config: Option<&Path>) -> Result<Self> {
        if let Some(dir) = model {
            let hf = mt_hf::HfModelDir::open(dir)
                .with_context(|| format!("cannot use --model {}", dir.display()))?;
            return Ok(ModelSource {
                cfg: hf.config.clone(),
                name: dir.display().to_string(),
                config_json: hf.config_json.clone(),
                hf: Some(hf),
            });
        }
        if let Some(p) = config {
            let cfg = ModelConfig::from_file(p)
                .with_context(|| format!("cannot use model config {}", p.display()))?;
            let text = std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?;
            let config_json =
                serde_json::from_str(&text).with_context(|| format!("{} is not JSON", p.display()))?;
            return Ok(ModelSource { cfg, name: p.display().to_string(), config_json, hf: None });
        }
        let cfg = ModelConfig::tiny_llama();
        Ok(ModelSource { config_json: cfg.to_hf_json(), cfg, name: BUILTIN_MODEL.to_owned(), hf: None })
    }
}

/// Runs `megatrain train`; progress and log lines go to the terminal, the summary is returned.
pub fn train(args: &TrainArgs) -> Result<TrainSummary> {
    let t0 = Instant::now();
    if args.device == DeviceKind::Cuda && !cfg!(feature = "cuda") {
        bail!("--device cuda: this megatrain was built without the cuda feature; use --device cpu");
    }
    let model = ModelSource::from_args(args.model.as_deref(), args.config.as_deref())?;
    let cfg = model.cfg.clone();
    checks::check_sizes(args, &cfg)?;
    let trace_step = checks::check_trace(args)?;
    checks::check_outputs(args)?;
    let data = TrainData::new(args, cfg.vocab_size, args.model.as_deref())
        .with_context(|| format!("--data for model {}", model.name))?;

    let layout = ModelLayout::new(&cfg);
    let opts = CpuOptions::uniform(args.delay_us, args.seed);
    match args.device {
        DeviceKind::Cpu => {
            // On the CPU the "device" buffers share host memory with the store.
            let avail = host_available_bytes();
            let p = make_plan(args, &cfg, avail, avail, false)?;
            run(args, &model, layout, p, CpuBackend::new(opts), t0, trace_step, data)
        }
        DeviceKind::Cuda => cuda_run(args, &model, layout, opts, t0, trace_step, data),
    }
}

#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn cuda_run(
    args: &TrainArgs,
    model: &ModelSource,
    layout: ModelLayout,
    opts: CpuOptions,
    t0: Instant,
    trace_step: usize,
    data: TrainData,
) -> Result<TrainSummary> {
    let backend = mt_sched::CudaBackend::new(0, opts).context("--device cuda: cannot open GPU 0")?;
    let (_, total) = backend.mem_info()?;
    let gpu = args.gpu_mem.map_or(total as u64, gib_to_bytes);
    eprintln!("device: {}", backend.describe());
    let fused = mt_layers::fused_kernels(mt_sched::Backend::device(&backend), args.precision.into());
    let p = make_plan(args, &model.cfg, gpu, host_available_bytes(), fused)?;
    run(args, model, layout, p, backend, t0, trace_step, data)
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::too_many_arguments)]
fn cuda_run(
    _: &TrainArgs,
    _: &ModelSource,
    _: ModelLayout,
    _: CpuOptions,
    _: Instant,
    _: usize,
    _: TrainData,
) -> Result<TrainSummary> {
    bail!("--device cuda: this megatrain was built without the cuda feature; use --device cpu")
}

fn gib_to_bytes(g: f64) -> u64 {
    (g * (1u64 << 30) as f64) as u64
}

/// Host memory available to this run: `--host-mem`, else MemAvailable of /proc/meminfo (no
/// limit where that cannot be read).
pub(crate) fn host_available_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            let line = t.lines().find(|l| l.starts_with("MemAvailable:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
        })
        .unwrap_or(u64::MAX)
}

/// Resident set size of this process in bytes (Linux; `None` elsewhere).
pub(crate) fn rss_bytes() -> Option<u64> {
    let t = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = t.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// Plans the step (chunking, ring depth, bytes per place, PCIe bytes) and prints it; refuses an
/// impossible plan before anything is allocated.
/// `fused`: the device runs the fused CUDA kernels (`mt_layers::fused_kernels`).
fn make_plan(
    args: &TrainArgs,
    cfg: &ModelConfig,
    gpu_bytes: u64,
    host_bytes: u64,
    fused: bool,
) -> Result<Plan> {
    let host_bytes = args.host_mem.map_or(host_bytes, gib_to_bytes);
    let gpu_bytes = args.gpu_mem.map_or(gpu_bytes, gib_to_bytes);
    let p = plan(&PlanInput {
        cfg: cfg.clone(),
        batch: args.batch_size,
        seq: args.seq_len,
        weight_dtype: args.precision.into(),
        grad_dtype: args.grad_dtype().into(),
        mode: args.optim_mode.into(),
        gpu_bytes,
        host_bytes,
        ring_depth: Some(args.ring_depth),
        n_chunks: args.chunks,
        rows_per_block: args.rows_per_block,
        resident_outer: args.resident_outer.choice(args.device, args.store.is_some()),
        resident_layers: args.resident_layers.choice(args.device, args.store.is_some()),
        kept_layers: args.kept_layers.choice(args.device, false),
        held_layers: args.held_layers.choice(args.device, false),
        gpu_updated_layers: args.gpu_updated_layers.choice(args.device, args.store.is_some()),
        late_state_downloads: args.late_state_downloads.choice(args.device, args.store.is_some()),
        early_state_uploads: args.early_state_uploads.choice(args.device, args.store.is_some()),
        fused_kernels: fused,
        flash_attention: args.attention.choice(),
        mlp_rows: args.mlp_rows.choice(),
        spilled_checkpoints: args.spill_checkpoints.choice(args.device, false),
    })
    .context("no memory plan fits this machine (set --chunks, --batch-size, --gpu-mem or --host-mem)")?;
    eprintln!("{p}");
    Ok(p)
}

#[allow(clippy::too_many_arguments)]
fn run<B: Backend>(
    args: &TrainArgs,
    model: &ModelSource,
    layout: ModelLayout,
    plan: Plan,
    backend: B,
    t0: Instant,
    trace_step: usize,
    data: TrainData,
) -> Result<TrainSummary> {
    let cfg = &model.cfg;
    let ckpt_dir = checkpoint_dir(args);
    let defining = defining_options(args, model)?;
    let (store, mut resumed) = open_store(args, &layout)?;
    let store = Arc::new(store);
    // Populated on every core before anything writes it: an import or initialisation into
    // unpopulated memory would take each page fault on the writing thread.
    let t_fault = Instant::now();
    match store.prefault() {
        Ok(0) => {}
        Ok(n) => {
            eprintln!(
                "host store: {:.2} GB pre-faulted in {:.1} s",
                n as f64 / 1e9,
                t_fault.elapsed().as_secs_f64()
            )
        }
        Err(e) => eprintln!("host store: not pre-faulted ({e}); the first update will fault its pages in"),
    }
    let mut resume_note = None;
    let checkpoint = match (&ckpt_dir, args.resume) {
        (Some(dir), true) => checkpoint::latest(dir)?,
        _ => None,
    };
    if let Some((path, m)) = &checkpoint {
        checkpoint::check_same_run(m, &defining)
            .with_context(|| format!("cannot resume from {}", path.display()))?;
        let snap = path.with_file_name(&m.store_file);
        store.restore_snapshot(&snap).with_context(|| format!("restoring {}", snap.display()))?;
        if m.data_cursor != data.cursor(m.step, args.batch_size) {
            bail!(
                "cannot resume from {}: its data cursor {:?} is not where this data puts step {} ({:?}); \
                 was --data changed?",
                path.display(),
                m.data_cursor,
                m.step,
                data.cursor(m.step, args.batch_size)
            );
        }
        resumed = true;
        resume_note = Some(format!("resumed from checkpoint {} at step {}", path.display(), m.step));
    } else if !resumed {
        match &model.hf {
            Some(hf) => {
                let r = mt_hf::import_weights(hf, &store)
                    .with_context(|| format!("importing the weights of {}", model.name))?;
                eprintln!("imported {} tensors ({} parameters) from {}", r.n_tensors, r.n_params, model.name);
            }
            None => {
                let t = Instant::now();
                let n = init_store(&store, args.seed).context("initialising the model")?;
                eprintln!(
                    "initialised {n} tensors (seed {}) in {:.1} s",
                    args.seed,
                    t.elapsed().as_secs_f64()
                );
            }
        }
    }
    let mut eopts = engine_options(args);
    eopts.resident_outer = plan.resident_outer;
    eopts.resident_layers = plan.resident_layers;
    eopts.kept_layers = plan.kept_layers;
    eopts.held_layers = plan.held_layers;
    eopts.gpu_updated_layers = plan.gpu_updated_layers;
    eopts.late_state_downloads = plan.late_state_downloads;
    eopts.early_state_uploads = plan.early_state_uploads;
    eopts.flash_attention = plan.flash_attention;
    eopts.mlp_rows = plan.mlp_rows;
    eopts.spilled_checkpoints = plan.spilled_checkpoints;
    eopts.rope_angles = args.rope_angles.into();
    eopts.n_chunks = plan.n_chunks;
    eopts.ring_depth = plan.ring_depth;
    let t_engine = Instant::now();
    let mut engine = Engine::new(cfg, Arc::clone(&store), backend, eopts)?;
    eprintln!(
        "engine ready in {:.1} s (device pool, page-locked rings, resident units loaded)",
        t_engine.elapsed().as_secs_f64()
    );
    if engine.pinned_record_bytes() > 0 {
        let layers: Vec<String> =
            engine.gpu_updated_units().iter().map(|u| format!("{}", u.index() - 1)).collect();
        let list = |units: Vec<mt_core::Unit>| {
            let l: Vec<String> = units.iter().map(|u| format!("{}", u.index() - 1)).collect();
            if l.is_empty() {
                "none".to_string()
            } else {
                l.join(",")
            }
        };
        eprintln!(
            "GPU-updated layers {} (state downloaded in the backward: {}; uploaded for the next step in the backward: {}): their store records page-locked in place ({:.2} GiB, part of the store)",
            layers.join(","),
            list(engine.late_download_units()),
            list(engine.early_upload_units()),
            engine.pinned_record_bytes() as f64 / (1u64 << 30) as f64
        );
    }
    // A store left by a crashed exact-mode run may hold a complete step's gradients whose
    // update was never applied; applying it now is bitwise what the next step would do.
    engine.flush_pending()?;
    let start_step = store.state().step;
    let end_step =
        if args.resume { (args.steps as u64).max(start_step) } else { start_step + args.steps as u64 };
    let n_steps = (end_step - start_step) as usize;

    let progress = Progress::new(n_steps, end_step, args.log_every);
    progress.note(format_args!("data: {}", data.describe()));
    match (&resume_note, resumed, &args.store) {
        (Some(note), _, _) => progress.note(note),
        (None, true, Some(path)) => {
            progress.note(format_args!("resumed from {} at step {start_step}", path.display()))
        }
        _ => {}
    }
    if args.resume && checkpoint.is_none() {
        progress.note("--resume: no checkpoint yet, starting from the beginning");
    }
    let mut log = match &args.metrics {
        Some(p) => {
            let mut log = MetricsLog::open(p)?;
            log.write(&metrics::run_record(&RunInfo {
                args,
                cfg,
                source: &model.name,
                store: &store,
                start_step,
                resumed,
            }))?;
            Some(log)
        }
        None => None,
    };

    let schedule = LrSchedule {
        peak: args.lr,
        warmup: args.warmup as u64,
        total: schedule_total(args, end_step),
        kind: args.schedule,
    };
    // Evaluation materialises a batch's [b, t, V] f32 logits (the training loss keeps at most
    // --rows-per-block rows alive): as many sequences as fit in that many rows, at least one.
    let eval_seqs = plan.seqs_per_chunk.min((args.rows_per_block / args.seq_len).max(1));
    let eval_batches = data.eval_batches(eval_seqs);
    let mut evals = Vec::new();
    if !eval_batches.is_empty() && start_step < end_step {
        // The starting point, so the log shows the eval loss falling (or not) from the first step.
        let e = evaluate(&mut engine, &eval_batches)?;
        progress.note(format_args!("step {start_step}: eval loss {:.6} over {} targets", e.0, e.1));
        if let Some(log) = &mut log {
            log.write(&metrics::eval_record(start_step, e.0, e.1, e.2))?;
        }
        evals.push((start_step, e.0));
    }
    let (mut first_loss, mut train_s) = (None, 0.0);
    let mut last: Option<StepReport> = None;
    let mut totals = StepTotals::default();
    let mut later_s = Vec::new();
    for k in start_step..end_step {
        let _span = tracing::info_span!("step", step = k + 1).entered();
        let batch = data.batch(args.seed, k, args.batch_size, args.seq_len);
        let lr = schedule.lr(k);
        let r = engine.step(&batch, lr).map_err(|e| crate::oom::step_error(e, k + 1, &plan))?;
        if !r.loss.is_finite() {
            bail!("training diverged at step {}: loss is {} (try a lower --lr)", k + 1, r.loss);
        }
        first_loss.get_or_insert(r.loss);
        train_s += r.step_s;
        if k > start_step {
            later_s.push(r.step_s);
        }
        totals.add(&r);
        if let Some(log) = &mut log {
            log.write(&metrics::step_record(k + 1, lr, &r, plan.flops_per_step, rss_bytes()))?;
        }
        if let (Some(path), true) = (&args.trace, k - start_step + 1 == trace_step as u64) {
            write_chrome_trace(path, &r, k + 1)?;
            progress.note(format_args!(
                "trace of step {} ({} operations) written to {}",
                k + 1,
                r.spans.len(),
                path.display()
            ));
        }
        progress.step(&StepLine {
            step: k + 1,
            loss: r.loss,
            lr,
            grad_norm: r.grad_norm,
            tokens_per_s: metrics::tokens_per_s(&r),
        });
        last = Some(r);
        let done = k + 1;
        if !eval_batches.is_empty()
            && args.eval_every > 0
            && done % args.eval_every as u64 == 0
            && done < end_step
        {
            let e = evaluate(&mut engine, &eval_batches)?;
            progress.note(format_args!("step {done}: eval loss {:.6} over {} targets", e.0, e.1));
            if let Some(log) = &mut log {
                log.write(&metrics::eval_record(done, e.0, e.1, e.2))?;
            }
            evals.push((done, e.0));
        }
        if let (Some(dir), true) = (&ckpt_dir, args.save_every > 0 && done % args.save_every as u64 == 0) {
            let t = Instant::now();
            engine.flush_pending().context("applying the update before a checkpoint")?;
            let cursor = data.cursor(done, args.batch_size);
            let path = checkpoint::save(dir, &store, cursor, args.seed, &defining, args.keep_checkpoints)
                .with_context(|| format!("writing the checkpoint of step {done}"))?;
            progress.note(format_args!(
                "step {done}: checkpoint {} ({:.1} s)",
                path.display(),
                t.elapsed().as_secs_f64()
            ));
        }
        if args.abort_after_step == Some(done) {
            progress.note(format_args!("--abort-after-step {done}: aborting"));
            std::process::abort();
        }
    }
    progress.finish();
    if mt_layers::profile::enabled() {
        // MT_PROFILE=1: where the device time went (the device was synchronised per section).
        let sections = mt_layers::profile::take();
        let total: f64 = sections.iter().map(|s| s.2).sum();
        for (name, n, secs) in sections {
            progress.note(format_args!(
                "profile {name:<42} {n:>6} calls {:>9.1} ms {:>5.1}%",
                1e3 * secs,
                100.0 * secs / total.max(1e-12)
            ));
        }
    }
    let t_flush = Instant::now();
    engine.flush_pending().context("applying the last update")?;
    store.flush().context("flushing the host store")?;
    progress.note(format_args!(
        "last update applied and the store written back in {:.1} s",
        t_flush.elapsed().as_secs_f64()
    ));
    if !eval_batches.is_empty() {
        let e = evaluate(&mut engine, &eval_batches)?;
        progress.note(format_args!("step {}: eval loss {:.6} over {} targets", store.state().step, e.0, e.1));
        if let Some(log) = &mut log {
            log.write(&metrics::eval_record(store.state().step, e.0, e.1, e.2))?;
        }
        evals.push((store.state().step, e.0));
    }
    let exported = match &args.out {
        Some(out) => {
            let t = Instant::now();
            let r = mt_hf::export(
                &store,
                &model.config_json,
                out,
                &mt_hf::ExportOptions {
                    dtype: match args.export_dtype {
                        ExportDtypeArg::Fp32 => mt_hf::ExportDtype::F32,
                        ExportDtypeArg::Bf16 => mt_hf::ExportDtype::Bf16,
                    },
                    max_shard_bytes: mt_hf::DEFAULT_MAX_SHARD_BYTES,
                    copy_files_from: args.model.clone(),
                },
            )
            .with_context(|| format!("exporting the model to --out {}", out.display()))?;
            progress.note(format_args!(
                "exported {} ({} shard(s), {:.2} GB) in {:.1} s",
                out.display(),
                r.n_shards,
                r.bytes_written as f64 / 1e9,
                t.elapsed().as_secs_f64()
            ));
            Some(out.clone())
        }
        None => None,
    };

    let (first, last_loss) = match &last {
        Some(r) => (first_loss.unwrap_or(r.loss), r.loss),
        None => (f64::NAN, f64::NAN),
    };
    Ok(TrainSummary {
        model: model.name.clone(),
        n_params: layout.n_params(),
        n_layers: layout.n_layers,
        start_step,
        end_step: store.state().step,
        first_loss: first,
        last_loss,
        tokens_per_step: args.batch_size * args.seq_len,
        train_s,
        wall_s: t0.elapsed().as_secs_f64(),
        store_bytes: store.bytes(),
        store_bytes_per_param: store.bytes_per_param(),
        rss_bytes: rss_bytes(),
        planned_host_bytes: crate::estimate::host_bytes(&plan, args.device),
        kept_bytes: (totals.kept_bytes(), plan.gpu.kept),
        device_peak: (totals.device_peak(), plan.gpu.total),
        flops_per_step: plan.flops_per_step,
        later_step_s: (!later_s.is_empty()).then(|| later_s.iter().sum::<f64>() / later_s.len() as f64),
        store_path: store.path().map(Path::to_owned),
        h2d_bytes_per_step: totals.h2d_bytes_per_step(),
        last_step_bytes: totals.last_step_bytes(),
        d2h_bytes_per_step: totals.d2h_bytes_per_step(),
        streams: totals.stream_means(),
        evals,
        exported,
    })
}

/// Mean loss over every target of the held-out batches, their target count and the seconds it
/// took, under the store's weights (with no update pending: flushes first).
fn evaluate<B: Backend>(engine: &mut Engine<B>, batches: &[mt_sched::Batch]) -> Result<(f64, usize, f64)> {
    let t = Instant::now();
    engine.flush_pending()?;
    let (mut sum, mut n) = (0.0, 0);
    for b in batches.iter().filter(|b| b.n_targets() > 0) {
        let (s, k) = engine.loss_sum(b).context("evaluating the held-out loss")?;
        sum += s;
        n += k;
    }
    let mean = if n > 0 { sum / n as f64 } else { f64::NAN };
    Ok((mean, n, t.elapsed().as_secs_f64()))
}

/// Where checkpoints go: `--checkpoint-dir`, else `OUT/checkpoints`; `None` without either.
pub(crate) fn checkpoint_dir(args: &TrainArgs) -> Option<std::path::PathBuf> {
    args.checkpoint_dir.clone().or_else(|| args.out.as_ref().map(|o| o.join("checkpoints")))
}

/// The length of the learning-rate schedule: `--schedule-steps`, else the run's last step.
fn schedule_total(args: &TrainArgs, end_step: u64) -> u64 {
    args.schedule_steps.map_or(end_step, |n| n as u64)
}

/// The options a checkpoint is only valid for: a resume with any of them changed is refused.
fn defining_options(args: &TrainArgs, model: &ModelSource) -> Result<serde_json::Value> {
    use clap::ValueEnum;
    let name = |v: Option<clap::builder::PossibleValue>| v.map(|v| v.get_name().to_owned());
    // A file is identified by its contents (hashed only when checkpoints are in use: a large
    // file takes a while), not by how its path is spelled.
    let (data, data_sha256) = match &args.data {
        crate::cli::DataSource::File(p) if checkpoint_dir(args).is_some() => {
            (p.file_name().map(|n| n.to_string_lossy().into_owned()), Some(checkpoint::hash_file(p)?))
        }
        crate::cli::DataSource::File(p) => (p.file_name().map(|n| n.to_string_lossy().into_owned()), None),
        other => (Some(describe_source(other)), None),
    };
    Ok(serde_json::json!({
        "model_config": model.cfg.to_hf_json(),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "precision": name(args.precision.to_possible_value()),
        "optim_mode": name(args.optim_mode.to_possible_value()),
        "grad_dtype": name(args.grad_dtype().to_possible_value()),
        "data": data,
        "data_sha256": data_sha256,
        "shuffle": !args.no_shuffle,
        "pack": !args.no_pack,
        "truncate": args.truncate,
        "eval_fraction": args.eval_fraction,
        "seed": args.seed,
        "lr": args.lr,
        "schedule": name(args.schedule.to_possible_value()),
        "schedule_steps": args.schedule_steps,
        "steps_if_scheduled": (args.schedule != crate::cli::ScheduleKind::Constant && args.schedule_steps.is_none())
            .then_some(args.steps),
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "clip": args.clip,
        "beta1": args.beta1,
        "beta2": args.beta2,
        "eps": args.eps,
    }))
}

/// The `--store` file (opened if it exists, else created) or an anonymous store; `true` when
/// an existing store was opened.
fn open_store(args: &TrainArgs, layout: &ModelLayout) -> Result<(HostStore, bool)> {
    let Some(path) = &args.store else {
        return Ok((HostStore::anonymous(layout, args.grad_dtype().into())?, false));
    };
    if path.exists() {
        let s = HostStore::open(path, layout).with_context(|| {
            format!("cannot resume from --store {} (is it for this model?)", path.display())
        })?;
        Ok((s, true))
    } else {
        let s = HostStore::create(path, layout, args.grad_dtype().into())
            .with_context(|| format!("cannot create --store {}", path.display()))?;
        Ok((s, false))
    }
}

fn engine_options(args: &TrainArgs) -> EngineOptions {
    let mut opts = EngineOptions {
        weight_dtype: args.precision.into(),
        ring_depth: args.ring_depth,
        n_chunks: args.chunks.unwrap_or(1),
        mode: args.optim_mode.into(),
        clip: (args.clip > 0.0).then_some(args.clip),
        overlap_optimizer: !args.no_optimizer_overlap,
        rows_per_block: args.rows_per_block,
        ..EngineOptions::default()
    };
    opts.adamw.lr = args.lr;
    opts.adamw.weight_decay = args.weight_decay;
    opts.adamw.beta1 = args.beta1;
    opts.adamw.beta2 = args.beta2;
    opts.adamw.eps = args.eps;
    opts
}

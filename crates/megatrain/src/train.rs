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

use crate::cli::{DeviceKind, GradDtypeArg, OptimModeArg, TrainArgs};
use crate::data::Dataset;
use crate::init::init_store;
use crate::metrics::{self, MetricsLog, RunInfo};
use crate::report::{Progress, StepLine, StepTotals, TrainSummary};
use crate::schedule::LrSchedule;
use crate::trace::write_chrome_trace;

/// Name of the built-in model in summaries and metrics.
pub const BUILTIN_MODEL: &str = "builtin:tiny_llama";

/// Runs `megatrain train`; progress and log lines go to the terminal, the summary is returned.
pub fn train(args: &TrainArgs) -> Result<TrainSummary> {
    let t0 = Instant::now();
    if args.device == DeviceKind::Cuda && !cfg!(feature = "cuda") {
        bail!("--device cuda: this megatrain was built without the cuda feature; use --device cpu");
    }
    let (cfg, source) = match &args.config {
        Some(p) => (
            ModelConfig::from_file(p).with_context(|| format!("cannot use model config {}", p.display()))?,
            p.display().to_string(),
        ),
        None => (ModelConfig::tiny_llama(), BUILTIN_MODEL.to_owned()),
    };
    check_sizes(args, &cfg)?;
    let trace_step = check_trace(args)?;
    let data =
        Dataset::new(args.data, cfg.vocab_size).with_context(|| format!("--data for model {source}"))?;

    let layout = ModelLayout::new(&cfg);
    let opts = CpuOptions::uniform(args.delay_us, args.seed);
    match args.device {
        DeviceKind::Cpu => {
            // On the CPU the "device" buffers share host memory with the store.
            let avail = host_available_bytes();
            let p = make_plan(args, &cfg, avail, avail)?;
            run(args, &cfg, source, layout, p, CpuBackend::new(opts), t0, trace_step, data)
        }
        DeviceKind::Cuda => cuda_run(args, &cfg, source, layout, opts, t0, trace_step, data),
    }
}

#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn cuda_run(
    args: &TrainArgs,
    cfg: &ModelConfig,
    source: String,
    layout: ModelLayout,
    opts: CpuOptions,
    t0: Instant,
    trace_step: usize,
    data: Dataset,
) -> Result<TrainSummary> {
    let backend = mt_sched::CudaBackend::new(0, opts).context("--device cuda: cannot open GPU 0")?;
    let (_, total) = backend.mem_info()?;
    let gpu = args.gpu_mem.map_or(total as u64, gib_to_bytes);
    eprintln!("device: {}", backend.describe());
    let p = make_plan(args, cfg, gpu, host_available_bytes())?;
    run(args, cfg, source, layout, p, backend, t0, trace_step, data)
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::too_many_arguments)]
fn cuda_run(
    _: &TrainArgs,
    _: &ModelConfig,
    _: String,
    _: ModelLayout,
    _: CpuOptions,
    _: Instant,
    _: usize,
    _: Dataset,
) -> Result<TrainSummary> {
    bail!("--device cuda: this megatrain was built without the cuda feature; use --device cpu")
}

fn gib_to_bytes(g: f64) -> u64 {
    (g * (1u64 << 30) as f64) as u64
}

/// Host memory available to this run: `--host-mem`, else MemAvailable of /proc/meminfo (no
/// limit where that cannot be read).
fn host_available_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            let line = t.lines().find(|l| l.starts_with("MemAvailable:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
        })
        .unwrap_or(u64::MAX)
}

/// Resident set size of this process in bytes (Linux; `None` elsewhere).
fn rss_bytes() -> Option<u64> {
    let t = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = t.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// Plans the step (chunking, ring depth, bytes per place, PCIe bytes) and prints it; refuses an
/// impossible plan before anything is allocated.
fn make_plan(args: &TrainArgs, cfg: &ModelConfig, gpu_bytes: u64, host_bytes: u64) -> Result<Plan> {
    let host_bytes = args.host_mem.map_or(host_bytes, gib_to_bytes);
    let gpu_bytes = args.gpu_mem.map_or(gpu_bytes, gib_to_bytes);
    let p = plan(&PlanInput {
        cfg: cfg.clone(),
        batch: args.batch_size,
        seq: args.seq_len,
        weight_dtype: args.precision.into(),
        grad_dtype: args.grad_dtype.into(),
        mode: args.optim_mode.into(),
        gpu_bytes,
        host_bytes,
        ring_depth: Some(args.ring_depth),
        n_chunks: args.chunks,
        rows_per_block: args.rows_per_block,
    })
    .context("no memory plan fits this machine (set --chunks, --batch-size, --gpu-mem or --host-mem)")?;
    eprintln!("{p}");
    Ok(p)
}

#[allow(clippy::too_many_arguments)]
fn run<B: Backend>(
    args: &TrainArgs,
    cfg: &ModelConfig,
    source: String,
    layout: ModelLayout,
    plan: Plan,
    backend: B,
    t0: Instant,
    trace_step: usize,
    data: Dataset,
) -> Result<TrainSummary> {
    let (store, resumed) = open_store(args, &layout)?;
    let store = Arc::new(store);
    if !resumed {
        init_store(&store, args.seed).context("initialising the model")?;
    }
    let mut eopts = engine_options(args);
    eopts.n_chunks = plan.n_chunks;
    eopts.ring_depth = plan.ring_depth;
    let mut engine = Engine::new(cfg, Arc::clone(&store), backend, eopts)?;
    // A store left by a crashed exact-mode run may hold a complete step's gradients whose
    // update was never applied; applying it now is bitwise what the next step would do.
    engine.flush_pending()?;
    let start_step = store.state().step;
    let end_step = start_step + args.steps as u64;

    let progress = Progress::new(args.steps, end_step, args.log_every);
    if let (true, Some(path)) = (resumed, &args.store) {
        progress.note(format_args!("resumed from {} at step {start_step}", path.display()));
    }
    let mut log = match &args.metrics {
        Some(p) => {
            let mut log = MetricsLog::open(p)?;
            log.write(&metrics::run_record(&RunInfo {
                args,
                cfg,
                source: &source,
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
        total: args.schedule_steps.map_or(end_step, |n| n as u64),
        kind: args.schedule,
    };
    let (mut first_loss, mut train_s) = (None, 0.0);
    let mut last: Option<StepReport> = None;
    let mut totals = StepTotals::default();
    let mut later_s = Vec::new();
    for k in start_step..end_step {
        let _span = tracing::info_span!("step", step = k + 1).entered();
        let batch = data.batch(args.seed, k, args.batch_size, args.seq_len);
        let lr = schedule.lr(k);
        let r = engine.step(&batch, lr).with_context(|| format!("training step {}", k + 1))?;
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
            log.write(&metrics::step_record(k + 1, lr, &r, plan.flops_per_step))?;
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
    engine.flush_pending().context("applying the last update")?;
    store.flush().context("flushing the host store")?;

    let last = last.context("no step was run")?;
    Ok(TrainSummary {
        model: source,
        n_params: layout.n_params(),
        n_layers: layout.n_layers,
        start_step,
        end_step: store.state().step,
        first_loss: first_loss.unwrap_or(last.loss),
        last_loss: last.loss,
        tokens_per_step: args.batch_size * args.seq_len,
        train_s,
        wall_s: t0.elapsed().as_secs_f64(),
        store_bytes: store.bytes(),
        store_bytes_per_param: store.bytes_per_param(),
        rss_bytes: rss_bytes(),
        flops_per_step: plan.flops_per_step,
        later_step_s: (!later_s.is_empty()).then(|| later_s.iter().sum::<f64>() / later_s.len() as f64),
        store_path: store.path().map(Path::to_owned),
        h2d_bytes_per_step: totals.h2d_bytes_per_step(),
        d2h_bytes_per_step: totals.d2h_bytes_per_step(),
        streams: totals.stream_means(),
    })
}

/// The step of this invocation (1-based) that `--trace` records: `--trace-step`, else 2 (the
/// first step is a warm-up: buffers are allocated and worker threads start), or 1 for a
/// one-step run. Refuses a step past `--steps` and a trace path whose directory is missing,
/// before any training step runs.
fn check_trace(args: &TrainArgs) -> Result<usize> {
    let step = args.trace_step.unwrap_or(if args.steps >= 2 { 2 } else { 1 });
    if step > args.steps {
        bail!(
            "--trace-step {step} is past the last step of this run (--steps {}); use 1..={}",
            args.steps,
            args.steps
        );
    }
    if let Some(path) = &args.trace {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            bail!("--trace {}: directory {} does not exist; create it first", path.display(), dir.display());
        }
    }
    Ok(step)
}

/// Refuses option combinations the model or the engine cannot run, naming the option to change.
fn check_sizes(args: &TrainArgs, cfg: &ModelConfig) -> Result<()> {
    if args.seq_len > cfg.max_position_embeddings {
        bail!(
            "--seq-len {} exceeds the model's max_position_embeddings ({}); use a shorter sequence",
            args.seq_len,
            cfg.max_position_embeddings
        );
    }
    cfg.check_seq_len(args.seq_len).context("--seq-len")?;
    if let Some(c) = args.chunks.filter(|&c| c > args.batch_size) {
        bail!(
            "--chunks {c} exceeds --batch-size {}: each chunk holds at least one whole sequence",
            args.batch_size
        );
    }
    if args.grad_dtype == GradDtypeArg::None && args.optim_mode == OptimModeArg::Exact {
        bail!(
            "--grad-dtype none needs --optim-mode lean: exact mode keeps each step's gradient in the \
             store until the next step"
        );
    }
    Ok(())
}

/// The `--store` file (opened if it exists, else created) or an anonymous store; `true` when
/// an existing store was opened.
fn open_store(args: &TrainArgs, layout: &ModelLayout) -> Result<(HostStore, bool)> {
    let Some(path) = &args.store else {
        return Ok((HostStore::anonymous(layout, args.grad_dtype.into())?, false));
    };
    if path.exists() {
        let s = HostStore::open(path, layout).with_context(|| {
            format!("cannot resume from --store {} (is it for this model?)", path.display())
        })?;
        Ok((s, true))
    } else {
        let s = HostStore::create(path, layout, args.grad_dtype.into())
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
    opts
}

//! `megatrain train`: checks the options against the model, opens or creates the host store
//! (initialising a new one, resuming an existing one), runs the engine step by step with the
//! learning-rate schedule, logs metrics, applies the last pending update and summarises.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use mt_core::{ModelConfig, ModelLayout};
use mt_sched::{CpuBackend, CpuOptions, Engine, EngineOptions, StepReport};
use mt_store::HostStore;

use crate::cli::{DeviceKind, GradDtypeArg, OptimModeArg, TrainArgs};
use crate::data::Dataset;
use crate::init::init_store;
use crate::metrics::{self, MetricsLog, RunInfo};
use crate::report::{Progress, StepLine, TrainSummary};
use crate::schedule::LrSchedule;

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
    let data =
        Dataset::new(args.data, cfg.vocab_size).with_context(|| format!("--data for model {source}"))?;

    let layout = ModelLayout::new(&cfg);
    let (store, resumed) = open_store(args, &layout)?;
    let store = Arc::new(store);
    if !resumed {
        init_store(&store, args.seed).context("initialising the model")?;
    }
    let mut engine = Engine::new(&cfg, Arc::clone(&store), backend(args)?, engine_options(args))?;
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
                cfg: &cfg,
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
        if let Some(log) = &mut log {
            log.write(&metrics::step_record(k + 1, lr, &r))?;
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
        store_path: store.path().map(Path::to_owned),
        h2d_bytes_per_step: last.h2d_bytes,
        d2h_bytes_per_step: last.d2h_bytes,
        last_streams: last.streams,
    })
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
    if args.chunks > args.batch_size {
        bail!(
            "--chunks {} exceeds --batch-size {}: each chunk holds at least one whole sequence",
            args.chunks,
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

/// The backend for `--device`. On CUDA this is the threaded backend over candle's CUDA device:
/// correct, but its copies do not overlap compute yet (see `mt_sched::cpu`).
fn backend(args: &TrainArgs) -> Result<CpuBackend> {
    let opts = CpuOptions::uniform(args.delay_us, args.seed);
    let device = match args.device {
        DeviceKind::Cpu => candle_core::Device::Cpu,
        DeviceKind::Cuda => candle_core::Device::new_cuda(0).context("--device cuda: cannot open GPU 0")?,
    };
    Ok(CpuBackend::on_device(device, opts))
}

fn engine_options(args: &TrainArgs) -> EngineOptions {
    let mut opts = EngineOptions {
        weight_dtype: args.precision.into(),
        ring_depth: args.ring_depth,
        n_chunks: args.chunks,
        mode: args.optim_mode.into(),
        clip: (args.clip > 0.0).then_some(args.clip),
        ..EngineOptions::default()
    };
    opts.adamw.lr = args.lr;
    opts.adamw.weight_decay = args.weight_decay;
    opts
}

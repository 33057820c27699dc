//! The `--metrics` JSON Lines log: its schema and its writer.
//!
//! One JSON object per line, appended to the file (a resumed run adds to the same log). Each
//! invocation writes one `run` record, then one `step` record per optimizer step. Units are in the
//! field names. Schema version [`SCHEMA_VERSION`]:
//!
//! `{"type": "run", ...}`
//! - `schema_version` (1), `megatrain_version`, `machine` (`os`, `arch`, `cpus`)
//! - `model`: `source` (config path or `"builtin:tiny_llama"`), `arch`, `vocab_size`,
//!   `hidden_size`, `intermediate_size`, `num_hidden_layers`, `num_attention_heads`,
//!   `num_key_value_heads`, `head_dim`, `max_position_embeddings`, `tie_word_embeddings`
//! - `options`: every `megatrain train` option as given (defaults filled in)
//! - `n_params`, `start_step`, `resumed`, `tokens_per_step`
//! - `store_bytes`, `store_bytes_per_param`, `store_path` (null for an anonymous store),
//!   `frozen_base_bytes` (a LoRA run's frozen base in host memory; 0 without LoRA),
//!   `base_dtype` (how it is held: `fp32`, `bf16`, `int8`, `nf4`; null without LoRA)
//! - `model_flops_per_step` and `flops_formula`: `6*N*T + 6*L*S*H*T` (N active parameters: all
//!   of a dense model, a mixture of experts' router and the k experts a token reaches; T
//!   tokens per step, L layers, S sequence length, H hidden size; recompute not counted, causal
//!   mask ignored; `mt_core::model_flops_per_step`)
//!
//! `{"type": "eval", ...}` (with an eval split: every `--eval-every` steps and after the last)
//! - `step`, `eval_loss` (mean cross-entropy over every held-out target, nats), `eval_targets`,
//!   `eval_ms`
//!
//! `{"type": "step", ...}`
//! - `step`: global step number after this step (1-based); `loss` (mean cross-entropy over the
//!   step's targets, nats, f64 written in shortest round-trip form: equal strings = equal bits);
//!   `lr` (the rate of this step's gradient); `grad_norm` (global L2 norm before clipping);
//!   `skipped`: null, or why the step applied no update (a non-finite loss or gradient norm);
//!   `skipped_steps`: steps skipped so far in the run (resumed runs included)
//! - `tokens`, `step_ms`, `tokens_per_s`, `model_tflops`, `h2d_bytes`, `d2h_bytes`,
//!   `rss_bytes` (host resident set after the step; null where it cannot be read)
//! - with a store paged from its file (the disk tier): `store_read_ahead_bytes`,
//!   `store_evicted_bytes`, `store_stalled_s` (the step waiting for write-back), the pager's
//!   totals since the run began (setup included)
//! - `io_read_bytes`, `io_write_bytes`: the process's storage I/O so far (Linux /proc/self/io;
//!   null elsewhere)
//! - per stream `S` in `host` (the CPU optimizer: staging casts, AdamW updates, gradient
//!   landing), `h2d`, `compute`, `d2h`: `S_busy_frac` (busy time / step time) and `S_max_gap_ms`
//!   (longest idle gap between two of its operations)

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use clap::ValueEnum;
use mt_core::{Error, Result};
use mt_sched::stats::StreamStats;
use mt_train::{stream_name, EvalResult, RunStart, StepEvent};
use serde_json::{json, Map, Value};

use crate::cli::TrainArgs;

/// The FLOPs convention, as written into the run record.
pub const FLOPS_FORMULA: &str = "6*N*T + 6*L*S*H*T";

/// Version of the record layout above; bump on any incompatible change.
pub const SCHEMA_VERSION: u32 = 1;

/// An open metrics log.
#[derive(Debug)]
pub struct MetricsLog {
    out: BufWriter<File>,
    path: PathBuf,
}

impl MetricsLog {
    /// Opens `path` for appending, creating it if missing.
    pub fn open(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| Error::Io { path: path.to_owned(), source })?;
        Ok(MetricsLog { out: BufWriter::new(file), path: path.to_owned() })
    }

    /// Appends one record as a line and flushes it (a crashed run leaves a readable log).
    pub fn write(&mut self, record: &Value) -> Result<()> {
        let io = |source| Error::Io { path: self.path.clone(), source };
        serde_json::to_writer(&mut self.out, record)
            .map_err(|e| Error::Io { path: self.path.clone(), source: e.into() })?;
        self.out.write_all(b"\n").map_err(io)?;
        self.out.flush().map_err(io)
    }
}

fn name_of<E: ValueEnum>(e: &E) -> Value {
    e.to_possible_value().map_or(Value::Null, |v| json!(v.get_name()))
}

/// The `run` record that opens an invocation's part of the log: the options of `args`, the run
/// as it starts.
pub fn run_record(a: &TrainArgs, info: &RunStart<'_>) -> Value {
    let c = info.cfg;
    json!({
        "type": "run",
        "schema_version": SCHEMA_VERSION,
        "megatrain_version": env!("CARGO_PKG_VERSION"),
        "machine": {
            "os": std::env::consts::OS,
            "arch": std::env::consts::ARCH,
            "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        },
        "model": {
            "source": info.source,
            "arch": format!("{:?}", c.arch).to_lowercase(),
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": c.tie_word_embeddings,
        },
        "options": {
            "config": a.config,
            "model": a.model,
            "data": mt_train::data::describe_source(&a.data),
            "no_shuffle": a.no_shuffle,
            "no_pack": a.no_pack,
            "truncate": a.truncate,
            "eval_fraction": a.eval_fraction,
            "eval_every": a.eval_every,
            "out": a.out,
            "export_dtype": name_of(&a.export_dtype),
            "save_every": a.save_every,
            "checkpoint_dir": a.checkpoint_dir,
            "resume": a.resume,
            "beta1": a.beta1,
            "beta2": a.beta2,
            "eps": a.eps,
            "steps": a.steps,
            "batch_size": a.batch_size,
            "seq_len": a.seq_len,
            "chunks": a.chunks,
            "lr": info.lr,
            "weight_decay": a.weight_decay,
            "clip": a.clip,
            "max_skipped_steps": a.max_skipped_steps,
            "warmup": a.warmup,
            "schedule": name_of(&a.schedule),
            "schedule_steps": a.schedule_steps,
            "seed": a.seed,
            "ring_depth": a.ring_depth,
            "optimizer_overlap": !a.no_optimizer_overlap,
            "rows_per_block": a.rows_per_block,
            "gpu_mem_gib": a.gpu_mem,
            "host_mem_gib": a.host_mem,
            "optim_mode": name_of(&a.optim_mode),
            "precision": name_of(&a.precision),
            "device": name_of(&a.device),
            "store": a.store,
            "grad_dtype": name_of(&a.grad_dtype()),
            "optim_states": name_of(&a.optim_states),
            "delay_us": a.delay_us,
        },
        "n_params": info.n_params,
        "start_step": info.start_step,
        "resumed": info.resumed,
        "tokens_per_step": a.batch_size * a.seq_len,
        "store_bytes": info.store_bytes,
        "store_bytes_per_param": info.store_bytes_per_param,
        "store_path": info.store_path,
        "frozen_base_bytes": info.frozen_base_bytes,
        "base_dtype": info.frozen_base_dtype.map(|d| d.name()),
        "model_flops_per_step": info.flops_per_step,
        "flops_formula": FLOPS_FORMULA,
    })
}

/// The `eval` record: held-out loss after global step `e.step`.
pub fn eval_record(e: &EvalResult) -> Value {
    json!({"type": "eval", "step": e.step, "eval_loss": e.loss, "eval_targets": e.targets, "eval_ms": 1e3 * e.secs})
}

/// Bytes this process has read from and written to storage so far (Linux; `None` elsewhere).
fn storage_io() -> Option<(u64, u64)> {
    let t = std::fs::read_to_string("/proc/self/io").ok()?;
    let field = |name: &str| -> Option<u64> {
        t.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse().ok())
    };
    Some((field("read_bytes:")?, field("write_bytes:")?))
}

/// The `step` record of a step; `rss_bytes`: the host's resident set after it.
pub fn step_record(s: &StepEvent<'_>, rss_bytes: Option<u64>) -> Value {
    let (step, lr, r, flops_per_step) = (s.step, s.lr, s.report, s.flops_per_step);
    let mut m = Map::new();
    m.insert("type".into(), json!("step"));
    m.insert("step".into(), json!(step));
    m.insert("loss".into(), json!(r.loss));
    m.insert("lr".into(), json!(lr));
    m.insert("grad_norm".into(), json!(r.grad_norm));
    m.insert("skipped".into(), json!(r.skipped.as_ref().map(|s| s.cause.to_string())));
    m.insert("skipped_steps".into(), json!(s.skipped_steps));
    m.insert("tokens".into(), json!(r.n_tokens));
    m.insert("step_ms".into(), json!(r.step_s * 1e3));
    m.insert("tokens_per_s".into(), json!(s.tokens_per_s()));
    m.insert(
        "model_tflops".into(),
        json!(if r.step_s > 0.0 { flops_per_step / r.step_s / 1e12 } else { 0.0 }),
    );
    m.insert("h2d_bytes".into(), json!(r.h2d_bytes));
    m.insert("d2h_bytes".into(), json!(r.d2h_bytes));
    m.insert("rss_bytes".into(), json!(rss_bytes));
    if let Some(p) = s.paging {
        m.insert("store_read_ahead_bytes".into(), json!(p.read_ahead_bytes));
        m.insert("store_evicted_bytes".into(), json!(p.evicted_bytes));
        m.insert("store_stalled_s".into(), json!(p.stalled_s));
    }
    let (io_read, io_write) = storage_io().unzip();
    m.insert("io_read_bytes".into(), json!(io_read));
    m.insert("io_write_bytes".into(), json!(io_write));
    // Running maxima since the engine started (setup and earlier steps included), not this
    // step's own peak: the most the run needed so far.
    if let Some(p) = r.device_peak {
        m.insert("gpu_peak_bytes".into(), json!(p.used));
        m.insert("gpu_reserved_peak_bytes".into(), json!(p.reserved));
    }
    for s in &r.streams {
        add_stream(&mut m, s);
    }
    Value::Object(m)
}

fn add_stream(m: &mut Map<String, Value>, s: &StreamStats) {
    let name = stream_name(s.stream);
    m.insert(format!("{name}_busy_frac"), json!(s.busy_frac));
    m.insert(format!("{name}_max_gap_ms"), json!(s.max_gap_s * 1e3));
}

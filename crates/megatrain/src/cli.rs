//! The command line: clap structures for `megatrain` and its `train` subcommand, with the value
//! parsers that refuse nonsense (zero sizes, negative rates) before anything is allocated.

use std::path::PathBuf;

use candle_core::DType;
use clap::{Args, Parser, Subcommand, ValueEnum};
use mt_sched::OptimMode;
use mt_store::GradDtype;

/// Train LLMs larger than GPU memory on one GPU by streaming layers through it.
#[derive(Debug, Parser)]
#[command(name = "megatrain", version, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model. With no arguments: the built-in tiny Llama on built-in text, on the CPU.
    Train(TrainArgs),
}

/// Options of `megatrain train`.
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Hugging Face config.json of the model to train [default: the built-in tiny Llama with a
    /// byte-level vocabulary of 256]. `--data builtin` needs vocab_size >= 256.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,

    /// Training data: `builtin` = an embedded English text tokenised as bytes; `synthetic` =
    /// deterministic arithmetic token sequences (works with any vocabulary).
    #[arg(long, value_enum, default_value_t = DataKind::Builtin)]
    pub data: DataKind,

    /// Optimizer steps to run in this invocation (on top of any steps recorded in --store).
    #[arg(long, default_value_t = 60, value_parser = at_least_one)]
    pub steps: usize,

    /// Sequences per step (the global batch).
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    pub batch_size: usize,

    /// Tokens per sequence.
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    pub seq_len: usize,

    /// Token chunks per step: the batch runs through each layer in this many groups of
    /// sequences (gradient accumulation within the step; the gradient is the same to rounding)
    /// [default: the fewest that fit in device memory, chosen by the planner].
    #[arg(long, value_parser = at_least_one)]
    pub chunks: Option<usize>,

    /// Device memory the plan may assume, in GiB [default: the GPU's total memory; on the CPU,
    /// the available host memory].
    #[arg(long, value_name = "GIB", value_parser = positive_f64)]
    pub gpu_mem: Option<f64>,

    /// Host memory the plan may assume, in GiB [default: MemAvailable from /proc/meminfo].
    #[arg(long, value_name = "GIB", value_parser = positive_f64)]
    pub host_mem: Option<f64>,

    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-2, value_parser = non_negative, allow_negative_numbers = true)]
    pub lr: f64,

    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.1, value_parser = non_negative, allow_negative_numbers = true)]
    pub weight_decay: f64,

    /// Global gradient-norm clipping threshold (0 = off). Lean mode clips with the previous
    /// step's norm.
    #[arg(long, default_value_t = 1.0, value_parser = non_negative, allow_negative_numbers = true)]
    pub clip: f64,

    /// Steps of linear learning-rate warmup from lr/warmup to lr.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,

    /// Learning-rate schedule after warmup: `constant`, or `cosine` decay to 10% of --lr at the
    /// end of the schedule.
    #[arg(long, value_enum, default_value_t = ScheduleKind::Cosine)]
    pub schedule: ScheduleKind,

    /// Length of the learning-rate schedule in global steps [default: the step training starts
    /// at + --steps]. Set it when one run is split over several invocations with --store, so the
    /// cosine decay is the same as in one long run.
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    pub schedule_steps: Option<usize>,

    /// Seed of the model initialisation and of the data order (the data of step k depends only
    /// on the seed and k, so resumed runs see the same batches).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Device weight slots (1 = no overlap of copies and compute, 2 = double buffering).
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    pub ring_depth: usize,

    /// Rows of logits alive at once in the loss (larger = fewer LM-head gradient accumulations,
    /// more memory: the planner counts it).
    #[arg(long, default_value_t = 4096, value_parser = at_least_one, hide = true)]
    pub rows_per_block: usize,

    /// Ablation: run the CPU optimizer (staging, AdamW updates, gradient landing) serially with
    /// compute instead of overlapped with it.
    #[arg(long)]
    pub no_optimizer_overlap: bool,

    /// Optimizer placement: `exact` = global-norm clipping, each layer's update deferred to just
    /// before its next upload; `lean` = update each layer as soon as its gradient lands.
    #[arg(long, value_enum, default_value_t = OptimModeArg::Exact)]
    pub optim_mode: OptimModeArg,

    /// Weight dtype on the device (fp32 master weights stay on the host either way).
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,

    /// Compute device.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,

    /// File-backed host store (master weights, AdamW moments, gradient buffer). Created if
    /// missing; if it exists, training continues from the step recorded in it. Without it the
    /// store lives in anonymous memory and is lost at exit.
    #[arg(long, value_name = "PATH")]
    pub store: Option<PathBuf>,

    /// Gradient buffer dtype of a new store: `bf16` = 14 bytes/param, `f32` = 16 bytes/param,
    /// `none` = 12 bytes/param (lean mode only). An existing store keeps the dtype it was created
    /// with.
    #[arg(long, value_enum, default_value_t = GradDtypeArg::Bf16)]
    pub grad_dtype: GradDtypeArg,

    /// Debug: random delay of up to N microseconds before every CPU copy-stream job, to shake
    /// out missing waits.
    #[arg(long, default_value_t = 0, hide = true)]
    pub delay_us: u64,

    /// Print a log line every N steps (0 = never; the progress bar shows every step).
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub log_every: usize,

    /// Write per-step metrics as JSON Lines to PATH (appended; see the `metrics` module docs for
    /// the schema).
    #[arg(long, value_name = "PATH")]
    pub metrics: Option<PathBuf>,

    /// Write a Chrome trace (Trace Event Format; open in Perfetto or chrome://tracing) of one
    /// step to PATH: every host (CPU optimizer), H2D, compute and D2H operation with its start
    /// and duration. See the `trace` module docs for the layout.
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,

    /// Which step of this invocation --trace records (1-based, at most --steps) [default: 2, or 1
    /// when --steps is 1: the first step is a warm-up that allocates buffers and starts threads].
    #[arg(long, value_name = "N", value_parser = at_least_one, requires = "trace")]
    pub trace_step: Option<usize>,
}

impl Default for TrainArgs {
    /// The defaults of `megatrain train` with no arguments.
    fn default() -> Self {
        match Cli::try_parse_from(["megatrain", "train"]) {
            Ok(Cli { command: Command::Train(a) }) => a,
            Err(e) => unreachable!("the default command line parses: {e}"),
        }
    }
}

/// Source of training tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DataKind {
    /// Embedded English text, one token per byte.
    Builtin,
    /// Deterministic arithmetic sequences of token ids.
    Synthetic,
}

/// Learning-rate schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScheduleKind {
    /// Hold the peak rate.
    Constant,
    /// Cosine decay from the peak rate to 10% of it.
    Cosine,
}

/// Optimizer placement (see [`OptimMode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimModeArg {
    /// Exact global-norm clipping; updates deferred to the next step's forward.
    Exact,
    /// Per-layer updates during backward.
    Lean,
}

impl From<OptimModeArg> for OptimMode {
    fn from(m: OptimModeArg) -> Self {
        match m {
            OptimModeArg::Exact => OptimMode::Exact,
            OptimModeArg::Lean => OptimMode::Lean,
        }
    }
}

/// Weight dtype on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    /// 32-bit floats.
    Fp32,
    /// bfloat16.
    Bf16,
}

impl From<Precision> for DType {
    fn from(p: Precision) -> Self {
        match p {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }
}

/// Compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceKind {
    /// The CPU backend (candle CPU, worker threads as copy streams).
    Cpu,
    /// An NVIDIA GPU (needs a build with the `cuda` feature).
    Cuda,
}

/// Gradient buffer dtype of the host store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GradDtypeArg {
    /// fp32 gradients.
    F32,
    /// bf16 gradients.
    Bf16,
    /// No gradient buffer (lean mode updates from the landed gradient).
    None,
}

impl From<GradDtypeArg> for GradDtype {
    fn from(g: GradDtypeArg) -> Self {
        match g {
            GradDtypeArg::F32 => GradDtype::F32,
            GradDtypeArg::Bf16 => GradDtype::Bf16,
            GradDtypeArg::None => GradDtype::None,
        }
    }
}

fn at_least_one(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("expected a whole number, found {s:?} ({e})"))?;
    if n == 0 {
        return Err("must be at least 1".into());
    }
    Ok(n)
}

fn non_negative(s: &str) -> Result<f64, String> {
    let x: f64 = s.parse().map_err(|e| format!("expected a number, found {s:?} ({e})"))?;
    if !(x.is_finite() && x >= 0.0) {
        return Err(format!("must be a finite number >= 0, found {x}"));
    }
    Ok(x)
}

fn positive_f64(s: &str) -> Result<f64, String> {
    let x: f64 = s.parse().map_err(|e| format!("expected a number, found {s:?} ({e})"))?;
    if !(x.is_finite() && x > 0.0) {
        return Err(format!("must be a finite number > 0, found {x}"));
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn defaults_parse() {
        let a = TrainArgs::default();
        assert_eq!((a.steps, a.batch_size, a.seq_len, a.chunks), (60, 16, 64, None));
        assert!(a.config.is_none() && a.store.is_none());
    }

    #[test]
    fn zero_sizes_and_negative_rates_are_refused() {
        for bad in [["--seq-len", "0"], ["--steps", "0"], ["--lr", "-1"], ["--clip", "nan"]] {
            let r = Cli::try_parse_from(["megatrain", "train", bad[0], bad[1]]);
            let e = r.expect_err("must be refused").to_string();
            assert!(e.contains(bad[0]), "{e}");
        }
    }
}

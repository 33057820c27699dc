//! The command line: clap structures for `megatrain` and its `train` subcommand, with the value
//! parsers that refuse nonsense (zero sizes, negative rates) before anything is allocated.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

mod config_file;
mod values;
pub use config_file::{config_file_options, parse_args, ArgsError};
use values::{at_least_one, fraction, layer_count, mlp_rows, non_negative, parse_data, positive_f64};
pub use values::{
    AttentionArg, DataKind, DataSource, DeviceKind, ExportDtypeArg, GradDtypeArg, LayerCount, MlpRows,
    OptimModeArg, Precision, ResidentOuter, RopeAnglesArg, ScheduleKind,
};

/// Train LLMs larger than GPU memory on one GPU by streaming layers through it.
#[derive(Debug, Parser)]
#[command(name = "megatrain", version, about, propagate_version = true, args_override_self = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per process; boxing would only add noise
pub enum Command {
    /// Train a model. With no arguments: the built-in tiny Llama on built-in text, on the CPU.
    Train(TrainArgs),
    /// Estimate host RAM, pinned RAM, GPU memory, PCIe bytes and step time of a training run
    /// without running it.
    Estimate(EstimateArgs),
    /// Write a seeded random initialisation of a model config as a Hugging Face directory.
    Init(InitArgs),
}

/// Options of `megatrain estimate`.
#[derive(Debug, Clone, Args)]
pub struct EstimateArgs {
    /// Hugging Face model directory (only config.json and the safetensors headers are read).
    #[arg(long, value_name = "DIR", conflicts_with = "config")]
    pub model: Option<PathBuf>,
    /// Hugging Face config.json [default: the built-in tiny Llama].
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Sequences per step.
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    pub batch_size: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    pub seq_len: usize,
    /// Token chunks per step [default: the fewest that fit].
    #[arg(long, value_parser = at_least_one)]
    pub chunks: Option<usize>,
    /// Device weight slots.
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    pub ring_depth: usize,
    /// Weight dtype on the device.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
    /// Optimizer placement.
    #[arg(long, value_enum, default_value_t = OptimModeArg::Exact)]
    pub optim_mode: OptimModeArg,
    /// Gradient buffer dtype of the store [default: as `megatrain train`: f32 with --precision
    /// fp32, bf16 with bf16].
    #[arg(long, value_enum)]
    pub grad_dtype: Option<GradDtypeArg>,
    /// The device the run would use: on `cpu` the device buffers are host memory too.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// As `megatrain train --resident-outer`.
    #[arg(long, value_enum, default_value_t = ResidentOuter::Auto)]
    pub resident_outer: ResidentOuter,
    /// As `megatrain train --resident-layers`.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub resident_layers: LayerCount,
    /// As `megatrain train --kept-layers`.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub kept_layers: LayerCount,
    /// As `megatrain train --held-layers`.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub held_layers: LayerCount,
    /// As `megatrain train --gpu-updated-layers`.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub gpu_updated_layers: LayerCount,
    /// As `megatrain train --late-state-downloads`.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub late_state_downloads: LayerCount,
    /// As `megatrain train --early-state-uploads`.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub early_state_uploads: LayerCount,
    /// As `megatrain train --attention`.
    #[arg(long, value_enum, default_value_t = AttentionArg::Auto)]
    pub attention: AttentionArg,
    /// As `megatrain train --mlp-rows`.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = mlp_rows)]
    pub mlp_rows: MlpRows,
    /// As `megatrain train --spill-checkpoints`.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub spill_checkpoints: LayerCount,
    /// GPU memory in GiB (for --device cuda) [default: 139.8, one H200].
    #[arg(long, value_name = "GIB", value_parser = positive_f64)]
    pub gpu_mem: Option<f64>,
    /// Host memory in GiB [default: MemAvailable of this machine].
    #[arg(long, value_name = "GIB", value_parser = positive_f64)]
    pub host_mem: Option<f64>,
    /// Compute capability of the GPU the estimate is for (`major.minor`, e.g. `8.0` for an A100).
    /// At 9.0 and above bf16 runs through the fused kernels, whose transient memory the planner
    /// counts smaller than candle's ops' (bf16 scores and logits); `megatrain train` reads the
    /// real device instead.
    #[arg(long, default_value_t = 9.0, value_name = "MAJOR.MINOR", value_parser = positive_f64)]
    pub compute_capability: f64,
    /// Sustained TFLOP/s of the device's compute stream alone, recompute included (measured on an
    /// H200 with every layer resident, build 1b473bc: 467 at 4 x 2048 tokens per step with every
    /// layer's activations kept, 474 at 16 x 2048 counting the 24 layers' recompute; 2026-11-23).
    /// On the CPU, measure your own.
    #[arg(long, default_value_t = 465.0, value_parser = positive_f64)]
    pub tflops: f64,
    /// PCIe bandwidth per direction in GB/s with both directions busy (H200 machine: 50.9).
    #[arg(long, default_value_t = 50.0, value_parser = positive_f64)]
    pub pcie_gbs: f64,
    /// Host memory bandwidth in GB/s that the optimizer's passes sustain (AdamW, the casts into
    /// staging, the gradient land; each priced by its bytes read and written per parameter).
    /// Measured on the 16-core H200 machine: the fused AdamW pass at 5.0 Gparam/s x 28 B inside
    /// a streamed step (the backward's casts and land, under concurrent DMA, run at ~60% of it
    /// but hide behind the GPU's backward).
    #[arg(long, default_value_t = 140.0, value_parser = positive_f64)]
    pub host_gbs: f64,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Options of `megatrain init`.
#[derive(Debug, Clone, Args)]
pub struct InitArgs {
    /// Hugging Face config.json of the model.
    #[arg(long, value_name = "PATH")]
    pub config: PathBuf,
    /// Output directory (Hugging Face format).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Seed of the initialisation (the same as `megatrain train --config PATH --seed N`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Weight dtype of the safetensors.
    #[arg(long, value_enum, default_value_t = ExportDtypeArg::Bf16)]
    pub export_dtype: ExportDtypeArg,
}

/// Options of `megatrain train`.
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Options from a TOML file: the same keys as the flags (`batch-size = 8` or
    /// `batch_size = 8`; `no-shuffle = true` for a switch). Flags on the command line win.
    #[arg(long, value_name = "PATH")]
    pub config_file: Option<PathBuf>,

    /// Hugging Face model directory to fine-tune: config.json, model.safetensors or sharded
    /// safetensors with model.safetensors.index.json (bf16, fp16 or fp32), and tokenizer.json
    /// (+ tokenizer_config.json with the chat template) for text and chat data.
    #[arg(long, value_name = "DIR", conflicts_with = "config")]
    pub model: Option<PathBuf>,

    /// Hugging Face config.json of a model to train from a seeded random initialisation
    /// [default: the built-in tiny Llama with a byte-level vocabulary of 256]. `--data builtin`
    /// needs vocab_size >= 256.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,

    /// Training data: `builtin` = an embedded English text tokenised as bytes; `synthetic` =
    /// deterministic arithmetic token sequences (works with any vocabulary); or a JSON Lines
    /// file with one of `{"text": ...}`, `{"messages": [...]}` (chat, loss on assistant turns
    /// only) or `{"input_ids": [...]}` per line.
    #[arg(long, value_name = "builtin|synthetic|FILE", default_value = "builtin", value_parser = parse_data)]
    pub data: DataSource,

    /// Do not shuffle: step k trains on sequences k*B .. k*B+B-1 in file order (for
    /// pre-tokenised lines of exactly --seq-len tokens: lines k*B .. k*B+B-1).
    #[arg(long)]
    pub no_shuffle: bool,

    /// One sample per sequence (padded) instead of packing short samples together.
    #[arg(long)]
    pub no_pack: bool,

    /// Cut samples longer than --seq-len instead of refusing them.
    #[arg(long)]
    pub truncate: bool,

    /// Fraction of the samples of --data held out for evaluation (0 = none).
    #[arg(long, default_value_t = 0.0, value_parser = fraction)]
    pub eval_fraction: f64,

    /// A separate JSON Lines file of held-out samples (same formats as --data, packed the same
    /// way); exclusive with --eval-fraction.
    #[arg(long, value_name = "FILE", conflicts_with = "eval_fraction")]
    pub eval_data: Option<PathBuf>,

    /// Evaluate the held-out loss every N steps (0 = only after the last step).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub eval_every: usize,

    /// Write the trained model after the last step as a Hugging Face directory (config.json,
    /// safetensors, tokenizer files copied from --model) that transformers loads unchanged.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,

    /// Weight dtype of the exported safetensors.
    #[arg(long, value_enum, default_value_t = ExportDtypeArg::Fp32)]
    pub export_dtype: ExportDtypeArg,

    /// Write a crash-consistent checkpoint (store snapshot + manifest) every K steps (0 = never).
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub save_every: usize,

    /// Checkpoint directory [default: OUT/checkpoints].
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,

    /// Checkpoints kept (older ones are removed once a newer one is complete).
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    pub keep_checkpoints: usize,

    /// Continue from the newest complete checkpoint in the checkpoint directory (same options;
    /// --steps is then the run's total, so rerunning the interrupted command with --resume
    /// finishes it). Starts from scratch when there is none yet.
    #[arg(long)]
    pub resume: bool,

    /// Optimizer steps: with --resume, the run's total; otherwise the steps of this invocation
    /// (on top of any steps recorded in --store).
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

    /// AdamW beta1.
    #[arg(long, default_value_t = 0.9, value_parser = fraction)]
    pub beta1: f64,

    /// AdamW beta2.
    #[arg(long, default_value_t = 0.999, value_parser = fraction)]
    pub beta2: f64,

    /// AdamW epsilon.
    #[arg(long, default_value_t = 1e-8, value_parser = positive_f64)]
    pub eps: f64,

    /// Global gradient-norm clipping threshold (0 = off). Lean mode clips with the previous
    /// step's norm.
    #[arg(long, default_value_t = 1.0, value_parser = non_negative, allow_negative_numbers = true)]
    pub clip: f64,

    /// Steps of linear learning-rate warmup from lr/warmup to lr.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,

    /// Learning-rate schedule after warmup: `constant`, `linear` decay to 0 or `cosine` decay to
    /// 10% of --lr at the end of the schedule.
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

    /// Where the outer unit's (embedding, final norm, LM head) fp32 master weights and AdamW
    /// moments live during training: `on` = on the GPU, updated there (it never crosses PCIe),
    /// `off` = streamed through the host optimizer like a layer, `auto` = on when the GPU has
    /// room for it without more chunks (always off on the CPU).
    #[arg(long, value_enum, default_value_t = ResidentOuter::Auto)]
    pub resident_outer: ResidentOuter,

    /// How many leading decoder layers stay on the GPU with their weights, fp32 gradients,
    /// master weights and AdamW moments (updated there; they never cross PCIe nor cost the
    /// host optimizer anything): a number, or `auto` = as many as fit beside the step's
    /// chunking (always 0 on the CPU or with a file-backed --store).
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub resident_layers: LayerCount,

    /// How many leading decoder layers keep their forward activations on the GPU for the
    /// backward instead of recomputing them from the layer input (the same gradients bit for
    /// bit, a quarter fewer GEMM FLOPs for those layers): a number, or `auto` = as many as fit
    /// in the GPU memory that residency leaves (bf16 only; always 0 on the CPU).
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub kept_layers: LayerCount,

    /// How many of the last decoder layers, streamed ones, are uploaded once a step and held on
    /// the GPU from their forward to their backward (no re-cast on the host, no second upload;
    /// their weights' bytes of GPU memory each): a number, or `auto` = as many streamed layers
    /// as fit in what residency leaves (always 0 on the CPU).
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub held_layers: LayerCount,

    /// How many streamed decoder layers (spread evenly among them) have their exact-mode AdamW
    /// update run on the GPU instead of the host: their fp32 master weights, moments and stored
    /// gradient go up from the host store (page-locked in place) and master and moments come
    /// back, 12 B/param more each way over PCIe, which the forward leaves mostly idle; the host's
    /// AdamW pass (28 B/param of host memory traffic, which bounds a streamed step) shrinks by
    /// those layers, though their state's DMA still moves 26 B/param through host memory.
    /// Bitwise the same training. A number, or `auto` = the count with the shortest forward
    /// (host memory traffic against those uploads, in the planner's model; always 0 on the CPU,
    /// in lean mode or with a file-backed --store, which refuses a number too).
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub gpu_updated_layers: LayerCount,

    /// Of the GPU-updated layers that are held (--held-layers), how many keep their state on the
    /// GPU from their update into the backward and download it there (spread over it, each
    /// before its layer's gradient lands): 12 B/param of host memory traffic and D2H move out
    /// of the forward, which host memory
    /// bounds, into the backward, whose D2H carries only gradients. Each costs a state slot of
    /// GPU memory (14-16 B/param); any costs two more gradient buffers. Bitwise the same
    /// training. A number, or `auto` = as many as the backward's D2H has time for (always 0
    /// without GPU-updated layers).
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub late_state_downloads: LayerCount,

    /// Of the GPU-updated layers that do not download late, how many get their state for the
    /// next step during this step's backward: master and moments go up into a state slot once
    /// it is free (at the loss, or right after a late download), the gradient is copied there on
    /// the GPU: 14 B/param of host memory traffic and H2D leave the forward, 12 go into the
    /// backward, whose H2D is idle when every streamed layer is held (with layers that are not,
    /// their re-cast uploads queue behind these). No GPU memory of their own; at most one per
    /// late download (each early layer needs a late one at least ring-depth layers after it).
    /// Bitwise the same training. A number, or `auto` = as many as the backward's H2D and host
    /// memory have room for (0 unless every streamed layer is held) and that pair.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub early_state_uploads: LayerCount,

    /// Attention kernels: `flash` = flash attention (O(seq) memory; bf16 on a CUDA GPU with a head
    /// dim of 16, 32, 64 or 128), `materialized` = the `[batch, heads, seq, seq]` scores,
    /// `auto` = flash wherever it runs.
    #[arg(long, value_enum, default_value_t = AttentionArg::Auto)]
    pub attention: AttentionArg,

    /// Rows (tokens) of each decoder layer's MLP tile, so that no `[seq, ffn]` tensor exists
    /// whole: a number (0 = a chunk's rows at once), or `auto` = a chunk at once when it fits,
    /// else the largest of 8192, 4096, 2048, 1024 rows that fits.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = mlp_rows)]
    pub mlp_rows: MlpRows,

    /// How many layer inputs (checkpoints; the first layers', needed last) go down to page-locked
    /// host memory after their layer's forward and come back for its backward, on the copy
    /// streams beside compute: a number, or `auto` = the fewest with which the step fits the GPU
    /// (their host memory is counted in the plan; always 0 on the CPU).
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count)]
    pub spill_checkpoints: LayerCount,

    /// How RoPE angles `position · inv_freq` are formed: `transformers` = in f32, as transformers
    /// and the inference engines that follow it do (the model as its checkpoint defines it; off
    /// by up to 2e-3 rad at position 32768 and 0.031 rad at 524287), `exact` = in f64, for models
    /// whose inference computes them exactly.
    #[arg(long, value_enum, default_value_t = RopeAnglesArg::Transformers)]
    pub rope_angles: RopeAnglesArg,

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
    /// `none` = 12 bytes/param (lean mode only) [default: f32 with --precision fp32, bf16 with
    /// --precision bf16]. An existing store keeps the dtype it was created with.
    #[arg(long, value_enum)]
    pub grad_dtype: Option<GradDtypeArg>,

    /// Debug: random delay of up to N microseconds before every CPU copy-stream job, to shake
    /// out missing waits.
    #[arg(long, default_value_t = 0, hide = true)]
    pub delay_us: u64,

    /// Test hook: abort the process (SIGABRT, as a crash) right after global step N and its
    /// checkpoint, if any.
    #[arg(long, value_name = "N", hide = true)]
    pub abort_after_step: Option<u64>,

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

impl TrainArgs {
    /// The store's gradient dtype: `--grad-dtype`, else the one matching `--precision`.
    pub fn grad_dtype(&self) -> GradDtypeArg {
        default_grad_dtype(self.grad_dtype, self.precision)
    }
}

/// `--grad-dtype` if given, else f32 gradients for fp32 training (so `--precision fp32` is
/// AdamW on exact fp32 gradients, as torch's) and bf16 for bf16 training (14 B/param).
pub fn default_grad_dtype(given: Option<GradDtypeArg>, precision: Precision) -> GradDtypeArg {
    given.unwrap_or(match precision {
        Precision::Fp32 => GradDtypeArg::F32,
        Precision::Bf16 => GradDtypeArg::Bf16,
    })
}

impl Default for TrainArgs {
    /// The defaults of `megatrain train` with no arguments.
    fn default() -> Self {
        match Cli::try_parse_from(["megatrain", "train"]) {
            Ok(Cli { command: Command::Train(a) }) => a,
            Ok(other) => unreachable!("`megatrain train` parsed as {other:?}"),
            Err(e) => unreachable!("the default command line parses: {e}"),
        }
    }
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
    fn a_config_file_sets_options_and_the_command_line_wins() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("run.toml");
        std::fs::write(
            &f,
            "batch_size = 3\nseq-len = 32\nlr = 0.002\nno-shuffle = true\ndata = \"synthetic\"\nout = \"-odd\"\n",
        )
        .unwrap();
        let argv = |extra: &[&str]| {
            let mut v: Vec<String> =
                ["megatrain", "train", "--config-file", f.to_str().unwrap()].map(String::from).to_vec();
            v.extend(extra.iter().map(|s| s.to_string()));
            v
        };
        let Command::Train(a) = parse_args(argv(&[])).unwrap().command else { panic!("train") };
        assert_eq!((a.batch_size, a.seq_len, a.lr, a.no_shuffle), (3, 32, 0.002, true));
        assert_eq!(a.data, DataSource::Builtin(DataKind::Synthetic));
        assert_eq!(a.out, Some(PathBuf::from("-odd")));
        let Command::Train(a) = parse_args(argv(&["--seq-len", "8"])).unwrap().command else {
            panic!("train")
        };
        assert_eq!((a.batch_size, a.seq_len), (3, 8));
    }

    #[test]
    fn a_config_file_with_unknown_keys_or_bad_values_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("run.toml");
        for (text, needle) in [
            ("batchsize = 3", "unknown option \"batchsize\""),
            ("no-shuffle = 1", "no-shuffle is a switch"),
            ("seq-len = 0", "--seq-len"),
            ("lr = [1]", "expected a string"),
            ("lr = ", "not valid TOML"),
        ] {
            std::fs::write(&f, text).unwrap();
            let e = parse_args(["megatrain", "train", "--config-file", f.to_str().unwrap()])
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
        let e =
            parse_args(["megatrain", "train", "--config-file", "/nonexistent.toml"]).unwrap_err().to_string();
        assert!(e.contains("cannot read"), "{e}");
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

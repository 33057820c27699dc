//! The options of `megatrain train`, grouped under `--help` headings (model, data, steps,
//! optimizer, device and memory, outputs and checkpoints, placement, long sequences,
//! diagnostics), one line of help each, and their translation into an [`mt_train::TrainConfig`].
//! What each option does in detail: README.md and `docs/decisions/`.

use std::path::PathBuf;

use clap::Args;
use mt_train::{ModelChoice, TrainConfig};

use super::lora_args::{LoraArgs, LORA};
use super::placement_args::PLACEMENT;
use super::values::{at_least_one, fault, fraction, mlp_rows, non_negative, parse_data, positive_f64};
use super::{
    AttentionArg, DataSource, DeviceKind, ExportDtypeArg, GradDtypeArg, MlpRows, MoeKernelsArg, OptimModeArg,
    OptimStatesArg, PlacementArgs, Precision, RopeAnglesArg, ScheduleKind,
};

/// Options of `megatrain train`.
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Print help (details of each option: README.md and docs/).
    #[arg(short, long, action = clap::ArgAction::HelpShort)]
    pub help: Option<bool>,

    /// Options from a TOML file, the flags' names as keys (`batch-size = 8`); flags win.
    #[arg(long, value_name = "PATH")]
    pub config_file: Option<PathBuf>,

    /// Hugging Face model directory to fine-tune (config.json, safetensors, tokenizer).
    #[arg(long, value_name = "DIR", conflicts_with = "config", help_heading = "Model")]
    pub model: Option<PathBuf>,

    /// Hugging Face config.json, trained from a random init [default: the built-in tiny Llama].
    #[arg(long, value_name = "PATH", help_heading = "Model")]
    pub config: Option<PathBuf>,

    /// `builtin` (text as bytes), `synthetic` (any vocabulary) or a JSON Lines file.
    #[arg(long, value_name = "builtin|synthetic|FILE", default_value = "builtin", value_parser = parse_data, help_heading = "Data")]
    pub data: DataSource,

    /// Keep the file's order: step k trains on sequences k*B .. k*B+B-1.
    #[arg(long, help_heading = "Data")]
    pub no_shuffle: bool,

    /// One sample per (padded) sequence instead of packing short samples together.
    #[arg(long, help_heading = "Data")]
    pub no_pack: bool,

    /// Cut samples longer than --seq-len instead of refusing them.
    #[arg(long, help_heading = "Data")]
    pub truncate: bool,

    /// Fraction of --data held out for evaluation.
    #[arg(long, default_value_t = 0.0, value_parser = fraction, help_heading = "Data", value_name = "F")]
    pub eval_fraction: f64,

    /// A separate JSON Lines file of held-out samples.
    #[arg(long, value_name = "FILE", conflicts_with = "eval_fraction", help_heading = "Data")]
    pub eval_data: Option<PathBuf>,

    /// Evaluate the held-out loss every N steps (0 = at the start and the end only).
    #[arg(long, default_value_t = 0, value_name = "N", help_heading = "Data")]
    pub eval_every: usize,

    /// Optimizer steps (with --resume: the run's total).
    #[arg(long, default_value_t = 60, value_parser = at_least_one, help_heading = "Steps", value_name = "N")]
    pub steps: usize,

    /// Sequences per step (the global batch).
    #[arg(long, default_value_t = 16, value_parser = at_least_one, help_heading = "Steps", value_name = "B")]
    pub batch_size: usize,

    /// Tokens per sequence.
    #[arg(long, default_value_t = 64, value_parser = at_least_one, help_heading = "Steps", value_name = "S")]
    pub seq_len: usize,

    /// Token chunks per step (accumulation inside the step) [default: the fewest that fit].
    #[arg(long, value_parser = at_least_one, help_heading = "Steps", value_name = "N")]
    pub chunks: Option<usize>,

    /// Seed of the initialisation and of the data order.
    #[arg(long, default_value_t = 0, help_heading = "Steps", value_name = "N")]
    pub seed: u64,

    /// Peak learning rate [default: 0.5 / hidden_size, at most 1e-2].
    #[arg(long, value_parser = non_negative, allow_negative_numbers = true, help_heading = "Optimizer", value_name = "LR")]
    pub lr: Option<f64>,

    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.1, value_parser = non_negative, allow_negative_numbers = true, help_heading = "Optimizer", value_name = "W")]
    pub weight_decay: f64,

    /// AdamW beta1.
    #[arg(long, default_value_t = 0.9, value_parser = fraction, help_heading = "Optimizer", value_name = "B1")]
    pub beta1: f64,

    /// AdamW beta2.
    #[arg(long, default_value_t = 0.999, value_parser = fraction, help_heading = "Optimizer", value_name = "B2")]
    pub beta2: f64,

    /// AdamW epsilon.
    #[arg(long, default_value_t = 1e-8, value_parser = positive_f64, help_heading = "Optimizer", value_name = "EPS")]
    pub eps: f64,

    /// Global gradient-norm clipping (0 = off; lean mode clips by the previous step's norm).
    #[arg(long, default_value_t = 1.0, value_parser = non_negative, allow_negative_numbers = true, help_heading = "Optimizer", value_name = "C")]
    pub clip: f64,

    /// Stop at K skipped steps in a row (a non-finite loss or gradient norm skips a step: no update).
    #[arg(long, default_value_t = 5, value_parser = at_least_one, help_heading = "Optimizer", value_name = "K")]
    pub max_skipped_steps: usize,

    /// Steps of linear warmup from lr/warmup to lr.
    #[arg(long, default_value_t = 5, help_heading = "Optimizer", value_name = "N")]
    pub warmup: usize,

    /// After warmup: constant, linear decay to 0, or cosine decay to 10% of --lr.
    #[arg(long, value_enum, default_value_t = ScheduleKind::Cosine, help_heading = "Optimizer", value_name = "constant|linear|cosine", hide_possible_values = true)]
    pub schedule: ScheduleKind,

    /// Length of the schedule in global steps [default: the run's last step].
    #[arg(long, value_name = "N", value_parser = at_least_one, help_heading = "Optimizer")]
    pub schedule_steps: Option<usize>,

    /// exact: clipping by the step's norm, updates deferred; lean: update as gradients land.
    #[arg(long, value_enum, default_value_t = OptimModeArg::Exact, help_heading = "Optimizer", value_name = "exact|lean", hide_possible_values = true)]
    pub optim_mode: OptimModeArg,

    /// Compute device (`cuda` needs a build with --features cuda).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu, help_heading = "Device and memory", value_name = "cpu|cuda", hide_possible_values = true)]
    pub device: DeviceKind,

    /// GPUs of this host to train on, data parallel through NCCL (needs a build with --features nccl).
    #[arg(long, default_value_t = 1, value_parser = at_least_one, help_heading = "Device and memory", value_name = "N")]
    pub gpus: usize,

    /// Weight dtype on the device (fp32 master weights stay on the host either way).
    #[arg(long, value_enum, default_value_t = Precision::Fp32, help_heading = "Device and memory", value_name = "fp32|bf16", hide_possible_values = true)]
    pub precision: Precision,

    /// Store gradients: 16 (f32), 14 (bf16) or 12 (none; lean) B/param [default: as --precision].
    #[arg(
        long,
        value_enum,
        help_heading = "Device and memory",
        value_name = "f32|bf16|none",
        hide_possible_values = true
    )]
    pub grad_dtype: Option<GradDtypeArg>,

    /// AdamW moments: fp32 (torch's update), or bf16 / int8 rounded stochastically; with the fp32
    /// master weights 12, 8 or 6 B/param (the store's and every checkpoint's).
    #[arg(
        long,
        value_enum,
        default_value_t = OptimStatesArg::Fp32,
        help_heading = "Device and memory",
        value_name = "fp32|bf16|int8",
        hide_possible_values = true
    )]
    pub optim_states: OptimStatesArg,

    /// Device memory the plan may assume, GiB [default: the GPU's; on the CPU, host memory].
    #[arg(long, value_name = "GIB", value_parser = positive_f64, help_heading = "Device and memory")]
    pub gpu_mem: Option<f64>,

    /// Host memory the plan may assume, GiB [default: MemAvailable].
    #[arg(long, value_name = "GIB", value_parser = positive_f64, help_heading = "Device and memory")]
    pub host_mem: Option<f64>,

    /// File-backed host store: created, or continued from the step recorded in it. The live state,
    /// not a checkpoint: a killed run's file is refused; --resume restores a checkpoint into it.
    /// A store larger than --host-mem is paged from this file through a RAM window (the disk tier).
    #[arg(long, value_name = "PATH", help_heading = "Device and memory")]
    pub store: Option<PathBuf>,

    /// The adapters (`--lora-rank` and its options).
    #[command(flatten)]
    pub lora: LoraArgs,

    /// Continue training the peft adapter in DIR (adapter_config.json, adapter_model.safetensors).
    #[arg(long, value_name = "DIR", help_heading = LORA)]
    pub lora_from: Option<PathBuf>,

    /// Export the base with the adapters merged in, as a full model, instead of the adapter.
    #[arg(long, help_heading = LORA)]
    pub merge: bool,

    /// Export the trained model here as a Hugging Face directory (the last step checkpointed first).
    #[arg(long, value_name = "DIR", help_heading = "Outputs and checkpoints")]
    pub out: Option<PathBuf>,

    /// Weight dtype of the export.
    #[arg(long, value_enum, default_value_t = ExportDtypeArg::Fp32, help_heading = "Outputs and checkpoints", value_name = "fp32|bf16", hide_possible_values = true)]
    pub export_dtype: ExportDtypeArg,

    /// A crash-consistent checkpoint every K steps (0 = never).
    #[arg(long, default_value_t = 0, value_name = "K", help_heading = "Outputs and checkpoints")]
    pub save_every: usize,

    /// Checkpoint directory [default: OUT/checkpoints].
    #[arg(long, value_name = "DIR", help_heading = "Outputs and checkpoints")]
    pub checkpoint_dir: Option<PathBuf>,

    /// Checkpoints kept.
    #[arg(long, default_value_t = 2, value_parser = at_least_one, help_heading = "Outputs and checkpoints", value_name = "N")]
    pub keep_checkpoints: usize,

    /// Continue from the newest intact checkpoint (same options; starts afresh when there is none).
    #[arg(long, help_heading = "Outputs and checkpoints")]
    pub resume: bool,

    /// The placement overrides.
    #[command(flatten)]
    pub placement: PlacementArgs,

    /// Device weight slots (1 = no copy/compute overlap, 2 = double buffering).
    #[arg(long, default_value_t = 2, value_parser = at_least_one, help_heading = PLACEMENT, value_name = "N")]
    pub ring_depth: usize,

    /// Flash (bf16 on a CUDA GPU), the materialised scores, or auto: flash where it runs.
    #[arg(long, value_enum, default_value_t = AttentionArg::Auto, help_heading = "Long sequences", value_name = "auto|flash|materialized", hide_possible_values = true)]
    pub attention: AttentionArg,

    /// Rows of each MLP tile (0 = a chunk at once) [auto: a chunk when it fits, else 8192..1024].
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = mlp_rows, help_heading = "Long sequences")]
    pub mlp_rows: MlpRows,

    /// RoPE angles in f32 as transformers forms them, or exact (f64).
    #[arg(long, value_enum, default_value_t = RopeAnglesArg::Transformers, help_heading = "Long sequences", value_name = "transformers|exact", hide_possible_values = true)]
    pub rope_angles: RopeAnglesArg,

    /// A mixture of experts on the GPU kernels (bf16 on a CUDA GPU, SwiGLU experts), or the
    /// portable per-expert path everywhere (to compare).
    #[arg(long, value_enum, default_value_t = MoeKernelsArg::Device, help_heading = "Device and memory", value_name = "device|portable", hide_possible_values = true)]
    pub moe_kernels: MoeKernelsArg,

    /// Rows of logits alive at once in the loss.
    #[arg(long, default_value_t = 4096, value_parser = at_least_one, hide = true)]
    pub rows_per_block: usize,

    /// Print a log line every N steps (0 = never).
    #[arg(long, default_value_t = 10, value_name = "N", help_heading = "Diagnostics")]
    pub log_every: usize,

    /// Append per-step metrics as JSON Lines (schema: crates/megatrain/src/metrics.rs).
    #[arg(long, value_name = "PATH", help_heading = "Diagnostics")]
    pub metrics: Option<PathBuf>,

    /// Write a Chrome trace (Perfetto, chrome://tracing) of one step.
    #[arg(long, value_name = "PATH", help_heading = "Diagnostics")]
    pub trace: Option<PathBuf>,

    /// Which step of this run --trace records [default: 2, or 1 for a one-step run].
    #[arg(long, value_name = "N", value_parser = at_least_one, requires = "trace", help_heading = "Diagnostics")]
    pub trace_step: Option<usize>,

    /// Ablation: run the host optimizer serially with compute.
    #[arg(long, help_heading = "Diagnostics")]
    pub no_optimizer_overlap: bool,

    /// Debug: random delay of up to N microseconds before every CPU copy-stream job.
    #[arg(long, default_value_t = 0, hide = true)]
    pub delay_us: u64,

    /// Test hook: abort the process (SIGABRT, as a crash) right after global step N and its checkpoint.
    #[arg(long, value_name = "N", hide = true)]
    pub abort_after_step: Option<u64>,

    /// Test hook: a NaN or infinity in global step N (`N:nan-grad`, `N:inf-grad`, `N:nan-loss`; repeatable).
    #[arg(long, value_name = "N:WHAT", value_parser = fault, hide = true)]
    pub inject_fault: Vec<(u64, mt_sched::Fault)>,

    /// Test hook: the export's writes fail as a full disk would after BYTES bytes.
    #[arg(long, value_name = "BYTES", hide = true)]
    pub inject_export_failure: Option<u64>,
}

impl TrainArgs {
    /// The store's gradient dtype: `--grad-dtype`, else the one matching `--precision`.
    pub fn grad_dtype(&self) -> GradDtypeArg {
        default_grad_dtype(self.grad_dtype, self.precision)
    }

    /// The run these options describe (the command line's own options, `--metrics`, `--trace`,
    /// `--log-every` and the test hook, are the observer's).
    pub fn to_config(&self) -> TrainConfig {
        TrainConfig {
            model: match (&self.model, &self.config) {
                (Some(dir), _) => ModelChoice::HfDir(dir.clone()),
                (None, Some(p)) => ModelChoice::Config(p.clone()),
                (None, None) => ModelChoice::Builtin,
            },
            data: self.data.clone(),
            shuffle: !self.no_shuffle,
            pack: !self.no_pack,
            truncate: self.truncate,
            eval_fraction: self.eval_fraction,
            eval_data: self.eval_data.clone(),
            eval_every: self.eval_every,
            steps: self.steps,
            batch_size: self.batch_size,
            seq_len: self.seq_len,
            chunks: self.chunks,
            seed: self.seed,
            lr: self.lr,
            weight_decay: self.weight_decay,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            clip: self.clip,
            max_skipped_steps: self.max_skipped_steps,
            warmup: self.warmup,
            schedule: self.schedule.into(),
            schedule_steps: self.schedule_steps,
            optim_mode: self.optim_mode.into(),
            device: self.device.into(),
            gpus: self.gpus,
            job: None,
            precision: self.precision.into(),
            grad_dtype: self.grad_dtype.map(Into::into),
            optim_states: self.optim_states.into(),
            gpu_mem_gib: self.gpu_mem,
            host_mem_gib: self.host_mem,
            store: self.store.clone(),
            out: self.out.clone(),
            export_dtype: self.export_dtype.into(),
            save_every: self.save_every,
            checkpoint_dir: self.checkpoint_dir.clone(),
            keep_checkpoints: self.keep_checkpoints,
            resume: self.resume,
            placement: self.placement.choice(),
            ring_depth: self.ring_depth,
            overlap_optimizer: !self.no_optimizer_overlap,
            attention: self.attention.choice(),
            flash_kernel: self.attention.kernel(),
            mlp_rows: self.mlp_rows.choice(),
            rope_angles: self.rope_angles.into(),
            moe_kernels: self.moe_kernels.into(),
            rows_per_block: self.rows_per_block,
            delay_us: self.delay_us,
            inject_faults: self.inject_fault.clone(),
            inject_export_failure: self.inject_export_failure,
            lora: self.lora.config(),
            lora_from: self.lora_from.clone(),
            merge: self.merge,
            base_dtype: self.lora.base_dtype.map(Into::into),
        }
    }

    /// Refuses a LoRA option given without adapters (`--lora-rank` or `--lora-from`), naming it.
    pub fn check_lora(&self) -> Result<(), String> {
        self.lora.refuse_without_adapters(
            Some(("--lora-from", self.lora_from.is_some())),
            &[("--merge", self.merge)],
        )
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

//! [`TrainConfig`]: everything a training run is asked to do, grouped as `megatrain train
//! --help` groups its options (model, data, steps, optimizer, device and memory, outputs and
//! checkpoints, placement, long sequences, diagnostics). Field names are the flags' names; the
//! defaults are the command line's.

use std::path::PathBuf;

use candle_core::DType;
use mt_core::ModelConfig;
use mt_core::StateDtype;
use mt_sched::OptimMode;
pub use mt_sched::PlacementChoice;
use mt_store::GradDtype;

pub use crate::schedule::ScheduleKind;

/// A built-in source of training tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataKind {
    /// Embedded English text, one token per byte.
    Builtin,
    /// Deterministic arithmetic sequences of token ids.
    Synthetic,
}

/// Training data: a built-in source or a JSON Lines file (`{"text": ...}`, `{"messages":
/// [...]}` or `{"input_ids": [...]}` per line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// A built-in source.
    Builtin(DataKind),
    /// A JSON Lines file.
    File(PathBuf),
}

/// Where the model comes from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ModelChoice {
    /// The built-in tiny Llama (4 layers, hidden 128, a byte vocabulary of 256), seeded random.
    #[default]
    Builtin,
    /// A Hugging Face `config.json`, trained from a seeded random initialisation.
    Config(PathBuf),
    /// A Hugging Face model directory to fine-tune (config.json, safetensors, tokenizer).
    HfDir(PathBuf),
}

/// The compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU backend (candle CPU, worker threads as copy streams).
    #[default]
    Cpu,
    /// GPU 0 through CUDA (needs the `cuda` feature).
    Cuda,
}

/// Weight and activation dtype on the device (fp32 master weights stay on the host either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// 32-bit floats.
    #[default]
    Fp32,
    /// bfloat16.
    Bf16,
}

impl Precision {
    /// The candle dtype.
    pub fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// The flag's value: `fp32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
        }
    }

    /// The store's gradient dtype when none is asked for: f32 with fp32 (so fp32 training is
    /// AdamW on exact fp32 gradients, as torch's), bf16 with bf16 (14 B/param).
    pub fn default_grad_dtype(self) -> GradDtype {
        match self {
            Precision::Fp32 => GradDtype::F32,
            Precision::Bf16 => GradDtype::Bf16,
        }
    }
}

/// A training run. `TrainConfig::default()` is `megatrain train` with no options: the built-in
/// tiny Llama on the built-in text, 60 steps of 16 x 64 tokens, on the CPU.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    // Model
    /// The model to train.
    pub model: ModelChoice,

    // Data
    /// Training data.
    pub data: DataSource,
    /// Shuffle the samples (seeded); `false`: step k trains on sequences k·B .. k·B+B-1.
    pub shuffle: bool,
    /// Pack short samples together into sequences; `false`: one sample per (padded) sequence.
    pub pack: bool,
    /// Cut samples longer than `seq_len` instead of refusing them.
    pub truncate: bool,
    /// Fraction of the samples of `data` held out for evaluation.
    pub eval_fraction: f64,
    /// A separate JSON Lines file of held-out samples.
    pub eval_data: Option<PathBuf>,
    /// Evaluate every N steps (0: only at the start and after the last step).
    pub eval_every: usize,

    // Steps and batch
    /// Optimizer steps: with `resume`, the run's total; otherwise the steps of this run.
    pub steps: usize,
    /// Sequences per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Token chunks per step; `None`: the fewest that fit.
    pub chunks: Option<usize>,
    /// Seed of the initialisation and of the data order.
    pub seed: u64,

    // Optimizer
    /// Peak learning rate; `None`: [`auto_lr`] of the model's width.
    pub lr: Option<f64>,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    /// Global gradient-norm clipping threshold (0: off).
    pub clip: f64,
    /// Stop the run at this many skipped steps in a row (a step with a non-finite loss or
    /// gradient norm applies no update and is skipped); at least 1.
    pub max_skipped_steps: usize,
    /// Steps of linear warmup.
    pub warmup: usize,
    /// Schedule after warmup.
    pub schedule: ScheduleKind,
    /// Length of the schedule in global steps; `None`: the run's last step.
    pub schedule_steps: Option<usize>,
    /// Exact (global-norm clipping, updates deferred) or lean (update as each gradient lands).
    pub optim_mode: OptimMode,

    // Device and memory
    /// The compute device.
    pub device: Device,
    /// GPUs 0..N of this host, data parallel (one engine per GPU over the one host store; the
    /// batch split over them; gradients summed through NCCL). 1: the plain engine.
    pub gpus: usize,
    /// This process's place in a job of several processes, one per host (`None`: the job is this
    /// process).
    pub job: Option<JobPlace>,
    /// Weight dtype on the device.
    pub precision: Precision,
    /// Gradient dtype of a new store; `None`: [`Precision::default_grad_dtype`].
    pub grad_dtype: Option<GradDtype>,
    /// Precision of the AdamW moments (`--optim-states`): fp32 (the update is torch's, 12 B/param
    /// of master and moments), bf16 (8) or int8 (6), both rounded stochastically
    /// (`docs/decisions/0033-optimizer-state-precision.md`). The store records it; a resume with
    /// another is refused.
    pub optim_states: StateDtype,
    /// Device memory the plan may assume, GiB; `None`: the GPU's (on the CPU: host memory).
    pub gpu_mem_gib: Option<f64>,
    /// Host memory the plan may assume, GiB; `None`: MemAvailable.
    pub host_mem_gib: Option<f64>,
    /// File-backed host store (created, or continued from the step recorded in it).
    pub store: Option<PathBuf>,

    // Outputs and checkpoints
    /// Export the trained model here as a Hugging Face directory.
    pub out: Option<PathBuf>,
    /// Weight dtype of the export.
    pub export_dtype: mt_hf::ExportDtype,
    /// A checkpoint every K steps (0: never).
    pub save_every: usize,
    /// Checkpoint directory; `None`: `out/checkpoints`.
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoints kept.
    pub keep_checkpoints: usize,
    /// Continue from the newest checkpoint.
    pub resume: bool,

    // Placement
    /// The placement overrides.
    pub placement: PlacementChoice,
    /// Device weight slots (1: no overlap, 2: double buffering).
    pub ring_depth: usize,
    /// Overlap the host optimizer with compute (`false`: the ablation).
    pub overlap_optimizer: bool,

    // Long sequences
    /// Flash attention (`Some(true)`), the materialised scores (`Some(false)`), or decide.
    pub attention: Option<bool>,
    /// Which flash kernels: the Hopper ones wherever they run (`Auto`), or one set forced.
    pub flash_kernel: mt_layers::FlashKernel,
    /// Rows of each MLP tile (0: a chunk at once), or decide.
    pub mlp_rows: Option<usize>,
    /// How RoPE angles are formed.
    pub rope_angles: mt_layers::RopeAngles,
    /// Which path a mixture of experts runs: the device kernels wherever they apply (`Device`),
    /// or the portable one everywhere.
    pub moe_kernels: mt_layers::MoeKernels,
    /// Rows of logits alive at once in the loss.
    pub rows_per_block: usize,

    // Diagnostics
    /// Random delay of up to this many microseconds before every CPU copy-stream job.
    pub delay_us: u64,
    /// NaN or infinities injected into global steps (tests only).
    #[doc(hidden)]
    pub inject_faults: Vec<(u64, mt_sched::Fault)>,
    /// The export's writes fail as a full disk would after this many bytes (tests only).
    #[doc(hidden)]
    pub inject_export_failure: Option<u64>,
    /// Train LoRA adapters on a frozen base (`--lora-rank` and its options).
    pub lora: Option<mt_core::LoraConfig>,
    /// Continue training the peft adapter in this directory (its `adapter_config.json` says the
    /// rank, alpha and targets).
    pub lora_from: Option<PathBuf>,
    /// A LoRA run exports the merged model (`W + s · B A`) instead of peft's adapter.
    pub merge: bool,
    /// How a LoRA run holds its frozen base in host memory; `None`: [`TrainConfig::base_dtype`].
    pub base_dtype: Option<mt_core::BaseDtype>,
}

/// A process's place in a job of several, one per host, each over its own host store (a hybrid
/// of the in-process data parallel of `--gpus` and one NCCL group across hosts): started by
/// torchrun or Slurm, `megatrain train` fills it in from the launcher's environment and the
/// rendezvous (`mt_dist`). Process `p` runs ranks `p * gpus .. (p + 1) * gpus` of the job's
/// `processes * gpus`, its first rank landing its store; every process steps the same global
/// batches and reports the whole batch's loss. Only process 0 writes checkpoints and the export,
/// so a resume needs its checkpoint directory where every process can read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobPlace {
    /// This process, `0..processes`.
    pub process: usize,
    /// Processes in the job.
    pub processes: usize,
    /// This process's GPUs are `first_gpu .. first_gpu + gpus` of its host's (the launcher's
    /// local rank times `gpus`: several processes on one host each take their own).
    pub first_gpu: usize,
    /// The job's NCCL unique id (its bytes, as process 0 made it: `nccl_unique_id`).
    pub nccl_id: Vec<u8>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: ModelChoice::Builtin,
            data: DataSource::Builtin(DataKind::Builtin),
            shuffle: true,
            pack: true,
            truncate: false,
            eval_fraction: 0.0,
            eval_data: None,
            eval_every: 0,
            steps: 60,
            batch_size: 16,
            seq_len: 64,
            chunks: None,
            seed: 0,
            lr: None,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            clip: 1.0,
            max_skipped_steps: 5,
            warmup: 5,
            schedule: ScheduleKind::Cosine,
            schedule_steps: None,
            optim_mode: OptimMode::Exact,
            device: Device::Cpu,
            gpus: 1,
            job: None,
            precision: Precision::Fp32,
            grad_dtype: None,
            optim_states: StateDtype::F32,
            gpu_mem_gib: None,
            host_mem_gib: None,
            store: None,
            out: None,
            export_dtype: mt_hf::ExportDtype::F32,
            save_every: 0,
            checkpoint_dir: None,
            keep_checkpoints: 2,
            resume: false,
            placement: PlacementChoice::default(),
            ring_depth: 2,
            overlap_optimizer: true,
            attention: None,
            flash_kernel: mt_layers::FlashKernel::Auto,
            mlp_rows: None,
            rope_angles: mt_layers::RopeAngles::Transformers,
            moe_kernels: mt_layers::MoeKernels::Device,
            rows_per_block: 4096,
            delay_us: 0,
            inject_faults: Vec::new(),
            inject_export_failure: None,
            lora: None,
            lora_from: None,
            merge: false,
            base_dtype: None,
        }
    }
}

/// The learning rate `lr: None` means: 0.5 / hidden_size, at most 1e-2. GPT-3's learning rates
/// fall with the model's width about so (6e-4 at width 768, 1.2e-4 at 4096, 6e-5 at 12288);
/// the built-in model (width 128) gets 3.9e-3, the 3.6B Llama-3 shape 1.6e-4 (1e-2 diverges
/// there: `docs/decisions/0016-safe-learning-rate.md`).
pub fn auto_lr(hidden_size: usize) -> f64 {
    (0.5 / hidden_size.max(1) as f64).min(1e-2)
}

impl TrainConfig {
    /// The store's gradient dtype: `grad_dtype`, else the one matching `precision`.
    pub fn grad_dtype(&self) -> GradDtype {
        self.grad_dtype.unwrap_or(self.precision.default_grad_dtype())
    }

    /// How a LoRA run holds its frozen base: `base_dtype`, else the weight dtype of `precision`.
    /// bf16 for a bf16 run: the device computes with bf16 weights, so the base loses nothing
    /// against an fp32 one (which the upload rounded to bf16 anyway); fp32 for an fp32 run, so
    /// fp32 runs keep the imported weights exactly (decision 0048).
    pub fn base_dtype(&self) -> mt_core::BaseDtype {
        self.base_dtype.unwrap_or(match self.precision {
            Precision::Fp32 => mt_core::BaseDtype::F32,
            Precision::Bf16 => mt_core::BaseDtype::Bf16,
        })
    }

    /// The peak learning rate for `cfg`: `lr`, else [`auto_lr`].
    pub fn lr_for(&self, cfg: &ModelConfig) -> f64 {
        self.lr.unwrap_or_else(|| auto_lr(cfg.hidden_size))
    }

    /// Data-parallel ranks of the whole job: this host's `gpus`, times the job's processes.
    pub fn ranks(&self) -> usize {
        self.gpus * self.job.as_ref().map_or(1, |j| j.processes)
    }

    /// This process's first GPU on its host ([`JobPlace::first_gpu`]; 0 alone).
    pub fn first_gpu(&self) -> usize {
        self.job.as_ref().map_or(0, |j| j.first_gpu)
    }

    /// Whether this process writes the run's outputs (checkpoints, the export) and locks them:
    /// the job's only process, or process 0 of several (the others' stores are the same bits).
    pub fn writes_outputs(&self) -> bool {
        self.job.as_ref().is_none_or(|j| j.process == 0)
    }

    /// Where checkpoints go: `checkpoint_dir`, else `out/checkpoints`; `None` without either.
    pub fn checkpoint_dir(&self) -> Option<PathBuf> {
        self.checkpoint_dir.clone().or_else(|| self.out.as_ref().map(|o| o.join("checkpoints")))
    }

    /// The length of the learning-rate schedule: `schedule_steps`, else the run's last step.
    pub fn schedule_total(&self, end_step: u64) -> u64 {
        self.schedule_steps.map_or(end_step, |n| n as u64)
    }
}

/// `exact` or `lean`, as the flag spells it.
pub fn optim_mode_name(m: OptimMode) -> &'static str {
    match m {
        OptimMode::Exact => "exact",
        OptimMode::Lean => "lean",
    }
}

/// `f32`, `bf16` or `none`, as the flag spells it.
pub fn grad_dtype_name(g: GradDtype) -> &'static str {
    match g {
        GradDtype::F32 => "f32",
        GradDtype::Bf16 => "bf16",
        GradDtype::None => "none",
    }
}

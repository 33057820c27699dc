//! The value types of the command line (`--data`, `--precision`, `--device`, placements,
//! dtypes...) and the parsers that check option values.

use std::path::PathBuf;

use candle_core::DType;
use clap::ValueEnum;
use mt_core::StateDtype;
use mt_sched::OptimMode;
use mt_store::GradDtype;
use mt_train::{DataKind, DataSource};

pub(super) fn parse_data(s: &str) -> Result<DataSource, String> {
    match s {
        "builtin" => Ok(DataSource::Builtin(DataKind::Builtin)),
        "synthetic" => Ok(DataSource::Builtin(DataKind::Synthetic)),
        "" => Err("expected builtin, synthetic or a file path".into()),
        path => Ok(DataSource::File(PathBuf::from(path))),
    }
}

/// Weight dtype of an exported model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExportDtypeArg {
    /// float32: the master weights exactly.
    Fp32,
    /// bfloat16 (round to nearest even): half the size.
    Bf16,
}

impl From<ExportDtypeArg> for mt_train::ExportDtype {
    fn from(d: ExportDtypeArg) -> Self {
        match d {
            ExportDtypeArg::Fp32 => mt_train::ExportDtype::F32,
            ExportDtypeArg::Bf16 => mt_train::ExportDtype::Bf16,
        }
    }
}

/// Learning-rate schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScheduleKind {
    /// Hold the peak rate.
    Constant,
    /// Cosine decay from the peak rate to 10% of it.
    Cosine,
    /// Linear decay from the peak rate to 0 at the end of the schedule.
    Linear,
}

impl From<ScheduleKind> for mt_train::ScheduleKind {
    fn from(s: ScheduleKind) -> Self {
        match s {
            ScheduleKind::Constant => mt_train::ScheduleKind::Constant,
            ScheduleKind::Cosine => mt_train::ScheduleKind::Cosine,
            ScheduleKind::Linear => mt_train::ScheduleKind::Linear,
        }
    }
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

impl Precision {
    /// Bytes per weight element on the device.
    pub fn bytes(self) -> f64 {
        match self {
            Precision::Fp32 => 4.0,
            Precision::Bf16 => 2.0,
        }
    }
}

impl From<Precision> for mt_train::Precision {
    fn from(p: Precision) -> Self {
        match p {
            Precision::Fp32 => mt_train::Precision::Fp32,
            Precision::Bf16 => mt_train::Precision::Bf16,
        }
    }
}

impl From<Precision> for DType {
    fn from(p: Precision) -> Self {
        match p {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }
}

/// Placement of the outer unit's optimizer state (`--resident-outer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ResidentOuter {
    /// The planner decides (resident on a GPU with room to spare, never on the CPU).
    Auto,
    /// On the GPU.
    On,
    /// Streamed through the host optimizer.
    Off,
}

impl ResidentOuter {
    /// The run's choice: `None` lets the planner decide
    /// (`mt_sched::PlacementChoice::for_run` says how `auto` is resolved).
    pub fn choice(self) -> Option<bool> {
        match self {
            ResidentOuter::On => Some(true),
            ResidentOuter::Off => Some(false),
            ResidentOuter::Auto => None,
        }
    }
}

/// The attention kernels (`--attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AttentionArg {
    /// Flash attention wherever it runs (bf16 on a CUDA GPU, head dim 16, 32, 64 or 128), the
    /// materialised scores elsewhere.
    Auto,
    /// Flash attention, on the Hopper kernels on an H100 / H200 (head dim 64 or 128) and the
    /// portable ones elsewhere; refused where it cannot run.
    Flash,
    /// Flash attention on the Hopper kernels (compute capability 9.0, head dim 64 or 128);
    /// refused elsewhere.
    Hopper,
    /// The Hopper kernels with the backward's dQ partials added as they arrive: faster at short
    /// sequences (about 1.1x forward + backward at 16k), not bitwise repeatable; refused elsewhere.
    HopperUnordered,
    /// Flash attention on the portable kernels (compute capability 8.0 and later), also on Hopper.
    Portable,
    /// The materialised `[batch, heads, seq, seq]` scores (transformers' eager path).
    Materialized,
}

impl AttentionArg {
    /// The planner's input: `None` lets it decide.
    pub fn choice(self) -> Option<bool> {
        match self {
            AttentionArg::Auto => None,
            AttentionArg::Flash
            | AttentionArg::Hopper
            | AttentionArg::HopperUnordered
            | AttentionArg::Portable => Some(true),
            AttentionArg::Materialized => Some(false),
        }
    }

    /// Which flash kernels.
    pub fn kernel(self) -> mt_train::FlashKernel {
        match self {
            AttentionArg::Hopper => mt_train::FlashKernel::Hopper,
            AttentionArg::HopperUnordered => mt_train::FlashKernel::HopperUnordered,
            AttentionArg::Portable => mt_train::FlashKernel::Portable,
            _ => mt_train::FlashKernel::Auto,
        }
    }
}

/// How RoPE angles are formed (`--rope-angles`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RopeAnglesArg {
    /// The f32 product `pos · inv_freq`, as transformers forms it (off by up to 2e-3 rad at
    /// position 32768 and 0.031 rad at 524287 for the fastest-turning pair).
    Transformers,
    /// The exact angle (f64).
    Exact,
}

impl From<RopeAnglesArg> for mt_layers::RopeAngles {
    fn from(a: RopeAnglesArg) -> Self {
        match a {
            RopeAnglesArg::Transformers => mt_layers::RopeAngles::Transformers,
            RopeAnglesArg::Exact => mt_layers::RopeAngles::Exact,
        }
    }
}

/// Which path a mixture of experts runs (`--moe-kernels`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MoeKernelsArg {
    /// The device kernels (routing, grouping by expert and grouped GEMMs on the GPU) wherever
    /// they apply: bf16 on a CUDA GPU of compute capability 8.0+, SwiGLU experts (not
    /// GPT-OSS's); the portable path elsewhere.
    Device,
    /// The portable path everywhere: the routing on the host, candle ops per expert (to
    /// compare with the device kernels).
    Portable,
}

impl From<MoeKernelsArg> for mt_layers::MoeKernels {
    fn from(a: MoeKernelsArg) -> Self {
        match a {
            MoeKernelsArg::Device => mt_layers::MoeKernels::Device,
            MoeKernelsArg::Portable => mt_layers::MoeKernels::Portable,
        }
    }
}

/// Rows of a decoder layer's MLP tile (`--mlp-rows`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpRows {
    /// The planner decides.
    Auto,
    /// This many rows (0 = a chunk's rows at once).
    Rows(usize),
}

impl MlpRows {
    /// The planner's input: `None` lets it decide.
    pub fn choice(self) -> Option<usize> {
        match self {
            MlpRows::Auto => None,
            MlpRows::Rows(r) => Some(r),
        }
    }
}

/// `--mlp-rows`: `auto` or a row count (0 = a chunk's rows at once).
pub(super) fn mlp_rows(s: &str) -> std::result::Result<MlpRows, String> {
    if s == "auto" {
        return Ok(MlpRows::Auto);
    }
    s.parse()
        .map(MlpRows::Rows)
        .map_err(|_| format!("{s:?}: expected `auto` or a number of rows (0 = no tiles)"))
}

/// A number of decoder layers given to some placement (`--resident-layers`, `--kept-layers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerCount {
    /// The planner decides (as many as fit on a GPU, none on the CPU).
    Auto,
    /// Exactly this many.
    Count(usize),
}

impl LayerCount {
    /// The run's choice: `None` lets the planner decide.
    pub fn choice(self) -> Option<usize> {
        match self {
            LayerCount::Count(k) => Some(k),
            LayerCount::Auto => None,
        }
    }
}

pub(super) fn layer_count(s: &str) -> std::result::Result<LayerCount, String> {
    if s == "auto" {
        return Ok(LayerCount::Auto);
    }
    s.parse().map(LayerCount::Count).map_err(|_| format!("{s:?}: expected `auto` or a layer count"))
}

/// Compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceKind {
    /// The CPU backend (candle CPU, worker threads as copy streams).
    Cpu,
    /// An NVIDIA GPU (needs a build with the `cuda` feature).
    Cuda,
}

impl From<DeviceKind> for mt_train::Device {
    fn from(d: DeviceKind) -> Self {
        match d {
            DeviceKind::Cpu => mt_train::Device::Cpu,
            DeviceKind::Cuda => mt_train::Device::Cuda,
        }
    }
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

/// Precision of the AdamW moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimStatesArg {
    /// fp32 moments: the update is torch's.
    Fp32,
    /// bf16 moments, rounded stochastically.
    Bf16,
    /// 8-bit blockwise moments, rounded stochastically.
    Int8,
}

impl From<OptimStatesArg> for StateDtype {
    fn from(s: OptimStatesArg) -> Self {
        match s {
            OptimStatesArg::Fp32 => StateDtype::F32,
            OptimStatesArg::Bf16 => StateDtype::Bf16,
            OptimStatesArg::Int8 => StateDtype::Int8,
        }
    }
}

/// How a LoRA run's frozen base is held in host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BaseDtypeArg {
    /// fp32, as imported (4 B/param).
    Fp32,
    /// bf16 (2 B/param).
    Bf16,
    /// int8 blockwise (1.06 B/param).
    Int8,
    /// QLoRA's 4-bit NormalFloat, blockwise (0.56 B/param).
    Nf4,
}

impl From<BaseDtypeArg> for mt_core::BaseDtype {
    fn from(b: BaseDtypeArg) -> Self {
        match b {
            BaseDtypeArg::Fp32 => mt_core::BaseDtype::F32,
            BaseDtypeArg::Bf16 => mt_core::BaseDtype::Bf16,
            BaseDtypeArg::Int8 => mt_core::BaseDtype::Int8,
            BaseDtypeArg::Nf4 => mt_core::BaseDtype::Nf4,
        }
    }
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

pub(super) fn at_least_one(s: &str) -> Result<usize, String> {
    if s.trim_start().starts_with('-') {
        return Err(format!("must be at least 1, found {s}"));
    }
    let n: usize = s.parse().map_err(|e| format!("expected a whole number, found {s:?} ({e})"))?;
    if n == 0 {
        return Err("must be at least 1".into());
    }
    Ok(n)
}

/// `--inject-fault N:WHAT`: a NaN or infinity in global step `N`'s first decoder layer's
/// gradient (`nan-grad`, `inf-grad`) or loss (`nan-loss`).
pub(super) fn fault(s: &str) -> Result<(u64, mt_sched::Fault), String> {
    use mt_sched::Fault;
    let (n, what) = s.split_once(':').ok_or_else(|| format!("expected N:WHAT, found {s:?}"))?;
    let n: u64 = n.parse().map_err(|e| format!("expected a step number, found {n:?} ({e})"))?;
    let unit = mt_core::Unit::Layer(0);
    let f = match what {
        "nan-grad" => Fault::Gradient { unit, value: f32::NAN },
        "inf-grad" => Fault::Gradient { unit, value: f32::INFINITY },
        "nan-loss" => Fault::Loss(f64::NAN),
        other => return Err(format!("{other:?}: expected nan-grad, inf-grad or nan-loss")),
    };
    Ok((n, f))
}

pub(super) fn non_negative(s: &str) -> Result<f64, String> {
    let x: f64 = s.parse().map_err(|e| format!("expected a number, found {s:?} ({e})"))?;
    if !(x.is_finite() && x >= 0.0) {
        return Err(format!("must be a finite number >= 0, found {x}"));
    }
    Ok(x)
}

pub(super) fn fraction(s: &str) -> Result<f64, String> {
    let x: f64 = s.parse().map_err(|e| format!("expected a number, found {s:?} ({e})"))?;
    if !(0.0..1.0).contains(&x) {
        return Err(format!("must be in [0, 1), found {x}"));
    }
    Ok(x)
}

/// A LoRA target module (`q_proj`, ...; `--lora-targets`).
pub(super) fn lora_target(s: &str) -> Result<mt_core::LoraTarget, String> {
    mt_core::LoraTarget::parse(s.trim()).ok_or_else(|| {
        format!("{s:?} is not a linear layer of the decoder: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj or down_proj")
    })
}

pub(super) fn positive_f64(s: &str) -> Result<f64, String> {
    let x: f64 = s.parse().map_err(|e| format!("expected a number, found {s:?} ({e})"))?;
    if !(x.is_finite() && x > 0.0) {
        return Err(format!("must be a finite number > 0, found {x}"));
    }
    Ok(x)
}

/// Two positive numbers `A,B` (`--attention-tflops FWD,BWD`).
pub(super) fn tflops_pair(s: &str) -> Result<(f64, f64), String> {
    let (a, b) = s.split_once(',').ok_or_else(|| format!("expected two numbers FWD,BWD, found {s:?}"))?;
    Ok((positive_f64(a.trim())?, positive_f64(b.trim())?))
}

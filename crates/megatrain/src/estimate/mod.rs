//! `megatrain estimate`: what a run would need and how fast it would go, from the same planner
//! the trainer uses ([`mt_sched::plan::plan`]), without allocating anything.
//!
//! Memory is the planner's byte count, place by place. Host RAM adds what the process itself
//! holds besides the planned buffers (code, libraries, allocator, the CUDA context's host side):
//! [`mt_train::host::PROCESS_OVERHEAD_CPU`] / [`mt_train::host::PROCESS_OVERHEAD_CUDA`], measured
//! as the RSS of runs minus their planned bytes. On the CPU backend the device pool is host memory
//! too and is added; transients are not, so small CPU runs sit below or above the figure by the
//! size of their activations.
//!
//! Step time is a bound from three overlapped pipelines, each at a sustained rate the user can
//! override (defaults measured by this project on the H200 machine):
//! compute `= (6·N·T + recompute) / tflops + attention`, the recompute being each layer's forward
//! up to its down projection (`2·(N_layer - N_down)·T` per layer), a third of the GEMM FLOPs in
//! the forward, and attention priced apart ([`attention_s`]: at long context it is most of the
//! step, and our flash kernel runs at half the GEMMs' rate); PCIe `= max(H2D, D2H) bytes / bandwidth`; the host optimizer `= bytes / host_gbs`,
//! its passes priced by the bytes they read and write per streamed parameter ([`HostTraffic`]).
//! Lean mode overlaps all three. Exact mode cannot start an update before the step's norm is
//! known, so its forward waits for the update pass and its backward for the re-casts and lands:
//! `max(forward, update) + max(backward, backward host work, PCIe)`. Either adds the pipeline fill
//! (one layer's upload and update, which cannot overlap). How close it comes to measured H200
//! runs (streamed and flash-attention steps): `docs/decisions/0041`; the test below holds the
//! flash runs within 10%.

use anyhow::Result;
use mt_core::{ModelConfig, ModelLayout};
use mt_sched::plan::Plan;
use serde_json::{json, Value};

use mt_train::host::{available_bytes, gib_to_bytes, planned_host_bytes};
use mt_train::{plan_for, DeviceKernels, ModelChoice, ModelSource, TrainConfig};

use crate::cli::{DeviceKind, EstimateArgs, Precision};

mod attention;
use attention::attention_s;
pub use attention::{FLASH_TFLOPS, HOPPER_FLASH_TFLOPS, MATERIALISED_ATTENTION_TFLOPS};

/// Default GPU memory: one H200 as the driver reports it.
pub const DEFAULT_GPU_GIB: f64 = 139.8;

/// `--tflops` on a GPU when not given: the H200 runs' compute rate (the option's help says which).
pub const DEFAULT_GPU_TFLOPS: f64 = 600.0;

/// `--moe-tflops` on a GPU when not given, on the device MoE kernels; this and
/// [`PORTABLE_MOE_TFLOPS`] are the rates that fit the OLMoE-1B-7B shape's H200 runs at 4 and 16 x 2048 with everything else
/// priced as it is (`results/2026-11-28-olmoe-engine-h200/`, decision 0049).
pub const DEFAULT_MOE_TFLOPS: f64 = 220.0;
/// `--moe-tflops` on a GPU when not given, on the portable path (host routing, per-expert GEMMs).
pub const PORTABLE_MOE_TFLOPS: f64 = 19.0;

/// The GPU memory bandwidth the device AdamW pass sustains, GB/s: an H200's (4.8 TB/s by its
/// datasheet) at the 85% a streaming kernel reaches.
pub const GPU_MEMORY_GBS: f64 = 4080.0;

/// Bytes a LoRA adapter moves through GPU memory per token and per element of its target's
/// `in + out` (bf16 activations, 2 bytes an element), beside its GEMMs' FLOPs, which are tiny at
/// the ranks people use. Counted pass by pass: the forward reads x for `x A^T`, writes
/// `(x A^T) B^T`, then reads it and y and writes y (2 in + 8 out); the recompute again; the
/// backward reads dy for `dy B` and for B's gradient, writes `(dy B) A`, reads it and dx and
/// writes dx, and reads x for A's gradient (10 in + 4 out): 14 in + 20 out, 17 per element where
/// in = out. The runs fit 15 (some passes hit L2): against the Llama-3 8B and 70B shapes' r 16
/// runs on an H200 at 4 x 2048 (0.581 and 6.14 s a step, `results/2026-11-29-lora-kept-base-h200/`)
/// the estimate is within 1.5% (it was 12% and 7% low without this term); a third of it is the
/// forward's.
pub const LORA_BYTES_PER_TARGET_ELEMENT: f64 = 15.0;

/// `--host-gbs` on a GPU machine when not given: the H200 machine's (the option's help says which).
pub const DEFAULT_HOST_GBS: f64 = 140.0;

/// The rates a step is priced at, `(tflops, host_gbs)`: as given, else a GPU machine's defaults.
/// The CPU backend's speed is not modelled: without both rates measured on the machine there is
/// no step time (`None`).
pub fn rates(args: &EstimateArgs) -> Option<(f64, f64)> {
    match (args.device, args.tflops, args.host_gbs) {
        (DeviceKind::Cuda, t, h) => Some((t.unwrap_or(DEFAULT_GPU_TFLOPS), h.unwrap_or(DEFAULT_HOST_GBS))),
        (DeviceKind::Cpu, Some(t), Some(h)) => Some((t, h)),
        (DeviceKind::Cpu, _, _) => None,
    }
}

/// An estimate of a run.
#[derive(Debug, Clone)]
pub struct Estimate {
    /// The planner's answer.
    pub plan: Plan,
    /// Host RAM the process will hold, bytes.
    pub host_bytes: u64,
    /// Page-locked host RAM (CUDA), bytes.
    pub pinned_bytes: u64,
    /// Device memory, bytes (on the CPU backend: part of `host_bytes`).
    pub device_bytes: u64,
    /// Seconds per step of each pipeline: compute, PCIe, host optimizer.
    pub compute_s: f64,
    /// PCIe seconds per step (the busier direction).
    pub pcie_s: f64,
    /// Host optimizer seconds per step.
    pub host_s: f64,
    /// Of which the update pass (exact mode: serial with the forward).
    pub host_update_s: f64,
    /// Expected seconds per step (the CPU backend's without measured rates: `NaN`, and
    /// `timed` false).
    pub step_s: f64,
    /// Whether the step was priced (on the CPU only with `--tflops` and `--host-gbs` given).
    pub timed: bool,
    /// The rate a mixture of experts' expert FLOPs were priced at (`--moe-tflops` or its
    /// default for the path that runs them).
    pub moe_tflops: f64,
    /// The device it is for (the words the plan is printed with).
    pub device: mt_train::DeviceKind,
    /// GPUs of the data-parallel run (1: one engine); the plan is each GPU's.
    pub gpus: usize,
    /// Bytes each GPU sends (and receives) in NCCL's ring all-reduce of every f32 gradient per
    /// step, `2 (N - 1) / N · 4 · params`; priced on the compute stream, where the sums run.
    pub nccl_bytes_per_gpu: u64,
    /// Tokens of the global batch per step.
    pub tokens_per_step: usize,
    /// Why `megatrain train` on this device refuses the model today (GPT-OSS on a GPU), if it
    /// does: the plan is then what the model will get once the device runs it.
    pub refused: Option<String>,
}

/// Whether the estimate's device runs the fused bf16 kernels (`--compute-capability` 8.0 or
/// more, as `mt_layers::fused_kernels` requires of a real device).
fn fused_kernels(args: &EstimateArgs) -> bool {
    args.device == DeviceKind::Cuda && args.precision == Precision::Bf16 && args.compute_capability >= 8.0
}

/// The kernels the estimate's device runs for `cfg`: the fused ones, flash attention on the
/// Hopper kernels at compute capability 9.0 for head dims 64 and 128 unless the portable ones
/// are asked for (as `mt_layers::hopper_attention` decides on a real device; GPT-OSS's sinks and
/// windows run on both sets), and a mixture of experts on the
/// device MoE kernels (as `mt_layers::moe_kernels_apply` decides).
fn device_kernels(args: &EstimateArgs, cfg: &ModelConfig) -> DeviceKernels {
    let fused = fused_kernels(args);
    let hopper_attention = fused
        && args.compute_capability == 9.0
        && matches!(cfg.head_dim, 64 | 128)
        && args.attention.kernel() != mt_train::FlashKernel::Portable;
    let moe = fused
        && mt_layers::MoeKernels::from(args.moe_kernels) == mt_layers::MoeKernels::Device
        && mt_layers::moe_kernels_fit(cfg);
    DeviceKernels { fused, hopper_attention, moe }
}

/// Plans the run and prices it.
pub fn estimate(args: &EstimateArgs) -> Result<Estimate> {
    let config = TrainConfig {
        model: match (&args.model, &args.config) {
            (Some(dir), _) => ModelChoice::HfDir(dir.clone()),
            (None, Some(p)) => ModelChoice::Config(p.clone()),
            (None, None) => ModelChoice::Builtin,
        },
        batch_size: args.batch_size,
        seq_len: args.seq_len,
        chunks: args.chunks,
        ring_depth: args.ring_depth,
        precision: args.precision.into(),
        grad_dtype: args.grad_dtype.map(Into::into),
        optim_states: args.optim_states.into(),
        optim_mode: args.optim_mode.into(),
        device: args.device.into(),
        gpus: args.gpus,
        placement: args.placement.choice(),
        attention: args.attention.choice(),
        flash_kernel: args.attention.kernel(),
        mlp_rows: args.mlp_rows.choice(),
        moe_kernels: args.moe_kernels.into(),
        store: args.store.clone(),
        lora: args.lora.config(),
        base_dtype: args.lora.base_dtype.map(Into::into),
        ..TrainConfig::default()
    };
    let mut model = ModelSource::load(&config.model)?;
    if let Some(l) = &config.lora {
        // As `megatrain train` would refuse them (it also needs the weights: --model DIR).
        let l = mt_core::LoraConfig { base: config.base_dtype(), ..l.clone().for_model(&model.cfg) };
        l.check(&model.cfg)?;
        if args.gpus > 1 {
            anyhow::bail!("LoRA runs on one device for now: use --gpus 1");
        }
        model.cfg.lora = Some(l);
    }
    let cfg = &model.cfg;
    let device = config.device;
    let host_avail = args.host_mem.map_or_else(available_bytes, gib_to_bytes);
    let gpu = match args.device {
        DeviceKind::Cuda => gib_to_bytes(args.gpu_mem.unwrap_or(DEFAULT_GPU_GIB)),
        DeviceKind::Cpu => host_avail,
    };
    // As `mt_layers::fused_kernels` decides on a real device: bf16 on compute capability 8.0+.
    // With --gpus N the plan is each GPU's, for its share of the batch (`plan_for`).
    let p = plan_for(&config, cfg, gpu, host_avail, device_kernels(args, cfg))?;
    let n_gpus = args.gpus as f64;
    // Each GPU has its own staging and landing rings; the store is one.
    let extra_rings = (args.gpus as u64 - 1) * p.host.pinned;
    let pinned = if args.device == DeviceKind::Cuda { p.host.pinned * args.gpus as u64 } else { 0 };
    let host_bytes = planned_host_bytes(&p, device) + extra_rings;
    // A device slot's layout (with LoRA: the base and its adapters) and what trains of it (the
    // adapters): the host's update, land and downloads are of what trains, its casts and the
    // uploads of whole slots.
    let (layout, trainable) = (ModelLayout::new(cfg), ModelLayout::trainable(cfg));
    let tokens = (p.batch * args.seq_len) as f64;
    // Model FLOPs (on the active parameters: a mixture of experts' tokens each reach k of its
    // E experts) plus the recomputed forward of every layer that does not keep its activations
    // (the recompute stops before down_proj, a MoE layer's before its experts' down projections).
    let active = mt_core::active_params(cfg);
    let active_layer = (active - layout.outer.n_params()) / layout.n_layers;
    let down = match &cfg.moe {
        None => layout.layer.get(mt_core::names::DOWN).map_or(0, |s| s.numel()),
        Some(m) => m.num_experts_per_tok * cfg.hidden_size * m.moe_intermediate_size,
    };
    let recomputed = layout.n_layers - p.placement.kept_layers;
    let recompute = 2.0 * (recomputed * (active_layer - down)) as f64 * tokens;
    // Of these, a mixture of experts' expert projections (each token's k experts: gate, up and
    // down), priced at their own rate: forward, backward and the recompute's gate and up.
    let expert =
        cfg.moe.as_ref().map_or(0, |m| m.num_experts_per_tok * cfg.hidden_size * m.moe_intermediate_size);
    let moe_fwd = 2.0 * (3 * expert * layout.n_layers) as f64 * tokens;
    let moe_frozen = if cfg.lora.is_some() { moe_fwd } else { 0.0 };
    let moe_flops = 3.0 * moe_fwd - moe_frozen + 2.0 * (2 * expert * recomputed) as f64 * tokens;
    // The forward's GEMMs, 2·N·T, and the backward's, twice that, less a frozen weight's
    // gradient (a LoRA run's base: 2 FLOPs an active parameter a token), which is never formed.
    let frozen = if cfg.lora.is_some() { (active - trainable.n_params()) as f64 } else { 0.0 };
    let fwd_gemm = 2.0 * active as f64 * tokens;
    let gemm = fwd_gemm + 4.0 * active as f64 * tokens - 2.0 * frozen * tokens;
    let attn = attention_s(cfg, &p, args);
    // Data parallel: every gradient summed by NCCL on the compute stream, after its backward.
    let nccl_bytes =
        if args.gpus > 1 { 2.0 * (n_gpus - 1.0) / n_gpus * 4.0 * layout.n_params() as f64 } else { 0.0 };
    let timed = rates(args);
    let (tflops, host_gbs) = timed.unwrap_or((f64::NAN, f64::NAN));
    let moe_tflops = args.moe_tflops.unwrap_or(match args.device {
        DeviceKind::Cuda if p.moe_kernels => DEFAULT_MOE_TFLOPS,
        DeviceKind::Cuda => PORTABLE_MOE_TFLOPS,
        DeviceKind::Cpu => tflops,
    });
    // A LoRA run's adapters: their memory passes over the activations of every target
    // (`LORA_BYTES_PER_TARGET_ELEMENT`), at the GPU's memory bandwidth.
    let lora_io = if cfg.lora.is_some() {
        let in_out: usize = trainable
            .layer
            .tensors
            .iter()
            .map(|t| if t.name.contains("lora_A") { t.shape[1] } else { t.shape[0] })
            .sum();
        let bytes = LORA_BYTES_PER_TARGET_ELEMENT * (in_out * layout.n_layers) as f64 * tokens;
        if args.device == DeviceKind::Cuda {
            bytes / (GPU_MEMORY_GBS * 1e9)
        } else {
            0.0
        }
    } else {
        0.0
    };
    let compute_s = (gemm + recompute - moe_flops) / (tflops * 1e12)
        + moe_flops / (moe_tflops * 1e12)
        + lora_io
        + attn.forward
        + attn.backward
        + nccl_bytes / (args.nccl_gbs * 1e9);
    // The forward is its GEMMs and attention's forward; the backward the rest.
    let fwd_s =
        (fwd_gemm - moe_fwd) / (tflops * 1e12) + moe_fwd / (moe_tflops * 1e12) + attn.forward + lora_io / 3.0;
    let bwd_s = compute_s - fwd_s;
    let pcie_s = p.pcie_h2d_per_step.max(p.pcie_d2h_per_step) as f64 / (args.pcie_gbs * 1e9);
    // The host optimizer works on the streamed units only: resident ones are updated on the GPU.
    // A LoRA run's frozen base is only staged into its slots' upload copies, as its encoding
    // says (`plan::BaseBytes`: an fp32 base cast, f32 read and `e` written; a bf16 one copied;
    // an int8 or NF4 layer's encoded bytes copied, to be dequantised on the GPU).
    let streamed_layers = layout.n_layers - p.placement.resident_layers;
    let layer_params = (streamed_layers * trainable.layer.n_params()) as f64;
    let outer_params = if p.placement.resident_outer { 0.0 } else { trainable.outer.n_params() as f64 };
    // Held layers and the outer unit keep their base in their own slots after the first step
    // (the plan's `pcie_h2d_per_step`): only the other streamed layers stage theirs.
    let base_layer_stage = p.base.layer_stage as f64;
    let base_staging_layers =
        (layout.n_layers - p.placement.resident_layers - p.placement.held_layers) as f64;
    // Bytes uploaded with a decoder layer: its base as staged, and what trains in the weight dtype.
    let adapters_up = trainable.layer.len as f64 * args.precision.bytes();
    let layer_up = p.base.layer_up as f64 + adapters_up;
    let mode = args.optim_mode.into();
    let grad = crate::cli::default_grad_dtype(args.grad_dtype, args.precision).into();
    let states = mt_core::StateDtype::from(args.optim_states);
    let b = HostTraffic::of(mode, grad, args.precision.bytes(), states.nominal_state_bytes() as f64);
    let secs = |bytes: f64| bytes / (host_gbs * 1e9);
    // Resident units and GPU-updated layers are updated on the GPU, on the compute stream: the
    // AdamW pass reads the master, the moments and the f32 gradient and writes the master, the
    // moments and the weights, bound by the GPU's memory bandwidth.
    let device_updated = (p.placement.resident_layers + p.placement.gpu_updated_layers)
        * trainable.layer.n_params()
        + if p.placement.resident_outer { trainable.outer.n_params() } else { 0 };
    let device_update_s = match args.device {
        DeviceKind::Cuda => {
            device_updated as f64 * (2.0 * b.state + 4.0 + args.precision.bytes()) / (GPU_MEMORY_GBS * 1e9)
        }
        DeviceKind::Cpu => 0.0,
    };
    let compute_s = compute_s + device_update_s;
    // GPU-updated layers' updates run on the GPU from their streamed state, but the DMA of that
    // state (master, m, v and the stored gradient up, master, m and v down: 26 B/param in bf16
    // with fp32 moments; `s` B/param of master and moments each way) goes through the same host
    // memory the host's update pass is bound by, in the same window: priced at the same
    // bandwidth (the host's pass slows beside it by about the DMA's bytes: docs/decisions/0041).
    // Late downloads (`s` B/param) come back in the backward
    // instead, and early uploads' master and moments (`s` B/param) go up there (their gradient is
    // copied on the device).
    let s = b.state;
    let gpu_params = (p.placement.gpu_updated_layers * layout.layer.n_params()) as f64;
    let late_params = (p.placement.late_state_downloads * layout.layer.n_params()) as f64;
    let early_params = (p.placement.early_state_uploads * layout.layer.n_params()) as f64;
    let state_dma = gpu_params * (2.0 * s + b.grad) - late_params * s - early_params * (s + b.grad);
    // Every GPU casts every streamed unit into its own staging ring; the update and the land
    // (GPU 0's) run once. In exact mode one GPU's forward cast is fused into the update, the
    // others' read the master again.
    let other_casts = match mode {
        mt_sched::OptimMode::Exact => (n_gpus - 1.0) * (4.0 + args.precision.bytes()),
        mt_sched::OptimMode::Lean => 0.0,
    };
    let base_staged = base_staging_layers * base_layer_stage;
    let host_update_s = secs(
        (layer_params - gpu_params + outer_params) * (b.update + n_gpus * b.fwd_cast + other_casts)
            + base_staged * n_gpus
            + state_dma,
    );
    // Held layers are not re-cast for the backward (their weights stay on the GPU).
    let recast_layers = (streamed_layers - p.placement.held_layers) as f64;
    let host_backward_s = secs(
        n_gpus * recast_layers * (trainable.layer.n_params() as f64 * b.bwd_cast + base_layer_stage)
            + layer_params * b.land
            + outer_params * b.outer_land
            + late_params * s
            + early_params * s,
    );
    let host_s = host_update_s + host_backward_s;
    // The first streamed layer's upload and update are not hidden behind anything.
    let fill = if streamed_layers > 0 {
        let t = trainable.layer.n_params() as f64;
        // The first streamed layer stages and uploads its base unless every streamed layer is held.
        let (up, stage) =
            if base_staging_layers > 0.0 { (layer_up, base_layer_stage) } else { (adapters_up, 0.0) };
        up / (args.pcie_gbs * 1e9) + secs(t * (b.update + b.fwd_cast) + stage)
    } else {
        0.0
    };
    let step_s = match mode {
        // Exact: the update needs the whole step's norm, so it runs in the next forward (which
        // waits for it layer by layer) and cannot overlap the backward. The forward's uploads
        // overlap the forward; the backward's re-uploads and every download the backward.
        mt_sched::OptimMode::Exact => {
            let bwd_h2d = recast_layers * layer_up + early_params * s;
            // GPU-updated layers' master and moments come back during the forward (the late
            // ones' during the backward).
            let fwd_d2h = ((p.placement.gpu_updated_layers - p.placement.late_state_downloads)
                * layout.layer.len) as f64
                * s;
            // Their state goes up beside the host's pass, slower than weights alone (the
            // planner's `STATE_UPLOAD_GBS` of its `PCIE_GBS`): master, m, v and the stored
            // gradient of each not uploaded early.
            let state_up = ((p.placement.gpu_updated_layers - p.placement.early_state_uploads)
                * layout.layer.len) as f64
                * (s + b.grad);
            let state_gbs = args.pcie_gbs * mt_sched::plan::STATE_UPLOAD_GBS / mt_sched::plan::PCIE_GBS;
            let fwd_h2d_s = (p.pcie_h2d_per_step as f64 - bwd_h2d - state_up) / (args.pcie_gbs * 1e9)
                + state_up / (state_gbs * 1e9);
            let pcie_fwd_s = fwd_h2d_s.max(fwd_d2h / (args.pcie_gbs * 1e9));
            let pcie_bwd_s = bwd_h2d.max(p.pcie_d2h_per_step as f64 - fwd_d2h) / (args.pcie_gbs * 1e9);
            fwd_s.max(host_update_s).max(pcie_fwd_s)
                + bwd_s.max(host_backward_s).max(pcie_bwd_s)
                + device_update_s
        }
        // Lean: every host pass may overlap any compute.
        mt_sched::OptimMode::Lean => compute_s.max(host_s).max(pcie_s),
    } + fill;
    Ok(Estimate {
        device_bytes: p.gpu.total,
        plan: p,
        host_bytes,
        pinned_bytes: pinned,
        compute_s,
        pcie_s,
        host_s,
        host_update_s,
        step_s,
        timed: timed.is_some(),
        moe_tflops,
        device: device.kind(),
        gpus: args.gpus,
        nccl_bytes_per_gpu: nccl_bytes as u64,
        tokens_per_step: args.batch_size * args.seq_len,
        refused: match args.device {
            DeviceKind::Cuda => mt_layers::check_gpu(cfg, config.precision.dtype(), config.attention)
                .err()
                .map(|e| e.to_string()),
            DeviceKind::Cpu => None,
        },
    })
}

/// Host memory traffic per streamed parameter per step, bytes read + written by each host pass
/// (what the step time's host side is priced by).
struct HostTraffic {
    /// The AdamW pass: exact mode's fused update + cast into staging (gradient, master, m, v,
    /// upload copy); lean mode's fused land + update (`mt_optim::land_and_step`: the landed f32
    /// read once, the stored gradient written, master, m, v).
    update: f64,
    /// Bytes of a parameter's master and moments (12, 8 or 6 by `--optim-states`): read and
    /// written by the update, and a GPU-updated layer's state DMA each way.
    state: f64,
    /// The forward's cast into staging (lean mode; exact mode fuses it into the update).
    fwd_cast: f64,
    /// The backward's re-cast into staging of a layer (master read, upload copy written).
    bwd_cast: f64,
    /// A layer's land in exact mode: a copy (bf16 landing) or a cast with its sum of squares (f32
    /// landing); in lean mode part of `update`.
    land: f64,
    /// The outer unit's land in exact mode (it always lands f32: cast + sum of squares).
    outer_land: f64,
    /// Bytes of a stored gradient element.
    grad: f64,
}

impl HostTraffic {
    fn of(mode: mt_sched::OptimMode, grad: mt_store::GradDtype, e: f64, s: f64) -> Self {
        let g = match grad {
            mt_store::GradDtype::F32 => 4.0,
            mt_store::GradDtype::Bf16 => 2.0,
            mt_store::GradDtype::None => 0.0,
        };
        let cast = 4.0 + e;
        match mode {
            mt_sched::OptimMode::Exact => HostTraffic {
                update: g + 2.0 * s + e,
                state: s,
                fwd_cast: 0.0,
                bwd_cast: cast,
                land: if mt_sched::plan::lands_bf16(mode, grad) { 2.0 + 2.0 } else { 4.0 + g },
                outer_land: 4.0 + g,
                grad: g,
            },
            mt_sched::OptimMode::Lean => HostTraffic {
                update: 4.0 + g + 2.0 * s,
                state: s,
                fwd_cast: cast,
                bwd_cast: cast,
                land: 0.0,
                outer_land: 0.0,
                grad: g,
            },
        }
    }
}

impl Estimate {
    /// Model FLOPs of the global batch's step (the plan's are one GPU's share).
    fn global_flops(&self) -> f64 {
        let p = &self.plan;
        if self.tokens_per_step == p.batch * p.seq {
            return p.flops_per_step;
        }
        p.flops_per_step * self.tokens_per_step as f64 / (p.batch * p.seq).max(1) as f64
    }

    /// The estimate as JSON (bytes and seconds; the plan's figures included).
    pub fn to_json(&self, args: &EstimateArgs) -> Value {
        let p = &self.plan;
        // Not priced (the CPU without measured rates): null, not NaN.
        let secs = |x: f64| if self.timed { json!(x) } else { Value::Null };
        let (tflops, host_gbs) = rates(args).unzip();
        json!({
            "n_params": p.n_params,
            "batch_size": p.batch, "seq_len": p.seq, "n_chunks": p.n_chunks, "ring_depth": p.ring_depth,
            "moe_kernels": p.moe_kernels,
            "host_bytes": self.host_bytes, "host_store_bytes": p.host.store, "host_staging_bytes": p.host.pinned,
            "host_frozen_base_bytes": p.host.frozen_base, "trainable_params": p.trainable_params,
            "base_dtype": (p.host.frozen_base > 0).then(|| p.base.dtype.name()),
            "base_upload_bytes_per_layer": p.base.layer_up, "base_stage_bytes_per_layer": p.base.layer_stage,
            "host_peak_bytes": p.host.total, "host_released_by_resident_bytes": p.host.released_by_resident,
            "host_store_window_bytes": p.host.store_window,
            "pinned_bytes": self.pinned_bytes, "device_bytes": self.device_bytes,
            "pcie_h2d_bytes_per_step": p.pcie_h2d_per_step, "pcie_d2h_bytes_per_step": p.pcie_d2h_per_step,
            "model_flops_per_step": p.flops_per_step,
            "compute_s": secs(self.compute_s), "pcie_s": self.pcie_s, "host_optimizer_s": secs(self.host_s),
            "host_update_s": secs(self.host_update_s),
            "step_s": secs(self.step_s),
            "tokens_per_s": secs(self.tokens_per_step as f64 / self.step_s),
            "model_tflops": secs(self.global_flops() / self.step_s / 1e12),
            "gpus": self.gpus, "nccl_bytes_per_gpu_per_step": self.nccl_bytes_per_gpu,
            "refused_by_train": self.refused,
            "assumed": {"tflops": tflops, "attention_tflops": args.attention_tflops.map(|r| [r.0, r.1]),
                "moe_tflops": (p.moe_kernels || self.moe_tflops.is_finite()).then_some(self.moe_tflops),
                        "pcie_gbs": args.pcie_gbs, "host_gbs": host_gbs,
                        "compute_capability": args.compute_capability, "fused_kernels": fused_kernels(args)},
        })
    }
}

/// `x` with three significant digits.
fn sig3(x: f64) -> String {
    let digits = if x == 0.0 { 0 } else { (2 - x.abs().log10().floor() as i32).clamp(0, 6) as usize };
    format!("{x:.digits$}")
}

/// Seconds with three significant digits, in ms or µs below a second: a tiny model's step is not
/// "0.000 s".
fn secs(s: f64) -> String {
    match s {
        0.0 => "0 s".to_owned(),
        s if s >= 1.0 => format!("{} s", sig3(s)),
        s if s >= 1e-3 => format!("{} ms", sig3(s * 1e3)),
        s => format!("{} µs", sig3(s * 1e6)),
    }
}

impl std::fmt::Display for Estimate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: u64| mt_core::units::bytes_binary(b as f64);
        let p = &self.plan;
        writeln!(f, "{}", p.display_on(self.device))?;
        let base = match p.host.frozen_base {
            0 => String::new(),
            b => format!(", frozen base {}", gib(b)),
        };
        writeln!(
            f,
            "host RAM: {} ({:.2} bytes/param; store {}{base}, staging/landing {}, process)",
            gib(self.host_bytes),
            self.host_bytes as f64 / p.n_params.max(1) as f64,
            gib(p
                .host
                .store_window
                .map_or(p.host.store, |_| p.host.total - p.host.pinned - p.host.frozen_base)),
            gib(p.host.pinned)
        )?;
        if p.host.frozen_base > 0 {
            let frozen = (p.n_params - p.trainable_params).max(1) as f64;
            let staged = match p.base.dtype {
                mt_core::BaseDtype::F32 => "cast to the weight dtype into each slot's upload",
                mt_core::BaseDtype::Bf16 => "copied into each slot's upload",
                // Where the layers go up encoded (bf16 or fp32 slots): their scratch buffer.
                _ if p.base.scratch > 0 => {
                    "a decoder layer's matrices uploaded encoded and dequantised on the GPU, the rest as bf16 weights"
                }
                _ => "dequantised on the host into each slot's upload",
            };
            writeln!(
                f,
                "LoRA: {} of the {} parameters train (the adapters: their fp32 master, AdamW moments \
                 and gradients are the store); the base is frozen in host RAM as {} ({:.2} B/param; \
                 {staged}; {} a decoder layer's upload beside its adapters); only the adapters' \
                 gradients come down",
                p.trainable_params,
                p.n_params,
                p.base.dtype,
                p.host.frozen_base as f64 / frozen,
                gib(p.base.layer_up)
            )?;
        }
        if let Some(w) = p.host.store_window {
            writeln!(
                f,
                "disk tier: the store pages from its file through a {} window; a step reads and \
                 writes about the store once each ({}), the reads more where the window is small \
                 (about 1.3x at a third of the store); not in the step time below",
                gib(w),
                mt_core::units::bytes(p.host.store as f64)
            )?;
        }
        let pcie = match self.device {
            mt_train::DeviceKind::Gpu => {
                writeln!(
                    f,
                    "pinned RAM: {}   GPU memory: {}",
                    gib(self.pinned_bytes),
                    gib(self.device_bytes)
                )?;
                "PCIe"
            }
            mt_train::DeviceKind::Cpu => "copies",
        };
        if !self.timed {
            write!(
                f,
                "step time: not estimated: the CPU backend's speed is not modelled. Give this machine's \
                 rates to price it: --tflops (the model TFLOP/s a short `megatrain train` run prints) \
                 and --host-gbs (its memory bandwidth)"
            )?;
        } else {
            write!(
                f,
                "step time: {} (compute {}, {pcie} {}, host optimizer {} of which update {}) -> {:.0} tokens/s, {} model TFLOP/s",
                secs(self.step_s),
                secs(self.compute_s),
                secs(self.pcie_s),
                secs(self.host_s),
                secs(self.host_update_s),
                self.tokens_per_step as f64 / self.step_s,
                sig3(self.global_flops() / self.step_s / 1e12)
            )?;
        }
        if let Some(why) = &self.refused {
            write!(f, "\nnote: `megatrain train` refuses this model on this device today ({why}); the plan above is what it will get once the device runs it")?;
        }
        if self.gpus > 1 {
            write!(
                f,
                "\ndata parallel: {} GPUs, each as planned above (its share of the batch, its own PCIe \
                 uploads; GPU 0 downloads the summed gradients); NCCL all-reduce {} per GPU per step \
                 (on the compute stream, in the compute time); host casts once per GPU",
                self.gpus,
                gib(self.nccl_bytes_per_gpu)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;

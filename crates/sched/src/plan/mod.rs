//! The memory and throughput planner: given a model, a batch shape, a weight dtype and the
//! memory of a machine, decides the chunking and ring depth of a step and accounts for every
//! byte it puts on the GPU and in host memory, the PCIe traffic of a step and its model FLOPs.
//! Pure arithmetic: no device is touched.
//!
//! GPU bytes (`e` = bytes of the weight dtype, `t` = tokens of the largest chunk):
//! - weight ring: `ring_depth × layer.len × e`; outer slot: `outer.len × e`; held layers' slots:
//!   `held_layers × layer.len × e`;
//! - gradients (fp32): `2 × layer.len × 4 + outer.len × 4`;
//! - a resident outer unit's optimizer state: `s × outer.len` (fp32 master, m, v; `s` = 12 with
//!   fp32 moments, 8 with bf16, 6 with 8-bit, `--optim-states`, plus the 8-bit blocks' scales);
//! - each resident decoder layer: `(e + 4 + s) × layer.len` (its weights, fp32 gradient,
//!   master, m and v);
//! - checkpoints: `(n_layers + 1) × batch × seq × hidden × e`; activation gradients:
//!   `batch × seq × hidden × e` (both grow with the batch, not with the chunking);
//! - kept activations: `kept_layers × DecoderLayer::kept_state_bytes` (what a layer's forward
//!   keeps so that its backward need not recompute it);
//! - workspace: the larger of one layer's backward-with-recompute and the loss over one chunk
//!   (they are different compute ops, never alive together), see [`layer_workspace`] and
//!   [`loss_workspace`].
//!
//! Host bytes: exactly the arena of [`mt_store::HostStore`] (header page, per unit a meta page
//! and page-rounded master, m, v and gradient regions: `4 + 2·m + g` B/param with moments of `m`
//! bytes and gradients of `g`) plus the staging and landing buffers
//! (page-locked on CUDA): `2 × layer.len × e + outer.len × e` and `2 × layer.len × 4 + outer.len × 4`.
//! All of it must fit (the store is populated before the engine starts); while training, the
//! resident units' gradient regions are given back (`HostBytes::released_by_resident`).
//!
//! A LoRA run (`cfg.lora`, decision 0044) is priced as it runs: the store, the gradient buffers,
//! the landing buffers and the downloads are the adapters' (`ModelLayout::trainable`); the weight
//! slots, the staging buffers and the uploads a slot's (the base and its adapters,
//! `ModelLayout::new`); the frozen base adds its own bytes to the host's
//! (`HostBytes::frozen_base`, in its encoding as `mt_store::FrozenBase` holds it: fp32, bf16,
//! int8 or NF4), and it is staged and uploaded in that encoding where the device dequantises it
//! (`Plan::base`, decision 0048). No optimizer state goes on the device: `auto` places none
//! there and asking for it is refused.

use candle_core::DType;
use mt_core::{ModelConfig, StateDtype};
use mt_store::GradDtype;

use crate::placement::{Placement, PlacementChoice};
use crate::{OptimMode, Result};

mod bytes;
pub use bytes::{
    base_bytes, largest_record, layer_workspace, loss_workspace, store_bytes, BaseBytes, LayerPath,
    PAGED_MIN_RECORDS,
};
mod display;
mod model;
mod phases;
pub use model::{
    early_upload_capacity, forward_window, host_update_bytes, late_download_capacity, BACKWARD_D2H_SHARE,
    BACKWARD_TFLOPS, HOST_MEMORY_GBS, PCIE_GBS, STATE_UPLOAD_GBS,
};

/// Fraction of the GPU's memory the plan may use; the rest is left for the CUDA context, the
/// RoPE tables, allocator fragmentation and library workspaces (cuBLAS).
pub const GPU_USABLE_FRACTION: f64 = 0.92;
/// Default number of weight slots (double buffering: compute never waits for an upload after
/// layer 0).
pub const DEFAULT_RING_DEPTH: usize = 2;
/// Upload staging and landing buffers the engine allocates (two each), and layer gradient
/// buffers without late state downloads ([`grad_bufs`]).
const N_BUFS: u64 = 2;

/// Device gradient buffers of the layer ring: two, or four with late state downloads. A late
/// download (1.2 GB at 3.6B) holds the backward's D2H for ~25 ms, three layers' backward at 4 x
/// 2048 on an H200; the gradients queued behind it need buffers to wait in, or the backward
/// stalls.
pub fn grad_bufs(late_state_downloads: usize) -> usize {
    if late_state_downloads > 0 {
        4
    } else {
        N_BUFS as usize
    }
}
/// What to plan for.
#[derive(Debug, Clone)]
pub struct PlanInput {
    /// The model.
    pub cfg: ModelConfig,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Weight dtype on the device (F32, BF16 or F16); also the activation dtype.
    pub weight_dtype: DType,
    /// Gradient dtype of the host store.
    pub grad_dtype: GradDtype,
    /// The AdamW moments' encoding (`--optim-states`): the store's, the resident units' and the
    /// state slots' bytes.
    pub state_dtype: StateDtype,
    /// Optimizer placement (exact mode needs store gradient buffers).
    pub mode: OptimMode,
    /// Total GPU memory in bytes.
    pub gpu_bytes: u64,
    /// Host memory available for the store and pinned buffers, in bytes.
    pub host_bytes: u64,
    /// Weight slots; `None` = [`DEFAULT_RING_DEPTH`].
    pub ring_depth: Option<usize>,
    /// Token chunks; `None` = the fewest that fit.
    pub n_chunks: Option<usize>,
    /// Rows of logits alive at once in the loss.
    pub rows_per_block: usize,
    /// The placement asked for (`None` settings: the planner decides, as each field's doc says).
    pub placement: PlacementChoice,
    /// The device runs the fused CUDA kernels (`mt_layers::fused_kernels`: bf16 on compute
    /// capability 8.0+), which keep less for the backward than candle's ops.
    pub fused_kernels: bool,
    /// Flash attention (`Some(true)`), the materialised scores (`Some(false)`), or decide
    /// (`None`): flash wherever it runs (the fused kernels and a head dim of 16, 32, 64 or 128).
    pub flash_attention: Option<bool>,
    /// Flash attention here runs the Hopper kernels (`mt_layers::hopper_attention`: compute
    /// capability 9.0, head dim 64 or 128, not forced portable), whose backward needs an fp32 dQ
    /// buffer beside its other transients (`mt_layers::hopper_dq_buffer_bytes`).
    pub hopper_attention: bool,
    /// A mixture of experts runs the device MoE kernels (`mt_layers::moe_kernels_apply`): their
    /// routed rows' workspace (`mt_layers::moe_device_workspace_bytes`) instead of the portable
    /// path's per-expert tensors. Only with the fused kernels and where the kernels take the
    /// model (`mt_layers::moe_kernels_fit`: not a dense model, not GPT-OSS).
    pub moe_kernels: bool,
    /// The store is a file (`--store`): where it does not fit `host_bytes`, it is paged through
    /// a RAM window (the disk tier, `HostStore::start_paging`) instead of refused.
    pub store_file: bool,
    /// Host bytes a paged store's window must leave to what the planner does not count (the
    /// process, a checkpoint's and the export's buffers; on the CPU backend the device buffers):
    /// the window is `host_bytes` less the rings, one record and this.
    pub host_reserved: u64,
    /// Rows of each decoder layer's MLP tile (`Some(r)`, 0 = a chunk's rows at once), or decide
    /// (`None`): a chunk's rows at once up to `MLP_TILE_ROWS[0]` of them, else the largest of
    /// [`MLP_TILE_ROWS`] that fits.
    pub mlp_rows: Option<usize>,
}

/// The MLP tile sizes the planner tries, largest first, for chunks of more rows: tiles of 8192
/// rows keep the MLP's GEMMs as efficient as whole ones (`[8192, hidden] x [hidden, ffn]`) and
/// leave the memory a whole chunk's `[rows, ffn]` tensors would take to residency.
pub const MLP_TILE_ROWS: [usize; 4] = [8192, 4096, 2048, 1024];

/// GPU bytes by kind of buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuBytes {
    /// Weight slot ring.
    pub weight_ring: u64,
    /// Held layers' own slots (`held_layers × layer.len × e`).
    pub held: u64,
    /// Outer slot (embedding, final norm, LM head).
    pub outer: u64,
    /// fp32 layer gradient buffers (with their bf16 twins where gradients land in bf16,
    /// [`lands_bf16`]) and the outer gradient buffer.
    pub grads: u64,
    /// Layer-boundary checkpoints of the whole batch.
    pub checkpoints: u64,
    /// Activation gradients of the whole batch at one boundary.
    pub act_grads: u64,
    /// Transient workspace of the largest chunk.
    pub workspace: u64,
    /// A resident outer unit's fp32 master weights and AdamW moments (`s × outer.len`: 12, 8 or
    /// 6 bytes a parameter, by `--optim-states`).
    pub outer_state: u64,
    /// Resident decoder layers: weights, fp32 gradients, master weights and moments
    /// (`(e + 4 + s) × layer.len` each).
    pub resident_layers: u64,
    /// Forward activations kept by layers `0..kept_layers` for their backward, the whole
    /// batch (`DecoderLayer::kept_state_bytes` each).
    pub kept: u64,
    /// State slots of the GPU-updated layers: `(ring_depth + late downloads) ×
    /// (s + g) × layer.len` (`[master | m | v]` and the stored gradient of `g` bytes), plus the f32
    /// copy a bf16 stored gradient is widened into (`4 × layer.len`), plus, with late downloads,
    /// the two more layer gradient buffers they need ([`grad_bufs`]).
    pub state_slots: u64,
    /// Sum of the above.
    pub total: u64,
    /// What the plan may use: [`GPU_USABLE_FRACTION`] of the GPU's memory.
    pub budget: u64,
}

/// Host bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostBytes {
    /// The host store's arena.
    pub store: u64,
    /// A LoRA run's frozen base weights (`mt_store::FrozenBase::bytes`: 4, 2, ~1.06 or ~0.56
    /// B/param by its encoding), 0 without LoRA.
    pub frozen_base: u64,
    /// Staging and landing buffers, and the spilled checkpoints' (page-locked on CUDA).
    pub pinned: u64,
    /// Of `pinned`, the spilled checkpoints' buffers.
    pub spilled_checkpoints: u64,
    /// Sum of the above (with a paged store, the window and one record instead of the store):
    /// what must fit.
    pub total: u64,
    /// Bytes of the store kept in RAM when it is paged from its file (`None`: all of it): the
    /// pager's window (`HostStore::start_paging`). `total` counts the window and one record
    /// more, on its way to disk.
    pub store_window: Option<u64>,
    /// Of the store, the gradient regions of the resident units, which the engine gives back to
    /// the kernel once it has loaded them (`HostStore::release_grad`, anonymous stores): the
    /// host holds `total - released_by_resident` while it trains.
    pub released_by_resident: u64,
}

/// A step plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Token chunks (contiguous groups of whole sequences, as [`crate::batch::chunk_ranges`]).
    pub n_chunks: usize,
    /// Sequences in the largest chunk.
    pub seqs_per_chunk: usize,
    /// Weight slots.
    pub ring_depth: usize,
    /// Decoder layers of the model.
    pub n_layers: usize,
    /// Where the step keeps what: the planner's decision.
    pub placement: Placement,
    /// Attention runs as flash attention (no `[s, s]` scores).
    pub flash_attention: bool,
    /// ... on the Hopper kernels (`PlanInput::hopper_attention`).
    pub hopper_attention: bool,
    /// A mixture of experts on the device MoE kernels (`PlanInput::moe_kernels`).
    pub moe_kernels: bool,
    /// Rows of each MLP tile (0 = a chunk's rows at once).
    pub mlp_rows: usize,
    /// GPU bytes.
    pub gpu: GpuBytes,
    /// Host bytes.
    pub host: HostBytes,
    /// Bytes uploaded per step: `(outer.len + (2 × streamed layers - held layers) × layer.len)
    /// × e`, without the `outer.len` term when the outer unit is resident (a LoRA run's frozen
    /// base part of each as [`BaseBytes`] says: an int8 or NF4 layer's encoded); each GPU-updated
    /// layer's forward upload (`layer.len × e`) is replaced by its state (`(s + g) ×
    /// layer.len`), an early-upload one's by `s × layer.len` (its gradient is copied on the
    /// device). A step after the first: a LoRA run's held layers and streamed outer unit upload
    /// their adapters alone, their base staying in their own slots from the first step on.
    pub pcie_h2d_per_step: u64,
    /// Bytes downloaded per step: `(streamed layers × layer.len + outer.len) × 4`, likewise
    /// (layer gradients in bf16 where they land so), plus `s × layer.len` per GPU-updated layer.
    pub pcie_d2h_per_step: u64,
    /// Model parameters (padding excluded; a LoRA run's base and adapters).
    pub n_params: u64,
    /// Of them, those that train (a LoRA run's adapters; all of them otherwise).
    pub trainable_params: u64,
    /// A LoRA run's frozen base as held, staged and uploaded (all zero without LoRA).
    pub base: BaseBytes,
    /// Model FLOPs per step ([`mt_core::model_flops_per_step`]: `6·N·T + 6·L·s·hidden·T`, `N`
    /// the active parameters (all of a dense model; a mixture of experts' router and routed
    /// experts), attention with the causal half, recompute not counted).
    pub flops_per_step: f64,
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// Whether the streamed layers' gradients cross PCIe and land in bf16: in exact mode with bf16
/// store gradients the host stores bf16 anyway, so the device narrows the f32 accumulation (and
/// takes its share of the global norm) and half the bytes cross and land. Otherwise f32 lands
/// (lean mode updates from the f32 gradient; f32 store gradients keep it).
pub fn lands_bf16(mode: OptimMode, grad_dtype: GradDtype) -> bool {
    mode == OptimMode::Exact && grad_dtype == GradDtype::Bf16
}

/// Plans a step; fails, naming what does not fit and by how much, when it cannot.
pub fn plan(input: &PlanInput) -> Result<Plan> {
    if input.cfg.lora.is_none() {
        return plan_any(input);
    }
    // A LoRA run keeps no optimizer state on the device yet (decision 0044).
    if let Some(flag) = input.placement.device_state_asked() {
        return Err(crate::Error::Options(format!(
            "{flag} keeps optimizer state on the GPU, which a LoRA run does not yet (its adapters' AdamW runs on the host): leave it at auto or 0"
        )));
    }
    plan_any(&PlanInput { placement: input.placement.host_state_by_default(), ..input.clone() })
}

/// [`plan`] of a placement a run may ask for: the outer unit resident, streamed, or the better.
fn plan_any(input: &PlanInput) -> Result<Plan> {
    match input.placement.resident_outer {
        Some(resident) => phases::plan_placed(input, resident),
        // Resident when it costs no chunk; whichever fits when only one does (the streamed
        // layout needs more pinned host memory, the resident one more GPU memory).
        None => match (phases::plan_placed(input, false), phases::plan_placed(input, true)) {
            (Ok(s), Ok(r)) => Ok(
                if r.n_chunks <= s.n_chunks
                    && r.placement.spilled_checkpoints <= s.placement.spilled_checkpoints
                {
                    r
                } else {
                    s
                },
            ),
            (Ok(s), Err(_)) => Ok(s),
            (Err(_), Ok(r)) => Ok(r),
            (Err(e), Err(_)) => Err(e),
        },
    }
}

#[cfg(test)]
mod tests;

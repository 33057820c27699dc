//! The memory and throughput planner: given a model, a batch shape, a weight dtype and the
//! memory of a machine, decides the chunking and ring depth of a step and accounts for every
//! byte it puts on the GPU and in host memory, the PCIe traffic of a step and its model FLOPs.
//! Pure arithmetic: no device is touched.
//!
//! GPU bytes (`e` = bytes of the weight dtype, `t` = tokens of the largest chunk):
//! - weight ring: `ring_depth × layer.len × e`; outer slot: `outer.len × e`; held layers' slots:
//!   `held_layers × layer.len × e`;
//! - gradients (fp32): `2 × layer.len × 4 + outer.len × 4`;
//! - a resident outer unit's optimizer state: `12 × outer.len` (fp32 master, m, v);
//! - each resident decoder layer: `(e + 4 + 12) × layer.len` (its weights, fp32 gradient,
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
//! and page-rounded master, m, v and gradient regions) plus the staging and landing buffers
//! (page-locked on CUDA): `2 × layer.len × e + outer.len × e` and `2 × layer.len × 4 + outer.len × 4`.
//! All of it must fit (the store is populated before the engine starts); while training, the
//! resident units' gradient regions are given back (`HostBytes::released_by_resident`).

use std::fmt;

use candle_core::DType;
use mt_core::{ModelConfig, ModelLayout};
use mt_store::GradDtype;

use crate::batch::chunk_ranges;
use crate::engine::RELOAD_SLOTS;
use crate::{Error, OptimMode, Result};

#[path = "plan_bytes.rs"]
mod bytes;
use bytes::{grad_elem_bytes, round_page};
pub use bytes::{layer_workspace, loss_workspace, store_bytes, LayerPath};
#[path = "plan_model.rs"]
mod model;
pub use model::{
    early_upload_capacity, forward_window, host_update_bytes, late_download_capacity, UpdatePlacement,
    BACKWARD_D2H_SHARE, BACKWARD_TFLOPS, HOST_MEMORY_GBS, PCIE_GBS, STATE_UPLOAD_GBS,
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
    /// Keep the outer unit's optimizer state on the GPU (`Some(true)`), stream it
    /// (`Some(false)`), or decide (`None`): resident when that costs no extra chunk.
    pub resident_outer: Option<bool>,
    /// Keep decoder layers `0..k` resident on the GPU with their optimizer state (`Some(k)`),
    /// or decide (`None`): as many as fit in what the chosen chunking leaves.
    pub resident_layers: Option<usize>,
    /// Decoder layers `0..k` keep their forward activations for the backward instead of
    /// recomputing them (`Some(k)`), or decide (`None`): as many as fit in what residency and
    /// holding leave, of the resident layers (of all, when every layer is resident or held).
    pub kept_layers: Option<usize>,
    /// The last `h` decoder layers (streamed ones) are uploaded once a step and held on the GPU
    /// from their forward to their backward (`Some(h)`), or decide (`None`): as many streamed
    /// layers as fit in what residency leaves.
    pub held_layers: Option<usize>,
    /// Of the streamed layers, this many have their exact-mode update applied on the GPU from
    /// their streamed state (`Some(k)`; `EngineOptions::gpu_updated_layers`), or decide (`None`):
    /// in exact mode, the count with the shortest forward window ([`forward_window`]: the host's
    /// memory traffic against the uploads of the state it moves), if its state slots fit.
    pub gpu_updated_layers: Option<usize>,
    /// Of the GPU-updated layers that are held, this many download their state in the backward
    /// (`Some(k)`; `EngineOptions::late_state_downloads`), or decide (`None`): as many as the
    /// backward's D2H has time for beside the gradients ([`late_download_capacity`]) and the
    /// GPU has room for.
    pub late_state_downloads: Option<usize>,
    /// Of the GPU-updated layers that do not download late, this many upload their state for the
    /// next step in the backward, into state slots free there (`Some(k)`;
    /// `EngineOptions::early_state_uploads`), or decide (`None`): as many as the backward's H2D
    /// and host memory have room for ([`early_upload_capacity`]: none unless every streamed
    /// layer is held) and have a late partner (`program::slot_pairs_of`).
    pub early_state_uploads: Option<usize>,
    /// The device runs the fused CUDA kernels (`mt_layers::fused_kernels`: bf16 on compute
    /// capability 9.0+), which keep less for the backward than candle's ops.
    pub fused_kernels: bool,
    /// Flash attention (`Some(true)`), the materialised scores (`Some(false)`), or decide
    /// (`None`): flash wherever it runs (the fused kernels and a head dim of 16, 32, 64 or 128).
    pub flash_attention: Option<bool>,
    /// Spill the checkpoints of boundaries `0..k` to page-locked host memory between their
    /// layer's forward and backward (`Some(k)`), or decide (`None`): the fewest that let the plan
    /// fit with its smallest workspace.
    pub spilled_checkpoints: Option<usize>,
    /// Rows of each decoder layer's MLP tile (`Some(r)`, 0 = a chunk's rows at once), or decide
    /// (`None`): a chunk's rows at once up to `MLP_TILE_ROWS[0]` of them, else the largest of
    /// [`MLP_TILE_ROWS`] that fits.
    pub mlp_rows: Option<usize>,
}

/// The MLP tile sizes the planner tries, largest first, for chunks of more rows: tiles of 8192
/// rows keep the MLP's GEMMs as efficient as whole ones (`[8192, hidden] x [hidden, ffn]`) and
/// leave the memory a whole chunk's `[rows, ffn]` tensors would take to residency.
pub const MLP_TILE_ROWS: [usize; 4] = [8192, 4096, 2048, 1024];

/// Where the layer-boundary checkpoints live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Placement {
    /// In GPU memory for the whole step. (Offloading them to pinned host memory is not
    /// implemented; a `Host` variant will be added with it.)
    Gpu,
}

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
    /// A resident outer unit's fp32 master weights and AdamW moments (`12 × outer.len`).
    pub outer_state: u64,
    /// Resident decoder layers: weights, fp32 gradients, master weights and moments
    /// (`(e + 16) × layer.len` each).
    pub resident_layers: u64,
    /// Forward activations kept by layers `0..kept_layers` for their backward, the whole
    /// batch (`DecoderLayer::kept_state_bytes` each).
    pub kept: u64,
    /// State slots of the GPU-updated layers: `(ring_depth + late downloads) ×
    /// (12 + g) × layer.len` (fp32 `[master | m | v]` and the stored gradient of `g` bytes), plus the f32
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
    /// Staging and landing buffers (page-locked on CUDA).
    pub pinned: u64,
    /// Of `pinned`, the spilled checkpoints' buffers.
    pub spilled_checkpoints: u64,
    /// Sum of the two: what must fit (the whole store is populated before the engine starts).
    pub total: u64,
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
    /// Where checkpoints live.
    pub checkpoints: Placement,
    /// Decoder layers of the model.
    pub n_layers: usize,
    /// Decoder layers `0..resident_layers` stay on the GPU with their optimizer state (AdamW
    /// there); the others stream.
    pub resident_layers: usize,
    /// The outer unit's optimizer state lives on the GPU (updated there; it never crosses the
    /// bus).
    pub resident_outer: bool,
    /// Decoder layers `0..kept_layers` keep their forward activations (no recompute).
    pub kept_layers: usize,
    /// Attention runs as flash attention (no `[s, s]` scores).
    pub flash_attention: bool,
    /// Checkpoints of boundaries `0..spilled_checkpoints` live in page-locked host memory between
    /// their layer's forward and backward.
    pub spilled_checkpoints: usize,
    /// Rows of each MLP tile (0 = a chunk's rows at once).
    pub mlp_rows: usize,
    /// The last `held_layers` decoder layers (streamed) are uploaded once a step and held on
    /// the GPU from their forward to their backward.
    pub held_layers: usize,
    /// Of the streamed layers, this many have their update applied on the GPU from their
    /// streamed state.
    pub gpu_updated_layers: usize,
    /// Of those, held ones whose state is downloaded in the backward (spread over it, each
    /// before its layer's gradient lands) instead of right after their update in the forward.
    pub late_state_downloads: usize,
    /// Of the others, ones whose master and moments for the next step go up in the backward (into
    /// a state slot once it is free; their gradient is copied on the device) instead of in the
    /// next forward.
    pub early_state_uploads: usize,
    /// GPU bytes.
    pub gpu: GpuBytes,
    /// Host bytes.
    pub host: HostBytes,
    /// Bytes uploaded per step: `(outer.len + (2 × streamed layers - held layers) × layer.len)
    /// × e`, without the `outer.len` term when the outer unit is resident; each GPU-updated
    /// layer's forward upload (`layer.len × e`) is replaced by its state (`(12 + g) ×
    /// layer.len`), an early-upload one's by `12 × layer.len` (its gradient is copied on the
    /// device).
    pub pcie_h2d_per_step: u64,
    /// Bytes downloaded per step: `(streamed layers × layer.len + outer.len) × 4`, likewise
    /// (layer gradients in bf16 where they land so), plus `12 × layer.len` per GPU-updated layer.
    pub pcie_d2h_per_step: u64,
    /// Model parameters (padding excluded).
    pub n_params: u64,
    /// Model FLOPs per step ([`mt_core::model_flops_per_step`]: `6·N·T + 6·L·s·hidden·T`, all
    /// parameters, attention with the causal half, recompute not counted).
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
    match input.resident_outer {
        Some(resident) => plan_placed(input, resident),
        // Resident when it costs no chunk; whichever fits when only one does (the streamed
        // layout needs more pinned host memory, the resident one more GPU memory).
        None => match (plan_placed(input, false), plan_placed(input, true)) {
            (Ok(s), Ok(r)) => {
                Ok(if r.n_chunks <= s.n_chunks && r.spilled_checkpoints <= s.spilled_checkpoints {
                    r
                } else {
                    s
                })
            }
            (Ok(s), Err(_)) => Ok(s),
            (Err(_), Ok(r)) => Ok(r),
            (Err(e), Err(_)) => Err(e),
        },
    }
}

fn plan_placed(input: &PlanInput, resident_outer: bool) -> Result<Plan> {
    let PlanInput { cfg, batch, seq, weight_dtype, .. } = input;
    let (batch, seq) = (*batch, *seq);
    let opt = |m: String| Err(Error::Options(m));
    if batch == 0 || seq == 0 || input.rows_per_block == 0 {
        return opt(format!(
            "batch ({batch}), seq ({seq}) and rows_per_block ({}) must be at least 1",
            input.rows_per_block
        ));
    }
    cfg.check_seq_len(seq)?;
    if !matches!(weight_dtype, DType::F32 | DType::BF16 | DType::F16) {
        return opt(format!("weight dtype {weight_dtype:?}; use f32, bf16 or f16"));
    }
    if input.mode == OptimMode::Exact && input.grad_dtype == GradDtype::None {
        return opt("exact mode keeps each step's gradient until the next step: the store needs gradient buffers (f32 or bf16)".into());
    }
    let ring_depth = input.ring_depth.unwrap_or(DEFAULT_RING_DEPTH);
    if ring_depth == 0 {
        return opt("ring_depth 0: the device needs at least one weight slot".into());
    }
    if let Some(n) = input.n_chunks.filter(|&n| n == 0 || n > batch) {
        return opt(format!(
            "n_chunks {n}: chunks are groups of whole sequences, so 1..={batch} for a batch of {batch}"
        ));
    }
    let layout = ModelLayout::new(cfg);
    let e = weight_dtype.size_in_bytes() as u64;
    let (ll, ol, nl) = (layout.layer.len as u64, layout.outer.len as u64, layout.n_layers as u64);
    let tokens = (batch * seq) as u64;
    let hid = cfg.hidden_size as u64;

    let store = store_bytes(&layout, input.grad_dtype);
    // The transferred part of the outer unit: none of it when it is resident.
    let ol_moved = if resident_outer { 0 } else { ol };
    // Bytes per element of a landed layer gradient (the outer unit's lands in f32).
    let le: u64 = if lands_bf16(input.mode, input.grad_dtype) { 2 } else { 4 };
    let pinned = N_BUFS * ll * e + ol_moved * e + N_BUFS * ll * le + ol_moved * 4;
    let mut host =
        HostBytes { store, pinned, spilled_checkpoints: 0, total: store + pinned, released_by_resident: 0 };
    if host.total > input.host_bytes {
        return opt(format!(
            "host store ({:.2} GiB) + pinned staging/landing ({:.2} GiB) = {:.2} GiB exceed the host's {:.2} GiB by {:.2} GiB",
            gib(store), gib(pinned), gib(host.total), gib(input.host_bytes), gib(host.total - input.host_bytes)
        ));
    }

    let budget = (input.gpu_bytes as f64 * GPU_USABLE_FRACTION) as u64;
    // Layer gradient buffers (f32) with their bf16 twins when bf16 lands, and the outer one.
    let narrow = if le == 2 { N_BUFS * ll * 2 } else { 0 };
    let (weight_ring, outer, grads) = (ring_depth as u64 * ll * e, ol * e, N_BUFS * ll * 4 + narrow + ol * 4);
    let outer_state = if resident_outer { 12 * ol } else { 0 };
    let per_resident_layer = ll * (e + 4 + 12);
    if let Some(k) = input.resident_layers.filter(|&k| k > layout.n_layers) {
        return opt(format!("{k} resident layers asked of a {}-layer model", layout.n_layers));
    }
    let asked_resident = input.resident_layers.unwrap_or(0) as u64 * per_resident_layer;
    let fixed = weight_ring + outer + grads + outer_state + asked_resident;
    let budget_line =
        format!("{:.2} GiB usable ({GPU_USABLE_FRACTION} of {:.2} GiB)", gib(budget), gib(input.gpu_bytes));
    if fixed > budget {
        return opt(format!(
            "weights and gradient buffers need {:.2} GiB (ring {:.2}, outer {:.2}, gradients {:.2}, resident outer state {:.2}, resident layers {:.2}), more than the GPU's {budget_line}",
            gib(fixed), gib(weight_ring), gib(outer), gib(grads), gib(outer_state), gib(asked_resident)
        ));
    }
    // One boundary's checkpoints (every chunk); on the device every boundary's, or, with `k`
    // spilled, the others' plus the one in flight down and the reload buffers (at most).
    let cp = tokens * hid * e;
    let device_checkpoints =
        |k: u64| if k == 0 { (nl + 1) * cp } else { (nl + 2 - k + RELOAD_SLOTS as u64) * cp };
    let act_grads = cp;
    let flash_runs = input.fused_kernels && mt_layers::flash_head_dim(cfg.head_dim);
    let flash = match input.flash_attention {
        Some(true) if !flash_runs => {
            return opt(format!(
                "flash attention asked, but it runs only with bf16 weights on a CUDA GPU of compute capability 9.0+ and a head dim of 16, 32, 64 or 128 (this model's is {}); use the materialised attention",
                cfg.head_dim
            ))
        }
        Some(f) => f,
        None => flash_runs,
    };
    // The chunk count's workspace with the largest MLP tile that fits in `left` (the smallest
    // tried when none does).
    let workspace_of = |n: usize, left: u64| {
        let b = chunk_ranges(batch, n).iter().map(|r| r.len()).max().unwrap_or(batch);
        let tiles: Vec<usize> = match input.mlp_rows {
            Some(r) => vec![r],
            None if b * seq <= MLP_TILE_ROWS[0] => vec![0],
            None => MLP_TILE_ROWS.to_vec(),
        };
        let ws = |mlp_rows: usize| {
            let path = LayerPath { fused: input.fused_kernels, flash, mlp_rows };
            layer_workspace(cfg, &layout, b, seq, e, path).max(loss_workspace(
                cfg,
                b * seq,
                input.rows_per_block,
                e,
                input.fused_kernels,
            ))
        };
        let r = tiles.iter().copied().find(|&r| ws(r) <= left).unwrap_or(*tiles.last().unwrap_or(&0));
        (b, r, ws(r))
    };
    let candidates: Vec<usize> = match input.n_chunks {
        Some(n) => vec![n],
        None => (1..=batch).collect(),
    };
    // Spilled checkpoints: as asked, or the fewest with which the smallest workspace fits.
    let min_ws = candidates.iter().map(|&n| workspace_of(n, 0).2).min().unwrap_or(0);
    let spilled = match input.spilled_checkpoints {
        Some(k) if k > layout.n_layers => {
            return opt(format!(
                "{k} spilled checkpoints asked of a {}-layer model (the inputs of its layers can spill; the loss's input stays)",
                layout.n_layers
            ))
        }
        Some(k) => k,
        None => (0..=layout.n_layers)
            .find(|&k| fixed + device_checkpoints(k as u64) + act_grads + min_ws <= budget)
            .unwrap_or(0),
    };
    let checkpoints = device_checkpoints(spilled as u64);
    if spilled > 0 {
        host.spilled_checkpoints = spilled as u64 * cp;
        host.pinned += host.spilled_checkpoints;
        host.total += host.spilled_checkpoints;
        if host.total > input.host_bytes {
            return opt(format!(
                "{spilled} checkpoints spilled to host memory ({:.2} GiB each, {:.2} GiB) with the host store ({:.2} GiB) and pinned buffers need {:.2} GiB, {:.2} GiB more than the host's {:.2} GiB; use fewer or shorter sequences, lean mode (--optim-mode lean --grad-dtype none), or more host memory",
                gib(cp), gib(host.spilled_checkpoints), gib(store), gib(host.total), gib(host.total - input.host_bytes), gib(input.host_bytes)
            ));
        }
    }
    if fixed + checkpoints + act_grads > budget {
        return opt(format!(
            "checkpoints for {batch} x {seq} tokens need {:.2} GiB{} (+ {:.2} GiB activation gradients), the GPU has {:.2} GiB left after weights and gradient buffers ({:.2} GiB) of its {budget_line}; use fewer or shorter sequences",
            gib(checkpoints),
            if spilled > 0 { format!(" with {spilled} of {} spilled to host memory", nl + 1) } else { String::new() },
            gib(act_grads), gib(budget - fixed), gib(fixed)
        ));
    }
    let left = budget - fixed - checkpoints - act_grads;
    let Some((n_chunks, (seqs_per_chunk, mlp_rows, workspace))) =
        candidates.iter().map(|&n| (n, workspace_of(n, left))).find(|(_, (_, _, ws))| *ws <= left)
    else {
        let n = *candidates.last().unwrap_or(&batch);
        let (b, r, ws) = workspace_of(n, left);
        let tiles = if r > 0 { format!(" (MLP tiles of {r} rows)") } else { String::new() };
        let spill = if spilled < layout.n_layers && input.spilled_checkpoints.is_some() {
            "; spill more checkpoints (--spill-checkpoints)"
        } else {
            ""
        };
        return opt(format!(
            "the workspace of a chunk of {b} x {seq} tokens{tiles} needs {:.2} GiB, {:.2} GiB more than the {:.2} GiB left after weights, gradients and checkpoints ({:.2} GiB) of the GPU's {budget_line}{}{spill}",
            gib(ws), gib(ws - left), gib(left), gib(budget - left),
            if input.n_chunks.is_some() && n < batch { "; use more chunks" } else { "; use shorter sequences" }
        ));
    };
    let mut total = fixed + checkpoints + act_grads + workspace;
    // Explicit held and kept counts are served before the automatic choices take what is left.
    let per_kept_layer =
        mt_layers::DecoderLayer::kept_state_bytes(cfg, batch, seq, e, input.fused_kernels, flash);
    let asked_held = input.held_layers.unwrap_or(0);
    // GPU-updated layers' state slots: `ring_depth` slots of fp32 master, m, v and the stored
    // gradient (`g` bytes), one more per late download (early uploads take slots free in the
    // backward), and the f32 copy a bf16 gradient is widened into; late downloads also take two
    // more gradient buffers.
    let g = grad_elem_bytes(input.grad_dtype);
    let grad_buf_bytes = ll * 4 + if le == 2 { ll * 2 } else { 0 };
    let state_cost = |late: usize| {
        (ring_depth + late) as u64 * (12 + g) * ll
            + if g == 2 { 4 * ll } else { 0 }
            + (grad_bufs(late) - N_BUFS as usize) as u64 * grad_buf_bytes
    };
    let asked_gpu = input.gpu_updated_layers.unwrap_or(0);
    let asked_late = input.late_state_downloads.unwrap_or(0);
    let reserved = asked_held as u64 * ll * e
        + input.kept_layers.unwrap_or(0) as u64 * per_kept_layer
        + if asked_gpu > 0 { state_cost(asked_late) } else { 0 };
    // Auto: as many leading layers as fit in what is left (their state costs no chunk), leaving
    // the held and GPU-updated layers asked for streamed.
    let resident_layers = match input.resident_layers {
        Some(k) => k,
        None => ((budget.saturating_sub(total + reserved) / per_resident_layer) as usize)
            .min(layout.n_layers.saturating_sub(asked_held.max(asked_gpu))),
    };
    let resident_bytes = resident_layers as u64 * per_resident_layer;
    total += resident_bytes - asked_resident;
    // Held layers: streamed layers whose weights stay on the GPU from their forward to their
    // backward (one upload, no re-cast on the host). They take what residency leaves; each
    // costs only its weights (`layer.len × e`).
    let streamed_count = layout.n_layers - resident_layers;
    let held_layers = match input.held_layers {
        Some(h) if h > streamed_count => {
            return opt(format!(
                "{h} held layers asked, but only {streamed_count} of {} layers stream ({resident_layers} resident); held layers are streamed ones",
                layout.n_layers
            ))
        }
        Some(h) if total + h as u64 * ll * e > budget => {
            return opt(format!(
                "holding {h} layers' weights needs {:.2} GiB, the GPU has {:.2} GiB left of its {budget_line}; hold fewer (--held-layers)",
                gib(h as u64 * ll * e), gib(budget.saturating_sub(total))
            ))
        }
        Some(h) => h,
        None => ((budget.saturating_sub(total + reserved) / (ll * e)) as usize).min(streamed_count),
    };
    let held = held_layers as u64 * ll * e;
    total += held;
    // GPU-updated layers: their state slots take what holding leaves (before kept activations:
    // they take host work off a streamed step, which is what limits it). Late downloads: those
    // of the held ones the backward's D2H has time for and the GPU room for.
    let late_capable = |n: usize| {
        crate::program::held_gpu_updated_of(layout.n_layers, resident_layers, held_layers, n).len()
    };
    let late_cap = late_download_capacity(
        mt_core::model_flops_per_step(cfg, batch, seq),
        streamed_count,
        held_layers,
        ll,
        le,
    );
    let auto_late = |n: usize| {
        let fits = |l: usize| total + state_cost(l) <= budget;
        if n == 0 || input.mode != OptimMode::Exact {
            return 0;
        }
        (0..=late_cap.min(late_capable(n))).rev().find(|&l| fits(l)).unwrap_or(0)
    };
    let flops = mt_core::model_flops_per_step(cfg, batch, seq);
    // Early uploads: as many as the backward has room for, each paired with a late download.
    let early_capable = |n: usize, late: usize| {
        crate::program::slot_pairs_of(layout.n_layers, resident_layers, held_layers, n, late, ring_depth)
            .len()
    };
    let auto_early = |n: usize, late: usize| {
        if n == 0 || input.mode != OptimMode::Exact {
            return 0;
        }
        early_upload_capacity(flops, streamed_count, held_layers, late, ll, le).min(early_capable(n, late))
    };
    let gpu_updated_layers = match input.gpu_updated_layers {
        Some(k) if k > streamed_count => {
            return opt(format!(
                "{k} GPU-updated layers asked, but only {streamed_count} of {} layers stream ({resident_layers} resident); GPU-updated layers are streamed ones",
                layout.n_layers
            ))
        }
        Some(k) if k > 0 && input.mode != OptimMode::Exact => {
            return opt(format!(
                "{k} GPU-updated layers asked in lean mode: they apply exact mode's pending update on the GPU (lean mode updates each layer as its gradient lands); use 0"
            ))
        }
        Some(k) if k > 0 && total + state_cost(asked_late) > budget => {
            let also = if asked_late > 0 { format!(" ({asked_late} of them downloading late)") } else { String::new() };
            return opt(format!(
                "the state slots of GPU-updated layers{also} need {:.2} GiB, the GPU has {:.2} GiB left of its {budget_line}; use {}--gpu-updated-layers 0",
                gib(state_cost(asked_late)), gib(budget.saturating_sub(total)),
                if asked_late > 0 { "fewer --late-state-downloads or " } else { "" }
            ))
        }
        Some(k) => k,
        None if input.mode == OptimMode::Exact && total + state_cost(asked_late) <= budget => {
            // The count with the shortest forward, each with the late downloads and early uploads
            // it would get; with either asked, among the counts that have room for that many.
            let late_of = |n: usize| input.late_state_downloads.unwrap_or_else(|| auto_late(n));
            let early_of = |n: usize| input.early_state_uploads.unwrap_or_else(|| auto_early(n, late_of(n)));
            let counts = (0..=streamed_count)
                .filter(|&n| late_of(n) <= late_capable(n) && early_of(n) <= early_capable(n, late_of(n)));
            let cost = |n: usize| {
                let p = UpdatePlacement { streamed: streamed_count, gpu: n, late: late_of(n), early: early_of(n) };
                forward_window(p, g, e, HOST_MEMORY_GBS, STATE_UPLOAD_GBS)
            };
            counts.fold(None, |best: Option<usize>, n| match best {
                Some(b) if cost(b) <= cost(n) => Some(b),
                _ => Some(n),
            })
            .unwrap_or(0)
        }
        None => 0,
    };
    let late_capable = late_capable(gpu_updated_layers);
    let late_state_downloads = match input.late_state_downloads {
        Some(k) if k > 0 && input.mode != OptimMode::Exact => {
            return opt(format!(
                "{k} late state downloads asked in lean mode: they are GPU-updated layers' downloads, and lean mode has none; use 0"
            ))
        }
        Some(k) if k > 0 && total + state_cost(k) > budget => {
            return opt(format!(
                "{k} late state downloads need {:.2} GiB of state slots and gradient buffers (with the GPU-updated layers' own), the GPU has {:.2} GiB left of its {budget_line}; use fewer (--late-state-downloads)",
                gib(state_cost(k)), gib(budget.saturating_sub(total))
            ))
        }
        Some(k) if k > late_capable => {
            return opt(format!(
                "{k} late state downloads asked, but only {late_capable} of the {gpu_updated_layers} GPU-updated layers are held ({held_layers} held layers): a late download keeps a held layer's state on the device until its backward"
            ))
        }
        Some(k) => k,
        None => auto_late(gpu_updated_layers),
    };
    let early_state_uploads = match input.early_state_uploads {
        Some(k) if k > 0 && input.mode != OptimMode::Exact => {
            return opt(format!(
                "{k} early state uploads asked in lean mode: they are GPU-updated layers' uploads, and lean mode has none; use 0"
            ))
        }
        Some(k) if k > 0 && gpu_updated_layers == 0 && total + state_cost(late_state_downloads) > budget => {
            return opt(format!(
                "{k} early state uploads need GPU-updated layers, whose state slots need {:.2} GiB; the GPU has {:.2} GiB left of its {budget_line}; use --early-state-uploads 0",
                gib(state_cost(late_state_downloads)), gib(budget.saturating_sub(total))
            ))
        }
        Some(k) if k > early_capable(gpu_updated_layers, late_state_downloads) => {
            let capable = early_capable(gpu_updated_layers, late_state_downloads);
            let mut why = crate::engine::early_refusal(k, capable, late_state_downloads, ring_depth);
            if input.late_state_downloads.is_none() && total + state_cost(late_state_downloads + 1) > budget {
                why += &format!(
                    " (the planner's {late_state_downloads} late downloads are all the state slots the GPU has room for: {:.2} GiB left of its {budget_line})",
                    gib(budget.saturating_sub(total + state_cost(late_state_downloads)))
                );
            }
            return opt(why);
        }
        Some(k) => k,
        None => auto_early(gpu_updated_layers, late_state_downloads),
    };
    let state_slots = if gpu_updated_layers > 0 { state_cost(late_state_downloads) } else { 0 };
    total += state_slots;
    // Kept activations take what is left after that (residency and holding save host work,
    // which is what limits a streamed step; keeping saves the recompute). Kept layers are the
    // leading ones, so auto keeps where that covers only layers whose backward is then
    // compute-bound: the resident ones, and the held ones when every layer is resident or held
    // (a streamed, not held layer's backward waits on the host's re-cast and land on 16 cores).
    // 3.6B at 4 x 2048 on an H200: all resident, 24 of 28 kept, 347.9 -> 419.6 model TFLOP/s;
    // all streamed, held and kept, 201.3 -> 216.1.
    let kept_layers = match input.kept_layers {
        Some(k) if k > layout.n_layers => {
            return opt(format!("{k} layers with kept activations asked of a {}-layer model", layout.n_layers))
        }
        Some(k) if k > 0 && spilled > 0 => {
            return opt(format!(
                "keeping the activations of {k} layers and spilling {spilled} checkpoints: spilled checkpoints free the device memory kept activations take; use one or the other"
            ))
        }
        Some(k) if total + k as u64 * per_kept_layer > budget => {
            return opt(format!(
                "keeping the activations of {k} layers needs {:.2} GiB ({:.2} GiB a layer), the GPU has {:.2} GiB left of its {budget_line}; keep fewer (--kept-layers)",
                gib(k as u64 * per_kept_layer), gib(per_kept_layer), gib(budget.saturating_sub(total))
            ))
        }
        Some(k) => k,
        None if spilled > 0 => 0,
        None => {
            let covered =
                if resident_layers + held_layers == layout.n_layers { layout.n_layers } else { resident_layers };
            ((budget.saturating_sub(total) / per_kept_layer) as usize).min(covered)
        }
    };
    let kept = kept_layers as u64 * per_kept_layer;
    total += kept;
    let streamed_layers = nl - resident_layers as u64;
    let grad_region = |len: u64| round_page(len * grad_elem_bytes(input.grad_dtype));
    host.released_by_resident =
        resident_layers as u64 * grad_region(ll) + if resident_outer { grad_region(ol) } else { 0 };
    let gpu = GpuBytes {
        weight_ring,
        held,
        outer,
        grads,
        checkpoints,
        act_grads,
        workspace,
        outer_state,
        resident_layers: resident_bytes,
        kept,
        state_slots,
        total,
        budget,
    };
    let gu = gpu_updated_layers as u64;

    Ok(Plan {
        batch,
        seq,
        n_chunks,
        seqs_per_chunk,
        ring_depth,
        checkpoints: Placement::Gpu,
        n_layers: layout.n_layers,
        resident_layers,
        resident_outer,
        kept_layers,
        flash_attention: flash,
        spilled_checkpoints: spilled,
        mlp_rows,
        held_layers,
        gpu_updated_layers,
        late_state_downloads,
        early_state_uploads,
        gpu,
        host,
        pcie_h2d_per_step: (ol_moved + (2 * streamed_layers - held_layers as u64 - gu) * ll) * e
            + gu * (12 + g) * ll
            - early_state_uploads as u64 * g * ll,
        pcie_d2h_per_step: streamed_layers * ll * le + ol_moved * 4 + gu * 12 * ll,
        n_params: layout.n_params() as u64,
        flops_per_step: mt_core::model_flops_per_step(cfg, batch, seq),
    })
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (g, h) = (&self.gpu, &self.host);
        writeln!(
            f,
            "step: {} x {} tokens in {} chunk(s) of up to {} sequences; ring depth {}; checkpoints on {:?}; {} of {} layers resident (AdamW on the device); outer unit {}; {} streamed layers held from forward to backward; {} streamed layers updated on the GPU from their streamed state ({} of them download it in the backward, {} upload it for the next step there); {} layers keep their activations (no recompute); {} attention; MLP in {}; {} checkpoints spilled to host memory",
            self.batch, self.seq, self.n_chunks, self.seqs_per_chunk, self.ring_depth, self.checkpoints, self.resident_layers, self.n_layers,
            if self.resident_outer { "resident (AdamW on the device)" } else { "streamed" }, self.held_layers, self.gpu_updated_layers, self.late_state_downloads, self.early_state_uploads, self.kept_layers,
            if self.flash_attention { "flash" } else { "materialised" },
            if self.mlp_rows == 0 { "whole chunks".to_string() } else { format!("tiles of {} rows", self.mlp_rows) },
            self.spilled_checkpoints
        )?;
        writeln!(f, "GPU (GiB)   ring {:.2} | held {:.2} | outer {:.2} | grads {:.2} | outer state {:.2} | resident layers {:.2} | state slots {:.2} | checkpoints {:.2} | kept activations {:.2} | act grads {:.2} | workspace {:.2} | total {:.2} of {:.2} usable",
            gib(g.weight_ring), gib(g.held), gib(g.outer), gib(g.grads), gib(g.outer_state), gib(g.resident_layers), gib(g.state_slots), gib(g.checkpoints), gib(g.kept), gib(g.act_grads), gib(g.workspace), gib(g.total), gib(g.budget))?;
        writeln!(
            f,
            "host (GiB)  store {:.2} | pinned {:.2} | total {:.2} | given back by resident units {:.2}",
            gib(h.store),
            gib(h.pinned),
            gib(h.total),
            gib(h.released_by_resident)
        )?;
        writeln!(
            f,
            "PCIe per step: H2D {} B ({:.2} GiB), D2H {} B ({:.2} GiB)",
            self.pcie_h2d_per_step,
            gib(self.pcie_h2d_per_step),
            self.pcie_d2h_per_step,
            gib(self.pcie_d2h_per_step)
        )?;
        write!(
            f,
            "model FLOPs per step: {:.4e} (6·N·T + 6·L·s·hidden·T); {} parameters",
            self.flops_per_step, self.n_params
        )
    }
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "plan_long_tests.rs"]
mod long_tests;

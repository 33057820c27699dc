//! The planner's phases, in the order [`plan_placed`] runs them: the request checked, the host's
//! bytes, the fixed GPU buffers and checkpoints, the chunking, then the layers placed in what is
//! left (resident and held, GPU-updated with their late downloads and early uploads, kept).
//! Each phase takes what the ones before it left of the GPU and refuses, naming what does not fit.

use candle_core::DType;
use mt_core::{ModelConfig, ModelLayout};
use mt_store::GradDtype;

use super::bytes::{
    base_bytes, grad_elem_bytes, largest_record, layer_workspace, loss_workspace, round_page, store_bytes,
    BaseBytes, LayerPath, PAGED_MIN_RECORDS,
};
use super::model::{
    early_upload_capacity, forward_window, late_download_capacity, HOST_MEMORY_GBS, STATE_UPLOAD_GBS,
};
use super::{
    gib, grad_bufs, lands_bf16, GpuBytes, HostBytes, Plan, PlanInput, DEFAULT_RING_DEPTH,
    GPU_USABLE_FRACTION, MLP_TILE_ROWS, N_BUFS,
};
use crate::batch::chunk_ranges;
use crate::placement::Placement;
use crate::program::RELOAD_SLOTS;
use crate::{Error, OptimMode, Result};

mod gpu;
mod host;
use gpu::place_gpu_updated;
use host::host_bytes;

/// What every phase of [`plan_placed`] reads: the request, the model's sizes and the GPU's budget.
struct Ctx<'a> {
    input: &'a PlanInput,
    cfg: &'a ModelConfig,
    /// A device weight slot's layout (with LoRA: the base, then the adapters), and what trains
    /// (the same, or the adapters alone): the store's records, gradient buffers and landings.
    layout: ModelLayout,
    trainable: ModelLayout,
    batch: usize,
    seq: usize,
    ring_depth: usize,
    /// Bytes of a weight element on the device.
    e: u64,
    /// Elements of a decoder layer, elements of the outer unit, decoder layers.
    ll: u64,
    ol: u64,
    nl: u64,
    /// Elements of a decoder layer's and of the outer unit's gradient (what trains of them).
    tl: u64,
    tol: u64,
    tokens: u64,
    hid: u64,
    /// Bytes per element of a landed layer gradient (the outer unit's lands in f32).
    le: u64,
    /// Bytes per element of a stored gradient.
    g: u64,
    /// Bytes of a decoder layer's master and moments (a state slot's, a resident layer's
    /// optimizer state), and nominal bytes of them a parameter (12, 8, 6).
    sl: u64,
    s: u64,
    /// The transferred part of the outer unit (none of it when it is resident): its slot's
    /// elements up, its gradient's down; and the bytes of its optimizer state on the GPU (none
    /// when it streams).
    ol_moved: u64,
    tol_moved: u64,
    outer_state: u64,
    /// A LoRA run's frozen base as held, staged and uploaded (all zero without LoRA).
    base: BaseBytes,
    /// Bytes uploaded with a streamed decoder layer (its base as [`BaseBytes::layer_up`] says, its
    /// adapters or all its weights in the weight dtype) and with the outer unit (none when it is
    /// resident).
    layer_up: u64,
    outer_up: u64,
    /// What the plan may use of the GPU, and that in words for refusals.
    budget: u64,
    budget_line: String,
}

impl<'a> Ctx<'a> {
    fn new(input: &'a PlanInput, resident_outer: bool, ring_depth: usize) -> Self {
        let PlanInput { cfg, batch, seq, weight_dtype, .. } = input;
        let (batch, seq) = (*batch, *seq);
        let (layout, trainable) = (ModelLayout::new(cfg), ModelLayout::trainable(cfg));
        let e = weight_dtype.size_in_bytes() as u64;
        let (ll, ol, nl) = (layout.layer.len as u64, layout.outer.len as u64, layout.n_layers as u64);
        let (tl, tol) = (trainable.layer.len as u64, trainable.outer.len as u64);
        let budget = (input.gpu_bytes as f64 * GPU_USABLE_FRACTION) as u64;
        let base = base_bytes(cfg, *weight_dtype);
        Ctx {
            input,
            cfg,
            batch,
            seq,
            ring_depth,
            e,
            ll,
            ol,
            nl,
            tl,
            tol,
            tokens: (batch * seq) as u64,
            hid: cfg.hidden_size as u64,
            le: if lands_bf16(input.mode, input.grad_dtype) { 2 } else { 4 },
            g: grad_elem_bytes(input.grad_dtype),
            sl: input.state_dtype.state_bytes(layout.layer.len) as u64,
            s: input.state_dtype.nominal_state_bytes(),
            ol_moved: if resident_outer { 0 } else { ol },
            tol_moved: if resident_outer { 0 } else { tol },
            outer_state: if resident_outer {
                input.state_dtype.state_bytes(layout.outer.len) as u64
            } else {
                0
            },
            base,
            layer_up: base.layer_up + tl * e,
            outer_up: if resident_outer { 0 } else { base.outer_up + tol * e },
            budget,
            budget_line: format!(
                "{:.2} GiB usable ({GPU_USABLE_FRACTION} of {:.2} GiB)",
                gib(budget),
                gib(input.gpu_bytes)
            ),
            layout,
            trainable,
        }
    }

    /// GPU bytes of the GPU-updated layers' state slots with `late` late downloads:
    /// `ring_depth` slots of master, m, v (`sl` bytes) and the stored gradient (`g` bytes a
    /// parameter), one more per late download (early uploads take slots free in the backward),
    /// and the f32 copy a bf16 gradient is widened into; late downloads also take two more
    /// gradient buffers.
    fn state_cost(&self, late: usize) -> u64 {
        let Ctx { ring_depth, ll, tl, le, g, sl, .. } = *self;
        let grad_buf_bytes = tl * 4 + if le == 2 { tl * 2 } else { 0 };
        (ring_depth + late) as u64 * (sl + g * ll)
            + if g == 2 { 4 * ll } else { 0 }
            + (grad_bufs(late) - N_BUFS as usize) as u64 * grad_buf_bytes
    }
}

fn opt<T>(m: String) -> Result<T> {
    Err(Error::Options(m))
}

/// Plans a step with the outer unit's optimizer state resident on the GPU or streamed, phase by
/// phase: each takes what the one before left of the GPU and refuses, naming what does not fit.
pub(super) fn plan_placed(input: &PlanInput, resident_outer: bool) -> Result<Plan> {
    let ring_depth = check_input(input)?;
    let c = Ctx::new(input, resident_outer, ring_depth);
    let mut host = host_bytes(&c)?;
    let fixed = fixed_gpu_bytes(&c)?;
    let mut placed = Placement { resident_outer, ..Placement::default() };
    let chunks = choose_chunking(&c, &fixed, &mut host, &mut placed)?;
    let mut total = fixed.fixed + chunks.checkpoints + fixed.act_grads + chunks.workspace;
    let per_kept_layer = mt_layers::DecoderLayer::kept_state_bytes(
        c.cfg,
        c.batch,
        c.seq,
        c.e,
        input.fused_kernels,
        chunks.flash,
        input.moe_kernels,
    );
    place_resident_and_held(&c, &fixed, per_kept_layer, &mut placed, &mut total)?;
    let state_slots = place_gpu_updated(&c, &mut placed, &mut total)?;
    place_kept(&c, per_kept_layer, &mut placed, &mut total)?;
    let Ctx { ll, nl, tl, tol, e, le, g, sl, tol_moved, layer_up, outer_up, .. } = c;
    let Placement {
        resident_layers, held_layers, kept_layers, gpu_updated_layers, early_state_uploads, ..
    } = placed;
    if host.store_window.is_some() && (resident_outer || resident_layers > 0 || gpu_updated_layers > 0) {
        // Their records would be read outside the pager's order and kept beside the window.
        return opt("a store paged from its file (larger than --host-mem) keeps every unit streamed and updated on the host: use --resident-outer off, --resident-layers 0 and --gpu-updated-layers 0 with it, or more --host-mem".into());
    }
    // A file's pages are the training state: resident units give none back (`release_grad`).
    let grad_region = |len: u64| if input.store_file { 0 } else { round_page(len * g) };
    host.released_by_resident =
        resident_layers as u64 * grad_region(tl) + if resident_outer { grad_region(tol) } else { 0 };
    let gpu = GpuBytes {
        weight_ring: fixed.weight_ring,
        held: held_layers as u64 * ll * e,
        outer: fixed.outer,
        grads: fixed.grads,
        checkpoints: chunks.checkpoints,
        act_grads: fixed.act_grads,
        workspace: chunks.workspace,
        outer_state: fixed.outer_state,
        resident_layers: resident_layers as u64 * fixed.per_resident_layer,
        kept: kept_layers as u64 * per_kept_layer,
        state_slots,
        total,
        budget: c.budget,
    };
    let streamed_layers = nl - resident_layers as u64;
    let gu = gpu_updated_layers as u64;
    Ok(Plan {
        batch: c.batch,
        seq: c.seq,
        n_chunks: chunks.n_chunks,
        seqs_per_chunk: chunks.seqs_per_chunk,
        ring_depth,
        n_layers: c.layout.n_layers,
        placement: placed,
        flash_attention: chunks.flash,
        hopper_attention: chunks.flash && input.hopper_attention,
        moe_kernels: input.moe_kernels && input.fused_kernels && mt_layers::moe_kernels_fit(c.cfg),
        mlp_rows: chunks.mlp_rows,
        gpu,
        host,
        // A LoRA run's held layers and outer unit keep their base in their slots after the
        // first step (`engine::Engine::base_kept`): the adapters alone go up.
        pcie_h2d_per_step: outer_up - if resident_outer { 0 } else { c.base.outer_up }
            + (2 * streamed_layers - held_layers as u64 - gu) * layer_up
            - held_layers as u64 * c.base.layer_up
            + gu * (sl + g * ll)
            - early_state_uploads as u64 * g * ll,
        pcie_d2h_per_step: streamed_layers * tl * le + tol_moved * 4 + gu * sl,
        n_params: c.layout.n_params() as u64,
        trainable_params: c.trainable.n_params() as u64,
        base: c.base,
        flops_per_step: mt_core::model_flops_per_step(c.cfg, c.batch, c.seq),
    })
}

/// Phase 1: the request is well formed. Returns the ring depth.
fn check_input(input: &PlanInput) -> Result<usize> {
    let PlanInput { cfg, batch, seq, weight_dtype, .. } = input;
    let (batch, seq) = (*batch, *seq);

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
    Ok(ring_depth)
}

/// The GPU buffers whose size does not depend on the chunking: weight ring, outer slot, gradient
/// buffers, resident state asked for, and the activation gradients of one boundary.
struct Fixed {
    weight_ring: u64,
    outer: u64,
    grads: u64,
    outer_state: u64,
    per_resident_layer: u64,
    asked_resident: u64,
    /// The sum of the above.
    fixed: u64,
    act_grads: u64,
}

/// Phase 3: the fixed GPU buffers fit.
fn fixed_gpu_bytes(c: &Ctx<'_>) -> Result<Fixed> {
    let Ctx { input, ring_depth, e, ll, ol, tl, tol, tokens, hid, le, sl, outer_state, budget, .. } = *c;
    let (layout, budget_line) = (&c.layout, &c.budget_line);
    // Layer gradient buffers (f32) with their bf16 twins when bf16 lands, and the outer one: of
    // what trains (a LoRA run's adapters).
    let narrow = if le == 2 { N_BUFS * tl * 2 } else { 0 };
    // The ring's slots, and the buffer an encoded base lands in before its dequantisation.
    let (weight_ring, outer, grads) =
        (ring_depth as u64 * ll * e + c.base.scratch, ol * e, N_BUFS * tl * 4 + narrow + tol * 4);
    let per_resident_layer = ll * (e + 4) + sl;
    if let Some(k) = input.placement.resident_layers.filter(|&k| k > layout.n_layers) {
        return opt(format!("{k} resident layers asked of a {}-layer model", layout.n_layers));
    }
    let asked_resident = input.placement.resident_layers.unwrap_or(0) as u64 * per_resident_layer;
    let fixed = weight_ring + outer + grads + outer_state + asked_resident;
    if fixed > budget {
        return opt(format!(
            "weights and gradient buffers need {:.2} GiB (ring {:.2}, outer {:.2}, gradients {:.2}, resident outer state {:.2}, resident layers {:.2}), more than the GPU's {budget_line}",
            gib(fixed), gib(weight_ring), gib(outer), gib(grads), gib(outer_state), gib(asked_resident)
        ));
    }
    Ok(Fixed {
        weight_ring,
        outer,
        grads,
        outer_state,
        per_resident_layer,
        asked_resident,
        fixed,
        act_grads: tokens * hid * e,
    })
}

/// The chunking of a step, the attention and MLP paths its workspace was sized for, and the
/// checkpoints (spilled ones too).
struct Chunking {
    flash: bool,
    n_chunks: usize,
    seqs_per_chunk: usize,
    mlp_rows: usize,
    workspace: u64,
    /// The checkpoints' bytes on the GPU (the spilled ones' are the host's).
    checkpoints: u64,
}

/// Phase 4: the attention path, the checkpoints (spilling the fewest the smallest workspace needs
/// to host memory, counted in `host`, placed in `placed`), and the fewest chunks (with the largest MLP tile) whose
/// workspace fits what is left.
fn choose_chunking(
    c: &Ctx<'_>,
    fixed: &Fixed,
    host: &mut HostBytes,
    placed: &mut Placement,
) -> Result<Chunking> {
    let Ctx { input, cfg, batch, seq, e, nl, tokens, hid, budget, .. } = *c;
    let (layout, budget_line) = (&c.layout, &c.budget_line);
    let flash_runs = input.fused_kernels && mt_layers::flash_head_dim(cfg.head_dim);
    let flash = match input.flash_attention {
        Some(true) if !flash_runs => {
            return opt(format!(
                "flash attention asked, but it runs only with bf16 weights on a CUDA GPU of compute capability 8.0+ and a head dim of 16, 32, 64 or 128 (this model's is {}); use the materialised attention",
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
            let path = LayerPath {
                fused: input.fused_kernels,
                flash,
                hopper: flash && input.hopper_attention,
                moe_kernels: input.moe_kernels,
                mlp_rows,
            };
            layer_workspace(cfg, &c.trainable, b, seq, e, path).max(loss_workspace(
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
    // One boundary's checkpoints (every chunk); on the device every boundary's, or, with `k`
    // spilled, the others' plus the one on its way down and the reload buffers (at most).
    let cp = tokens * hid * e;
    let device_checkpoints =
        |k: u64| if k == 0 { (nl + 1) * cp } else { (nl + 2 - k + RELOAD_SLOTS as u64) * cp };
    let (fixed_bytes, act_grads) = (fixed.fixed, fixed.act_grads);
    // Spilled checkpoints: as asked, or the fewest with which the smallest workspace fits.
    let min_ws = candidates.iter().map(|&n| workspace_of(n, 0).2).min().unwrap_or(0);
    let spilled = match input.placement.spilled_checkpoints {
        Some(k) if k > layout.n_layers => {
            return opt(format!(
                "{k} spilled checkpoints asked of a {}-layer model (the inputs of its layers can spill; the loss's input stays)",
                layout.n_layers
            ))
        }
        Some(k) => k,
        None => (0..=layout.n_layers)
            .find(|&k| fixed_bytes + device_checkpoints(k as u64) + act_grads + min_ws <= budget)
            .unwrap_or(0),
    };
    let checkpoints = device_checkpoints(spilled as u64);
    if spilled > 0 {
        host.spilled_checkpoints = spilled as u64 * cp;
        host.pinned += host.spilled_checkpoints;
        host.total += host.spilled_checkpoints;
        if let Some(w) = host.store_window {
            // A paged store gives the spilled checkpoints room from its window.
            let record = largest_record(&c.trainable, input.grad_dtype, input.state_dtype);
            if w >= host.spilled_checkpoints + PAGED_MIN_RECORDS * record {
                host.store_window = Some(w - host.spilled_checkpoints);
                host.total -= host.spilled_checkpoints;
            }
        }
        if host.total > input.host_bytes {
            return opt(format!(
                "{spilled} checkpoints spilled to host memory ({:.2} GiB each, {:.2} GiB) with the host store ({:.2} GiB) and pinned buffers need {:.2} GiB, {:.2} GiB more than the host's {:.2} GiB; use fewer or shorter sequences, lean mode (--optim-mode lean --grad-dtype none), or more host memory",
                gib(cp), gib(host.spilled_checkpoints), gib(host.store), gib(host.total), gib(host.total - input.host_bytes), gib(input.host_bytes)
            ));
        }
    }
    if fixed_bytes + checkpoints + act_grads > budget {
        return opt(format!(
            "checkpoints for {batch} x {seq} tokens need {:.2} GiB{} (+ {:.2} GiB activation gradients), the GPU has {:.2} GiB left after weights and gradient buffers ({:.2} GiB) of its {budget_line}; use fewer or shorter sequences",
            gib(checkpoints),
            if spilled > 0 { format!(" with {spilled} of {} spilled to host memory", nl + 1) } else { String::new() },
            gib(act_grads), gib(budget - fixed_bytes), gib(fixed_bytes)
        ));
    }
    let left = budget - fixed_bytes - checkpoints - act_grads;
    let Some((n_chunks, (seqs_per_chunk, mlp_rows, workspace))) =
        candidates.iter().map(|&n| (n, workspace_of(n, left))).find(|(_, (_, _, ws))| *ws <= left)
    else {
        let n = *candidates.last().unwrap_or(&batch);
        let (b, r, ws) = workspace_of(n, left);
        let tiles = if r > 0 { format!(" (MLP tiles of {r} rows)") } else { String::new() };
        let spill = if spilled < layout.n_layers && input.placement.spilled_checkpoints.is_some() {
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
    placed.spilled_checkpoints = spilled;
    Ok(Chunking { flash, n_chunks, seqs_per_chunk, mlp_rows, workspace, checkpoints })
}

/// Phase 5: resident layers (the leading ones, with their optimizer state) and held layers (the
/// last streamed ones, their weights kept from forward to backward) in what the chunking left;
/// explicit counts are served before the automatic choices. Places both and adds their bytes to
/// `total`.
fn place_resident_and_held(
    c: &Ctx<'_>,
    fixed: &Fixed,
    per_kept_layer: u64,
    placed: &mut Placement,
    running: &mut u64,
) -> Result<()> {
    let Ctx { input, e, ll, budget, .. } = *c;
    let (layout, budget_line) = (&c.layout, &c.budget_line);
    let Fixed { per_resident_layer, asked_resident, .. } = *fixed;
    let state_cost = |late: usize| c.state_cost(late);
    let mut total = *running;
    // Explicit held and kept counts are served before the automatic choices take what is left.
    let asked_held = input.placement.held_layers.unwrap_or(0);
    let asked_gpu = input.placement.gpu_updated_layers.unwrap_or(0);
    let asked_late = input.placement.late_state_downloads.unwrap_or(0);
    let reserved = asked_held as u64 * ll * e
        + input.placement.kept_layers.unwrap_or(0) as u64 * per_kept_layer
        + if asked_gpu > 0 { state_cost(asked_late) } else { 0 };
    // Auto: as many leading layers as fit in what is left (their state costs no chunk), leaving
    // the held and GPU-updated layers asked for streamed.
    let resident_layers = match input.placement.resident_layers {
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
    let held_layers = match input.placement.held_layers {
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
    *running = total;
    placed.resident_layers = resident_layers;
    placed.held_layers = held_layers;
    Ok(())
}

/// Phase 7: the layers that keep their forward activations for the backward, in what is left.
/// Places them and adds their bytes to `total`.
fn place_kept(c: &Ctx<'_>, per_kept_layer: u64, placed: &mut Placement, running: &mut u64) -> Result<()> {
    let Ctx { input, budget, .. } = *c;
    let Placement { resident_layers, held_layers, spilled_checkpoints: spilled, .. } = *placed;
    let (layout, budget_line) = (&c.layout, &c.budget_line);
    let mut total = *running;
    // Kept activations take what is left after that (residency and holding save host work,
    // which is what limits a streamed step; keeping saves the recompute). Kept layers are the
    // leading ones, so auto keeps where that covers only layers whose backward is then
    // compute-bound: the resident ones, and the held ones when every layer is resident or held
    // (a streamed, not held layer's backward waits on the host's re-cast and land on 16 cores;
    // what keeping gained where: docs/decisions/0020, 0041).
    let kept_layers = match input.placement.kept_layers {
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
    *running = total;
    placed.kept_layers = kept_layers;
    Ok(())
}

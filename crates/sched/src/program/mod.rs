//! The step program: everything one training step does, in issue order, as data.
//!
//! Each instruction runs on one [`Stream`] and lists the instructions it must wait for. The
//! executor only interprets this list; nothing about ordering is inferred at run time. Tests
//! check the schedule's invariants on the data alone (every layer fetched before use, at most
//! `ring_depth` slots live, each gradient offloaded exactly once, updates in forward order).
//!
//! Layer-major order (docs/design.md, "Step program"): the outer unit (embedding, final norm, LM
//! head) is uploaded once and stays resident; layer `i` is uploaded for forward (all chunks),
//! the loss runs chunk by chunk, then layers `L-1..0` are uploaded again, recomputed and
//! back-propagated over all chunks, and each layer's gradient is downloaded once.
//!
//! What a placement changes of that (held, resident and GPU-updated layers with their state's
//! moves, spilled checkpoints) is one module each of the builder (`build/`), which says why.

use mt_core::Unit;

use crate::placement::Placement;

/// A logical stream. Instructions on one stream run in program order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    /// CPU worker: optimizer updates, casts into staging, gradient landing.
    Host,
    /// Host-to-device copies.
    H2D,
    /// Device compute.
    Compute,
    /// Device-to-host copies.
    D2H,
}

/// A device weight slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Slot {
    /// Slot `k` of the layer ring.
    Ring(usize),
    /// The outer unit's dedicated slot.
    Outer,
    /// The own slot of resident decoder layer `l` (never uploaded into during a step).
    Resident(usize),
    /// The own slot of held decoder layer `l`: a streamed layer uploaded once a step, for its
    /// forward, whose weights stay there for its backward.
    Held(usize),
}

/// A host-side buffer of a ring (staging for uploads, landing for downloads), or the outer
/// unit's dedicated one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostBuf {
    /// Buffer `k` of the ring.
    Ring(usize),
    /// The outer unit's dedicated buffer.
    Outer,
}

/// Optimizer placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimMode {
    /// Exact global-norm clipping: a unit's update for step `t` runs during step `t+1`'s forward,
    /// fused with the cast into its upload staging, just ahead of its upload.
    Exact,
    /// Each unit is updated as soon as its gradient lands during backward (clipping, if any,
    /// uses the previous step's global norm).
    Lean,
}

/// Where a layer's backward finds what its forward saw ([`Op::Backward`]'s `input`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackwardInput {
    /// Its input checkpoint (boundary `layer`) in the pool, which it recomputes the forward from
    /// and then frees: the backward is its last reader.
    Checkpoint,
    /// What its forward kept ([`Op::Forward`]'s `keep`): no recompute. Its input checkpoint, not
    /// read, is freed likewise.
    Kept,
    /// Reload buffer `slot`, where its spilled input came back ([`Op::ReloadCheckpoint`] into the
    /// same slot), which it recomputes the forward from. It frees nothing: the device copy was
    /// freed after the forward ([`Op::DropCheckpoint`]), and the buffer is the next reload's.
    Reload(usize),
}

/// One operation of the step.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Host: cast the unit's master weights into a staging buffer; with `update`, first apply
    /// the pending AdamW update in the same pass.
    Stage {
        /// Unit.
        unit: Unit,
        /// Staging buffer.
        staging: HostBuf,
        /// Apply the deferred update (exact mode, forward phase).
        update: bool,
    },
    /// H2D: staging buffer into a device slot.
    Upload {
        /// Unit.
        unit: Unit,
        /// Source staging buffer.
        staging: HostBuf,
        /// Destination slot.
        slot: Slot,
    },
    /// Compute: zero the outer gradient and embed every chunk (checkpoint boundary 0).
    Embed,
    /// Compute: layer forward over every chunk (boundary `layer` to `layer + 1`).
    Forward {
        /// Layer.
        layer: usize,
        /// Slot holding its weights.
        slot: Slot,
        /// Keep the activations its backward needs (`Placement::kept_layers`): no recompute.
        keep: bool,
    },
    /// Compute: final norm, LM head, cross-entropy and their backward, chunk by chunk; then the
    /// head's input (checkpoint boundary `n_layers`, never spilled) is freed: the loss is its
    /// only reader.
    Loss,
    /// Compute: zero a gradient buffer, recompute the layer from its input (or take what its
    /// forward kept) as `input` says, and back-propagate every chunk, accumulating the weight
    /// gradient.
    Backward {
        /// Layer.
        layer: usize,
        /// Slot holding its weights.
        slot: Slot,
        /// Gradient buffer of the ring to accumulate into (`None` = the resident layer's own).
        grad_buf: Option<usize>,
        /// Where it finds what its forward saw, and whether it frees its input checkpoint.
        input: BackwardInput,
    },
    /// Compute: embedding backward (accumulates into the outer gradient).
    EmbedBackward,
    /// Compute (data-parallel ranks): the unit's device gradient summed over the ranks in place,
    /// before it is narrowed or downloaded (NCCL's all-reduce on a GPU).
    AllReduce {
        /// Unit.
        unit: Unit,
        /// Gradient buffer of the ring (`None` = the unit's own: a resident layer's, the outer).
        grad_buf: Option<usize>,
    },
    /// Compute: the unit's share of the global norm (Σg²), taken on the device and read at the
    /// step's end: a ring buffer's gradient narrowed to bf16 into its twin first (exact mode with
    /// bf16 store gradients: the bytes that then cross and land), or a resident unit's own
    /// buffer, which never lands.
    SumSquares {
        /// Unit.
        unit: Unit,
        /// Gradient buffer of the ring (`None` = the unit's own: a resident layer's, the outer).
        grad_buf: Option<usize>,
    },
    /// H2D (GPU-updated layers): the unit's fp32 master, m and v and its stored gradient, from
    /// its page-locked host record into state slot `buf`.
    UploadState {
        /// Unit.
        unit: Unit,
        /// State slot.
        buf: usize,
    },
    /// Compute (GPU-updated layers): the pending AdamW update on state slot `buf` (once: a
    /// retried step whose update reached the record only casts), the new weights written into
    /// `slot` for the forward.
    UpdateStreamed {
        /// Unit.
        unit: Unit,
        /// State slot.
        buf: usize,
        /// Weight slot the new weights go to.
        slot: Slot,
    },
    /// H2D (early-upload layers, in the backward, for the next step): the unit's fp32 master, m
    /// and v (not its gradient) from its page-locked host record into state slot `buf`.
    UploadMoments {
        /// Unit.
        unit: Unit,
        /// State slot.
        buf: usize,
    },
    /// Compute (early-upload layers, right after their backward): the layer's gradient as the
    /// store keeps it (the bf16 twin it downloads from, or the f32 buffer) into state slot
    /// `buf`'s gradient: the bytes its land stores, for the next step's update.
    CopyGrad {
        /// Unit.
        unit: Unit,
        /// Device gradient buffer of the ring.
        grad_buf: usize,
        /// State slot.
        buf: usize,
        /// From the ring buffer's bf16 twin, as the layer's [`Op::Download`] reads
        /// ([`ProgramSpec::narrow_grads`]), not from the f32 buffer.
        narrowed: bool,
    },
    /// D2H (GPU-updated layers): state slot `buf`'s master, m and v back into the unit's host
    /// record; once they are there, the record is marked updated (so a retried step does not
    /// apply the update twice).
    DownloadState {
        /// Unit.
        unit: Unit,
        /// State slot.
        buf: usize,
    },
    /// Compute (resident units only): AdamW on the unit's device-resident state from its
    /// device gradient, then its weights cast into its slot. Exact mode: the pending update,
    /// before the unit's first use in the step; lean mode: this step's, at the step's end, and
    /// only if the unit's gradient is finite (its [`Op::SumSquares`]; `docs/decisions/0030`).
    UpdateResident {
        /// Unit.
        unit: Unit,
        /// Skip the update if the unit's Σg² this step is not finite (lean mode).
        if_finite: bool,
    },
    /// D2H: every chunk's checkpoint of `boundary` into its page-locked host buffer.
    SpillCheckpoint {
        /// Layer boundary (the input of layer `boundary`).
        boundary: usize,
    },
    /// Compute: frees the device copy of a spilled checkpoint (after its spill is done; a
    /// checkpoint that is not spilled is freed by the op that reads it last: its layer's
    /// [`Op::Backward`], or the [`Op::Loss`]).
    DropCheckpoint {
        /// Layer boundary.
        boundary: usize,
    },
    /// H2D: a spilled checkpoint's host buffers into device reload buffer `slot`, where the
    /// layer's backward reads it.
    ReloadCheckpoint {
        /// Layer boundary.
        boundary: usize,
        /// Reload buffer.
        slot: usize,
    },
    /// D2H: a unit's accumulated gradient into a landing buffer.
    Download {
        /// Unit.
        unit: Unit,
        /// Device gradient buffer (ring index; `None` = the outer gradient buffer).
        grad_buf: Option<usize>,
        /// Landing buffer.
        landing: HostBuf,
        /// From the ring buffer's bf16 twin, which its [`Op::SumSquares`] narrowed it into
        /// ([`ProgramSpec::narrow_grads`]), not from the f32 buffer.
        narrowed: bool,
    },
    /// Host: landing buffer into the store's gradient buffer (+ its sum of squares); with
    /// `update`, apply AdamW right away (lean mode).
    Land {
        /// Unit.
        unit: Unit,
        /// Landing buffer.
        landing: HostBuf,
        /// Apply the update now.
        update: bool,
    },
}

/// An instruction: an op on a stream after its dependencies.
#[derive(Debug, Clone, PartialEq)]
pub struct Instr {
    /// Stream it runs on.
    pub stream: Stream,
    /// What it does.
    pub op: Op,
    /// Indices of the instructions it waits for.
    pub waits: Vec<usize>,
}

/// Shape of the rings the program uses, and the placement it builds the step for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgramSpec {
    /// Decoder layers.
    pub n_layers: usize,
    /// Device weight slots (1 = no overlap, 2 = double buffering).
    pub ring_depth: usize,
    /// Upload staging buffers for layers.
    pub n_staging: usize,
    /// Device gradient buffers for layers.
    pub n_grad_bufs: usize,
    /// Gradient landing buffers for layers.
    pub n_landing: usize,
    /// Optimizer placement.
    pub mode: OptimMode,
    /// Whether a deferred (exact-mode) update is pending from the previous step.
    pub pending_update: bool,
    /// Where the step keeps what. The program reads: the outer unit's and the first layers'
    /// residency (never staged, uploaded, downloaded or landed; [`Op::UpdateResident`] updates
    /// them on the compute stream), the held layers ([`Slot::Held`]: fetched once, for their
    /// forward), the GPU-updated layers (their pending update on the device; none in lean mode)
    /// with their late downloads (state slot taken until the backward) and early uploads (their
    /// next state up in this step's backward: into slot `n_state_bufs - early_state_uploads + i`
    /// once it is free, the gradient copied there by [`Op::CopyGrad`]; 0 in lean mode), and the
    /// spilled checkpoints.
    pub placement: Placement,
    /// The early-upload layers' states are already in their slots (uploaded in the previous
    /// step's backward, their records unchanged since): their forward uploads nothing. The
    /// engine sets it only after a step that issued them succeeded.
    pub early_ready: bool,
    /// Device buffers the spilled checkpoints are reloaded into (at least 1 when any is spilled).
    pub reload_slots: usize,
    /// State slots for the GPU-updated layers (at least `ring_depth + late_state_downloads` when
    /// any layer is GPU-updated: `ring_depth` state uploads can be ahead of their forward while
    /// the late ones wait for their backward; the last `early_state_uploads` slots are the early
    /// layers', taken by other layers' states in between).
    pub n_state_bufs: usize,
    /// The streamed layers' gradients are narrowed to bf16 on the device, where their share of
    /// the global norm is taken ([`Op::SumSquares`]), and land in bf16 (exact mode with bf16
    /// store gradients, `plan::lands_bf16`).
    pub narrow_grads: bool,
    /// This engine is data-parallel rank `r` among the ranks that share its host store
    /// (`Some(r)`; `DataParallel::rank - DataParallel::lead`): every gradient is summed over all
    /// ranks on the device ([`Op::AllReduce`]) before it is narrowed or downloaded, and only the
    /// store's rank 0 (its lead) downloads and lands it.
    pub rank: Option<usize>,
    /// The host stream overlaps compute. `false` is the ablation: every host instruction waits
    /// for the compute before it and the next compute waits for it, so the optimizer's time adds
    /// to the step.
    pub overlap_optimizer: bool,
}

/// The placement's layer picks for this spec's model and ring ([`Placement::is_gpu_updated`] and
/// its siblings).
impl ProgramSpec {
    /// Whether `layer` is resident.
    pub fn is_resident(&self, layer: usize) -> bool {
        self.placement.is_resident(layer)
    }

    /// Whether `layer` is held.
    pub fn is_held(&self, layer: usize) -> bool {
        self.placement.is_held(self.n_layers, layer)
    }

    /// Whether `layer` is GPU-updated.
    pub fn is_gpu_updated(&self, layer: usize) -> bool {
        self.placement.is_gpu_updated(self.n_layers, layer)
    }

    /// The GPU-updated layers that are held.
    pub fn held_gpu_updated(&self) -> Vec<usize> {
        self.placement.held_gpu_updated(self.n_layers)
    }

    /// Whether `layer` downloads its state late.
    pub fn is_late_download(&self, layer: usize) -> bool {
        self.placement.is_late_download(self.n_layers, layer)
    }

    /// The early-upload layers, in forward order.
    pub fn early_upload_layers(&self) -> Vec<usize> {
        self.placement.early_upload_layers(self.n_layers, self.ring_depth)
    }

    /// The (early-upload, late-download) layer pairs.
    pub fn early_upload_pairs(&self) -> Vec<(usize, usize)> {
        self.placement.early_upload_pairs(self.n_layers, self.ring_depth)
    }
}

/// Device buffers the spilled checkpoints are reloaded through (two: one reload ahead of the
/// backward that reads the other); the engine allocates them, the planner prices them.
pub(crate) const RELOAD_SLOTS: usize = 2;

/// The reload buffer spilled boundary `boundary` comes back through, of `reload_slots`, when
/// boundaries `0..spilled` are spilled: the reloads go in backward order, round-robin.
pub fn reload_slot(spilled: usize, reload_slots: usize, boundary: usize) -> usize {
    (spilled - 1 - boundary) % reload_slots
}

/// The instructions of one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// Instructions in issue order.
    pub instrs: Vec<Instr>,
    /// The spec it was built from.
    pub spec: ProgramSpec,
}

mod build;

#[cfg(test)]
mod tests;

impl Program {
    /// Checks that every wait points to an earlier instruction (the executor relies on it).
    pub fn validate(&self) -> Result<(), crate::Error> {
        for (i, ins) in self.instrs.iter().enumerate() {
            if let Some(&w) = ins.waits.iter().find(|&&w| w >= i) {
                return Err(crate::Error::Schedule(format!(
                    "invalid program: instruction {i} ({:?}) waits for instruction {w}, which is not earlier",
                    ins.op
                )));
            }
        }
        Ok(())
    }

    /// Units whose optimizer state goes up and comes back in this step (GPU-updated layers), in
    /// order.
    pub fn state_uploads(&self) -> impl Iterator<Item = Unit> + '_ {
        self.instrs.iter().filter_map(|i| match i.op {
            Op::UploadState { unit, .. } => Some(unit),
            _ => None,
        })
    }

    /// Units whose master and moments go up in this step's backward for the next step's update
    /// (early-upload layers), in order.
    pub fn moment_uploads(&self) -> impl Iterator<Item = Unit> + '_ {
        self.instrs.iter().filter_map(|i| match i.op {
            Op::UploadMoments { unit, .. } => Some(unit),
            _ => None,
        })
    }

    /// Units whose weights are uploaded (cast on the host) in this step, in order (for
    /// accounting; GPU-updated layers' forward weights are written on the device instead).
    pub fn uploads(&self) -> impl Iterator<Item = Unit> + '_ {
        self.instrs.iter().filter_map(|i| match i.op {
            Op::Upload { unit, .. } => Some(unit),
            _ => None,
        })
    }

    /// Units whose store records the host touches (staging, landing, state copies), in issue
    /// order.
    pub fn host_accesses(&self) -> impl Iterator<Item = Unit> + '_ {
        self.instrs.iter().filter_map(|i| match i.op {
            Op::Stage { unit, .. }
            | Op::Land { unit, .. }
            | Op::UploadState { unit, .. }
            | Op::UploadMoments { unit, .. }
            | Op::DownloadState { unit, .. } => Some(unit),
            _ => None,
        })
    }

    /// Units whose gradients are downloaded, in order.
    pub fn downloads(&self) -> impl Iterator<Item = Unit> + '_ {
        self.instrs.iter().filter_map(|i| match i.op {
            Op::Download { unit, .. } => Some(unit),
            _ => None,
        })
    }
}

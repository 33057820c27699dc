//! [`EngineOptions`]: how the engine runs, and the checks an engine makes of them before it
//! allocates anything.

use candle_core::DType;
use mt_core::{ModelLayout, Unit};
use mt_optim::AdamW;
use mt_store::GradDtype;

use crate::placement::early_refusal;
use crate::program::{OptimMode, Program, ProgramSpec};
use crate::{Error, Result};

/// How the engine runs.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Weight dtype on the device (and of upload staging): F32, BF16 or F16.
    pub weight_dtype: DType,
    /// Device weight slots (1 = no overlap, 2 = double buffering, 3 = triple).
    pub ring_depth: usize,
    /// Token chunks per step (each a contiguous group of sequences).
    pub n_chunks: usize,
    /// Optimizer placement.
    pub mode: OptimMode,
    /// AdamW hyper-parameters (the learning rate is given per step).
    pub adamw: AdamW,
    /// Global-norm clipping threshold (`None` = no clipping).
    pub clip: Option<f64>,
    /// Rows of logits alive at once in the loss.
    pub rows_per_block: usize,
    /// Let the CPU optimizer (stage, update, land) run concurrently with compute. `false` is an
    /// ablation: every host operation then waits for the compute issued before it and compute
    /// waits for it, so the optimizer's time adds to the step.
    pub overlap_optimizer: bool,
    /// Keep the outer unit (embedding, final norm, LM head) resident on the compute device with
    /// its fp32 master weights and AdamW moments, updated there (`mt_kernels::device_optim`): it
    /// then never crosses the bus, and the step boundary no longer waits for its download, host
    /// update and upload. The host store's copy is brought up to date by [`Engine::sync_store`](super::Engine::sync_store)
    /// (called by [`Engine::flush_pending`](super::Engine::flush_pending) and on drop).
    pub resident_outer: bool,
    /// Keep decoder layers `0..resident_layers` resident on the compute device likewise
    /// (weights, fp32 gradient, master weights and moments, AdamW there): they never cross the
    /// bus and cost the host optimizer nothing. The first layers, because in exact mode the host
    /// must finish each streamed layer's update before its upload, and every resident layer
    /// ahead of the first streamed one gives it that much more time.
    pub resident_layers: usize,
    /// Decoder layers `0..kept_layers` keep their forward's activations on the device until
    /// their backward (`DecoderLayer::forward_keep`), which then does not recompute the forward:
    /// the same gradients bit for bit, a quarter fewer GEMM FLOPs for those layers, at
    /// `DecoderLayer::kept_state_bytes` of device memory each. The first layers, as residency:
    /// a resident (or held) layer's backward is compute-bound, so the recompute it skips is time
    /// saved.
    pub kept_layers: usize,
    /// The last `held_layers` decoder layers (streamed ones) are uploaded once a step, for their
    /// forward, into their own device slot, where their backward finds them: no re-cast on the
    /// host, no second upload (`layer.len` weight-dtype elements of device memory each). The
    /// rest of their path (host update, gradient download and land) is a streamed layer's.
    pub held_layers: usize,
    /// Of the streamed layers, this many (spread evenly, `program::is_gpu_updated`) have their
    /// exact-mode update applied on the device: their fp32 master, moments and stored gradient
    /// go up from the host record (page-locked in place on a GPU) into a state slot, AdamW runs
    /// there (`kernels/adamw.cu`, bitwise the host's) and writes the weights into the layer's
    /// slot, and master and moments go back. Each costs 12 B/param more each way over PCIe and
    /// takes its AdamW pass (28 B/param of host memory traffic) off the host, though its state's
    /// DMA still moves 26 B/param through host memory; 0 = every update on the host. Refused
    /// with a file-backed store on a GPU (DMA writes into a file mapping are not tracked dirty).
    pub gpu_updated_layers: usize,
    /// Of the GPU-updated layers that are also held, this many (spread evenly,
    /// `program::is_late_download`) keep their state on the device from their update into the
    /// backward and download it there (spread over it, each before its layer's gradient lands):
    /// 12 B/param of host memory
    /// traffic and D2H move out of the forward (bound by host memory) into the backward (whose
    /// D2H carries only gradients), for a state slot each (`(12 + g) × layer.len` bytes of
    /// device memory) and two more gradient buffers. 0 = every state download right after its
    /// update.
    pub late_state_downloads: usize,
    /// Of the GPU-updated layers that do not download late, this many
    /// (`program::early_upload_pairs`: at most one per late-download layer at least
    /// `ring_depth` layers after it) get their state for the next step in this step's backward:
    /// master and moments go up from the record into a state slot once it is free (at the loss,
    /// or right after a late download), and the gradient is copied there on the device right
    /// after the layer's backward. 12 + g B/param of host memory traffic and H2D leave the
    /// forward (bound by host memory and uploads), 12 B/param go into the backward (whose H2D is
    /// idle when every streamed layer is held). No device memory of its own: the slot held
    /// another layer's state in between, so every byte uploaded is needed. The step after a failed one, or
    /// after [`Engine::flush_pending`](super::Engine::flush_pending), uploads them in its
    /// forward. Needs the device gradient in the store's dtype (device narrowing with bf16 store
    /// gradients). 0 = every state upload in the forward.
    pub early_state_uploads: usize,
    /// Flash attention where it applies (`mt_layers::flash_attention`: bf16 on a CUDA device,
    /// head dim 16, 32, 64 or 128): O(t) memory instead of the materialised `[b, heads, t, t]`
    /// scores; elsewhere the materialised path runs regardless.
    pub flash_attention: bool,
    /// Which flash kernels (`mt_layers::FlashKernel`): the Hopper ones wherever they run, or one
    /// set forced.
    pub flash_kernel: mt_layers::FlashKernel,
    /// Boundaries `0..spilled_checkpoints` (the inputs of the first layers) go down to
    /// page-locked host memory once their layer's forward has read them and come back up for
    /// its backward (`program::Op::SpillCheckpoint`, `ReloadCheckpoint`): device memory for
    /// host memory, the copies on the D2H and H2D streams beside compute. At most `n_layers`;
    /// not with kept activations.
    pub spilled_checkpoints: usize,
    /// How RoPE angles are formed (`mt_layers::RopeAngles`: transformers' f32 product by default).
    pub rope_angles: mt_layers::RopeAngles,
    /// Rows of each decoder layer's MLP tile (`mt_layers::LayerOptions::mlp_rows`; 0 = a chunk's
    /// rows at once): bounds the `[rows, ffn]` tensors of long sequences.
    pub mlp_rows: usize,
    /// Where exact mode keeps bf16 store gradients, narrow each streamed layer's gradient on the
    /// device and land it in bf16 (`plan::lands_bf16`); `false` lands f32 and narrows on the
    /// host, as before. Exists so tests can prove the two bitwise equal; the planner assumes
    /// `true`. Not for production use.
    #[doc(hidden)]
    pub device_narrowing: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            weight_dtype: DType::F32,
            ring_depth: 2,
            n_chunks: 1,
            mode: OptimMode::Exact,
            adamw: AdamW::default(),
            clip: Some(1.0),
            rows_per_block: 1024,
            overlap_optimizer: true,
            resident_outer: false,
            resident_layers: 0,
            kept_layers: 0,
            held_layers: 0,
            gpu_updated_layers: 0,
            late_state_downloads: 0,
            early_state_uploads: 0,
            flash_attention: false,
            flash_kernel: mt_layers::FlashKernel::Auto,
            spilled_checkpoints: 0,
            rope_angles: mt_layers::RopeAngles::Transformers,
            mlp_rows: 0,
            device_narrowing: true,
        }
    }
}

impl EngineOptions {
    /// Refuses options that cannot run on `layout` with a store keeping `store_grad` gradients,
    /// naming the problem.
    pub(super) fn check(&self, layout: &ModelLayout, store_grad: GradDtype) -> Result<()> {
        if self.ring_depth == 0 || self.n_chunks == 0 || self.rows_per_block == 0 {
            return Err(Error::Options(format!(
                "ring_depth ({}), n_chunks ({}) and rows_per_block ({}) must be at least 1",
                self.ring_depth, self.n_chunks, self.rows_per_block
            )));
        }
        self.adamw.validate(&self.adamw.args(1))?;
        if let Some(c) = self.clip {
            if !(c.is_finite() && c > 0.0) {
                return Err(Error::Options(format!(
                    "clip threshold {c} must be finite and > 0 (None = no clipping)"
                )));
            }
        }
        if self.mode == OptimMode::Exact && store_grad == GradDtype::None {
            return Err(Error::Options(
                "exact mode keeps each step's gradient until the next step: the store needs gradient buffers (f32 or bf16)".into(),
            ));
        }
        if self.resident_layers > layout.n_layers {
            return Err(Error::Options(format!(
                "{} resident layers asked of a {}-layer model",
                self.resident_layers, layout.n_layers
            )));
        }
        if self.resident_layers + self.held_layers > layout.n_layers {
            return Err(Error::Options(format!(
                "{} held layers beside {} resident ones of a {}-layer model: held layers are streamed ones",
                self.held_layers, self.resident_layers, layout.n_layers
            )));
        }
        let streamed = layout.n_layers - self.resident_layers;
        if self.gpu_updated_layers > streamed {
            return Err(Error::Options(format!(
                "{} GPU-updated layers asked, but only {streamed} of {} layers stream ({} resident): GPU-updated layers are streamed ones",
                self.gpu_updated_layers, layout.n_layers, self.resident_layers
            )));
        }
        if self.gpu_updated_layers > 0 && self.mode != OptimMode::Exact {
            return Err(Error::Options(
                "GPU-updated layers apply exact mode's pending update on the device; lean mode updates each layer on the host as its gradient lands: use --gpu-updated-layers 0 with lean mode".into(),
            ));
        }
        let late_capable = crate::program::held_gpu_updated_of(
            layout.n_layers,
            self.resident_layers,
            self.held_layers,
            self.gpu_updated_layers,
        )
        .len();
        if self.late_state_downloads > late_capable {
            return Err(Error::Options(format!(
                "{} late state downloads asked, but only {late_capable} of the {} GPU-updated layers are held (the last {} layers are): a late download keeps a held layer's state on the device until its backward",
                self.late_state_downloads, self.gpu_updated_layers, self.held_layers
            )));
        }
        if self.early_state_uploads > 0 && self.mode != OptimMode::Exact {
            return Err(Error::Options(
                "early state uploads are GPU-updated layers' uploads of exact mode's pending update; lean mode has none: use --early-state-uploads 0 with lean mode".into(),
            ));
        }
        let early_capable = crate::program::slot_pairs_of(
            layout.n_layers,
            self.resident_layers,
            self.held_layers,
            self.gpu_updated_layers,
            self.late_state_downloads,
            self.ring_depth,
        )
        .len();
        if self.early_state_uploads > early_capable {
            return Err(Error::Options(early_refusal(
                self.early_state_uploads,
                early_capable,
                self.late_state_downloads,
                self.ring_depth,
            )));
        }
        if self.early_state_uploads > 0 && store_grad == GradDtype::Bf16 && !self.device_narrowing {
            return Err(Error::Options(
                "early state uploads copy the device's bf16 gradient into the state slot, and without device narrowing there is none: use early_state_uploads 0 or device_narrowing".into(),
            ));
        }
        if self.spilled_checkpoints > layout.n_layers {
            return Err(Error::Options(format!(
                "{} spilled checkpoints asked of a {}-layer model: the inputs of its layers can spill, the loss's input stays",
                self.spilled_checkpoints, layout.n_layers
            )));
        }
        if self.spilled_checkpoints > 0 && self.kept_layers > 0 {
            return Err(Error::Options(
                "spilled checkpoints free device memory that kept activations take: use one or the other"
                    .into(),
            ));
        }
        if self.kept_layers > layout.n_layers {
            return Err(Error::Options(format!(
                "{} layers with kept activations asked of a {}-layer model",
                self.kept_layers, layout.n_layers
            )));
        }
        Ok(())
    }
}

impl EngineOptions {
    /// The program's shape for a step of a model of `n_layers` layers (`pending`: an exact-mode
    /// update is pending; `early_ready`: the early-upload layers' states are already up).
    pub(crate) fn program_spec(&self, n_layers: usize, pending: bool, early_ready: bool) -> ProgramSpec {
        ProgramSpec {
            n_layers,
            ring_depth: self.ring_depth,
            n_staging: super::N_STAGING,
            n_grad_bufs: crate::plan::grad_bufs(self.late_state_downloads),
            n_landing: super::N_LANDING,
            mode: self.mode,
            pending_update: pending,
            resident_outer: self.resident_outer,
            resident_layers: self.resident_layers,
            held_layers: self.held_layers,
            gpu_updated: self.gpu_updated_layers,
            late_downloads: self.late_state_downloads,
            early_uploads: if self.mode == OptimMode::Exact { self.early_state_uploads } else { 0 },
            early_ready,
            spilled_checkpoints: self.spilled_checkpoints,
            reload_slots: if self.spilled_checkpoints > 0 { crate::program::RELOAD_SLOTS } else { 0 },
            // The device pool's state slots (`DevicePool::new`).
            n_state_bufs: if self.gpu_updated_layers > 0 {
                self.ring_depth + self.late_state_downloads
            } else {
                0
            },
        }
    }

    /// The store records a steady-state step touches on the host, in the order it touches them
    /// (what a paged store reads ahead: `HostStore::start_paging`), once the options are checked
    /// as the engine checks them for a store of gradient dtype `grad`.
    pub fn host_access_order(&self, layout: &ModelLayout, grad: GradDtype) -> Result<Vec<Unit>> {
        self.check(layout, grad)?;
        let pending = self.mode == OptimMode::Exact;
        Ok(Program::build(self.program_spec(layout.n_layers, pending, false)).host_accesses().collect())
    }
}

//! [`EngineOptions`]: how the engine runs, and the checks an engine makes of them before it
//! allocates anything.

use candle_core::DType;
use mt_core::{ModelLayout, Unit};
use mt_optim::AdamW;
use mt_store::GradDtype;

use crate::placement::{early_refusal, Placement};
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
    /// Where the step keeps what (`crate::placement::Placement`: resident units, held, kept and
    /// GPU-updated layers with their state moves, spilled checkpoints).
    pub placement: Placement,
    /// Flash attention where it applies (`mt_layers::flash_attention`: bf16 on a CUDA device,
    /// head dim 16, 32, 64 or 128): O(t) memory instead of the materialised `[b, heads, t, t]`
    /// scores; elsewhere the materialised path runs regardless.
    pub flash_attention: bool,
    /// Which flash kernels (`mt_layers::FlashKernel`): the Hopper ones wherever they run, or one
    /// set forced.
    pub flash_kernel: mt_layers::FlashKernel,
    /// How RoPE angles are formed (`mt_layers::RopeAngles`: transformers' f32 product by default).
    pub rope_angles: mt_layers::RopeAngles,
    /// Which path a mixture of experts runs (`mt_layers::MoeKernels`): the device kernels
    /// wherever they apply (`mt_layers::moe_kernels_apply`), or the portable path everywhere.
    pub moe_kernels: mt_layers::MoeKernels,
    /// Rows of each decoder layer's MLP tile (`mt_layers::LayerOptions::mlp_rows`; 0 = a chunk's
    /// rows at once): bounds the `[rows, ffn]` tensors of long sequences.
    pub mlp_rows: usize,
    /// Where exact mode keeps bf16 store gradients, narrow each streamed layer's gradient on the
    /// device and land it in bf16 (`plan::lands_bf16`); `false` lands f32 and narrows on the
    /// host, as before. Exists so tests can prove the two bitwise equal; the planner assumes
    /// `true`. Not for production use.
    #[doc(hidden)]
    pub device_narrowing: bool,
    /// A LoRA run's frozen base weights (`ModelConfig::lora`): each unit's slot is its base
    /// then its adapters, which are the store's records; `None` for full fine-tuning.
    pub frozen_base: Option<std::sync::Arc<mt_store::FrozenBase>>,
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
            placement: Placement::default(),
            flash_attention: false,
            flash_kernel: mt_layers::FlashKernel::Auto,
            rope_angles: mt_layers::RopeAngles::Transformers,
            moe_kernels: mt_layers::MoeKernels::Device,
            mlp_rows: 0,
            device_narrowing: true,
            frozen_base: None,
        }
    }
}

impl EngineOptions {
    /// Refuses a LoRA model without its frozen base (or a base without LoRA), a base of another
    /// model, and placements that keep optimizer state on the device, which LoRA runs do not
    /// have yet (their adapters are streamed with their layer and updated on the host).
    pub(super) fn check_lora(
        &self,
        cfg: &mt_core::ModelConfig,
        layout: &ModelLayout,
        slot: &ModelLayout,
    ) -> Result<()> {
        let (l, base) = match (&cfg.lora, &self.frozen_base) {
            (None, None) => return Ok(()),
            (Some(l), Some(base)) => (l, base),
            (Some(_), None) => {
                return Err(Error::Options(
                    "a LoRA model needs its frozen base weights (EngineOptions::frozen_base)".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(Error::Options(
                    "frozen base weights were given for a model without LoRA adapters".into(),
                ))
            }
        };
        l.check(cfg)?;
        if layout.units().any(|u| base.layout().unit(u).len != layout.frozen_len(slot, u)) {
            return Err(Error::Options(
                "the frozen base weights were built for a different model layout".into(),
            ));
        }
        if base.dtype() != l.base {
            // The planner prices the base by the config's encoding, the engine moves the base's.
            return Err(Error::Options(format!(
                "the frozen base is held in {} but the model's LoRA config says {} (LoraConfig::base)",
                base.dtype(),
                l.base
            )));
        }
        let p = &self.placement;
        if p.resident_outer || p.resident_layers > 0 || p.gpu_updated_layers > 0 {
            return Err(Error::Options(
                "a LoRA run keeps no optimizer state on the device yet: use --resident-outer off, --resident-layers 0 and --gpu-updated-layers 0".into(),
            ));
        }
        Ok(())
    }

    /// Refuses options that cannot run on `layout` with a store keeping `store_grad` gradients,
    /// naming the problem.
    pub(super) fn check(&self, layout: &ModelLayout, store_grad: GradDtype) -> Result<()> {
        let p = &self.placement;
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
        if p.resident_layers > layout.n_layers {
            return Err(Error::Options(format!(
                "{} resident layers asked of a {}-layer model",
                p.resident_layers, layout.n_layers
            )));
        }
        if p.resident_layers + p.held_layers > layout.n_layers {
            return Err(Error::Options(format!(
                "{} held layers beside {} resident ones of a {}-layer model: held layers are streamed ones",
                p.held_layers, p.resident_layers, layout.n_layers
            )));
        }
        let streamed = layout.n_layers - p.resident_layers;
        if p.gpu_updated_layers > streamed {
            return Err(Error::Options(format!(
                "{} GPU-updated layers asked, but only {streamed} of {} layers stream ({} resident): GPU-updated layers are streamed ones",
                p.gpu_updated_layers, layout.n_layers, p.resident_layers
            )));
        }
        if p.gpu_updated_layers > 0 && self.mode != OptimMode::Exact {
            return Err(Error::Options(
                "GPU-updated layers apply exact mode's pending update on the device; lean mode updates each layer on the host as its gradient lands: use --gpu-updated-layers 0 with lean mode".into(),
            ));
        }
        let late_capable = p.held_gpu_updated(layout.n_layers).len();
        if p.late_state_downloads > late_capable {
            return Err(Error::Options(format!(
                "{} late state downloads asked, but only {late_capable} of the {} GPU-updated layers are held (the last {} layers are): a late download keeps a held layer's state on the device until its backward",
                p.late_state_downloads, p.gpu_updated_layers, p.held_layers
            )));
        }
        if p.early_state_uploads > 0 && self.mode != OptimMode::Exact {
            return Err(Error::Options(
                "early state uploads are GPU-updated layers' uploads of exact mode's pending update; lean mode has none: use --early-state-uploads 0 with lean mode".into(),
            ));
        }
        let early_capable = p.slot_pairs(layout.n_layers, self.ring_depth).len();
        if p.early_state_uploads > early_capable {
            return Err(Error::Options(early_refusal(
                p.early_state_uploads,
                early_capable,
                p.late_state_downloads,
                self.ring_depth,
            )));
        }
        if p.early_state_uploads > 0 && store_grad == GradDtype::Bf16 && !self.device_narrowing {
            return Err(Error::Options(
                "early state uploads copy the device's bf16 gradient into the state slot, and without device narrowing there is none: use early_state_uploads 0 or device_narrowing".into(),
            ));
        }
        if p.spilled_checkpoints > layout.n_layers {
            return Err(Error::Options(format!(
                "{} spilled checkpoints asked of a {}-layer model: the inputs of its layers can spill, the loss's input stays",
                p.spilled_checkpoints, layout.n_layers
            )));
        }
        if p.spilled_checkpoints > 0 && p.kept_layers > 0 {
            return Err(Error::Options(
                "spilled checkpoints free device memory that kept activations take: use one or the other"
                    .into(),
            ));
        }
        if p.kept_layers > layout.n_layers {
            return Err(Error::Options(format!(
                "{} layers with kept activations asked of a {}-layer model",
                p.kept_layers, layout.n_layers
            )));
        }
        Ok(())
    }
}

impl EngineOptions {
    /// The program's shape for a step of a model of `n_layers` layers on a store of `store_grad`
    /// gradients, trained alone (`pending`: an exact-mode update is pending; `early_ready`: the
    /// early-upload layers' states are already up).
    pub(crate) fn program_spec(
        &self,
        n_layers: usize,
        store_grad: GradDtype,
        pending: bool,
        early_ready: bool,
    ) -> ProgramSpec {
        let p = &self.placement;
        ProgramSpec {
            n_layers,
            ring_depth: self.ring_depth,
            n_staging: super::N_STAGING,
            n_grad_bufs: crate::plan::grad_bufs(p.late_state_downloads),
            n_landing: super::N_LANDING,
            mode: self.mode,
            pending_update: pending,
            placement: Placement {
                early_state_uploads: if self.mode == OptimMode::Exact { p.early_state_uploads } else { 0 },
                ..*p
            },
            early_ready,
            reload_slots: if p.spilled_checkpoints > 0 { crate::program::RELOAD_SLOTS } else { 0 },
            // The device pool's state slots (`DevicePool::new`).
            n_state_bufs: if p.gpu_updated_layers > 0 { self.ring_depth + p.late_state_downloads } else { 0 },
            narrow_grads: self.device_narrowing && crate::plan::lands_bf16(self.mode, store_grad),
            rank: None,
            overlap_optimizer: self.overlap_optimizer,
        }
    }

    /// The store records a steady-state step touches on the host, in the order it touches them
    /// (what a paged store reads ahead: `HostStore::start_paging`), once the options are checked
    /// as the engine checks them for a store of gradient dtype `grad`.
    pub fn host_access_order(&self, layout: &ModelLayout, grad: GradDtype) -> Result<Vec<Unit>> {
        self.check(layout, grad)?;
        let pending = self.mode == OptimMode::Exact;
        Ok(Program::build(self.program_spec(layout.n_layers, grad, pending, false)).host_accesses().collect())
    }
}

//! The engine: owns the host store, the device pool, the templates and a backend, and runs one
//! training step by building the step [`Program`] and issuing its instructions in order.

use std::sync::{Arc, Mutex};

use candle_core::DType;
use mt_core::{Error as CoreError, ModelConfig, ModelLayout, Unit};
use mt_layers::{DecoderLayer, LayerOptions, Outer, Positions, Rope};
use mt_optim::{StepArgs, Upload};
use mt_pool::{DevicePool, PoolSpec};
use mt_store::{GradDtype, HostStore, PinnedRecords, StoreState, TransferBuf, TransferDtype};

use crate::backend::{Backend, DevicePeak, Span};
use crate::batch::{make_chunks_normalised, Batch, Chunk};
use crate::program::{OptimMode, Program, ProgramSpec, Stream};
use crate::stats::{stream_stats, StreamStats};
use crate::{Error, Result};

mod commit;
mod compute;
mod copy;
mod eval;
mod faults;
mod host;
mod options;
mod rank;
mod resident;
mod spill;

use host::update_unit;

#[doc(hidden)]
pub use commit::{SkipCause, Skipped};
pub use faults::Fault;
pub use options::EngineOptions;
pub(crate) use resident::state_words;

/// What one step did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Mean cross-entropy over the batch's non-masked targets, plus, for a mixture of experts
    /// with `output_router_logits`, `router_aux_loss_coef` times the load-balancing loss (the
    /// loss transformers trains on).
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens processed (batch x seq).
    pub n_tokens: usize,
    /// Non-masked targets (the loss normaliser).
    pub n_targets: usize,
    /// Wall time of the step.
    pub step_s: f64,
    /// Bytes copied host to device.
    pub h2d_bytes: u64,
    /// Bytes copied device to host.
    pub d2h_bytes: u64,
    /// Per-stream busy time and idle gaps.
    pub streams: Vec<StreamStats>,
    /// Bytes of the forward activations the kept layers held for their backward
    /// (`LayerState::bytes`, all of them alive at the loss): what the plan counts as
    /// `GpuBytes::kept`.
    pub kept_bytes: u64,
    /// Device memory high-water marks so far ([`Backend::device_peak`]), after this step.
    pub device_peak: Option<DevicePeak>,
    /// Every operation's span (for traces).
    pub spans: Vec<Span>,
    /// `Some` when the loss or the gradient norm was not finite: the step applied no update
    /// (in lean mode: none to the units whose gradient was not finite; `commit.rs`).
    pub skipped: Option<Skipped>,
}

/// The streamed training engine.
pub struct Engine<B: Backend> {
    // Field order is drop order: the (page-locked) staging and landing rings are unregistered
    // while the backend, and with it the CUDA context, is still alive; `Drop` drains every
    // stream first, so no copy is in flight when they go. Likewise the GPU-updated layers' records,
    // page-locked in place.
    pinned_records: Option<PinnedRecords>,
    staging: Vec<Arc<Mutex<TransferBuf>>>,
    outer_staging: Arc<Mutex<TransferBuf>>,
    landing: Vec<Arc<Mutex<TransferBuf>>>,
    outer_landing: Arc<Mutex<TransferBuf>>,
    cfg: ModelConfig,
    /// The layout of what trains: the store's records, gradient buffers and landings.
    layout: ModelLayout,
    /// The layout of a device weight slot: `layout`, or with LoRA the frozen base then the
    /// adapters (`ModelLayout::trainable`).
    slot_layout: ModelLayout,
    /// A LoRA run's decoder-layer base encoding, where its layers go up encoded and are
    /// dequantised on the device (`mt_store::uploads_encoded`: an int8 or NF4 base) into the
    /// pool's `base_scratch`.
    encoded_base: Option<Arc<mt_core::BaseEncoding>>,
    store: Arc<HostStore>,
    backend: B,
    pool: DevicePool,
    layer_t: DecoderLayer,
    outer_t: Outer,
    rope: Option<Rope>,
    /// The positions of each chunk's tokens this step (empty outside a step).
    positions: Vec<Positions>,
    /// Page-locked host buffers of the spilled checkpoints, `[boundary][chunk]`.
    spill_host: Vec<Vec<Arc<Mutex<TransferBuf>>>>,
    sumsq: Arc<Mutex<Vec<f64>>>,
    /// Resident units' shares of the global norm, still on the device until the step ends.
    device_sumsq: Vec<(Unit, mt_kernels::device_optim::SumSquares)>,
    /// Forward activations kept for the backward, by `layer * n_chunks + chunk` (only layers
    /// `0..opts.placement.kept_layers`; empty outside a step).
    kept: Vec<Option<mt_layers::LayerState>>,
    /// Bytes kept this step (see [`StepReport::kept_bytes`]).
    kept_bytes: u64,
    /// A MoE model's router statistics over this step's forwards (`None` for a dense model).
    router_stats: Option<mt_layers::RouterStats>,
    /// The load-balancing loss's gradient at the router probabilities, set at the loss when the
    /// model adds that loss (`output_router_logits`); every MoE layer's backward adds it.
    router_grad: Option<mt_layers::RouterGrad>,
    opts: EngineOptions,
    /// Resident units: the optimizer step each one's device state has applied (by unit index),
    /// and whether any device state is newer than the host store's records.
    applied: Vec<u64>,
    dirty: bool,
    /// The early-upload layers' states are in their slots, uploaded by the last step's backward
    /// with their records unchanged since ([`ProgramSpec::early_ready`]): set only after a step
    /// that issued them succeeded, cleared by anything that may change a record.
    early_ready: bool,
    /// A LoRA run's frozen base is in the slots no other unit uses (the held layers' and the
    /// outer unit's), uploaded by a step that succeeded: it never changes, so from then on those
    /// units stage and upload their adapters alone ([`Engine::base_kept`]). A failed step leaves
    /// it as it was: its uploads wrote the adapters' elements at most.
    base_ready: bool,
    /// Faults injected into the next step, and those of the step running ([`Fault`]).
    faults: Vec<Fault>,
    step_faults: Vec<Fault>,
    /// This engine's place among data-parallel ranks (`None`: it trains alone).
    dp: Option<crate::data_parallel::DataParallel>,
}

impl<B: Backend> Drop for Engine<B> {
    fn drop(&mut self) {
        // Also makes the backend's context current on this thread (CUDA), which unregistering
        // the page-locked rings needs.
        let _ = self.backend.synchronize();
        if let Err(e) = self.sync_store() {
            tracing::error!("could not write the resident units back to the host store: {e}");
        }
    }
}

impl<B: Backend> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("opts", &self.opts).finish_non_exhaustive()
    }
}

pub(super) const N_STAGING: usize = 2;
pub(super) const N_LANDING: usize = 2;

fn upload_dtype(d: DType) -> Result<TransferDtype> {
    match d {
        DType::F32 => Ok(TransferDtype::F32),
        DType::BF16 => Ok(TransferDtype::Bf16),
        DType::F16 => Ok(TransferDtype::F16),
        other => Err(Error::Options(format!("weight dtype {other:?}; use f32, bf16 or f16"))),
    }
}

impl<B: Backend> Engine<B> {
    /// Builds an engine over an initialised store.
    pub fn new(cfg: &ModelConfig, store: Arc<HostStore>, backend: B, opts: EngineOptions) -> Result<Self> {
        let (layout, slot_layout) = (ModelLayout::trainable(cfg), ModelLayout::new(cfg));
        if store.layout() != &layout {
            return Err(Error::Options("the host store was built for a different model layout".into()));
        }
        mt_layers::check_device(cfg, backend.device(), opts.weight_dtype, opts.flash_attention)?;
        opts.check(&layout, store.grad_dtype())?;
        opts.check_lora(cfg, &layout, &slot_layout)?;
        if backend.pins_host_buffers() && opts.placement.gpu_updated_layers > 0 && store.is_file_backed() {
            // A file's pages written by DMA are not marked dirty (and recent kernels refuse
            // long-term writable pins of shared file mappings): the file would silently keep
            // stale master weights and moments.
            return Err(Error::Options(
                "GPU-updated layers write their state back by DMA into the host store's pages, which a file-backed --store does not track: use --gpu-updated-layers 0 with --store".into(),
            ));
        }
        let up = upload_dtype(opts.weight_dtype)?;
        let encoded_base = opts
            .frozen_base
            .as_ref()
            .map(|b| b.encoding(Unit::Layer(0)))
            .filter(|enc| mt_store::uploads_encoded(enc, up))
            .map(|enc| Arc::new(enc.clone()));
        let land_bf16 = opts.device_narrowing && crate::plan::lands_bf16(opts.mode, store.grad_dtype());
        let pool = DevicePool::new(
            &PoolSpec {
                ring_depth: opts.ring_depth,
                layer_len: slot_layout.layer.len,
                outer_len: slot_layout.outer.len,
                grad_lens: (layout.layer.len, layout.outer.len),
                weight_dtype: opts.weight_dtype,
                grad_dtype: DType::F32,
                n_grad_bufs: crate::plan::grad_bufs(opts.placement.late_state_downloads),
                n_layers: layout.n_layers,
                n_chunks: opts.n_chunks,
                placement: opts.placement,
                land_bf16,
                state_slots: if opts.placement.gpu_updated_layers > 0 {
                    opts.ring_depth + opts.placement.late_state_downloads
                } else {
                    0
                },
                state_grad_dtype: if store.grad_dtype() == GradDtype::F32 { DType::F32 } else { DType::BF16 },
                state_dtype: store.state_dtype(),
                base_scratch: encoded_base.as_ref().map_or(0, |e| e.bytes),
            },
            backend.device(),
        )?;
        // The pool was zeroed on the compute stream; copy streams may touch it from step 1 on.
        backend.synchronize()?;
        // TransferBuf and landing rings: allocated once, page-locked once when the backend wants it
        // (never the store itself).
        let pin = backend.pins_host_buffers();
        let host_buf = |dtype, n| -> Result<_> {
            let mut s = TransferBuf::new(dtype, n);
            if pin && n > 0 {
                s.pin()?;
            }
            Ok(Arc::new(Mutex::new(s)))
        };
        // Layer gradients land in bf16 when the device narrows them.
        let layer_land = if land_bf16 { TransferDtype::Bf16 } else { TransferDtype::F32 };
        // A resident outer unit needs no staging or landing buffer of its own.
        let outer_host_len = if opts.placement.resident_outer { 0 } else { slot_layout.outer.len };
        let outer_land_len = if opts.placement.resident_outer { 0 } else { layout.outer.len };
        let layout_units = layout.n_units();
        let mut engine = Engine {
            pinned_records: None,
            cfg: cfg.clone(),
            staging: (0..N_STAGING).map(|_| host_buf(up, slot_layout.layer.len)).collect::<Result<_>>()?,
            outer_staging: host_buf(up, outer_host_len)?,
            landing: (0..N_LANDING).map(|_| host_buf(layer_land, layout.layer.len)).collect::<Result<_>>()?,
            outer_landing: host_buf(TransferDtype::F32, outer_land_len)?,
            sumsq: Arc::new(Mutex::new(vec![0.0; layout.n_units()])),
            device_sumsq: Vec::new(),
            kept: Vec::new(),
            kept_bytes: 0,
            router_stats: None,
            router_grad: None,
            layer_t: DecoderLayer::with_options(
                cfg,
                LayerOptions {
                    flash: opts.flash_attention,
                    flash_kernel: opts.flash_kernel,
                    mlp_rows: opts.mlp_rows,
                    moe_kernels: opts.moe_kernels,
                },
            ),
            outer_t: Outer::new(cfg, opts.rows_per_block),
            rope: None,
            positions: Vec::new(),
            spill_host: Vec::new(),
            layout,
            slot_layout,
            encoded_base,
            store,
            backend,
            pool,
            opts,
            applied: vec![0; layout_units],
            dirty: false,
            early_ready: false,
            base_ready: false,
            faults: Vec::new(),
            step_faults: Vec::new(),
            dp: None,
        };
        engine.check_records()?;
        engine.load_resident()?;
        if pin && engine.opts.placement.gpu_updated_layers > 0 {
            // Their whole state crosses PCIe: page-lock their records in place (DMA at bus speed
            // from and into the store, no copy through the staging rings).
            let units = engine.gpu_updated_units();
            engine.pinned_records = Some(PinnedRecords::pin(&engine.store, &units)?);
        }
        Ok(engine)
    }

    /// Refuses to go on with a store a failed copy left untrustworthy ([`HostStore::poison`]).
    fn check_not_poisoned(&self) -> Result<()> {
        match self.store.poisoned() {
            Some(why) => Err(Error::Options(format!(
                "the host store can no longer be trusted: {why}; resume from a checkpoint (--resume)"
            ))),
            None => Ok(()),
        }
    }

    /// The program's shape for a step (`pending`: an exact-mode update is pending; `early_ready`:
    /// the early-upload layers' states are already up).
    fn program_spec(&self, pending: bool, early_ready: bool) -> ProgramSpec {
        let spec =
            self.opts.program_spec(self.layout.n_layers, self.store.grad_dtype(), pending, early_ready);
        ProgramSpec { rank: self.dp.as_ref().map(|d| d.rank - d.lead), ..spec }
    }

    /// The decoder layers whose exact-mode update runs on the device from their streamed state
    /// (`Placement::gpu_updated_layers`, picked by `Placement::is_gpu_updated`).
    pub fn gpu_updated_units(&self) -> Vec<Unit> {
        let spec = self.program_spec(true, false);
        (0..self.layout.n_layers).filter(|&l| spec.is_gpu_updated(l)).map(Unit::Layer).collect()
    }

    /// The GPU-updated layers whose state is downloaded in the backward
    /// (`Placement::late_state_downloads`, picked by `Placement::is_late_download`).
    pub fn late_download_units(&self) -> Vec<Unit> {
        let spec = self.program_spec(true, false);
        (0..self.layout.n_layers).filter(|&l| spec.is_late_download(l)).map(Unit::Layer).collect()
    }

    /// The GPU-updated layers whose state for the next step goes up in the backward
    /// (`Placement::early_state_uploads`, picked by `Placement::early_upload_layers`), in forward
    /// order.
    pub fn early_upload_units(&self) -> Vec<Unit> {
        self.program_spec(true, false).early_upload_layers().into_iter().map(Unit::Layer).collect()
    }

    /// Bytes of host memory page-locked in place for the GPU-updated layers' records.
    pub fn pinned_record_bytes(&self) -> usize {
        self.pinned_records.as_ref().map_or(0, PinnedRecords::bytes)
    }

    /// The host store.
    pub fn store(&self) -> &Arc<HostStore> {
        &self.store
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The options.
    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    /// Bytes of device memory held by the pool right now.
    pub fn device_bytes(&self) -> mt_pool::PoolBytes {
        self.pool.bytes()
    }

    /// One training step on `batch` with learning rate `lr`.
    ///
    /// Exact mode: the step computes and lands the gradients; their update is applied during the
    /// next step's forward (or by [`Engine::flush_pending`]). Lean mode: each unit is updated as
    /// its gradient lands.
    pub fn step(&mut self, batch: &Batch, lr: f64) -> Result<StepReport> {
        self.step_with(batch, lr, |_| {})
    }

    /// [`Engine::step`] with a hook that may alter the program before it runs. Exists so tests
    /// can prove that removing a wait breaks the result; not for production use.
    #[doc(hidden)]
    pub fn step_with(
        &mut self,
        batch: &Batch,
        lr: f64,
        edit: impl FnOnce(&mut Program),
    ) -> Result<StepReport> {
        if self.dp.is_some() {
            return Err(Error::Options(
                "a data-parallel rank steps on its share of the batch: use step_rank".into(),
            ));
        }
        batch.validate(&self.cfg)?;
        self.step_inner(batch, batch.n_targets(), lr, edit)
    }

    /// A step of `batch` whose loss weights are `1 / norm_targets` (the whole batch's target
    /// count; a data-parallel rank's share is normalised by the global batch's).
    pub(super) fn step_inner(
        &mut self,
        batch: &Batch,
        norm_targets: usize,
        lr: f64,
        edit: impl FnOnce(&mut Program),
    ) -> Result<StepReport> {
        self.check_not_poisoned()?;
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(Error::Options(format!("learning rate {lr} must be finite and non-negative")));
        }
        if self.opts.mode == OptimMode::Lean && self.store.state().pending_update {
            if self.dp.is_some() {
                return Err(Error::Options(
                    "a lean-mode step of data-parallel ranks on a store with a pending exact-mode update: apply it first (flush_pending on one engine)".into(),
                ));
            }
            // The store was last trained in exact mode: apply its pending update first.
            self.flush_pending()?;
        }
        let chunks = make_chunks_normalised(batch, self.opts.n_chunks, norm_targets, self.backend.device())?;
        self.ensure_rope(batch.seq)?;
        self.positions = self.chunk_positions(&chunks)?;
        self.ensure_spill(&chunks)?;
        let state = self.store.state();
        let mut program = Program::build(self.program_spec(state.pending_update, self.early_ready));
        edit(&mut program);
        program.validate()?;
        // Consumed: a step that fails from here on may leave a slot updated, or half uploaded.
        self.early_ready = false;
        // Arguments of the updates this step applies.
        let update_args = match self.opts.mode {
            OptimMode::Exact => {
                StepArgs { step: state.step + 1, lr: state.pending_lr, grad_scale: state.pending_grad_scale }
            }
            OptimMode::Lean => StepArgs {
                step: state.step + 1,
                lr,
                // Lean mode clips with the previous step's norm (none before the first step).
                grad_scale: match (self.opts.clip, state.step) {
                    (Some(c), s) if s > 0 => mt_optim::clip_coef(state.grad_norm, c),
                    _ => 1.0,
                },
            },
        };
        if self.opts.placement.resident_outer || self.opts.placement.resident_layers > 0 {
            // From here until the write-back the device holds state the store does not; a crash
            // leaves the mark, and the next engine refuses the store.
            self.dirty = true;
            self.store.set_device_owned(true);
        }
        self.backend.begin_step();
        self.device_sumsq.clear();
        self.step_faults = std::mem::take(&mut self.faults);
        self.kept = std::iter::repeat_with(|| None).take(self.layout.n_layers * chunks.len()).collect();
        self.kept_bytes = 0;
        self.router_stats = self.cfg.moe.as_ref().map(|m| mt_layers::RouterStats::new(m.num_experts));
        self.router_grad = None;
        let loss = self.execute(&program, &chunks, update_args);
        self.router_grad = None;
        // Whatever a failed step left kept is freed with it.
        self.kept.clear();
        self.positions.clear();
        let (loss, norm, skipped) = self.commit(state, lr, loss?, &update_args)?;
        let step_s = self.backend.now_s();
        // Every stream is drained: the early uploads this step issued are in their slots (of no
        // use after a skipped step, which leaves no update pending for them).
        self.early_ready = program.spec.placement.early_state_uploads > 0 && skipped.is_none();
        self.base_ready = self.opts.frozen_base.is_some();
        let spans = self.backend.spans();
        let (h2d_bytes, d2h_bytes) = self.backend.transferred();
        Ok(StepReport {
            loss,
            grad_norm: norm,
            n_tokens: batch.batch * batch.seq,
            n_targets: batch.n_targets(),
            step_s,
            h2d_bytes,
            d2h_bytes,
            streams: stream_stats(&spans, step_s),
            kept_bytes: self.kept_bytes,
            device_peak: self.backend.device_peak(),
            spans,
            skipped,
        })
    }

    /// Applies a pending (exact-mode) update to every unit now, e.g. before saving or exporting.
    /// Bitwise the same as letting the next step apply it.
    ///
    /// Resident units are updated on the device and the store's records are then brought up to
    /// date ([`Engine::sync_store`]), pending update or not.
    pub fn flush_pending(&mut self) -> Result<()> {
        self.check_not_poisoned()?;
        // It may change the records the early-uploaded states were copied from.
        self.early_ready = false;
        let state = self.store.state();
        if !state.pending_update {
            return self.sync_store();
        }
        let args =
            StepArgs { step: state.step + 1, lr: state.pending_lr, grad_scale: state.pending_grad_scale };
        for u in self.resident_units() {
            self.update_resident(u, &args)?;
        }
        for u in self.layout.units() {
            if self.is_resident(u) {
                continue;
            }
            update_unit(u, &mut self.store.record(u), &self.opts.adamw, &args, Upload::None)?;
        }
        self.sync_store()?;
        self.store.set_state(StoreState { step: state.step + 1, pending_update: false, ..state });
        Ok(())
    }

    /// Each chunk's [`Positions`]: its position ids' RoPE rows and packed documents.
    pub(super) fn chunk_positions(&self, chunks: &[Chunk]) -> Result<Vec<Positions>> {
        let rope = self.rope.as_ref().ok_or_else(|| Error::Schedule("rope table missing".into()))?;
        chunks
            .iter()
            .map(|ch| {
                let (b, t) = ch.ids.dims2()?;
                Ok(match &ch.positions {
                    Some(ids) => Positions::from_ids(rope, b, t, ids)?,
                    None => Positions::range(rope, 0, t)?,
                })
            })
            .collect()
    }

    pub(super) fn ensure_rope(&mut self, seq: usize) -> Result<()> {
        if self.rope.as_ref().is_none_or(|r| r.max_t() < seq) {
            self.rope = Some(Rope::with_angles(
                &self.cfg,
                seq,
                self.opts.weight_dtype,
                self.backend.device(),
                self.opts.rope_angles,
            )?);
        }
        Ok(())
    }

    fn execute(&mut self, program: &Program, chunks: &[Chunk], args: StepArgs) -> Result<f64> {
        let r = self.issue_all(program, chunks, args);
        // Every exit drains every stream first, so no job or copy of this step outlives it (a
        // retried step would otherwise stage into a buffer an old upload still reads) and a
        // stale stream error cannot fail the next step.
        let drained = self.backend.synchronize();
        let loss = r?;
        drained?;
        Ok(loss)
    }

    fn issue_all(&mut self, program: &Program, chunks: &[Chunk], args: StepArgs) -> Result<f64> {
        let mut events: Vec<B::Event> = Vec::with_capacity(program.instrs.len());
        let mut losses = Vec::new();
        for ins in &program.instrs {
            let waits: Vec<B::Event> = ins.waits.iter().map(|&w| events[w].clone()).collect();
            let ev = match ins.stream {
                Stream::Compute => {
                    self.backend.compute_wait(&waits)?;
                    self.backend.compute_begin();
                    let t0 = self.backend.now_s();
                    self.run_compute(&ins.op, chunks, &mut losses, &args)
                        .map_err(|e| Error::Op { op: format!("{:?}", ins.op), source: Box::new(e) })?;
                    self.backend.compute_record(format!("{:?}", ins.op), t0)
                }
                Stream::Host => self.issue_host(&ins.op, &waits, args)?,
                Stream::H2D | Stream::D2H => self.issue_copy(&ins.op, &waits, args.step)?,
            };
            events.push(ev);
        }
        // The chunks' losses, read now that every instruction is issued, summed in chunk order
        // (as when each was read as it was computed).
        let mut loss = 0.0;
        for l in &losses {
            loss += l.to_scalar::<f64>()?;
        }
        Ok(loss)
    }
}

/// Initialises a store's master weights from named f32 tensors (HF names), zeroing moments.
/// Every parameter of the model must be given exactly once.
pub fn load_params<'a>(
    store: &HostStore,
    params: impl IntoIterator<Item = (&'a String, &'a [f32])>,
) -> Result<usize> {
    let mut seen = std::collections::BTreeSet::new();
    for (name, data) in params {
        store.write_param(name, data)?;
        if !seen.insert(name.clone()) {
            return Err(CoreError::Data(format!("parameter {name} given twice")).into());
        }
    }
    let missing: Vec<String> =
        store.layout().all_params().into_iter().map(|(n, _, _)| n).filter(|n| !seen.contains(n)).collect();
    if !missing.is_empty() {
        return Err(
            CoreError::Data(format!("{} parameters missing, e.g. {}", missing.len(), missing[0])).into()
        );
    }
    Ok(seen.len())
}

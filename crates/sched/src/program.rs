//! The step program: everything one training step does, in issue order, as data.
//!
//! Each instruction runs on one [`Stream`] and lists the instructions it must wait for. The
//! executor only interprets this list; nothing about ordering is inferred at run time. Tests
//! check the schedule's invariants on the data alone (every layer fetched before use, at most
//! `ring_depth` slots live, each gradient offloaded exactly once, updates in forward order).
//!
//! Layer-major order (engine-brief "Step program"): the outer unit (embedding, final norm, LM
//! head) is uploaded once and stays resident; layer `i` is uploaded for forward (all chunks),
//! the loss runs chunk by chunk, then layers `L-1..0` are uploaded again, recomputed and
//! back-propagated over all chunks, and each layer's gradient is downloaded once.
//!
//! Held layers (the last `held_layers` streamed ones) are fetched once, for their forward, into
//! their own slot, and their backward reads it there.
//!
//! GPU-updated layers (`gpu_updated` of the streamed layers, spread evenly among them; exact
//! mode with a pending update) do not have their update applied by the host: their fp32
//! `[master | m | v]` and stored gradient go up from the host record into a state slot
//! ([`Op::UploadState`]), [`Op::UpdateStreamed`] applies AdamW there and writes the new weights
//! into the layer's slot, and [`Op::DownloadState`] brings master and moments back into the
//! record. Host memory bandwidth, which bounds the host's update pass, is then shared with the
//! DMA engines over PCIe, which the forward otherwise leaves mostly idle. Of the held ones,
//! `late_downloads` ([`is_late_download`]) keep their state slot into the backward and download
//! it there, spread over it from the loss on: out of the forward, whose host memory is the
//! step's bottleneck, into the backward, whose host memory and D2H are partly idle.
//!
//! Of the others, `early_uploads` ([`early_upload_layers`]) get their state for the next step
//! during this step's backward, into a slot of their own: master and moments go up from the loss
//! on ([`Op::UploadMoments`]), the gradient is copied on the device after the layer's backward
//! ([`Op::CopyGrad`]); a step whose early states are ready ([`ProgramSpec::early_ready`]) uploads
//! nothing for them in its forward.
//!
//! Resident units (the outer unit and the first `resident_layers` decoder layers, when the
//! planner keeps them on the GPU) never cross the bus: their weights sit in their own slot,
//! their gradient accumulates in their own buffer, and [`Op::UpdateResident`] applies their
//! AdamW step on the compute stream (exact mode: just before their first use in the step; lean
//! mode: right after their backward).

use mt_core::Unit;

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
    },
    /// Compute: final norm, LM head, cross-entropy and their backward, chunk by chunk.
    Loss,
    /// Compute: zero a gradient buffer, recompute the layer from its checkpoints and
    /// back-propagate every chunk, accumulating the weight gradient. A resident layer's
    /// gradient (its own buffer) then also gives its share of the global norm.
    Backward {
        /// Layer.
        layer: usize,
        /// Slot holding its weights.
        slot: Slot,
        /// Gradient buffer of the ring to accumulate into (`None` = the resident layer's own).
        grad_buf: Option<usize>,
    },
    /// Compute: embedding backward (accumulates into the outer gradient); with a resident outer
    /// unit, also the outer gradient's sum of squares (for the global norm).
    EmbedBackward,
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
    /// before the unit's first use in the step; lean mode: right after its backward.
    UpdateResident {
        /// Unit.
        unit: Unit,
    },
    /// D2H: a unit's accumulated gradient into a landing buffer.
    Download {
        /// Unit.
        unit: Unit,
        /// Device gradient buffer (ring index; `None` = the outer gradient buffer).
        grad_buf: Option<usize>,
        /// Landing buffer.
        landing: HostBuf,
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

/// Shape of the rings the program uses.
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
    /// The outer unit's optimizer state lives on the device: it is never staged, uploaded,
    /// downloaded or landed; [`Op::UpdateResident`] updates it on the compute stream.
    pub resident_outer: bool,
    /// Decoder layers `0..resident_layers` live on the device likewise (weights, gradient,
    /// optimizer state); the ring streams the others.
    pub resident_layers: usize,
    /// The last `held_layers` decoder layers (streamed ones) are uploaded once, for their
    /// forward, into their own slot ([`Slot::Held`]), and their backward reads them there: no
    /// re-cast, no second upload. At most `n_layers - resident_layers`.
    pub held_layers: usize,
    /// Of the streamed layers, this many (spread evenly: [`is_gpu_updated`]) have their pending
    /// exact-mode update applied on the device from their streamed state. 0 in lean mode.
    pub gpu_updated: usize,
    /// Of the GPU-updated layers that are held, this many (spread evenly among them:
    /// [`is_late_download`]) download their state in the backward (spread over it, each before
    /// its layer's land) instead of right after their update; their state slot stays taken
    /// until then.
    pub late_downloads: usize,
    /// Of the GPU-updated layers that do not download late, this many ([`early_upload_layers`]:
    /// spread evenly over them) get their state for the next step
    /// into a state slot of their own (the last `early_uploads` slots) during this step's
    /// backward: master and moments go up from the loss on ([`Op::UploadMoments`]), the gradient
    /// is copied on the device right after the layer's backward ([`Op::CopyGrad`]: the bytes its
    /// land stores), and the slot stays taken until their next forward's update has gone back.
    /// Out of the forward, whose host memory and uploads bound a streamed step, into the
    /// backward, whose H2D is idle when every streamed layer is held; the gradient no longer
    /// crosses up at all. Master and moments still go up and come back once a step.
    pub early_uploads: usize,
    /// The early-upload layers' states are already in their slots (uploaded in the previous
    /// step's backward, their records unchanged since): their forward uploads nothing. The
    /// engine sets it only after a step that issued them succeeded.
    pub early_ready: bool,
    /// State slots for the GPU-updated layers (at least `ring_depth + late_downloads +
    /// early_uploads` when `gpu_updated > 0`: `ring_depth` state uploads can be ahead of their
    /// forward while the late ones wait for their backward and the early ones for their next
    /// forward).
    pub n_state_bufs: usize,
}

/// Whether decoder `layer` is one of the `spec.gpu_updated` GPU-updated layers: the streamed
/// layers `resident_layers..n_layers` picked evenly, one in the middle of each of `gpu_updated`
/// equal stretches (Bresenham, centred), so that host updates and state transfers alternate
/// through the forward, and the last streamed layer (whose backward follows its forward at once,
/// so that a re-cast waiting for its state could not be hidden) is one only when more than half
/// of them are.
pub fn is_gpu_updated(spec: &ProgramSpec, layer: usize) -> bool {
    gpu_updated_among(spec.n_layers, spec.resident_layers, spec.gpu_updated, layer)
}

fn gpu_updated_among(n_layers: usize, resident_layers: usize, gpu_updated: usize, layer: usize) -> bool {
    if layer < resident_layers || layer >= n_layers {
        return false;
    }
    spread(layer - resident_layers, n_layers - resident_layers, gpu_updated)
}

/// Whether item `i` of `n` is one of `k` picked evenly (Bresenham, centred).
fn spread(i: usize, n: usize, k: usize) -> bool {
    let k = k.min(n);
    ((i + 1) * k + n / 2) / n > (i * k + n / 2) / n
}

/// The GPU-updated layers that are also held (in layer order): the ones whose state may stay on
/// the device until their backward.
pub fn held_gpu_updated(spec: &ProgramSpec) -> Vec<usize> {
    held_gpu_updated_of(spec.n_layers, spec.resident_layers, spec.held_layers, spec.gpu_updated)
}

/// [`held_gpu_updated`] of a placement: `n_layers`, of which the first `resident_layers` are
/// resident, the last `held_layers` held, and `gpu_updated` of the streamed ones GPU-updated.
pub fn held_gpu_updated_of(
    n_layers: usize,
    resident_layers: usize,
    held_layers: usize,
    gpu_updated: usize,
) -> Vec<usize> {
    let first_held = n_layers.saturating_sub(held_layers).max(resident_layers);
    (first_held..n_layers).filter(|&l| gpu_updated_among(n_layers, resident_layers, gpu_updated, l)).collect()
}

/// Whether decoder `layer` is one of the `spec.late_downloads` GPU-updated, held layers whose
/// state is downloaded in the backward (spread evenly over [`held_gpu_updated`], so that their
/// downloads spread over the backward's D2H).
pub fn is_late_download(spec: &ProgramSpec, layer: usize) -> bool {
    let held = held_gpu_updated(spec);
    held.iter().position(|&l| l == layer).is_some_and(|i| spread(i, held.len(), spec.late_downloads))
}

/// The layers whose state for the next step goes up in this step's backward
/// ([`ProgramSpec::early_uploads`]), in forward order: of the GPU-updated layers that do not
/// download late, `early_uploads` spread evenly, so that the state uploads left to the forward
/// (the others') spread over it too. The `i`-th takes state slot
/// `n_state_bufs - early_uploads + i`.
pub fn early_upload_layers(spec: &ProgramSpec) -> Vec<usize> {
    let held = held_gpu_updated(spec);
    let late = |l: usize| {
        held.iter().position(|&h| h == l).is_some_and(|i| spread(i, held.len(), spec.late_downloads))
    };
    let candidates: Vec<usize> =
        (0..spec.n_layers).filter(|&l| is_gpu_updated(spec, l) && !late(l)).collect();
    let n = candidates.len();
    candidates
        .into_iter()
        .enumerate()
        .filter(|&(i, _)| spread(i, n, spec.early_uploads))
        .map(|(_, l)| l)
        .collect()
}

/// The instructions of one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// Instructions in issue order.
    pub instrs: Vec<Instr>,
    /// The spec it was built from.
    pub spec: ProgramSpec,
}

/// Remembers, per reusable resource, the last instruction that used it, so the next writer
/// waits for it.
#[derive(Default)]
struct LastUse(std::collections::HashMap<(u8, usize), usize>);

impl LastUse {
    fn take(&mut self, kind: u8, idx: usize, now: usize) -> Option<usize> {
        self.0.insert((kind, idx), now)
    }
}

const K_STAGING: u8 = 0;
const K_SLOT: u8 = 1;
const K_GRAD: u8 = 2;
const K_LANDING: u8 = 3;
const K_STATE: u8 = 4;

fn buf_idx(b: HostBuf) -> usize {
    match b {
        HostBuf::Ring(k) => k,
        HostBuf::Outer => usize::MAX,
    }
}

struct Builder {
    instrs: Vec<Instr>,
    last: LastUse,
    /// The Stage that applies a unit's pending update in this step, if any.
    update_of: std::collections::HashMap<Unit, usize>,
    /// Layer fetches so far (staging buffers are taken in fetch order).
    n_fetches: usize,
    /// State slots whose state has been downloaded (or never used), least recently freed first.
    free_states: std::collections::VecDeque<usize>,
    /// The state slot each GPU-updated unit's state went to this step.
    state_of: std::collections::HashMap<Unit, usize>,
    /// Late-download units updated on the device whose state is still in its slot: the update's
    /// id.
    late_updates: std::collections::HashMap<Unit, usize>,
    /// Late-download layers in backward order (their downloads are issued in that order).
    late_order: Vec<usize>,
    /// Late downloads issued so far.
    late_issued: usize,
    /// Backward fetches (use index, slot) of GPU-updated layers whose device update is not issued
    /// yet: their re-cast must read the downloaded master, so they are issued right after it.
    deferred: Vec<(usize, Slot)>,
    /// The early-upload units' own state slots (never in `free_states`).
    early_slot: std::collections::HashMap<Unit, usize>,
}

impl Builder {
    fn push(&mut self, stream: Stream, op: Op, mut waits: Vec<usize>) -> usize {
        waits.sort_unstable();
        waits.dedup();
        self.instrs.push(Instr { stream, op, waits });
        self.instrs.len() - 1
    }

    /// The next id, for resource bookkeeping before pushing.
    fn next(&self) -> usize {
        self.instrs.len()
    }

    /// Stage + upload of a unit; returns the upload's id.
    fn fetch(&mut self, unit: Unit, staging: HostBuf, slot: Slot, update: bool) -> usize {
        // The previous upload out of this staging buffer must be done before it is rewritten;
        // a unit updated on the device this step is re-cast only from its downloaded master.
        let id = self.next();
        let prev_reader = self.last.take(K_STAGING, buf_idx(staging), id + 1);
        let waits = prev_reader.into_iter().chain(self.update_of.get(&unit).copied()).collect();
        let stage = self.push(Stream::Host, Op::Stage { unit, staging, update }, waits);
        if update {
            self.update_of.insert(unit, stage);
        }
        let mut waits = vec![stage];
        if let Slot::Ring(k) = slot {
            // The previous compute that read this slot must be done before it is overwritten.
            if let Some(&reader) = self.last.0.get(&(K_SLOT, k)) {
                waits.push(reader);
            }
        }
        self.push(Stream::H2D, Op::Upload { unit, staging, slot }, waits)
    }

    /// Upload of a GPU-updated unit's state into its own slot (an early-upload unit) or the next
    /// free one; returns the upload's id.
    fn fetch_state(&mut self, unit: Unit) -> usize {
        let buf = match self.early_slot.get(&unit) {
            Some(&buf) => buf,
            None => self.free_states.pop_front().unwrap_or_else(|| {
                panic!("no state slot free for {unit:?}: every one holds a state not yet downloaded")
            }),
        };
        self.state_of.insert(unit, buf);
        // The previous download out of this slot must be done before it is overwritten.
        let prev = self.last.0.get(&(K_STATE, buf)).copied();
        self.push(Stream::H2D, Op::UploadState { unit, buf }, prev.into_iter().collect())
    }

    /// The device update of a GPU-updated unit (after its state upload `up`, if it is this step's)
    /// into `slot`, and, unless `late`, the download of its state; returns the update's id.
    fn update_streamed(&mut self, unit: Unit, slot: Slot, up: Option<usize>, late: bool) -> usize {
        let buf = self.state_of[&unit];
        let upd =
            self.push(Stream::Compute, Op::UpdateStreamed { unit, buf, slot }, up.into_iter().collect());
        if late {
            self.late_updates.insert(unit, upd);
        } else {
            self.download_state(unit, upd);
        }
        upd
    }

    /// Issues the late state downloads due at streamed backward position `p` of `positions`:
    /// the `k`-th (in backward order) at position `k × positions / late` — spread over the
    /// backward from its start (the loss), so the D2H interleaves them with the gradients and
    /// none is left for the end of the step — or at its own layer's position (its land waits for
    /// it), whichever comes first.
    fn late_downloads_due(&mut self, p: usize, positions: usize, n_layers: usize) {
        let late = self.late_order.len();
        while let Some(&layer) = self.late_order.get(self.late_issued) {
            let own = n_layers - 1 - layer; // its backward position
            if p < self.late_issued * positions / late && p < own {
                break;
            }
            let unit = Unit::Layer(layer);
            let upd =
                self.late_updates.remove(&unit).expect("a late download's update was issued in the forward");
            self.download_state(unit, upd);
            self.late_issued += 1;
        }
    }

    /// The download of a GPU-updated unit's state after its update `upd`; frees its slot (unless
    /// it is an early-upload unit's own).
    fn download_state(&mut self, unit: Unit, upd: usize) {
        let buf = self.state_of[&unit];
        let dl = self.push(Stream::D2H, Op::DownloadState { unit, buf }, vec![upd]);
        self.last.take(K_STATE, buf, dl);
        if !self.early_slot.contains_key(&unit) {
            self.free_states.push_back(buf);
        }
        // Landing overwrites the record's gradient and a backward re-cast reads its master:
        // both after the state is back (and the record marked updated, so that a retried step
        // never updates it twice from a new gradient).
        self.update_of.insert(unit, dl);
    }

    /// The upload, for the next step, of an early-upload unit's master and moments into its own
    /// slot, after the slot's last download (this step's of the unit's updated state, if it was
    /// updated: the record is whole then).
    fn early_upload(&mut self, unit: Unit) {
        let buf = self.early_slot[&unit];
        let prev = self.last.0.get(&(K_STATE, buf)).copied();
        let up = self.push(Stream::H2D, Op::UploadMoments { unit, buf }, prev.into_iter().collect());
        self.last.take(K_STATE, buf, up);
    }
}

impl Program {
    /// Builds the program of one step.
    ///
    /// Issue order matters as much as the waits: the executor issues instructions in this order
    /// and the CPU backend runs compute inline. The streamed layers' slot uses are numbered
    /// `j = 0..` (forward layers, then backward layers; resident layers take no slot); the
    /// fetch for use `j + N` is issued right after compute `j` (the last reader of its slot), so
    /// with `N >= 2` it overlaps compute `j + 1..`, and with `N = 1` there is no overlap (the
    /// ablation). The fetch is issued before the gradient download and landing of use `j`, so a
    /// prefetch never queues behind an offload on the host stream. Exception: the backward
    /// re-cast of a GPU-updated layer whose prefetch would precede its forward's device update
    /// is issued right after that forward (it must read the master the update sent back). Late
    /// state downloads are issued in the backward, spread over it from its start
    /// (`Builder::late_downloads_due`), each before its layer's land (which waits for it).
    pub fn build(spec: ProgramSpec) -> Program {
        assert!(spec.ring_depth >= 1 && spec.n_staging >= 1 && spec.n_grad_bufs >= 1 && spec.n_landing >= 1);
        assert!(
            spec.resident_layers + spec.held_layers <= spec.n_layers,
            "held layers must be streamed ones"
        );
        assert!(
            spec.gpu_updated == 0
                || (spec.mode == OptimMode::Exact
                    && spec.n_state_bufs >= spec.ring_depth + spec.late_downloads + spec.early_uploads),
            "GPU-updated layers need exact mode and at least ring_depth (+ late downloads + early uploads) state slots"
        );
        assert!(
            spec.late_downloads <= held_gpu_updated(&spec).len(),
            "late downloads are of GPU-updated held layers"
        );
        let early = early_upload_layers(&spec);
        assert!(
            early.len() == spec.early_uploads && (spec.early_uploads == 0 || spec.gpu_updated > 0),
            "early uploads are of GPU-updated layers that do not download late"
        );
        let exact_update = spec.mode == OptimMode::Exact && spec.pending_update;
        let lean = spec.mode == OptimMode::Lean;
        let n = spec.n_layers;
        let resident = |layer: usize| layer < spec.resident_layers;
        let held = |layer: usize| !resident(layer) && layer + spec.held_layers >= n;
        let mut b = Builder {
            instrs: Vec::new(),
            last: LastUse::default(),
            update_of: Default::default(),
            n_fetches: 0,
            free_states: (0..spec.n_state_bufs).collect(),
            state_of: Default::default(),
            late_updates: Default::default(),
            late_order: (0..spec.n_layers)
                .rev()
                .filter(|&l| exact_update && is_late_download(&spec, l))
                .collect(),
            late_issued: 0,
            deferred: Vec::new(),
            early_slot: early
                .iter()
                .enumerate()
                .map(|(i, &l)| (Unit::Layer(l), spec.n_state_bufs - spec.early_uploads + i))
                .collect(),
        };
        // The free list holds the other slots.
        b.free_states.truncate(spec.n_state_bufs - spec.early_uploads);
        let gpu_update = |layer: usize| exact_update && is_gpu_updated(&spec, layer);
        // Use k: (layer, is_backward). Ring uses are the streamed, not held layers' uses: ring
        // use `j` goes through slot `j % ring_depth`. Held layers are fetched once, for their
        // forward, into their own slot. Staging buffers are taken in fetch order.
        let uses: Vec<(usize, bool)> =
            (0..n).map(|l| (l, false)).chain((0..n).rev().map(|l| (l, true))).collect();
        let ring: Vec<usize> =
            (0..uses.len()).filter(|&k| !resident(uses[k].0) && !held(uses[k].0)).collect();
        // Each use's upload (none for an early-upload layer's forward whose state is already up).
        let mut uploads: Vec<Option<usize>> = vec![None; uses.len()];
        let fetch = |b: &mut Builder, uploads: &mut Vec<Option<usize>>, k: usize, slot: Slot| {
            let (layer, backward) = uses[k];
            if !backward && gpu_update(layer) {
                let unit = Unit::Layer(layer);
                match b.early_slot.get(&unit) {
                    Some(&buf) if spec.early_ready => {
                        b.state_of.insert(unit, buf);
                    }
                    _ => uploads[k] = Some(b.fetch_state(unit)),
                }
                return;
            }
            if backward && gpu_update(layer) && !b.update_of.contains_key(&Unit::Layer(layer)) {
                // Its prefetch comes before its forward's device update (the last forward
                // layers' backward is the next ring use): issued after that update instead.
                b.deferred.push((k, slot));
                return;
            }
            let staging = HostBuf::Ring(b.n_fetches % spec.n_staging);
            b.n_fetches += 1;
            uploads[k] = Some(b.fetch(Unit::Layer(layer), staging, slot, exact_update && !backward));
        };
        // A held layer's forward is fetched as a ring use would be: `ring_depth` streamed forward
        // uses ahead of its compute (forward use `k` of a streamed layer is position
        // `k - resident_layers`).
        let fetch_held = |b: &mut Builder, uploads: &mut Vec<Option<usize>>, pos: usize| {
            let k = spec.resident_layers + pos;
            if k < n && held(k) {
                fetch(b, uploads, k, Slot::Held(k));
            }
        };

        // Forward order = update order: the outer unit first, then layers 0..L-1.
        let up_outer =
            (!spec.resident_outer).then(|| b.fetch(Unit::Outer, HostBuf::Outer, Slot::Outer, exact_update));
        // The first `ring_depth` forward positions (ring or held) in forward order, then any
        // backward use among the first `ring_depth` ring uses (few layers through the ring), so
        // that no re-cast is staged ahead of a forward's update.
        let is_backward = |j: usize| uses[ring[j]].1;
        for j in 0..spec.ring_depth {
            if j < ring.len() && !is_backward(j) {
                fetch(&mut b, &mut uploads, ring[j], Slot::Ring(j % spec.ring_depth));
            }
            fetch_held(&mut b, &mut uploads, j);
        }
        for j in (0..spec.ring_depth.min(ring.len())).filter(|&j| is_backward(j)) {
            fetch(&mut b, &mut uploads, ring[j], Slot::Ring(j % spec.ring_depth));
        }
        if spec.resident_outer && exact_update {
            b.push(Stream::Compute, Op::UpdateResident { unit: Unit::Outer }, vec![]);
        }
        b.push(Stream::Compute, Op::Embed, up_outer.into_iter().collect());
        let mut n_grads = 0usize;
        let mut j = 0usize; // ring uses so far
        for (k, &(layer, backward)) in uses.iter().enumerate() {
            if k == n {
                b.push(Stream::Compute, Op::Loss, vec![]);
                // The backward's H2D is free from here (every streamed layer held): the early
                // uploads go first, in the next forward's order.
                if spec.mode == OptimMode::Exact {
                    for &l in &early {
                        b.early_upload(Unit::Layer(l));
                    }
                }
            }
            let unit = Unit::Layer(layer);
            if resident(layer) {
                if !backward {
                    if exact_update {
                        b.push(Stream::Compute, Op::UpdateResident { unit }, vec![]);
                    }
                    b.push(Stream::Compute, Op::Forward { layer, slot: Slot::Resident(layer) }, vec![]);
                } else {
                    let op = Op::Backward { layer, slot: Slot::Resident(layer), grad_buf: None };
                    b.push(Stream::Compute, op, vec![]);
                    if lean {
                        b.push(Stream::Compute, Op::UpdateResident { unit }, vec![]);
                    }
                }
                continue;
            }
            let slot = if held(layer) { Slot::Held(layer) } else { Slot::Ring(j % spec.ring_depth) };
            // The ring use whose fetch this compute (the last reader of its slot) releases.
            let prefetch = (!held(layer)).then(|| j + spec.ring_depth).filter(|&p| p < ring.len());
            if !held(layer) {
                j += 1;
            }
            if !backward {
                let ready = if gpu_update(layer) {
                    b.update_streamed(unit, slot, uploads[k], is_late_download(&spec, layer))
                } else {
                    uploads[k].expect("a streamed layer is fetched before its forward")
                };
                let fwd = b.push(Stream::Compute, Op::Forward { layer, slot }, vec![ready]);
                if let Slot::Ring(r) = slot {
                    b.last.take(K_SLOT, r, fwd);
                }
                let (now, later): (Vec<_>, Vec<_>) =
                    std::mem::take(&mut b.deferred).into_iter().partition(|&(d, _)| uses[d].0 == layer);
                b.deferred = later;
                for (d, dslot) in now {
                    fetch(&mut b, &mut uploads, d, dslot);
                }
                fetch_held(&mut b, &mut uploads, layer - spec.resident_layers + spec.ring_depth);
                if let Some(p) = prefetch {
                    fetch(&mut b, &mut uploads, ring[p], Slot::Ring(p % spec.ring_depth));
                }
                continue;
            }
            b.late_downloads_due(n_grads, n - spec.resident_layers, n);
            let grad_buf = n_grads % spec.n_grad_bufs;
            let landing = HostBuf::Ring(n_grads % spec.n_landing);
            n_grads += 1;
            // Wait for the previous download out of this gradient buffer before zeroing it (a held
            // layer's weights are in its slot since its forward, earlier on this stream).
            let mut waits: Vec<usize> = if held(layer) {
                vec![]
            } else {
                vec![uploads[k].expect("a streamed layer is fetched before its backward")]
            };
            waits.extend(b.last.0.get(&(K_GRAD, grad_buf)).copied());
            let op = Op::Backward { layer, slot, grad_buf: Some(grad_buf) };
            let bwd = b.push(Stream::Compute, op, waits);
            if let Slot::Ring(r) = slot {
                b.last.take(K_SLOT, r, bwd);
            }
            if let (Some(&buf), OptimMode::Exact) = (b.early_slot.get(&unit), spec.mode) {
                // The gradient the land stores, for the next step's update (compute order: after
                // this step's update read the slot's previous one).
                b.push(Stream::Compute, Op::CopyGrad { unit, grad_buf, buf }, vec![]);
            }
            if let Some(p) = prefetch {
                fetch(&mut b, &mut uploads, ring[p], Slot::Ring(p % spec.ring_depth));
            }
            let mut waits = vec![bwd];
            waits.extend(b.last.0.get(&(K_LANDING, buf_idx(landing))).copied()); // previous land
            let dl = b.push(Stream::D2H, Op::Download { unit, grad_buf: Some(grad_buf), landing }, waits);
            b.last.take(K_GRAD, grad_buf, dl);
            // Landing overwrites the gradient the pending update reads: after that update.
            let waits = std::iter::once(dl).chain(b.update_of.get(&unit).copied()).collect();
            let land = b.push(Stream::Host, Op::Land { unit, landing, update: lean }, waits);
            b.last.take(K_LANDING, buf_idx(landing), land);
        }
        assert!(b.deferred.is_empty(), "backward fetches never issued: {:?}", b.deferred);
        assert!(b.late_updates.is_empty(), "late state downloads never issued: {:?}", b.late_updates);
        if n == 0 {
            b.push(Stream::Compute, Op::Loss, vec![]);
        }
        let eb = b.push(Stream::Compute, Op::EmbedBackward, vec![]);
        if spec.resident_outer {
            if lean {
                b.push(Stream::Compute, Op::UpdateResident { unit: Unit::Outer }, vec![]);
            }
            return Program { instrs: b.instrs, spec };
        }
        let landing = HostBuf::Outer;
        let dl = b.push(Stream::D2H, Op::Download { unit: Unit::Outer, grad_buf: None, landing }, vec![eb]);
        let waits = std::iter::once(dl).chain(b.update_of.get(&Unit::Outer).copied()).collect();
        b.push(Stream::Host, Op::Land { unit: Unit::Outer, landing, update: lean }, waits);
        Program { instrs: b.instrs, spec }
    }

    /// Checks that every wait points to an earlier instruction (the executor relies on it).
    pub fn validate(&self) -> Result<(), crate::Error> {
        for (i, ins) in self.instrs.iter().enumerate() {
            if let Some(&w) = ins.waits.iter().find(|&&w| w >= i) {
                return Err(crate::Error::Options(format!(
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

    /// Units whose gradients are downloaded, in order.
    pub fn downloads(&self) -> impl Iterator<Item = Unit> + '_ {
        self.instrs.iter().filter_map(|i| match i.op {
            Op::Download { unit, .. } => Some(unit),
            _ => None,
        })
    }
}

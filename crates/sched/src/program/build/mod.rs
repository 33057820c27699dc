//! [`Program::build`]: the step as it runs, one flat per-layer list (llm.c's `gpt2_backward` is
//! the model): the outer unit's forward, each layer's forward, the loss, each layer's backward,
//! the outer unit's backward. This file is the streamed step: every layer staged and uploaded
//! through the weight ring for its forward and again for its backward, its gradient downloaded
//! and landed. What a placement changes of that walk is one module per feature, the steps the
//! walk calls at fixed points: [`resident`] (units that never cross the bus), [`held`] (layers
//! uploaded once), [`gpu_updated`] (the pending update on the device, with the state's moves:
//! late downloads, early uploads), [`spill`] (checkpoints in host memory between forward and
//! backward) and [`ranks`] (data parallel: gradients summed over the ranks, landed by one).
//! Kept activations change no instruction's place, only what a `Forward` keeps.
//!
//! Every reusable resource (staging and landing buffers, weight slots, gradient buffers, state
//! slots) remembers its last user ([`LastUse`]), and its next writer waits for it.

mod gpu_updated;
mod held;
mod ranks;
mod resident;
mod spill;

use std::collections::HashMap;

use mt_core::Unit;

use super::{BackwardInput, HostBuf, Instr, Op, OptimMode, Program, ProgramSpec, Slot, Stream};

impl Program {
    /// Builds the program of one step.
    ///
    /// Issue order matters as much as the waits: the executor issues instructions in this order
    /// and the CPU backend runs compute inline. The streamed layers' slot uses are numbered
    /// `j = 0..` (forward layers, then backward layers; resident and held layers take no ring
    /// slot); the fetch for use `j + N` is issued right after compute `j` (the last reader of its
    /// slot), so with `N >= 2` it overlaps compute `j + 1..`, and with `N = 1` there is no overlap
    /// (the ablation). The fetch is issued before the gradient download and landing of use `j`, so
    /// a prefetch never queues behind an offload on the host stream.
    pub fn build(spec: ProgramSpec) -> Program {
        check(&spec);
        let mut b = Builder::new(spec);
        // Forward order = update order: the outer unit first, then layers 0..L-1.
        let outer = b.fetch_outer();
        b.fetch_first_uses();
        b.embed(outer);
        for layer in 0..spec.n_layers {
            b.forward(layer);
        }
        b.loss();
        for layer in (0..spec.n_layers).rev() {
            b.backward(layer);
        }
        b.outer_backward();
        b.update_resident_at_end();
        b.finish()
    }
}

impl Builder {
    /// Layer `layer`'s forward: its weights ready in their slot, every chunk through it, the
    /// fetch that takes over the slot right after.
    fn forward(&mut self, layer: usize) {
        if self.spec.is_resident(layer) {
            return self.resident_forward(layer);
        }
        let (slot, prefetch) = self.walk_use(layer);
        let ready = self.weights_ready(layer, slot);
        let fwd =
            self.push(Stream::Compute, Op::Forward { layer, slot, keep: self.keeps(layer) }, vec![ready]);
        self.read_slot(slot, fwd);
        self.checkpoints_after_forward(layer, fwd);
        self.fetch_deferred(layer);
        self.fetch_held_ahead(layer);
        self.prefetch(prefetch);
    }

    /// The loss (with its backward), and what the backward's start lets go.
    fn loss(&mut self) {
        self.push(Stream::Compute, Op::Loss, vec![]);
        self.first_reloads();
        self.early_uploads_at_loss();
    }

    /// Layer `layer`'s backward: a gradient buffer zeroed (once its last download is done),
    /// every chunk back-propagated into it, the fetch that takes over the slot, then the
    /// gradient downloaded and landed.
    fn backward(&mut self, layer: usize) {
        if self.spec.is_resident(layer) {
            return self.resident_backward(layer);
        }
        let (slot, prefetch) = self.walk_use(layer);
        self.late_downloads_due();
        let grad_buf = self.n_grads % self.spec.n_grad_bufs;
        let landing = HostBuf::Ring(self.n_grads % self.spec.n_landing);
        self.n_grads += 1;
        let mut waits: Vec<usize> = self.weights_fetched(layer).into_iter().collect();
        waits.extend(self.last.of(Resource::GradBuf(grad_buf)));
        waits.extend(self.reload_of(layer));
        let op = Op::Backward { layer, slot, grad_buf: Some(grad_buf), input: self.backward_input(layer) };
        let bwd = self.push(Stream::Compute, op, waits);
        let grad = self.gradient_done(Unit::Layer(layer), Some(grad_buf), bwd);
        self.read_slot(slot, bwd);
        self.reload_after(layer, bwd);
        self.copy_grad(layer, grad_buf);
        self.prefetch(prefetch);
        self.offload(Unit::Layer(layer), Some(grad_buf), landing, grad);
    }

    /// The embedding's backward, then the outer gradient downloaded and landed (it stays on the
    /// device when the outer unit is resident).
    fn outer_backward(&mut self) {
        let eb = self.push(Stream::Compute, Op::EmbedBackward, vec![]);
        let grad = self.gradient_done(Unit::Outer, None, eb);
        if !self.spec.placement.resident_outer {
            self.offload(Unit::Outer, None, HostBuf::Outer, grad);
        }
    }

    /// After the backward `after` that accumulated `unit`'s gradient (into ring buffer
    /// `grad_buf`, else its own): its sum over the data-parallel ranks, then its share of the
    /// global norm where the device takes it (a gradient narrowed to bf16, a resident unit's).
    /// Returns the last of them: what the gradient's download waits for.
    fn gradient_done(&mut self, unit: Unit, grad_buf: Option<usize>, after: usize) -> usize {
        let mut last = self.all_reduce(unit, grad_buf).unwrap_or(after);
        let on_device = match grad_buf {
            Some(_) => self.spec.narrow_grads,
            None => unit != Unit::Outer || self.spec.placement.resident_outer,
        };
        if on_device {
            last = self.push(Stream::Compute, Op::SumSquares { unit, grad_buf }, vec![]);
        }
        last
    }

    /// The outer unit staged and uploaded into its slot (none when it is resident).
    fn fetch_outer(&mut self) -> Option<usize> {
        let resident = self.spec.placement.resident_outer;
        (!resident).then(|| self.stage_and_upload(Unit::Outer, HostBuf::Outer, Slot::Outer, self.update))
    }

    /// The fetches issued before any compute: the first `ring_depth` streamed forward positions
    /// (ring or held) in forward order, then any backward use among the first `ring_depth` ring
    /// uses (few layers through the ring), so that no re-cast is staged ahead of a forward's
    /// update.
    fn fetch_first_uses(&mut self) {
        let n = self.spec.ring_depth;
        for j in 0..n {
            if j < self.ring.len() && !self.ring_backward(j) {
                self.fetch(self.ring[j], Slot::Ring(j % n));
            }
            self.fetch_held(j);
        }
        for j in 0..n.min(self.ring.len()) {
            if self.ring_backward(j) {
                self.fetch(self.ring[j], Slot::Ring(j % n));
            }
        }
    }

    /// Every chunk embedded (boundary 0), after the outer unit's upload `fetched`.
    fn embed(&mut self, fetched: Option<usize>) {
        self.update_resident_outer();
        let embed = self.push(Stream::Compute, Op::Embed, fetched.into_iter().collect());
        self.spill(0, embed);
    }

    /// Fetches use `k` into `slot`: its weights staged (with the pending update, in the forward)
    /// and uploaded, unless the GPU-updated layers' step takes it over.
    fn fetch(&mut self, k: usize, slot: Slot) {
        if self.fetch_gpu_updated(k, slot) {
            return;
        }
        let (layer, backward) = self.uses[k];
        let staging = HostBuf::Ring(self.n_fetches % self.spec.n_staging);
        self.n_fetches += 1;
        let update = self.update && !backward;
        self.uploads[k] = Some(self.stage_and_upload(Unit::Layer(layer), staging, slot, update));
    }

    /// Stage + upload of a unit; returns the upload's id.
    fn stage_and_upload(&mut self, unit: Unit, staging: HostBuf, slot: Slot, update: bool) -> usize {
        // The previous upload out of this staging buffer must be done before it is rewritten;
        // a unit updated on the device this step is re-cast only from its downloaded master.
        let upload = self.instrs.len() + 1;
        let previous = self.last.take(Resource::Staging(staging), upload);
        let waits = previous.into_iter().chain(self.update_of.get(&unit).copied()).collect();
        let stage = self.push(Stream::Host, Op::Stage { unit, staging, update }, waits);
        if update {
            self.update_of.insert(unit, stage);
        }
        let mut waits = vec![stage];
        if let Slot::Ring(k) = slot {
            // The previous compute that read this slot must be done before it is overwritten.
            waits.extend(self.last.of(Resource::RingSlot(k)));
        }
        self.push(Stream::H2D, Op::Upload { unit, staging, slot }, waits)
    }

    /// The gradient in `grad_buf` (`None`: the outer one) downloaded after `after` and the
    /// previous land out of `landing`, then landed after the update that reads the gradient it
    /// overwrites (by the landing rank only).
    fn offload(&mut self, unit: Unit, grad_buf: Option<usize>, landing: HostBuf, after: usize) {
        if !self.lands() {
            return;
        }
        let mut waits = vec![after];
        waits.extend(self.last.of(Resource::Landing(landing)));
        let narrowed = grad_buf.is_some() && self.spec.narrow_grads;
        let dl = self.push(Stream::D2H, Op::Download { unit, grad_buf, landing, narrowed }, waits);
        if let Some(k) = grad_buf {
            self.last.take(Resource::GradBuf(k), dl);
        }
        let waits = std::iter::once(dl).chain(self.update_of.get(&unit).copied()).collect();
        let lean = self.spec.mode == OptimMode::Lean;
        let land = self.push(Stream::Host, Op::Land { unit, landing, update: lean }, waits);
        self.last.take(Resource::Landing(landing), land);
    }
}

/// A reusable resource whose next writer waits for its last user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Resource {
    /// An upload staging buffer: its last upload.
    Staging(HostBuf),
    /// Weight slot `k` of the ring: the last compute that read it.
    RingSlot(usize),
    /// Layer gradient buffer `k`: its last download.
    GradBuf(usize),
    /// A landing buffer: its last land.
    Landing(HostBuf),
    /// State slot `k`: its last download, or the early upload into it.
    StateSlot(usize),
}

/// Remembers, per reusable resource, the last instruction that used it.
#[derive(Default)]
struct LastUse(HashMap<Resource, usize>);

impl LastUse {
    /// Records `user` as `r`'s last user; returns the one before.
    fn take(&mut self, r: Resource, user: usize) -> Option<usize> {
        self.0.insert(r, user)
    }

    /// `r`'s last user so far.
    fn of(&self, r: Resource) -> Option<usize> {
        self.0.get(&r).copied()
    }
}

/// The program being built, and where the walk is.
struct Builder {
    spec: ProgramSpec,
    instrs: Vec<Instr>,
    last: LastUse,
    /// Exact mode with an update pending: this step applies it (on the host as each streamed
    /// unit is staged for its forward, on the device for resident and GPU-updated units).
    update: bool,
    /// Slot uses in walk order, `(layer, backward)`: every layer's forward, then every layer's
    /// backward (use `k` of a forward is its layer; of a backward, `2 × n_layers - 1 - layer`).
    uses: Vec<(usize, bool)>,
    /// The uses that go through the ring (not resident, not held), in order: ring use `j` goes
    /// through slot `j % ring_depth`.
    ring: Vec<usize>,
    /// Ring uses walked so far.
    walked: usize,
    /// Each use's upload, once issued (none for a GPU-updated layer's forward whose state is
    /// already up, nor for resident uses).
    uploads: Vec<Option<usize>>,
    /// Layer fetches through the host so far (staging buffers are taken in fetch order).
    n_fetches: usize,
    /// Layer gradients offloaded so far (gradient and landing buffers are taken in that order).
    n_grads: usize,
    /// What a unit's re-cast and land wait for this step: the Stage that applies its pending
    /// update, or (GPU-updated) its state's download.
    update_of: HashMap<Unit, usize>,
    gpu: gpu_updated::StateSlots,
    spill: spill::Spills,
}

impl Builder {
    fn new(spec: ProgramSpec) -> Self {
        let n = spec.n_layers;
        let uses: Vec<(usize, bool)> =
            (0..n).map(|l| (l, false)).chain((0..n).rev().map(|l| (l, true))).collect();
        let ring =
            (0..uses.len()).filter(|&k| !spec.is_resident(uses[k].0) && !spec.is_held(uses[k].0)).collect();
        let update = spec.mode == OptimMode::Exact && spec.pending_update;
        Builder {
            instrs: Vec::new(),
            last: LastUse::default(),
            update,
            uploads: vec![None; uses.len()],
            uses,
            ring,
            walked: 0,
            n_fetches: 0,
            n_grads: 0,
            update_of: HashMap::new(),
            gpu: gpu_updated::StateSlots::new(&spec, update),
            spill: spill::Spills::default(),
            spec,
        }
    }

    fn push(&mut self, stream: Stream, op: Op, mut waits: Vec<usize>) -> usize {
        waits.sort_unstable();
        waits.dedup();
        self.instrs.push(Instr { stream, op, waits });
        self.instrs.len() - 1
    }

    /// The use index of `layer`'s forward or backward.
    fn use_of(&self, layer: usize, backward: bool) -> usize {
        if backward {
            2 * self.spec.n_layers - 1 - layer
        } else {
            layer
        }
    }

    /// Whether ring use `j` is a backward one.
    fn ring_backward(&self, j: usize) -> bool {
        self.uses[self.ring[j]].1
    }

    /// The next use of streamed `layer`: its slot (its own when held), and the ring use whose
    /// fetch it releases (the last reader of its slot).
    fn walk_use(&mut self, layer: usize) -> (Slot, Option<usize>) {
        if self.spec.is_held(layer) {
            return (Slot::Held(layer), None);
        }
        let j = self.walked;
        self.walked += 1;
        let prefetch = Some(j + self.spec.ring_depth).filter(|&p| p < self.ring.len());
        (Slot::Ring(j % self.spec.ring_depth), prefetch)
    }

    /// The fetch of ring use `p`, if there is one.
    fn prefetch(&mut self, p: Option<usize>) {
        if let Some(p) = p {
            self.fetch(self.ring[p], Slot::Ring(p % self.spec.ring_depth));
        }
    }

    /// Compute `id` read `slot`: the next upload into it (a ring slot) waits for it.
    fn read_slot(&mut self, slot: Slot, id: usize) {
        if let Slot::Ring(r) = slot {
            self.last.take(Resource::RingSlot(r), id);
        }
    }

    /// Whether `layer`'s forward keeps what its backward needs (`Placement::kept_layers`, the
    /// first layers).
    fn keeps(&self, layer: usize) -> bool {
        layer < self.spec.placement.kept_layers
    }

    /// Where `layer`'s backward finds what its forward saw: what the forward kept, else the
    /// reload buffer its spilled input came back into (the reload is issued by then), else its
    /// input checkpoint.
    fn backward_input(&self, layer: usize) -> BackwardInput {
        if self.keeps(layer) {
            BackwardInput::Kept
        } else if let Some(slot) = self.reloaded_into(layer) {
            BackwardInput::Reload(slot)
        } else {
            BackwardInput::Checkpoint
        }
    }

    fn finish(mut self) -> Program {
        self.gpu.check_done();
        if !self.spec.overlap_optimizer {
            serialise_host(&mut self.instrs);
        }
        Program { instrs: self.instrs, spec: self.spec }
    }
}

/// The ablation of `ProgramSpec::overlap_optimizer`: every host instruction waits for the
/// compute before it, and the next compute for every host instruction since the one before, so
/// the host's work adds to the step.
fn serialise_host(instrs: &mut [Instr]) {
    let mut last_compute = None;
    let mut host_since = Vec::new();
    for (i, ins) in instrs.iter_mut().enumerate() {
        match ins.stream {
            Stream::Host => {
                ins.waits.extend(last_compute);
                host_since.push(i);
            }
            Stream::Compute => {
                ins.waits.append(&mut host_since);
                last_compute = Some(i);
            }
            Stream::H2D | Stream::D2H => continue,
        }
        ins.waits.sort_unstable();
        ins.waits.dedup();
    }
}

/// The spec's promises the builder relies on.
fn check(spec: &ProgramSpec) {
    let p = &spec.placement;
    assert!(spec.ring_depth >= 1 && spec.n_staging >= 1 && spec.n_grad_bufs >= 1 && spec.n_landing >= 1);
    assert!(p.resident_layers + p.held_layers <= spec.n_layers, "held layers must be streamed ones");
    assert!(
        p.gpu_updated_layers == 0
            || (spec.mode == OptimMode::Exact
                && spec.n_state_bufs >= spec.ring_depth + p.late_state_downloads),
        "GPU-updated layers need exact mode and at least ring_depth (+ late downloads) state slots"
    );
    assert!(
        p.late_state_downloads <= spec.held_gpu_updated().len(),
        "late downloads are of GPU-updated held layers"
    );
    assert!(
        p.spilled_checkpoints <= spec.n_layers && (p.spilled_checkpoints == 0 || spec.reload_slots >= 1),
        "spilled checkpoints are inputs of layers, reloaded through at least one buffer"
    );
    assert!(
        p.spilled_checkpoints == 0 || p.kept_layers == 0,
        "spilled checkpoints and kept activations exclude each other"
    );
    assert!(
        spec.early_upload_pairs().len() == p.early_state_uploads
            && (p.early_state_uploads == 0 || p.gpu_updated_layers > 0),
        "early uploads each pair with a late download at least ring_depth layers after them"
    );
}

//! [`Program::build`]: the step program's builder — the issue order, and the waits between
//! streams that each reusable resource (staging and landing buffers, weight slots, gradient
//! buffers, state slots) needs.

use mt_core::Unit;

use super::{HostBuf, Instr, Op, OptimMode, Program, ProgramSpec, Slot, Stream};

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
    /// The unit whose state is in each state slot and not yet downloaded (or, for an early
    /// upload, not yet used).
    occupant: std::collections::HashMap<usize, Unit>,
    /// The early-upload unit waiting for each late-download unit's slot: its upload follows that
    /// download.
    early_after: std::collections::HashMap<Unit, Unit>,
    /// The early-upload units' slots (the last `early_uploads`): where their state for the next
    /// step goes up in the backward, and where the next forward finds it.
    early_slot: std::collections::HashMap<Unit, usize>,
    /// Spilled boundaries (`0..spilled`) and the reload buffers they come back through.
    spilled: usize,
    reload_slots: usize,
    /// Each spilled boundary's spill, and its reload once issued.
    spill_of: std::collections::HashMap<usize, usize>,
    reload_of: std::collections::HashMap<usize, usize>,
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

    /// Upload of a GPU-updated unit's state into the least recently freed state slot; returns
    /// the upload's id.
    fn fetch_state(&mut self, unit: Unit) -> usize {
        let buf = self.free_states.pop_front().unwrap_or_else(|| {
            panic!("no state slot free for {unit:?}: every one holds a state not yet downloaded")
        });
        self.occupy(buf, unit);
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
            if let Some(early) = self.early_after.remove(&unit) {
                self.early_upload(early);
            }
        }
    }

    /// The download of a GPU-updated unit's state after its update `upd`; frees its slot.
    fn download_state(&mut self, unit: Unit, upd: usize) {
        let buf = self.state_of[&unit];
        let dl = self.push(Stream::D2H, Op::DownloadState { unit, buf }, vec![upd]);
        self.last.take(K_STATE, buf, dl);
        self.occupant.remove(&buf);
        self.free_states.push_back(buf);
        // Landing overwrites the record's gradient and a backward re-cast reads its master:
        // both after the state is back (and the record marked updated, so that a retried step
        // never updates it twice from a new gradient).
        self.update_of.insert(unit, dl);
    }

    /// The upload, for the next step, of an early-upload unit's master and moments into its
    /// slot, after the slot's last download this step (issued after a late one's) and after the
    /// unit's own updated state is back in the record (its download this step, which may have
    /// gone out of another slot: a step whose early states were not ready fetched it from the
    /// free list).
    fn early_upload(&mut self, unit: Unit) {
        let buf = self.early_slot[&unit];
        self.occupy(buf, unit);
        let prev = self.last.0.get(&(K_STATE, buf)).copied();
        let waits = prev.into_iter().chain(self.update_of.get(&unit).copied()).collect();
        let up = self.push(Stream::H2D, Op::UploadMoments { unit, buf }, waits);
        self.last.take(K_STATE, buf, up);
    }

    /// After `producer` wrote boundary `boundary`: its spill, if it is a spilled one.
    fn spill(&mut self, boundary: usize, producer: usize) {
        if boundary < self.spilled {
            let id = self.push(Stream::D2H, Op::SpillCheckpoint { boundary }, vec![producer]);
            self.spill_of.insert(boundary, id);
        }
    }

    /// After the forward that read spilled boundary `boundary`: its device copy freed, once its
    /// spill is done.
    fn drop_spilled(&mut self, boundary: usize) {
        if let Some(&spill) = self.spill_of.get(&boundary) {
            self.push(Stream::Compute, Op::DropCheckpoint { boundary }, vec![spill]);
        }
    }

    /// The reload of spilled boundary `boundary` into buffer `(spilled - 1 - boundary) %
    /// reload_slots` (the reloads' order is the backward's), after its spill and after
    /// `previous`, the backward that last read that buffer.
    fn reload(&mut self, boundary: usize, previous: Option<usize>) {
        let slot = super::reload_slot(self.spilled, self.reload_slots, boundary);
        let waits = self.spill_of.get(&boundary).copied().into_iter().chain(previous).collect();
        let id = self.push(Stream::H2D, Op::ReloadCheckpoint { boundary, slot }, waits);
        self.reload_of.insert(boundary, id);
    }

    /// After the backward `bwd` of layer `layer`: the reload that takes over its reload buffer.
    fn reload_after(&mut self, layer: usize, bwd: usize) {
        if layer < self.spilled && layer >= self.reload_slots {
            self.reload(layer - self.reload_slots, Some(bwd));
        }
    }

    /// Marks slot `buf` as holding `unit`'s state; panics if another's is still there.
    fn occupy(&mut self, buf: usize, unit: Unit) {
        if let Some(other) = self.occupant.insert(buf, unit) {
            panic!(
                "{unit:?}'s state would overwrite {other:?}'s in shared state slot {buf} before its download"
            );
        }
    }
}

impl Program {
    #[allow(dead_code)]
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
    pub(crate) fn build_old(spec: ProgramSpec) -> Program {
        assert!(spec.ring_depth >= 1 && spec.n_staging >= 1 && spec.n_grad_bufs >= 1 && spec.n_landing >= 1);
        assert!(
            spec.placement.resident_layers + spec.placement.held_layers <= spec.n_layers,
            "held layers must be streamed ones"
        );
        assert!(
            spec.placement.gpu_updated_layers == 0
                || (spec.mode == OptimMode::Exact
                    && spec.n_state_bufs >= spec.ring_depth + spec.placement.late_state_downloads),
            "GPU-updated layers need exact mode and at least ring_depth (+ late downloads) state slots"
        );
        assert!(
            spec.placement.late_state_downloads <= spec.held_gpu_updated().len(),
            "late downloads are of GPU-updated held layers"
        );
        assert!(
            spec.placement.spilled_checkpoints <= spec.n_layers
                && (spec.placement.spilled_checkpoints == 0 || spec.reload_slots >= 1),
            "spilled checkpoints are inputs of layers, reloaded through at least one buffer"
        );
        let pairs = spec.early_upload_pairs();
        assert!(
            pairs.len() == spec.placement.early_state_uploads
                && (spec.placement.early_state_uploads == 0 || spec.placement.gpu_updated_layers > 0),
            "early uploads each pair with a late download at least ring_depth layers after them"
        );
        let exact_update = spec.mode == OptimMode::Exact && spec.pending_update;
        let lean = spec.mode == OptimMode::Lean;
        let n = spec.n_layers;
        let resident = |layer: usize| layer < spec.placement.resident_layers;
        let held = |layer: usize| !resident(layer) && layer + spec.placement.held_layers >= n;
        let mut b = Builder {
            instrs: Vec::new(),
            last: LastUse::default(),
            update_of: Default::default(),
            n_fetches: 0,
            // The early slots last (and, when they hold the last step's early uploads, not at
            // all until their state has gone back).
            free_states: (0..spec.n_state_bufs).collect(),
            state_of: Default::default(),
            late_updates: Default::default(),
            late_order: (0..spec.n_layers)
                .rev()
                .filter(|&l| exact_update && spec.is_late_download(l))
                .collect(),
            late_issued: 0,
            deferred: Vec::new(),
            occupant: Default::default(),
            early_after: Default::default(),
            early_slot: (pairs.iter().enumerate())
                .map(|(i, &(e, _))| {
                    (Unit::Layer(e), spec.n_state_bufs - spec.placement.early_state_uploads + i)
                })
                .collect(),
            spilled: spec.placement.spilled_checkpoints,
            reload_slots: spec.reload_slots,
            spill_of: Default::default(),
            reload_of: Default::default(),
        };
        // Whether the early uploads go up in this step (exact mode).
        let early_uploads = spec.mode == OptimMode::Exact;
        if spec.early_ready && exact_update {
            // The last step's early uploads: their slots are free once their state has gone back.
            b.occupant.extend(b.early_slot.iter().map(|(&unit, &buf)| (buf, unit)));
            b.free_states.truncate(spec.n_state_bufs - spec.placement.early_state_uploads);
        }
        let gpu_update = |layer: usize| exact_update && spec.is_gpu_updated(layer);
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
            let k = spec.placement.resident_layers + pos;
            if k < n && held(k) {
                fetch(b, uploads, k, Slot::Held(k));
            }
        };

        // Forward order = update order: the outer unit first, then layers 0..L-1.
        let up_outer = (!spec.placement.resident_outer)
            .then(|| b.fetch(Unit::Outer, HostBuf::Outer, Slot::Outer, exact_update));
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
        if spec.placement.resident_outer && exact_update {
            b.push(Stream::Compute, Op::UpdateResident { unit: Unit::Outer }, vec![]);
        }
        let embed = b.push(Stream::Compute, Op::Embed, up_outer.into_iter().collect());
        b.spill(0, embed);
        let mut n_grads = 0usize;
        let mut j = 0usize; // ring uses so far
        for (k, &(layer, backward)) in uses.iter().enumerate() {
            if k == n {
                b.push(Stream::Compute, Op::Loss, vec![]);
                // The first reloads, one per buffer, as the backward starts.
                for i in 0..spec.reload_slots.min(spec.placement.spilled_checkpoints) {
                    b.reload(spec.placement.spilled_checkpoints - 1 - i, None);
                }
                // The backward's H2D is free from here (every streamed layer held): the early
                // uploads whose slot is empty go now, in the next forward's order; the others
                // right after the download of the late layer whose state is there.
                if early_uploads {
                    for &(e, _) in &pairs {
                        let unit = Unit::Layer(e);
                        match b.occupant.get(&b.early_slot[&unit]).copied() {
                            None => b.early_upload(unit),
                            Some(late) => {
                                assert!(
                                    b.late_updates.contains_key(&late),
                                    "{late:?}'s state was not downloaded"
                                );
                                b.early_after.insert(late, unit);
                            }
                        }
                    }
                }
            }
            let unit = Unit::Layer(layer);
            if resident(layer) {
                if !backward {
                    if exact_update {
                        b.push(Stream::Compute, Op::UpdateResident { unit }, vec![]);
                    }
                    let fwd =
                        b.push(Stream::Compute, Op::Forward { layer, slot: Slot::Resident(layer) }, vec![]);
                    b.drop_spilled(layer);
                    b.spill(layer + 1, fwd);
                } else {
                    let op = Op::Backward { layer, slot: Slot::Resident(layer), grad_buf: None };
                    let bwd =
                        b.push(Stream::Compute, op, b.reload_of.get(&layer).copied().into_iter().collect());
                    b.reload_after(layer, bwd);
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
                    b.update_streamed(unit, slot, uploads[k], spec.is_late_download(layer))
                } else {
                    uploads[k].expect("a streamed layer is fetched before its forward")
                };
                let fwd = b.push(Stream::Compute, Op::Forward { layer, slot }, vec![ready]);
                if let Slot::Ring(r) = slot {
                    b.last.take(K_SLOT, r, fwd);
                }
                b.drop_spilled(layer);
                b.spill(layer + 1, fwd);
                let (now, later): (Vec<_>, Vec<_>) =
                    std::mem::take(&mut b.deferred).into_iter().partition(|&(d, _)| uses[d].0 == layer);
                b.deferred = later;
                for (d, dslot) in now {
                    fetch(&mut b, &mut uploads, d, dslot);
                }
                fetch_held(&mut b, &mut uploads, layer - spec.placement.resident_layers + spec.ring_depth);
                if let Some(p) = prefetch {
                    fetch(&mut b, &mut uploads, ring[p], Slot::Ring(p % spec.ring_depth));
                }
                continue;
            }
            b.late_downloads_due(n_grads, n - spec.placement.resident_layers, n);
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
            waits.extend(b.reload_of.get(&layer).copied());
            let op = Op::Backward { layer, slot, grad_buf: Some(grad_buf) };
            let bwd = b.push(Stream::Compute, op, waits);
            if let Slot::Ring(r) = slot {
                b.last.take(K_SLOT, r, bwd);
            }
            b.reload_after(layer, bwd);
            if let (Some(&buf), true) = (b.early_slot.get(&unit), early_uploads) {
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
        assert!(b.early_after.is_empty(), "early uploads never issued: {:?}", b.early_after);
        if n == 0 {
            b.push(Stream::Compute, Op::Loss, vec![]);
        }
        let eb = b.push(Stream::Compute, Op::EmbedBackward, vec![]);
        if spec.placement.resident_outer {
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
}

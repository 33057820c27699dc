//! GPU-updated layers (`Placement::gpu_updated_layers` of the streamed layers, spread evenly;
//! exact mode with a pending update): their fp32 `[master | m | v]` and stored gradient go up
//! from the host record into a state slot ([`Op::UploadState`], at the distance ahead of a ring
//! fetch), [`Op::UpdateStreamed`] applies AdamW there and writes the new weights into the layer's
//! slot just before its forward, and [`Op::DownloadState`] brings master and moments back into
//! the record. The record is the host's again only once its state is back: the layer's land and
//! any backward re-cast wait for the download, and a re-cast whose prefetch would come before
//! the forward's device update is issued right after it instead.
//!
//! Of the held ones, `late_state_downloads` ([`crate::placement::Placement::is_late_download`])
//! keep their state slot into the backward and download it there, spread over it from the loss
//! on, each before its layer's land. Of the others, `early_state_uploads`
//! ([`crate::placement::Placement::early_upload_pairs`]) get their state for the next step during
//! this step's backward, each into one of the last slots once it is free (at the loss, or right
//! after the download of the late layer whose state is there): master and moments go up
//! ([`Op::UploadMoments`]), the gradient is copied on the device after the layer's backward
//! ([`Op::CopyGrad`]); a step whose early states are ready uploads nothing for them in its
//! forward, and their slots return to the free list once their state has gone back.

use std::collections::{HashMap, VecDeque};

use mt_core::Unit;

use super::{Builder, Resource};
use crate::program::{Op, OptimMode, ProgramSpec, Slot, Stream};

/// The state slots and what is in them as the walk goes.
pub(super) struct StateSlots {
    /// Slots whose state has been downloaded (or never used), least recently freed first.
    free: VecDeque<usize>,
    /// The slot each GPU-updated unit's state went to this step.
    state_of: HashMap<Unit, usize>,
    /// The unit whose state is in each slot and not yet downloaded (or, for an early upload,
    /// not yet used).
    occupant: HashMap<usize, Unit>,
    /// Late-download units updated on the device whose state is still in its slot: the update.
    late_updates: HashMap<Unit, usize>,
    /// Late-download layers in backward order (their downloads are issued in that order), and
    /// how many are issued.
    late_order: Vec<usize>,
    late_issued: usize,
    /// Backward fetches (use, slot) of GPU-updated layers whose device update is not issued yet:
    /// their re-cast must read the downloaded master, so they are issued right after it.
    deferred: Vec<(usize, Slot)>,
    /// The early-upload layers and the late one whose slot each waits for, in the early layers'
    /// order; each early unit's slot (the last `early_state_uploads`); the early unit waiting for
    /// each late unit's download.
    pairs: Vec<(usize, usize)>,
    early_slot: HashMap<Unit, usize>,
    early_after: HashMap<Unit, Unit>,
}

impl StateSlots {
    /// The slots of a step of `spec` (`update`: exact mode's pending update is applied).
    pub(super) fn new(spec: &ProgramSpec, update: bool) -> Self {
        let (n_bufs, early) = (spec.n_state_bufs, spec.placement.early_state_uploads);
        let pairs = spec.early_upload_pairs();
        let early_slot: HashMap<Unit, usize> =
            pairs.iter().enumerate().map(|(i, &(e, _))| (Unit::Layer(e), n_bufs - early + i)).collect();
        let mut s = StateSlots {
            // The early slots last (and, when they hold the last step's early uploads, not at
            // all until their state has gone back).
            free: (0..n_bufs).collect(),
            state_of: HashMap::new(),
            occupant: HashMap::new(),
            late_updates: HashMap::new(),
            late_order: (0..spec.n_layers).rev().filter(|&l| update && spec.is_late_download(l)).collect(),
            late_issued: 0,
            deferred: Vec::new(),
            pairs,
            early_slot,
            early_after: HashMap::new(),
        };
        if spec.early_ready && update {
            // The last step's early uploads: their slots are free once their state has gone back.
            s.occupant.extend(s.early_slot.iter().map(|(&unit, &buf)| (buf, unit)));
            s.free.truncate(n_bufs - early);
        }
        s
    }

    /// Every late download, early upload and deferred fetch was issued.
    pub(super) fn check_done(&self) {
        assert!(self.deferred.is_empty(), "backward fetches never issued: {:?}", self.deferred);
        assert!(self.late_updates.is_empty(), "late state downloads never issued: {:?}", self.late_updates);
        assert!(self.early_after.is_empty(), "early uploads never issued: {:?}", self.early_after);
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

impl Builder {
    /// Whether `layer`'s pending update runs on the device this step.
    fn gpu_update(&self, layer: usize) -> bool {
        self.update && self.spec.is_gpu_updated(layer)
    }

    /// Takes over fetch `k` of a GPU-updated layer: its forward's state upload (none when its
    /// early state is ready), or its backward re-cast deferred until its forward's update has
    /// sent the master back. Whether it did.
    pub(super) fn fetch_gpu_updated(&mut self, k: usize, slot: Slot) -> bool {
        let (layer, backward) = self.uses[k];
        if !self.gpu_update(layer) {
            return false;
        }
        let unit = Unit::Layer(layer);
        if !backward {
            match self.gpu.early_slot.get(&unit) {
                Some(&buf) if self.spec.early_ready => {
                    self.gpu.state_of.insert(unit, buf);
                }
                _ => self.uploads[k] = Some(self.upload_state(unit)),
            }
            return true;
        }
        if !self.update_of.contains_key(&unit) {
            // Its prefetch comes before its forward's device update (the last forward layers'
            // backward is the next ring use): issued after that update instead.
            self.gpu.deferred.push((k, slot));
            return true;
        }
        false
    }

    /// Upload of a GPU-updated unit's state into the least recently freed state slot; returns
    /// the upload's id.
    fn upload_state(&mut self, unit: Unit) -> usize {
        let buf = self.gpu.free.pop_front().unwrap_or_else(|| {
            panic!("no state slot free for {unit:?}: every one holds a state not yet downloaded")
        });
        self.gpu.occupy(buf, unit);
        self.gpu.state_of.insert(unit, buf);
        // The previous download out of this slot must be done before it is overwritten.
        let previous = self.last.of(Resource::StateSlot(buf));
        self.push(Stream::H2D, Op::UploadState { unit, buf }, previous.into_iter().collect())
    }

    /// What streamed `layer`'s forward waits for: its weights' upload, or (GPU-updated) its
    /// device update into `slot` after its state's upload, followed, unless it downloads late,
    /// by the state's download.
    pub(super) fn weights_ready(&mut self, layer: usize, slot: Slot) -> usize {
        let up = self.uploads[self.use_of(layer, false)];
        if !self.gpu_update(layer) {
            return up.expect("a streamed layer is fetched before its forward");
        }
        let unit = Unit::Layer(layer);
        let buf = self.gpu.state_of[&unit];
        let upd =
            self.push(Stream::Compute, Op::UpdateStreamed { unit, buf, slot }, up.into_iter().collect());
        if self.spec.is_late_download(layer) {
            self.gpu.late_updates.insert(unit, upd);
        } else {
            self.download_state(unit, upd);
        }
        upd
    }

    /// After `layer`'s forward: the backward fetches deferred until its device update.
    pub(super) fn fetch_deferred(&mut self, layer: usize) {
        let uses = &self.uses;
        let (now, later): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.gpu.deferred).into_iter().partition(|&(d, _)| uses[d].0 == layer);
        self.gpu.deferred = later;
        for (d, slot) in now {
            self.fetch(d, slot);
        }
    }

    /// The download of a GPU-updated unit's state after its update `upd`; frees its slot.
    fn download_state(&mut self, unit: Unit, upd: usize) {
        let buf = self.gpu.state_of[&unit];
        let dl = self.push(Stream::D2H, Op::DownloadState { unit, buf }, vec![upd]);
        self.last.take(Resource::StateSlot(buf), dl);
        self.gpu.occupant.remove(&buf);
        self.gpu.free.push_back(buf);
        // Landing overwrites the record's gradient and a backward re-cast reads its master:
        // both after the state is back (and the record marked updated, so that a retried step
        // never updates it twice from a new gradient).
        self.update_of.insert(unit, dl);
    }

    /// The late state downloads due at the backward's next streamed position `p` (the gradients
    /// offloaded so far) of `n_layers - resident_layers`: the `k`-th (in backward order) at
    /// position `k × positions / late` — spread over the backward from its start (the loss), so
    /// the D2H interleaves them with the gradients and none is left for the end of the step — or
    /// at its own layer's position (its land waits for it), whichever comes first.
    pub(super) fn late_downloads_due(&mut self) {
        let (p, n) = (self.n_grads, self.spec.n_layers);
        let positions = n - self.spec.placement.resident_layers;
        let late = self.gpu.late_order.len();
        while let Some(&layer) = self.gpu.late_order.get(self.gpu.late_issued) {
            let own = n - 1 - layer; // its backward position
            if p < self.gpu.late_issued * positions / late && p < own {
                break;
            }
            let unit = Unit::Layer(layer);
            let upd = self
                .gpu
                .late_updates
                .remove(&unit)
                .expect("a late download's update was issued in the forward");
            self.download_state(unit, upd);
            self.gpu.late_issued += 1;
            if let Some(early) = self.gpu.early_after.remove(&unit) {
                self.early_upload(early);
            }
        }
    }

    /// At the loss, the backward's H2D is free (every streamed layer held): the early uploads
    /// whose slot is empty go now, in the next forward's order; the others right after the
    /// download of the late layer whose state is there.
    pub(super) fn early_uploads_at_loss(&mut self) {
        if self.spec.mode != OptimMode::Exact {
            return;
        }
        for (e, _) in self.gpu.pairs.clone() {
            let unit = Unit::Layer(e);
            match self.gpu.occupant.get(&self.gpu.early_slot[&unit]).copied() {
                None => self.early_upload(unit),
                Some(late) => {
                    assert!(self.gpu.late_updates.contains_key(&late), "{late:?}'s state was not downloaded");
                    self.gpu.early_after.insert(late, unit);
                }
            }
        }
    }

    /// The upload, for the next step, of an early-upload unit's master and moments into its
    /// slot, after the slot's last download this step (issued after a late one's) and after the
    /// unit's own updated state is back in the record (its download this step, which may have
    /// gone out of another slot: a step whose early states were not ready fetched it from the
    /// free list).
    fn early_upload(&mut self, unit: Unit) {
        let buf = self.gpu.early_slot[&unit];
        self.gpu.occupy(buf, unit);
        let previous = self.last.of(Resource::StateSlot(buf));
        let waits = previous.into_iter().chain(self.update_of.get(&unit).copied()).collect();
        let up = self.push(Stream::H2D, Op::UploadMoments { unit, buf }, waits);
        self.last.take(Resource::StateSlot(buf), up);
    }

    /// After an early-upload layer's backward: the gradient its land stores, copied into its
    /// slot for the next step's update (compute order: after this step's update read the slot's
    /// previous one).
    pub(super) fn copy_grad(&mut self, layer: usize, grad_buf: usize) {
        let unit = Unit::Layer(layer);
        if let (Some(&buf), OptimMode::Exact) = (self.gpu.early_slot.get(&unit), self.spec.mode) {
            let narrowed = self.spec.narrow_grads;
            self.push(Stream::Compute, Op::CopyGrad { unit, grad_buf, buf, narrowed }, vec![]);
        }
    }
}

#[cfg(test)]
mod tests {
    use mt_core::Unit;

    use crate::placement::Placement;
    use crate::program::tests::spec_with;
    use crate::program::{Op, OptimMode, Program, Stream};

    /// Alone (no held, late or early layers), a GPU-updated layer's state goes up once before its
    /// update, which writes its forward weights (no forward upload), and back once right after
    /// it; its backward re-cast and its land wait for that download.
    #[test]
    fn a_gpu_updated_layer_moves_its_state_up_and_back_in_the_forward() {
        for (n, g, ring) in [(1, 1, 1), (4, 2, 2), (5, 5, 2), (6, 3, 3)] {
            let spec = spec_with(
                n,
                ring,
                OptimMode::Exact,
                Placement { gpu_updated_layers: g, ..Placement::default() },
            );
            let p = Program::build(spec);
            for l in (0..n).filter(|&l| spec.is_gpu_updated(l)) {
                let unit = Unit::Layer(l);
                let at = |f: &dyn Fn(&Op) -> bool| -> Vec<usize> {
                    (0..p.instrs.len()).filter(|&i| f(&p.instrs[i].op)).collect()
                };
                let [up] = at(&|o| matches!(*o, Op::UploadState { unit: u, .. } if u == unit))[..] else {
                    panic!("{spec:?}: one state upload of {unit:?}")
                };
                let [upd] = at(&|o| matches!(*o, Op::UpdateStreamed { unit: u, .. } if u == unit))[..] else {
                    panic!("{spec:?}: one device update of {unit:?}")
                };
                let [dl] = at(&|o| matches!(*o, Op::DownloadState { unit: u, .. } if u == unit))[..] else {
                    panic!("{spec:?}: one state download of {unit:?}")
                };
                let fwd = at(&|o| matches!(*o, Op::Forward { layer, .. } if layer == l))[0];
                assert!(p.instrs[upd].waits.contains(&up) && p.instrs[dl].waits == vec![upd], "{spec:?}");
                assert!(
                    p.instrs[fwd].waits == vec![upd] && p.instrs[upd].stream == Stream::Compute,
                    "{spec:?}"
                );
                // The one upload of its weights is the backward's re-cast, after the state is back.
                let stages = at(&|o| matches!(*o, Op::Stage { unit: u, .. } if u == unit));
                assert_eq!(stages.len(), 1, "{spec:?}: {unit:?}");
                assert!(p.instrs[stages[0]].waits.contains(&dl), "{spec:?}: {unit:?}'s re-cast");
                let land = at(&|o| matches!(*o, Op::Land { unit: u, .. } if u == unit))[0];
                assert!(p.instrs[land].waits.contains(&dl), "{spec:?}: {unit:?}'s land");
            }
        }
    }
}

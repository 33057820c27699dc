//! Spilled checkpoints (`Placement::spilled_checkpoints`: boundaries `0..k`, the inputs of the
//! first `k` layers, produced first and needed last) leave the device once the forward has read
//! them: each goes down to page-locked host memory right after the op that produced it
//! ([`Op::SpillCheckpoint`], on the D2H stream, beside the next layer's forward), its device copy
//! is freed after that layer's forward ([`Op::DropCheckpoint`], once the copy is done), and it
//! comes back up in the backward ([`Op::ReloadCheckpoint`]) into one of `reload_slots` device
//! buffers, `reload_slots` backward layers ahead of the layer that reads it (whose
//! [`Op::Backward`] names that buffer: [`BackwardInput::Reload`]; a checkpoint that is not spilled
//! is read and freed by its backward, [`BackwardInput::Checkpoint`]).

use std::collections::HashMap;

use super::Builder;
#[cfg(doc)]
use crate::program::BackwardInput;
use crate::program::{reload_slot, Op, Stream};

/// Each spilled boundary's spill, and its reload (with the buffer it goes into) once issued.
#[derive(Default)]
pub(super) struct Spills {
    spill_of: HashMap<usize, usize>,
    reload_of: HashMap<usize, (usize, usize)>,
}

impl Builder {
    /// After `producer` wrote boundary `boundary`: its spill, if it is a spilled one.
    pub(super) fn spill(&mut self, boundary: usize, producer: usize) {
        if boundary < self.spec.placement.spilled_checkpoints {
            let id = self.push(Stream::D2H, Op::SpillCheckpoint { boundary }, vec![producer]);
            self.spill.spill_of.insert(boundary, id);
        }
    }

    /// After forward `fwd` of `layer`: its input's device copy freed if it was spilled (once the
    /// spill is done), its output spilled if it is a spilled boundary.
    pub(super) fn checkpoints_after_forward(&mut self, layer: usize, fwd: usize) {
        if let Some(&spill) = self.spill.spill_of.get(&layer) {
            self.push(Stream::Compute, Op::DropCheckpoint { boundary: layer }, vec![spill]);
        }
        self.spill(layer + 1, fwd);
    }

    /// As the backward starts: the first reloads, one per buffer.
    pub(super) fn first_reloads(&mut self) {
        let spilled = self.spec.placement.spilled_checkpoints;
        for i in 0..self.spec.reload_slots.min(spilled) {
            self.reload(spilled - 1 - i, None);
        }
    }

    /// The reload of spilled boundary `boundary` into its buffer ([`reload_slot`]: the reloads'
    /// order is the backward's), after its spill and after `previous`, the backward that last
    /// read that buffer.
    fn reload(&mut self, boundary: usize, previous: Option<usize>) {
        let slot = reload_slot(self.spec.placement.spilled_checkpoints, self.spec.reload_slots, boundary);
        let waits = self.spill.spill_of.get(&boundary).copied().into_iter().chain(previous).collect();
        let id = self.push(Stream::H2D, Op::ReloadCheckpoint { boundary, slot }, waits);
        self.spill.reload_of.insert(boundary, (id, slot));
    }

    /// The reload `layer`'s backward waits for, if its input was spilled.
    pub(super) fn reload_of(&self, layer: usize) -> Option<usize> {
        self.spill.reload_of.get(&layer).map(|&(id, _)| id)
    }

    /// The reload buffer `layer`'s backward reads its input from, if that input was spilled
    /// (its reload issued).
    pub(super) fn reloaded_into(&self, layer: usize) -> Option<usize> {
        self.spill.reload_of.get(&layer).map(|&(_, slot)| slot)
    }

    /// After the backward `bwd` of `layer`: the reload that takes over its reload buffer.
    pub(super) fn reload_after(&mut self, layer: usize, bwd: usize) {
        let slots = self.spec.reload_slots;
        if layer < self.spec.placement.spilled_checkpoints && layer >= slots {
            self.reload(layer - slots, Some(bwd));
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::placement::Placement;
    use crate::program::tests::spec_with;
    use crate::program::{Op, OptimMode, Program, ProgramSpec};

    /// Alone, spilling sends each spilled boundary down once after the op that wrote it, frees
    /// it after the forward that read it, and brings it back once, before the backward that reads
    /// it and after the backward that last read its reload buffer.
    #[test]
    fn a_spilled_checkpoint_goes_down_once_and_comes_back_before_its_backward() {
        for (n, k, slots) in [(1, 1, 1), (4, 1, 2), (4, 4, 1), (5, 5, 2), (5, 3, 2)] {
            let spec = ProgramSpec {
                reload_slots: slots,
                ..spec_with(
                    n,
                    2,
                    OptimMode::Exact,
                    Placement { spilled_checkpoints: k, ..Placement::default() },
                )
            };
            let p = Program::build(spec);
            let find = |f: &dyn Fn(&Op) -> bool| {
                let at: Vec<usize> = (0..p.instrs.len()).filter(|&i| f(&p.instrs[i].op)).collect();
                assert_eq!(at.len(), 1, "{spec:?}");
                at[0]
            };
            for b in 0..n {
                let bwd = find(&|o| matches!(*o, Op::Backward { layer, .. } if layer == b));
                if b >= k {
                    assert!(!p
                        .instrs
                        .iter()
                        .any(|i| matches!(i.op, Op::SpillCheckpoint { boundary } if boundary == b)));
                    continue;
                }
                let spill = find(&|o| matches!(*o, Op::SpillCheckpoint { boundary } if boundary == b));
                let drop = find(&|o| matches!(*o, Op::DropCheckpoint { boundary } if boundary == b));
                let reload = find(&|o| matches!(*o, Op::ReloadCheckpoint { boundary, .. } if boundary == b));
                let fwd = find(&|o| matches!(*o, Op::Forward { layer, .. } if layer == b));
                assert!(spill < fwd && fwd < drop && p.instrs[drop].waits.contains(&spill), "{spec:?}: {b}");
                assert!(
                    p.instrs[reload].waits.contains(&spill) && p.instrs[bwd].waits.contains(&reload),
                    "{spec:?}: {b}"
                );
            }
        }
    }
}

//! Resident units (`Placement::resident_outer`, `Placement::resident_layers`): their weights sit
//! in their own slot ([`Slot::Resident`]), their gradient accumulates in their own buffer, and
//! [`Op::UpdateResident`] applies their AdamW step on the compute stream (exact mode: the pending
//! update, just before their first use in the step; lean mode: this step's, at the step's end,
//! each only if its gradient is finite, as the host's lean updates are; decision 0030). They
//! never cross the bus: no stage, upload, download or land; their share of the global norm is
//! taken on the device.

use mt_core::Unit;

use super::Builder;
use crate::program::{Op, OptimMode, Slot, Stream};

impl Builder {
    /// Resident `layer`'s forward, after its pending update.
    pub(super) fn resident_forward(&mut self, layer: usize) {
        if self.update {
            self.push(
                Stream::Compute,
                Op::UpdateResident { unit: Unit::Layer(layer), if_finite: false },
                vec![],
            );
        }
        let op = Op::Forward { layer, slot: Slot::Resident(layer), keep: self.keeps(layer) };
        let fwd = self.push(Stream::Compute, op, vec![]);
        self.checkpoints_after_forward(layer, fwd);
    }

    /// Resident `layer`'s backward into its own gradient buffer (after its input's reload).
    pub(super) fn resident_backward(&mut self, layer: usize) {
        let op = Op::Backward {
            layer,
            slot: Slot::Resident(layer),
            grad_buf: None,
            input: self.backward_input(layer),
        };
        let bwd = self.push(Stream::Compute, op, self.reload_of(layer).into_iter().collect());
        self.gradient_done(Unit::Layer(layer), None, bwd);
        self.reload_after(layer, bwd);
    }

    /// A resident outer unit's pending update, before the embedding.
    pub(super) fn update_resident_outer(&mut self) {
        if self.spec.placement.resident_outer && self.update {
            self.push(Stream::Compute, Op::UpdateResident { unit: Unit::Outer, if_finite: false }, vec![]);
        }
    }

    /// Lean mode's updates of the resident units, at the step's end (every unit's share of the
    /// norm is known there), in the order their backward ended: the layers last to first, then
    /// the outer unit.
    pub(super) fn update_resident_at_end(&mut self) {
        if self.spec.mode != OptimMode::Lean {
            return;
        }
        let layers = (0..self.spec.placement.resident_layers).rev().map(Unit::Layer);
        let outer = self.spec.placement.resident_outer.then_some(Unit::Outer);
        for unit in layers.chain(outer) {
            self.push(Stream::Compute, Op::UpdateResident { unit, if_finite: true }, vec![]);
        }
    }
}

#[cfg(test)]
mod tests {
    use mt_core::Unit;

    use crate::placement::Placement;
    use crate::program::tests::spec_with;
    use crate::program::{Op, OptimMode, Program, Stream};

    /// Alone, residency takes every resident unit off the copy streams and the host, and
    /// updates each once, on the compute stream, where the mode says.
    #[test]
    fn resident_units_never_cross_the_bus_and_are_updated_on_the_device() {
        for mode in [OptimMode::Exact, OptimMode::Lean] {
            for (n, k, outer) in [(3, 3, true), (4, 1, false), (4, 2, true)] {
                let spec = spec_with(
                    n,
                    2,
                    mode,
                    Placement { resident_outer: outer, resident_layers: k, ..Placement::default() },
                );
                let p = Program::build(spec);
                let resident = |u: Unit| match u {
                    Unit::Outer => outer,
                    Unit::Layer(l) => l < k,
                };
                for (i, ins) in p.instrs.iter().enumerate() {
                    let unit = match ins.op {
                        Op::Stage { unit, .. }
                        | Op::Upload { unit, .. }
                        | Op::Download { unit, .. }
                        | Op::Land { unit, .. } => unit,
                        Op::UpdateResident { unit, .. } => {
                            assert!(resident(unit) && ins.stream == Stream::Compute, "{spec:?}: {i}");
                            continue;
                        }
                        _ => continue,
                    };
                    assert!(!resident(unit), "{spec:?}: instruction {i} moves resident {unit:?}");
                }
                let updates = p.instrs.iter().filter(|i| matches!(i.op, Op::UpdateResident { .. })).count();
                assert_eq!(updates, k + usize::from(outer), "{spec:?}");
            }
        }
    }
}

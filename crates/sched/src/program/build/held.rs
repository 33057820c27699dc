//! Held layers (`Placement::held_layers`, the last streamed ones): uploaded once a step, for
//! their forward, into their own slot ([`Slot::Held`]), where their backward finds them: no
//! second stage or upload, no ring slot.

use super::Builder;
use crate::program::Slot;

impl Builder {
    /// The held layer at streamed forward position `pos` (the `pos`-th layer after the resident
    /// ones), if it is one, fetched into its own slot as a ring use would be.
    pub(super) fn fetch_held(&mut self, pos: usize) {
        let layer = self.spec.placement.resident_layers + pos;
        if layer < self.spec.n_layers && self.spec.is_held(layer) {
            self.fetch(self.use_of(layer, false), Slot::Held(layer));
        }
    }

    /// After `layer`'s forward: the held layer `ring_depth` streamed forward positions ahead.
    pub(super) fn fetch_held_ahead(&mut self, layer: usize) {
        self.fetch_held(layer - self.spec.placement.resident_layers + self.spec.ring_depth);
    }

    /// The upload streamed `layer`'s backward waits for: its backward fetch's, or none for a held
    /// layer, whose weights are in its slot since its forward (earlier on the compute stream).
    pub(super) fn weights_fetched(&self, layer: usize) -> Option<usize> {
        if self.spec.is_held(layer) {
            return None;
        }
        Some(self.uploads[self.use_of(layer, true)].expect("a streamed layer is fetched before its backward"))
    }
}

#[cfg(test)]
mod tests {
    use mt_core::Unit;

    use crate::placement::Placement;
    use crate::program::tests::spec_with;
    use crate::program::{Op, OptimMode, Program, Slot};

    /// Alone, holding turns the last layers' two uploads into one, into their own slot, which
    /// both their forward and their backward read.
    #[test]
    fn a_held_layer_is_uploaded_once_into_its_own_slot() {
        for (n, h) in [(1, 1), (4, 1), (4, 4), (6, 3)] {
            let p = Program::build(spec_with(
                n,
                2,
                OptimMode::Exact,
                Placement { held_layers: h, ..Placement::default() },
            ));
            for l in 0..n {
                let unit = Unit::Layer(l);
                let uploads: Vec<Slot> = p
                    .instrs
                    .iter()
                    .filter_map(|i| match i.op {
                        Op::Upload { unit: u, slot, .. } if u == unit => Some(slot),
                        _ => None,
                    })
                    .collect();
                let computes = p.instrs.iter().filter_map(|i| match i.op {
                    Op::Forward { layer, slot, .. } | Op::Backward { layer, slot, .. } if layer == l => {
                        Some(slot)
                    }
                    _ => None,
                });
                if l + h >= n {
                    assert_eq!(uploads, vec![Slot::Held(l)], "{n}/{h}: layer {l}");
                    assert!(computes.into_iter().all(|s| s == Slot::Held(l)), "{n}/{h}: layer {l}");
                } else {
                    assert_eq!(uploads.len(), 2, "{n}/{h}: layer {l}");
                    assert!(uploads.iter().all(|s| matches!(s, Slot::Ring(_))), "{n}/{h}: layer {l}");
                }
            }
        }
    }
}

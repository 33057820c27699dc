//! The placement as a table: one row per decoder layer ([`Placement::table`], the layers picked
//! as the step program picks them) and the outer unit's, printed compactly (layers as ranges) in
//! the words of the device a run computes on ([`PlacementTable::display_on`]).

use std::fmt;

use super::Placement;

/// The kind of device a run computes on, for the words a plan is printed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU backend: the "device" buffers are host memory and copies are memory copies.
    Cpu,
    /// A CUDA GPU behind PCIe.
    Gpu,
}

impl DeviceKind {
    /// How the device is named in a plan: `GPU`, or `device` on the CPU backend.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "device",
            DeviceKind::Gpu => "GPU",
        }
    }
}

/// Where a decoder layer's weights are during a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Weights {
    /// On the device for the whole run, with its fp32 gradient, master weights and moments.
    Resident,
    /// Streamed, uploaded once a step (for its forward) and held on the device until its backward.
    Held,
    /// Streamed through the ring: uploaded for its forward and again for its backward.
    Streamed,
}

/// Where a decoder layer's AdamW update runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Update {
    /// On the host, over the store record (the host optimizer).
    Host,
    /// On the device: a resident layer's state lives there; a GPU-updated layer's goes up for it.
    Device,
}

/// How a decoder layer's optimizer state (fp32 master, m, v) moves in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StateMove {
    /// It stays where the update runs: in the host store, or on the device for a resident layer.
    Stays,
    /// A GPU-updated layer's: up before its forward, back right after its update.
    UpAndBackInForward,
    /// A GPU-updated, held layer's: up before its forward, back during the backward (late).
    BackInBackward,
    /// A GPU-updated layer's: up during the previous step's backward (early), back in the forward.
    UpInBackward,
}

/// One decoder layer's placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerPlacement {
    /// Where its weights are.
    pub weights: Weights,
    /// Its forward keeps the activations its backward needs (no recompute).
    pub kept: bool,
    /// Where its AdamW update runs.
    pub update: Update,
    /// How its optimizer state moves.
    pub state: StateMove,
}

impl Placement {
    /// One row per layer of a model of `n_layers` decoder layers whose step has `ring_depth`
    /// weight slots, the layers picked as the step program picks them.
    pub fn table(&self, n_layers: usize, ring_depth: usize) -> PlacementTable {
        let early = self.early_upload_layers(n_layers, ring_depth);
        let layers = (0..n_layers)
            .map(|l| {
                let weights = if self.is_resident(l) {
                    Weights::Resident
                } else if self.is_held(n_layers, l) {
                    Weights::Held
                } else {
                    Weights::Streamed
                };
                let gpu_updated = self.is_gpu_updated(n_layers, l);
                let state = if !gpu_updated {
                    StateMove::Stays
                } else if self.is_late_download(n_layers, l) {
                    StateMove::BackInBackward
                } else if early.contains(&l) {
                    StateMove::UpInBackward
                } else {
                    StateMove::UpAndBackInForward
                };
                let update =
                    if weights == Weights::Resident || gpu_updated { Update::Device } else { Update::Host };
                LayerPlacement { weights, kept: l < self.kept_layers, update, state }
            })
            .collect();
        PlacementTable { outer_resident: self.resident_outer, layers }
    }
}

/// Every decoder layer's placement, in layer order, and the outer unit's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementTable {
    /// The outer unit (embedding, final norm, LM head) keeps its optimizer state on the device
    /// and is updated there; otherwise it streams like a layer and is updated on the host.
    pub outer_resident: bool,
    /// Decoder layer `i`'s placement at index `i`.
    pub layers: Vec<LayerPlacement>,
}

impl PlacementTable {
    /// Distinct placements in order of their first layer, each with its layers.
    pub fn groups(&self) -> Vec<(LayerPlacement, Vec<usize>)> {
        let mut out: Vec<(LayerPlacement, Vec<usize>)> = Vec::new();
        for (l, p) in self.layers.iter().enumerate() {
            match out.iter_mut().find(|(q, _)| q == p) {
                Some((_, ls)) => ls.push(l),
                None => out.push((*p, vec![l])),
            }
        }
        out
    }

    /// The table in the words of `device`: one row per distinct placement, its layers as ranges.
    pub fn display_on(&self, device: DeviceKind) -> impl fmt::Display + '_ {
        TableDisplay { table: self, device }
    }
}

struct TableDisplay<'a> {
    table: &'a PlacementTable,
    device: DeviceKind,
}

impl fmt::Display for TableDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dev = self.device.name();
        let t = self.table;
        let outer =
            if t.outer_resident { format!("resident, AdamW on the {dev}") } else { "streamed".into() };
        write!(f, "placement of {} decoder layers (outer unit: {outer}):", t.layers.len())?;
        let mut rows = vec![[
            "layers".to_string(),
            "weights".into(),
            "activations".into(),
            "AdamW".into(),
            "optimizer state".into(),
        ]];
        for (p, layers) in t.groups() {
            rows.push([
                ranges(&layers),
                match p.weights {
                    Weights::Resident => "resident".into(),
                    Weights::Held => "held (up once)".into(),
                    Weights::Streamed => "streamed (up twice)".into(),
                },
                if p.kept { "kept" } else { "recomputed" }.into(),
                match p.update {
                    Update::Host => "host".into(),
                    Update::Device => dev.into(),
                },
                match (p.state, p.weights) {
                    (StateMove::Stays, Weights::Resident) => format!("on the {dev}"),
                    (StateMove::Stays, _) => "host store".into(),
                    (StateMove::UpAndBackInForward, _) => "up and back in the forward".into(),
                    (StateMove::BackInBackward, _) => "up in the forward, back in the backward".into(),
                    (StateMove::UpInBackward, _) => "up in the previous backward, back in the forward".into(),
                },
            ]);
        }
        let widths: Vec<usize> = (0..5).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0)).collect();
        for r in &rows {
            write!(f, "\n ")?;
            for (c, cell) in r.iter().enumerate() {
                if c + 1 == r.len() {
                    write!(f, " {cell}")?;
                } else {
                    write!(f, " {cell:<w$} ", w = widths[c])?;
                }
            }
        }
        Ok(())
    }
}

/// `0-3,5,7-8`: sorted layer numbers as ranges.
fn ranges(layers: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        out.push(if j == i { layers[i].to_string() } else { format!("{}-{}", layers[i], layers[j]) });
        i = j + 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_join_runs_of_consecutive_layers() {
        assert_eq!(ranges(&[0, 1, 2, 3, 5, 7, 8]), "0-3,5,7-8");
        assert_eq!(ranges(&[4]), "4");
        assert_eq!(ranges(&[]), "");
    }
}

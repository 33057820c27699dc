//! The plan as a run prints it, in the words of the device it runs on: the step's shape, the
//! per-layer placement table, the bytes per place, the copies per step and the model FLOPs. On
//! the CPU backend the "device" buffers are host memory and the copies are memory copies, so
//! nothing there speaks of a GPU or of PCIe.

use std::fmt;

use super::{gib, Plan};
use crate::placement::{DeviceKind, PlacementTable};

impl Plan {
    /// The per-layer placement this plan decided, the layers picked as the step program picks them.
    pub fn placement_table(&self) -> PlacementTable {
        self.placement.table(self.n_layers, self.ring_depth)
    }

    /// The plan as printed for a run on `device` (`Display` of a plan prints it for a GPU).
    pub fn display_on(&self, device: DeviceKind) -> impl fmt::Display + '_ {
        PlanDisplay { plan: self, device }
    }
}

struct PlanDisplay<'a> {
    plan: &'a Plan,
    device: DeviceKind,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        PlanDisplay { plan: self, device: DeviceKind::Gpu }.fmt(f)
    }
}

/// `b` bytes in MiB below a GiB, else in GiB.
fn human(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", gib(b))
    } else {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// `name size` for each non-zero size, joined by ` | `.
fn sizes(items: &[(&str, u64)]) -> String {
    items
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(n, b)| format!("{n} {}", human(*b)))
        .collect::<Vec<_>>()
        .join(" | ")
}

impl fmt::Display for PlanDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (p, dev) = (self.plan, self.device.name());
        let (g, h) = (&p.gpu, &p.host);
        let chunks = if p.n_chunks == 1 {
            format!("1 chunk of {} sequences", p.seqs_per_chunk)
        } else {
            format!("{} chunks of up to {} sequences", p.n_chunks, p.seqs_per_chunk)
        };
        let checkpoints = match p.placement.spilled_checkpoints {
            0 => format!("on the {dev}"),
            k => format!(
                "on the {dev} but the first {k} layers' inputs, which go to host memory after their forward and back for their backward"
            ),
        };
        writeln!(
            f,
            "step: {} x {} tokens in {chunks}; ring depth {}; {} attention; MLP{} in {}; layer checkpoints {checkpoints}",
            p.batch,
            p.seq,
            p.ring_depth,
            match (p.flash_attention, p.hopper_attention) {
                (true, true) => "flash (Hopper kernels)",
                (true, false) => "flash",
                (false, _) => "materialised",
            },
            if p.moe_kernels { " (experts on the device MoE kernels)" } else { "" },
            if p.mlp_rows == 0 { "whole chunks".to_string() } else { format!("tiles of {} rows", p.mlp_rows) },
        )?;
        writeln!(f, "{}", p.placement_table().display_on(self.device))?;
        let device_bytes = sizes(&[
            ("ring", g.weight_ring),
            ("held", g.held),
            ("outer", g.outer),
            ("grads", g.grads),
            ("outer state", g.outer_state),
            ("resident layers", g.resident_layers),
            ("state slots", g.state_slots),
            ("checkpoints", g.checkpoints),
            ("kept activations", g.kept),
            ("act grads", g.act_grads),
            ("workspace", g.workspace),
        ]);
        let total = format!("total {} of {} usable", human(g.total), human(g.budget));
        match self.device {
            DeviceKind::Gpu => writeln!(f, "GPU memory: {device_bytes} | {total}")?,
            DeviceKind::Cpu => writeln!(f, "device buffers (in host memory): {device_bytes} | {total}")?,
        }
        let rings = match self.device {
            DeviceKind::Gpu => "pinned rings",
            DeviceKind::Cpu => "staging/landing rings",
        };
        writeln!(
            f,
            "host memory: {}",
            sizes(&[
                (if h.store_window.is_some() { "store (paged from its file)" } else { "store" }, h.store),
                ("store window in RAM", h.store_window.unwrap_or(0)),
                (&format!("frozen base ({})", p.base.dtype), h.frozen_base),
                (rings, h.pinned - h.spilled_checkpoints),
                ("spilled checkpoints", h.spilled_checkpoints),
                ("total", h.total),
                ("given back by resident units", h.released_by_resident)
            ])
        )?;
        let copies = match self.device {
            DeviceKind::Gpu => "PCIe per step",
            DeviceKind::Cpu => "copies per step between host and device buffers",
        };
        writeln!(
            f,
            "{copies}: H2D {} B ({}), D2H {} B ({})",
            p.pcie_h2d_per_step,
            human(p.pcie_h2d_per_step),
            p.pcie_d2h_per_step,
            human(p.pcie_d2h_per_step)
        )?;
        let trained = if p.trainable_params < p.n_params {
            format!(", {} of them trained (the adapters; the base is frozen)", p.trainable_params)
        } else {
            String::new()
        };
        write!(
            f,
            "model FLOPs per step: {:.4e} (6·N·T + 6·L·s·hidden·T); {} parameters{trained}",
            p.flops_per_step, p.n_params
        )
    }
}

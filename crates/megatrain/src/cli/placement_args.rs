//! The placement overrides of `megatrain train` and `megatrain estimate`: one flag per setting of
//! `mt_sched::Placement`, `auto` or a value, parsed into an [`mt_train::PlacementChoice`].

use clap::Args;
use mt_train::PlacementChoice;

use super::values::layer_count;
use super::{LayerCount, ResidentOuter};

/// The `--help` heading of the placement overrides.
pub(super) const PLACEMENT: &str =
    "Placement (auto: the planner decides; nothing on the GPU when on the CPU)";

/// The placement overrides (what each does: `mt_sched::Placement`, ARCHITECTURE.md "Placement").
#[derive(Debug, Clone, Args)]
pub struct PlacementArgs {
    /// The outer unit's (embedding, norm, head) AdamW state on the GPU [auto: if it costs no chunk].
    #[arg(long, value_enum, default_value_t = ResidentOuter::Auto, help_heading = PLACEMENT, value_name = "auto|on|off", hide_possible_values = true, hide_default_value = true)]
    pub resident_outer: ResidentOuter,

    /// Leading layers resident on the GPU with their AdamW state.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count, help_heading = PLACEMENT, hide_default_value = true)]
    pub resident_layers: LayerCount,

    /// Last streamed layers uploaded once a step, held from forward to backward.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count, help_heading = PLACEMENT, hide_default_value = true)]
    pub held_layers: LayerCount,

    /// Leading layers that keep their activations for the backward (no recompute).
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count, help_heading = PLACEMENT, hide_default_value = true)]
    pub kept_layers: LayerCount,

    /// Streamed layers whose AdamW runs on the GPU from their streamed state (exact mode).
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count, help_heading = PLACEMENT, hide_default_value = true)]
    pub gpu_updated_layers: LayerCount,

    /// GPU-updated held layers that bring their state back late, in the backward.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count, help_heading = PLACEMENT, hide_default_value = true)]
    pub late_state_downloads: LayerCount,

    /// GPU-updated layers whose next state goes up early, in this step's backward.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count, help_heading = PLACEMENT, hide_default_value = true)]
    pub early_state_uploads: LayerCount,

    /// Leading layers whose input checkpoint goes to host memory after their forward and back
    /// for their backward [auto: the fewest with which the step fits the GPU; 0 on the CPU].
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = layer_count, help_heading = "Long sequences", hide_default_value = true)]
    pub spill_checkpoints: LayerCount,
}

impl PlacementArgs {
    /// The placement these flags ask for.
    pub fn choice(&self) -> PlacementChoice {
        PlacementChoice {
            resident_outer: self.resident_outer.choice(),
            resident_layers: self.resident_layers.choice(),
            held_layers: self.held_layers.choice(),
            kept_layers: self.kept_layers.choice(),
            gpu_updated_layers: self.gpu_updated_layers.choice(),
            late_state_downloads: self.late_state_downloads.choice(),
            early_state_uploads: self.early_state_uploads.choice(),
            spilled_checkpoints: self.spill_checkpoints.choice(),
        }
    }
}

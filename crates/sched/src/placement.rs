//! The placement (`mt_core::placement`, re-exported here: one type from the command line to the
//! program and the device pool) and what mt-sched says about it beyond the type: why a count of
//! early state uploads is refused, in the words the planner and the engine's checks share.

pub use mt_core::placement::{
    DeviceKind, LayerPlacement, Placement, PlacementChoice, PlacementTable, StateMove, Update, Weights,
};

/// Why `asked` early state uploads are refused when only `capable` of the `late` late-download
/// layers have a partner (the planner and the engine's option checks say the same).
pub(crate) fn early_refusal(asked: usize, capable: usize, late: usize, ring_depth: usize) -> String {
    if late == 0 {
        return format!(
            "{asked} early state uploads asked, but no layer downloads its state late: each early upload needs a late-download layer (a held GPU-updated one) at least ring_depth = {ring_depth} layers after it, as there are no more state slots than ring_depth + late downloads; use --late-state-downloads (with --held-layers and --gpu-updated-layers) or --early-state-uploads 0"
        );
    }
    format!(
        "{asked} early state uploads asked, but only {capable} of the {late} late-download layers have a partner (a GPU-updated layer that does not download late, at least ring_depth = {ring_depth} layers before it): there are no more state slots than ring_depth + late downloads, and each early layer's slot stays taken in the forward until its state has gone back; use more --late-state-downloads or fewer early ones"
    )
}

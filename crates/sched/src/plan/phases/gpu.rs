//! Phase 6 of the planner (`phases/mod.rs`): the GPU-updated layers, their late state downloads
//! and early state uploads, and their state slots' bytes.

use super::*;

/// Phase 6: GPU-updated layers (their state slots take what holding leaves, before kept
/// activations: they take host work off a streamed step, which is what limits it), their late
/// downloads and early uploads. Places them beside the resident and held layers in `placed`, adds
/// the state slots' bytes to `total` and returns them.
pub(super) fn place_gpu_updated(c: &Ctx<'_>, placed: &mut Placement, running: &mut u64) -> Result<u64> {
    let Placement { resident_layers, held_layers, .. } = *placed;
    let Ctx { input, cfg, batch, seq, ring_depth, e, ll, le, g, sl, s, budget, .. } = *c;
    let (layout, budget_line) = (&c.layout, &c.budget_line);
    let state_cost = |late: usize| c.state_cost(late);
    let asked_late = input.placement.late_state_downloads.unwrap_or(0);
    let streamed_count = layout.n_layers - resident_layers;
    let mut total = *running;
    // GPU-updated layers: their state slots take what holding leaves (before kept activations:
    // they take host work off a streamed step, which is what limits it). Late downloads: those
    // of the held ones the backward's D2H has time for and the GPU room for.
    let with = |gpu_updated_layers: usize, late_state_downloads: usize| Placement {
        gpu_updated_layers,
        late_state_downloads,
        ..*placed
    };
    let late_capable = |n: usize| with(n, 0).held_gpu_updated(layout.n_layers).len();
    let late_cap = late_download_capacity(
        mt_core::model_flops_per_step(cfg, batch, seq),
        streamed_count,
        held_layers,
        ll,
        le,
        sl,
    );
    let auto_late = |n: usize| {
        let fits = |l: usize| total + state_cost(l) <= budget;
        if n == 0 || input.mode != OptimMode::Exact {
            return 0;
        }
        (0..=late_cap.min(late_capable(n))).rev().find(|&l| fits(l)).unwrap_or(0)
    };
    let flops = mt_core::model_flops_per_step(cfg, batch, seq);
    // Early uploads: as many as the backward has room for, each paired with a late download.
    let early_capable = |n: usize, late: usize| with(n, late).slot_pairs(layout.n_layers, ring_depth).len();
    let auto_early = |n: usize, late: usize| {
        if n == 0 || input.mode != OptimMode::Exact {
            return 0;
        }
        early_upload_capacity(flops, streamed_count, held_layers, late, ll, le, sl)
            .min(early_capable(n, late))
    };
    let gpu_updated_layers = match input.placement.gpu_updated_layers {
        Some(k) if k > streamed_count => {
            return opt(format!(
                "{k} GPU-updated layers asked, but only {streamed_count} of {} layers stream ({resident_layers} resident); GPU-updated layers are streamed ones",
                layout.n_layers
            ))
        }
        Some(k) if k > 0 && input.mode != OptimMode::Exact => {
            return opt(format!(
                "{k} GPU-updated layers asked in lean mode: they apply exact mode's pending update on the GPU (lean mode updates each layer as its gradient lands); use 0"
            ))
        }
        Some(k) if k > 0 && total + state_cost(asked_late) > budget => {
            let also = if asked_late > 0 { format!(" ({asked_late} of them downloading late)") } else { String::new() };
            return opt(format!(
                "the state slots of GPU-updated layers{also} need {:.2} GiB, the GPU has {:.2} GiB left of its {budget_line}; use {}--gpu-updated-layers 0",
                gib(state_cost(asked_late)), gib(budget.saturating_sub(total)),
                if asked_late > 0 { "fewer --late-state-downloads or " } else { "" }
            ))
        }
        Some(k) => k,
        None if input.mode == OptimMode::Exact && total + state_cost(asked_late) <= budget => {
            // The count with the shortest forward, each with the late downloads and early uploads
            // it would get; with either asked, among the counts that have room for that many.
            let late_of = |n: usize| input.placement.late_state_downloads.unwrap_or_else(|| auto_late(n));
            let early_of = |n: usize| input.placement.early_state_uploads.unwrap_or_else(|| auto_early(n, late_of(n)));
            let counts = (0..=streamed_count)
                .filter(|&n| late_of(n) <= late_capable(n) && early_of(n) <= early_capable(n, late_of(n)));
            let cost = |n: usize| {
                let p = Placement { early_state_uploads: early_of(n), ..with(n, late_of(n)) };
                forward_window(streamed_count, p, g, e, s, HOST_MEMORY_GBS, STATE_UPLOAD_GBS)
            };
            counts.fold(None, |best: Option<usize>, n| match best {
                Some(b) if cost(b) <= cost(n) => Some(b),
                _ => Some(n),
            })
            .unwrap_or(0)
        }
        None => 0,
    };
    let late_capable = late_capable(gpu_updated_layers);
    let late_state_downloads = match input.placement.late_state_downloads {
        Some(k) if k > 0 && input.mode != OptimMode::Exact => {
            return opt(format!(
                "{k} late state downloads asked in lean mode: they are GPU-updated layers' downloads, and lean mode has none; use 0"
            ))
        }
        Some(k) if k > 0 && total + state_cost(k) > budget => {
            return opt(format!(
                "{k} late state downloads need {:.2} GiB of state slots and gradient buffers (with the GPU-updated layers' own), the GPU has {:.2} GiB left of its {budget_line}; use fewer (--late-state-downloads)",
                gib(state_cost(k)), gib(budget.saturating_sub(total))
            ))
        }
        Some(k) if k > late_capable => {
            return opt(format!(
                "{k} late state downloads asked, but only {late_capable} of the {gpu_updated_layers} GPU-updated layers are held ({held_layers} held layers): a late download keeps a held layer's state on the device until its backward"
            ))
        }
        Some(k) => k,
        None => auto_late(gpu_updated_layers),
    };
    let early_state_uploads = match input.placement.early_state_uploads {
        Some(k) if k > 0 && input.mode != OptimMode::Exact => {
            return opt(format!(
                "{k} early state uploads asked in lean mode: they are GPU-updated layers' uploads, and lean mode has none; use 0"
            ))
        }
        Some(k) if k > 0 && gpu_updated_layers == 0 && total + state_cost(late_state_downloads) > budget => {
            return opt(format!(
                "{k} early state uploads need GPU-updated layers, whose state slots need {:.2} GiB; the GPU has {:.2} GiB left of its {budget_line}; use --early-state-uploads 0",
                gib(state_cost(late_state_downloads)), gib(budget.saturating_sub(total))
            ))
        }
        Some(k) if k > early_capable(gpu_updated_layers, late_state_downloads) => {
            let capable = early_capable(gpu_updated_layers, late_state_downloads);
            let mut why = crate::placement::early_refusal(k, capable, late_state_downloads, ring_depth);
            if input.placement.late_state_downloads.is_none() && total + state_cost(late_state_downloads + 1) > budget {
                why += &format!(
                    " (the planner's {late_state_downloads} late downloads are all the state slots the GPU has room for: {:.2} GiB left of its {budget_line})",
                    gib(budget.saturating_sub(total + state_cost(late_state_downloads)))
                );
            }
            return opt(why);
        }
        Some(k) => k,
        None => auto_early(gpu_updated_layers, late_state_downloads),
    };
    let state_slots = if gpu_updated_layers > 0 { state_cost(late_state_downloads) } else { 0 };
    total += state_slots;
    *running = total;
    placed.gpu_updated_layers = gpu_updated_layers;
    placed.late_state_downloads = late_state_downloads;
    placed.early_state_uploads = early_state_uploads;
    Ok(state_slots)
}

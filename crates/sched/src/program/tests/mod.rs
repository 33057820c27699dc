//! Schedule invariants of the step program, checked on the data alone: the spec sweep every
//! test runs over and the helpers they share are here, the tests in one file per concern.

use std::collections::{HashMap, HashSet};

use mt_core::Unit;

use crate::placement::Placement;
use crate::program::{Op, OptimMode, Program, ProgramSpec, Slot, Stream, RELOAD_SLOTS};

fn spec(n_layers: usize, ring_depth: usize, mode: OptimMode, pending: bool) -> ProgramSpec {
    spec_placed(n_layers, ring_depth, mode, pending, false)
}

fn spec_placed(
    n_layers: usize,
    ring_depth: usize,
    mode: OptimMode,
    pending: bool,
    resident: bool,
) -> ProgramSpec {
    spec_held(n_layers, ring_depth, mode, pending, resident, 0, 0)
}

fn spec_held(
    n_layers: usize,
    ring_depth: usize,
    mode: OptimMode,
    pending: bool,
    resident: bool,
    resident_layers: usize,
    held_layers: usize,
) -> ProgramSpec {
    let placement =
        Placement { resident_outer: resident, resident_layers, held_layers, ..Placement::default() };
    ProgramSpec { pending_update: pending, ..spec_with(n_layers, ring_depth, mode, placement) }
}

/// A step of the engine's buffer counts in `mode` with an update pending, placed as `placement`:
/// `ring_depth + late` state slots for its GPU-updated layers, two reload buffers for its spilled
/// checkpoints (the schedule tests here and each placement feature's in `build/`).
pub(crate) fn spec_with(
    n_layers: usize,
    ring_depth: usize,
    mode: OptimMode,
    placement: Placement,
) -> ProgramSpec {
    ProgramSpec {
        n_layers,
        ring_depth,
        n_staging: 2,
        n_grad_bufs: 2,
        n_landing: 2,
        mode,
        pending_update: true,
        placement,
        early_ready: false,
        reload_slots: if placement.spilled_checkpoints > 0 { RELOAD_SLOTS } else { 0 },
        n_state_bufs: if placement.gpu_updated_layers > 0 {
            ring_depth + placement.late_state_downloads
        } else {
            0
        },
        narrow_grads: false,
        rank: None,
        overlap_optimizer: true,
    }
}

fn all_specs() -> Vec<ProgramSpec> {
    let mut v = Vec::new();
    for l in [1usize, 2, 4, 5, 8] {
        for n in [1, 2, 3, 4] {
            for mode in [OptimMode::Exact, OptimMode::Lean] {
                for pending in [false, true] {
                    for resident in [false, true] {
                        // No resident layer, one, all but one, all of them.
                        let mut ks = vec![0, 1, l.saturating_sub(1), l];
                        ks.dedup();
                        for k in ks {
                            // No held layer, one, every streamed one.
                            let mut hs = vec![0, 1.min(l - k), l - k];
                            hs.dedup();
                            for h in hs {
                                v.push(spec_held(l, n, mode, pending, resident, k, h));
                                // Spilled checkpoints: the first layer's input, every layer's;
                                // through one reload buffer or two.
                                for (spilled, reload_slots) in [(1, 2), (l, 1), (l, 2)] {
                                    let base = spec_held(l, n, mode, pending, resident, k, h);
                                    v.push(ProgramSpec {
                                        reload_slots,
                                        placement: Placement {
                                            spilled_checkpoints: spilled,
                                            ..base.placement
                                        },
                                        ..base
                                    });
                                }
                                // GPU-updated layers (exact mode): one, three quarters, every
                                // streamed one.
                                let mut gs = vec![1.min(l - k), (l - k) * 3 / 4, l - k];
                                gs.sort_unstable();
                                gs.dedup();
                                for g in gs.into_iter().filter(|&g| g > 0 && mode == OptimMode::Exact) {
                                    let s = ProgramSpec {
                                        n_state_bufs: n,
                                        reload_slots: 0,
                                        placement: Placement {
                                            gpu_updated_layers: g,
                                            spilled_checkpoints: 0,
                                            ..spec_held(l, n, mode, pending, resident, k, h).placement
                                        },
                                        ..spec_held(l, n, mode, pending, resident, k, h)
                                    };
                                    // Late downloads: none, one, all but one, every held GPU-updated
                                    // layer.
                                    let held_gpu = s.held_gpu_updated().len();
                                    let mut ds = vec![0, 1, held_gpu.saturating_sub(1), held_gpu];
                                    ds.sort_unstable();
                                    ds.dedup();
                                    for d in ds.into_iter().filter(|&d| d <= s.held_gpu_updated().len()) {
                                        let s = ProgramSpec {
                                            n_state_bufs: n + d,
                                            placement: Placement { late_state_downloads: d, ..s.placement },
                                            ..s
                                        };
                                        v.push(s);
                                        // Early uploads: one, one per late layer with a partner; their
                                        // states up from the last step or not.
                                        let pairs = Placement {
                                            resident_layers: k,
                                            held_layers: h,
                                            gpu_updated_layers: g,
                                            late_state_downloads: d,
                                            ..Placement::default()
                                        }
                                        .slot_pairs(l, n)
                                        .len();
                                        let mut es = vec![1, pairs];
                                        es.dedup();
                                        for e in es.into_iter().filter(|&e| e > 0 && e <= pairs) {
                                            // (Ready states are left by an exact step, which
                                            // always leaves an update pending.)
                                            for ready in [false, true].into_iter().filter(|&r| !r || pending)
                                            {
                                                v.push(ProgramSpec {
                                                    early_ready: ready,
                                                    n_state_bufs: n + d,
                                                    reload_slots: 0,
                                                    placement: Placement {
                                                        early_state_uploads: e,
                                                        spilled_checkpoints: 0,
                                                        ..s.placement
                                                    },
                                                    ..s
                                                });
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    v
}

/// Transitive predecessors of every instruction (including same-stream program order).
fn ancestors(p: &Program) -> Vec<HashSet<usize>> {
    let mut last_on: HashMap<Stream, usize> = HashMap::new();
    let mut anc: Vec<HashSet<usize>> = Vec::new();
    for (i, ins) in p.instrs.iter().enumerate() {
        let mut set = HashSet::new();
        let mut direct: Vec<usize> = ins.waits.clone();
        direct.extend(last_on.get(&ins.stream).copied());
        for d in direct {
            assert!(d < i, "instruction {i} waits for a later one ({d})");
            set.insert(d);
            set.extend(anc[d].iter().copied());
        }
        last_on.insert(ins.stream, i);
        anc.push(set);
    }
    anc
}

/// The slot an op writes a unit's weights into: an upload, or a GPU-updated layer's update.
fn slot_written(op: &Op) -> Option<(Slot, Unit)> {
    match *op {
        Op::Upload { slot, unit, .. } | Op::UpdateStreamed { slot, unit, .. } => Some((slot, unit)),
        _ => None,
    }
}

/// Whether the step applies `layer`'s update on the device from its streamed state.
fn gpu_updates(s: &ProgramSpec, layer: usize) -> bool {
    s.mode == OptimMode::Exact && s.pending_update && s.is_gpu_updated(layer)
}

fn slot_of(op: &Op) -> Option<(Slot, Unit)> {
    match *op {
        Op::Forward { layer, slot, .. } | Op::Backward { layer, slot, .. } => {
            Some((slot, Unit::Layer(layer)))
        }
        Op::Embed | Op::Loss | Op::EmbedBackward => Some((Slot::Outer, Unit::Outer)),
        _ => None,
    }
}

/// Weight slots, staging and landing buffers: what each compute reads, how many slots are live,
/// when a buffer is reused.
mod buffers;

/// Update order, the overlap double buffering gives, the land's wait for the update.
mod order;

/// Checkpoints: where each backward finds its input, when each is freed; spilled ones' moves.
mod checkpoints;

/// The GPU-updated layers' state slots: reuse, late downloads, early uploads.
mod state;

/// Data-parallel ranks, lean mode's resident updates, the serial ablation.
mod ranks;

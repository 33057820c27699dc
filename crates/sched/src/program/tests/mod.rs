//! Schedule invariants of the step program, checked on the data alone.

use std::collections::{HashMap, HashSet};

use mt_core::Unit;

use crate::placement::Placement;
use crate::program::{HostBuf, Instr, Op, OptimMode, Program, ProgramSpec, Slot, Stream, RELOAD_SLOTS};
use crate::simulate::simulate;

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

#[test]
fn every_compute_reads_the_unit_it_expects_and_no_upload_clobbers_a_live_slot() {
    for s in all_specs() {
        let p = Program::build(s);
        let anc = ancestors(&p);
        for (i, ins) in p.instrs.iter().enumerate() {
            let Some((slot, unit)) = slot_of(&ins.op) else { continue };
            // The latest upload into this slot issued before i must be this unit's, and i must
            // depend on it.
            let up = p.instrs[..i]
                .iter()
                .enumerate()
                .rev()
                .find(|(_, x)| slot_written(&x.op).is_some_and(|(s2, _)| s2 == slot))
                .map(|(j, x)| (j, x.op.clone()));
            if s.placement.resident_outer && slot == Slot::Outer {
                // The slot is written by UpdateResident (or at engine start), never uploaded.
                assert!(up.is_none(), "{s:?}: a resident outer slot is uploaded into");
                continue;
            }
            if let Slot::Resident(l) = slot {
                // Only resident layers use their own slot, and nothing is uploaded into it.
                assert!(l < s.placement.resident_layers && unit == Unit::Layer(l), "{s:?}: {:?}", ins.op);
                assert!(up.is_none(), "{s:?}: a resident layer's slot is uploaded into");
                continue;
            }
            if let Slot::Held(l) = slot {
                assert!(
                    l + s.placement.held_layers >= s.n_layers && l >= s.placement.resident_layers,
                    "{s:?}: {:?}",
                    ins.op
                );
            }
            if let Unit::Layer(l) = unit {
                assert!(l >= s.placement.resident_layers, "{s:?}: resident layer {l} read from the ring");
                let held = l + s.placement.held_layers >= s.n_layers;
                assert_eq!(held, slot == Slot::Held(l), "{s:?}: layer {l} read from {slot:?}");
            }
            let (j, op) =
                up.unwrap_or_else(|| panic!("{s:?}: instr {i} {:?} has no upload before it", ins.op));
            assert!(
                slot_written(&op).is_some_and(|(_, u)| u == unit),
                "{s:?}: {i} reads {unit:?} but slot holds {op:?}"
            );
            assert!(anc[i].contains(&j), "{s:?}: compute {i} does not wait for its upload {j}");
            // A GPU-updated layer's forward reads what its update wrote, which read its uploaded
            // state.
            if let Op::UpdateStreamed { unit: u, buf, .. } = op {
                let su = p.instrs[..j].iter().rposition(|x| x.op == Op::UploadState { unit: u, buf });
                let early = s.early_upload_layers();
                if let Some(e) = early.iter().position(|&l| s.early_ready && Unit::Layer(l) == u) {
                    // Its state went up in the last step's backward, into its early slot.
                    assert_eq!(su, None, "{s:?}: early-upload {u:?} uploaded again");
                    assert_eq!(
                        buf,
                        s.n_state_bufs - s.placement.early_state_uploads + e,
                        "{s:?}: {u:?}'s slot"
                    );
                } else {
                    let su = su.unwrap_or_else(|| panic!("{s:?}: update {j} of {u:?} has no state upload"));
                    assert!(
                        anc[j].contains(&su),
                        "{s:?}: update {j} does not wait for its state upload {su}"
                    );
                }
                // Its forward, or its backward from the slot it is held in.
                let ok = matches!(ins.op, Op::Forward { .. })
                    || matches!(ins.op, Op::Backward { slot: Slot::Held(_), .. });
                assert!(ok, "{s:?}: {:?} reads a device update", ins.op);
            }
            // Any later write into the slot must wait for this compute.
            for (k, x) in p.instrs.iter().enumerate().skip(i + 1) {
                if slot_written(&x.op).is_some_and(|(s2, _)| s2 == slot) {
                    assert!(anc[k].contains(&i), "{s:?}: upload {k} may overwrite slot in use by {i}");
                }
            }
        }
    }
}

#[test]
fn ring_uses_at_most_depth_slots_and_each_layer_crosses_twice_its_gradient_once() {
    for s in all_specs() {
        let p = Program::build(s);
        let slots: HashSet<Slot> = p.instrs.iter().filter_map(|i| slot_of(&i.op).map(|x| x.0)).collect();
        assert!(slots.iter().all(|s2| match s2 {
            Slot::Outer => true,
            Slot::Ring(k) => *k < s.ring_depth,
            Slot::Resident(l) => *l < s.placement.resident_layers,
            Slot::Held(l) => *l + s.placement.held_layers >= s.n_layers,
        }));
        assert!(slots.len() <= s.ring_depth + 1 + s.placement.resident_layers + s.placement.held_layers);
        let mut ups: HashMap<Unit, usize> = HashMap::new();
        p.uploads().for_each(|u| *ups.entry(u).or_default() += 1);
        let mut downs: HashMap<Unit, usize> = HashMap::new();
        p.downloads().for_each(|u| *downs.entry(u).or_default() += 1);
        // A resident outer unit never crosses the bus; a streamed one once each way.
        let outer = (!s.placement.resident_outer).then_some(1);
        assert_eq!(ups.get(&Unit::Outer).copied(), outer, "{s:?}");
        assert_eq!(downs.get(&Unit::Outer).copied(), outer, "{s:?}");
        // A resident layer never crosses the bus; a streamed one twice up (a held one once),
        // once down.
        // A GPU-updated one's forward weights are written on the device from its state, which
        // goes up once and comes back once.
        let state_ups: Vec<Unit> = p.state_uploads().collect();
        let state_downs: Vec<Unit> = p
            .instrs
            .iter()
            .filter_map(|i| match i.op {
                Op::DownloadState { unit, .. } => Some(unit),
                _ => None,
            })
            .collect();
        let sorted = |mut v: Vec<Unit>| {
            v.sort_by_key(|u| u.index());
            v
        };
        // Every state that comes back went up this step, but an early-upload layer's whose state
        // the last step uploaded; early-upload layers' states go up in the backward for the next.
        let early = if s.mode == OptimMode::Exact { s.early_upload_layers() } else { vec![] };
        let loss = p.instrs.iter().position(|i| i.op == Op::Loss).unwrap();
        let fwd_state_ups: Vec<Unit> = p.instrs[..loss]
            .iter()
            .filter_map(|i| match i.op {
                Op::UploadState { unit, .. } => Some(unit),
                _ => None,
            })
            .collect();
        let ready = |u: &Unit| s.early_ready && early.iter().any(|&l| Unit::Layer(l) == *u);
        let came_back_without: Vec<Unit> = state_downs.iter().copied().filter(|u| !ready(u)).collect();
        assert_eq!(sorted(fwd_state_ups), sorted(came_back_without), "{s:?}");
        for l in 0..s.n_layers {
            let held = l + s.placement.held_layers >= s.n_layers;
            let gpu = gpu_updates(&s, l);
            let (is_early, is_ready) = (early.contains(&l), ready(&Unit::Layer(l)));
            let (up, down) = if l < s.placement.resident_layers {
                (0, 0)
            } else {
                (2 - usize::from(held) - usize::from(gpu), 1)
            };
            assert_eq!(ups.get(&Unit::Layer(l)).copied().unwrap_or(0), up, "{s:?}: layer {l} uploads");
            assert_eq!(downs.get(&Unit::Layer(l)).copied().unwrap_or(0), down, "{s:?}: layer {l} downloads");
            let states = state_ups.iter().filter(|&&u| u == Unit::Layer(l)).count();
            assert_eq!(states, usize::from(gpu && !(is_early && is_ready)), "{s:?}: layer {l} state uploads");
            let moments = p.moment_uploads().filter(|&u| u == Unit::Layer(l)).count();
            assert_eq!(moments, usize::from(is_early), "{s:?}: layer {l} early uploads");
            let downs = state_downs.iter().filter(|&&u| u == Unit::Layer(l)).count();
            assert_eq!(downs, usize::from(gpu), "{s:?}: layer {l} state downloads");
        }
        let forward_ups = if s.pending_update {
            s.placement.gpu_updated_layers - if s.early_ready { early.len() } else { 0 }
        } else {
            0
        };
        assert_eq!(state_ups.len(), forward_ups, "{s:?}: GPU-updated layers");
    }
}

#[test]
fn host_buffers_are_not_reused_before_their_reader_is_done() {
    for s in all_specs() {
        let p = Program::build(s);
        let anc = ancestors(&p);
        let mut last_upload_of: HashMap<HostBuf, usize> = HashMap::new();
        let mut last_land_of: HashMap<HostBuf, usize> = HashMap::new();
        let mut last_download_of: HashMap<Option<usize>, usize> = HashMap::new();
        for (i, ins) in p.instrs.iter().enumerate() {
            match ins.op {
                Op::Stage { staging, .. } => {
                    if let Some(&u) = last_upload_of.get(&staging) {
                        assert!(anc[i].contains(&u), "{s:?}: stage {i} rewrites staging before upload {u}");
                    }
                }
                Op::Upload { staging, .. } => {
                    last_upload_of.insert(staging, i);
                }
                Op::Backward { grad_buf: Some(grad_buf), .. } => {
                    if let Some(&d) = last_download_of.get(&Some(grad_buf)) {
                        assert!(
                            anc[i].contains(&d),
                            "{s:?}: backward {i} zeroes grad buffer before download {d}"
                        );
                    }
                }
                Op::Download { grad_buf, landing, .. } => {
                    if let Some(&l) = last_land_of.get(&landing) {
                        assert!(
                            anc[i].contains(&l),
                            "{s:?}: download {i} overwrites landing before land {l}"
                        );
                    }
                    last_download_of.insert(grad_buf, i);
                }
                Op::Land { landing, .. } => {
                    last_land_of.insert(landing, i);
                }
                _ => {}
            }
        }
    }
}

#[test]
fn updates_run_in_forward_order_only_where_the_mode_says() {
    for s in all_specs() {
        let p = Program::build(s);
        let stage_updates: Vec<Unit> = p
            .instrs
            .iter()
            .filter_map(|i| match i.op {
                Op::Stage { unit, update: true, .. } => Some(unit),
                _ => None,
            })
            .collect();
        let land_updates = p.instrs.iter().filter(|i| matches!(i.op, Op::Land { update: true, .. })).count();
        let device_update_of = |unit: Unit| {
            (0..p.instrs.len())
                .filter(|&i| matches!(p.instrs[i].op, Op::UpdateResident { unit: u, .. } if u == unit))
                .collect::<Vec<_>>()
        };
        let device_updates = device_update_of(Unit::Outer);
        let position = |op: Op| p.instrs.iter().position(|i| i.op == op);
        let host_outer = usize::from(!s.placement.resident_outer);
        let streamed = s.n_layers - s.placement.resident_layers;
        let all_device_updates =
            p.instrs.iter().filter(|i| matches!(i.op, Op::UpdateResident { .. })).count();
        for l in 0..s.n_layers {
            let ups = device_update_of(Unit::Layer(l));
            let resident_update =
                l < s.placement.resident_layers && (s.mode == OptimMode::Lean || s.pending_update);
            assert_eq!(ups.len(), usize::from(resident_update), "{s:?}: layer {l} device updates");
            let Some(&u) = ups.first() else { continue };
            let fwd = p
                .instrs
                .iter()
                .position(
                    |i| matches!(i.op, Op::Forward { layer, slot: Slot::Resident(_), .. } if layer == l),
                )
                .unwrap();
            let bwd = p.instrs.iter().position(|i| matches!(i.op, Op::Backward { layer, .. } if layer == l));
            match s.mode {
                // Exact: the pending update before the layer's forward reads its weights.
                OptimMode::Exact => assert!(u < fwd, "{s:?}: layer {l}"),
                // Lean: after its gradient is complete.
                OptimMode::Lean => assert!(u > bwd.unwrap(), "{s:?}: layer {l}"),
            }
        }
        assert_eq!(
            all_device_updates,
            if s.mode == OptimMode::Lean || s.pending_update {
                s.placement.resident_layers + usize::from(s.placement.resident_outer)
            } else {
                0
            },
            "{s:?}"
        );
        match (s.mode, s.pending_update) {
            (OptimMode::Exact, true) => {
                let expected: Vec<Unit> = (!s.placement.resident_outer)
                    .then_some(Unit::Outer)
                    .into_iter()
                    .chain(
                        (s.placement.resident_layers..s.n_layers)
                            .filter(|&l| !gpu_updates(&s, l))
                            .map(Unit::Layer),
                    )
                    .collect();
                assert_eq!(stage_updates, expected, "{s:?}");
                // The others are updated on the device, in forward order, each before its
                // forward, and their state comes back after the update.
                let streamed_updates: Vec<(usize, Unit)> = p
                    .instrs
                    .iter()
                    .enumerate()
                    .filter_map(|(i, x)| match x.op {
                        Op::UpdateStreamed { unit, .. } => Some((i, unit)),
                        _ => None,
                    })
                    .collect();
                let gpu_layers: Vec<Unit> =
                    (0..s.n_layers).filter(|&l| gpu_updates(&s, l)).map(Unit::Layer).collect();
                assert_eq!(streamed_updates.iter().map(|x| x.1).collect::<Vec<_>>(), gpu_layers, "{s:?}");
                let anc = ancestors(&p);
                for &(i, unit) in &streamed_updates {
                    let Unit::Layer(l) = unit else { unreachable!() };
                    let fwd =
                        p.instrs.iter().position(|x| matches!(x.op, Op::Forward { layer, .. } if layer == l));
                    assert!(i < fwd.unwrap(), "{s:?}: layer {l} updated after its forward");
                    let dl = p
                        .instrs
                        .iter()
                        .position(|x| matches!(x.op, Op::DownloadState { unit: u, .. } if u == unit));
                    assert!(
                        anc[dl.unwrap()].contains(&i),
                        "{s:?}: layer {l}'s state downloaded before its update"
                    );
                }
                assert_eq!(land_updates, 0);
                // The resident outer unit is updated on the device before anything reads it.
                if s.placement.resident_outer {
                    assert_eq!(device_updates.len(), 1, "{s:?}");
                    assert!(device_updates[0] < position(Op::Embed).unwrap(), "{s:?}");
                }
            }
            (OptimMode::Exact, false) => {
                assert!(stage_updates.is_empty() && land_updates == 0 && device_updates.is_empty(), "{s:?}")
            }
            (OptimMode::Lean, _) => {
                assert!(stage_updates.is_empty());
                assert_eq!(land_updates, streamed + host_outer);
                if s.placement.resident_outer {
                    // After the outer gradient is complete (and its sum of squares taken).
                    assert_eq!(device_updates.len(), 1, "{s:?}");
                    assert!(device_updates[0] > position(Op::EmbedBackward).unwrap(), "{s:?}");
                }
            }
        }
    }
}

/// With copies cheaper than compute, double buffering hides every upload after the first;
/// a single slot serialises copy and compute. This is what the ablation will measure.
#[test]
fn depth_two_hides_uploads_behind_compute_and_depth_one_does_not() {
    let cost = |i: &Instr| match i.op {
        Op::Forward { .. } => 10.0,
        Op::Backward { .. } => 20.0,
        Op::Upload { .. } | Op::Download { .. } => 6.0,
        Op::Stage { .. } | Op::Land { .. } => 2.0,
        _ => 1.0,
    };
    let l = 8;
    let t1 = simulate(&Program::build(spec(l, 1, OptimMode::Exact, true)), cost);
    let t2 = simulate(&Program::build(spec(l, 2, OptimMode::Exact, true)), cost);
    let t3 = simulate(&Program::build(spec(l, 3, OptimMode::Exact, true)), cost);
    // Idle time of the compute stream between the start of layer 0's forward and the end of
    // layer 0's backward: the time compute waited for copies or the host.
    let idle = |p: &Program, t: &crate::simulate::Timeline| {
        let spans: Vec<(f64, f64)> = p
            .instrs
            .iter()
            .zip(&t.spans)
            .filter(|(i, _)| matches!(i.op, Op::Forward { .. } | Op::Backward { .. } | Op::Loss))
            .map(|(_, s)| *s)
            .collect();
        let busy: f64 = spans.iter().map(|(a, b)| b - a).sum();
        spans.last().unwrap().1 - spans[0].0 - busy
    };
    let p1 = Program::build(spec(l, 1, OptimMode::Exact, true));
    let p2 = Program::build(spec(l, 2, OptimMode::Exact, true));
    assert_eq!(idle(&p2, &t2), 0.0, "depth 2 leaves compute idle");
    assert_eq!(idle(&Program::build(spec(l, 3, OptimMode::Exact, true)), &t3), 0.0);
    // Depth 1: every upload after the first is exposed (6 each), except that the first
    // backward upload overlaps the loss (1).
    assert_eq!(idle(&p1, &t1), (2 * l - 1) as f64 * 6.0 - 1.0, "depth 1 idle");
    assert!(t1.makespan > t2.makespan + (2 * l - 2) as f64 * 6.0);
    assert!(t3.makespan <= t2.makespan + 1e-9);
    // Holding every layer from forward to backward: no backward upload at all, nothing exposed.
    let ph = Program::build(spec_held(l, 2, OptimMode::Exact, true, false, 0, l));
    let th = simulate(&ph, cost);
    assert_eq!(idle(&ph, &th), 0.0, "held layers leave compute idle");
    assert_eq!(ph.uploads().count(), l + 1);
}

#[test]
fn landing_a_gradient_waits_for_the_update_that_reads_the_previous_one() {
    for s in all_specs() {
        let p = Program::build(s);
        let anc = ancestors(&p);
        for (i, ins) in p.instrs.iter().enumerate() {
            let Op::Land { unit, .. } = ins.op else { continue };
            for (j, x) in p.instrs.iter().enumerate() {
                let reads_previous = matches!(x.op, Op::Stage { unit: u, update: true, .. } if u == unit)
                    || matches!(x.op, Op::DownloadState { unit: u, .. } if u == unit);
                if reads_previous {
                    // Direct wait, not just host-stream order: a multi-threaded host stream must
                    // keep it.
                    assert!(ins.waits.contains(&j), "{s:?}: land {i} does not wait for update {j}");
                    assert!(anc[i].contains(&j));
                }
            }
        }
        assert!(p.validate().is_ok());
    }
}

#[test]
fn a_program_waiting_on_a_later_instruction_is_refused() {
    let mut p = Program::build(spec(2, 2, OptimMode::Exact, true));
    let n = p.instrs.len();
    p.instrs[0].waits.push(n - 1);
    let err = p.validate().unwrap_err().to_string();
    assert!(err.contains("instruction 0") && err.contains("not earlier"), "{err}");
}

/// The GPU-updated layers' state slots: reuse, late downloads, early uploads.
mod state;

/// Data-parallel ranks, lean mode's resident updates, the serial ablation.
mod ranks;

/// Spilled checkpoints: each spilled boundary goes down once after the op that wrote it, its
/// device copy is freed once (after its layer's forward read it and its spill is done), it comes
/// back once (after its spill) before its layer's backward, and a reload buffer is refilled only
/// after the backward that read it.
#[test]
fn spilled_checkpoints_go_down_and_come_back_in_order() {
    let mut checked = 0;
    for s in all_specs().into_iter().filter(|s| s.placement.spilled_checkpoints > 0) {
        let p = Program::build(s);
        let anc = ancestors(&p);
        let find = |f: &dyn Fn(&Op) -> bool| -> Vec<usize> {
            (0..p.instrs.len()).filter(|&i| f(&p.instrs[i].op)).collect()
        };
        let mut slot_users: HashMap<usize, Vec<(usize, usize)>> = HashMap::new();
        for b in 0..s.placement.spilled_checkpoints {
            let spill = find(&|o| *o == Op::SpillCheckpoint { boundary: b });
            let drop = find(&|o| *o == Op::DropCheckpoint { boundary: b });
            let reload = find(&|o| matches!(o, Op::ReloadCheckpoint { boundary, .. } if *boundary == b));
            assert_eq!((spill.len(), drop.len(), reload.len()), (1, 1, 1), "{s:?} boundary {b}");
            let (spill, drop, reload) = (spill[0], drop[0], reload[0]);
            assert_eq!(p.instrs[spill].stream, Stream::D2H);
            assert_eq!(p.instrs[drop].stream, Stream::Compute);
            assert_eq!(p.instrs[reload].stream, Stream::H2D);
            let producer = if b == 0 {
                find(&|o| *o == Op::Embed)[0]
            } else {
                find(&|o| matches!(o, Op::Forward { layer, .. } if *layer == b - 1))[0]
            };
            let forward = find(&|o| matches!(o, Op::Forward { layer, .. } if *layer == b))[0];
            let backward = find(&|o| matches!(o, Op::Backward { layer, .. } if *layer == b))[0];
            assert!(anc[spill].contains(&producer), "{s:?}: spill {b} before its producer");
            assert!(anc[drop].contains(&spill) && anc[drop].contains(&forward), "{s:?}: drop {b} too early");
            assert!(anc[reload].contains(&spill), "{s:?}: reload {b} before its spill");
            assert!(anc[backward].contains(&reload), "{s:?}: backward {b} before its reload");
            let Op::ReloadCheckpoint { slot, .. } = p.instrs[reload].op else { unreachable!() };
            assert!(slot < s.reload_slots);
            slot_users.entry(slot).or_default().push((reload, backward));
        }
        for users in slot_users.values_mut() {
            users.sort_unstable();
            for w in users.windows(2) {
                assert!(
                    anc[w[1].0].contains(&w[0].1),
                    "{s:?}: a reload buffer refilled before its reader ran"
                );
            }
        }
        checked += 1;
    }
    assert!(checked > 100, "{checked} specs with spilled checkpoints");
}

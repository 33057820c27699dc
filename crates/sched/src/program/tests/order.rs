//! Schedule invariants of order and overlap: updates run in forward order where the mode says,
//! double buffering hides uploads behind compute (on `simulate`'s timeline), a land waits for the
//! update that reads the gradient it overwrites, and a program whose wait points forward is
//! refused.

use super::*;
use crate::program::Instr;
use crate::simulate::simulate;

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

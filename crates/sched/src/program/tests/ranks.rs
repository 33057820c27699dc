//! Schedule invariants of what the executor once decided at run time and the program now says:
//! data-parallel ranks (the all-reduce, who lands), lean mode's resident updates, and the serial
//! ablation's waits, on the program data alone (and on `simulate`'s timeline).

use super::*;
use crate::program::Instr;
use crate::simulate::simulate;

fn units(n_layers: usize) -> impl Iterator<Item = Unit> {
    std::iter::once(Unit::Outer).chain((0..n_layers).map(Unit::Layer))
}

/// The op that accumulates `unit`'s gradient: its layer's backward, or the embedding's.
fn accumulates(op: &Op, unit: Unit) -> bool {
    match (op, unit) {
        (&Op::Backward { layer, .. }, Unit::Layer(l)) => layer == l,
        (Op::EmbedBackward, Unit::Outer) => true,
        _ => false,
    }
}

/// What reads a unit's device gradient once it is complete.
fn reads_gradient(op: &Op, unit: Unit) -> bool {
    match *op {
        Op::SumSquares { unit: u, .. } | Op::CopyGrad { unit: u, .. } | Op::Download { unit: u, .. } => {
            u == unit
        }
        _ => false,
    }
}

/// Every rank sums each gradient over the ranks exactly once, after the op that accumulates it
/// and before anything reads it (its narrowing and share of the norm, an early layer's copy, its
/// download); rank 0's downloads and lands are a lone engine's, the other ranks' none. A lone
/// engine sums nothing.
#[test]
fn every_rank_sums_each_gradient_once_before_it_is_read_and_only_rank_0_lands() {
    let moves = |p: &Program| -> Vec<Op> {
        p.instrs
            .iter()
            .filter(|i| matches!(i.op, Op::Download { .. } | Op::Land { .. }))
            .map(|i| i.op.clone())
            .collect()
    };
    for s in all_specs() {
        let alone = Program::build(s);
        assert!(!alone.instrs.iter().any(|i| matches!(i.op, Op::AllReduce { .. })), "{s:?}");
        for rank in [0, 1, 3] {
            let p = Program::build(ProgramSpec { rank: Some(rank), ..s });
            let anc = ancestors(&p);
            for unit in units(s.n_layers) {
                let at = |f: &dyn Fn(&Op) -> bool| {
                    (0..p.instrs.len()).filter(|&i| f(&p.instrs[i].op)).collect::<Vec<_>>()
                };
                let reduces = at(&|o| matches!(*o, Op::AllReduce { unit: u, .. } if u == unit));
                let [r] = reduces[..] else {
                    panic!("{s:?} rank {rank}: {unit:?} summed {} times", reduces.len())
                };
                let [acc] = at(&|o| accumulates(o, unit))[..] else { panic!("{s:?}: {unit:?}'s backward") };
                assert!(anc[r].contains(&acc), "{s:?} rank {rank}: {unit:?} summed before its backward");
                for i in at(&|o| reads_gradient(o, unit)) {
                    assert!(
                        anc[i].contains(&r),
                        "{s:?} rank {rank}: {:?} reads {unit:?}'s gradient before its sum",
                        p.instrs[i].op
                    );
                }
            }
            if rank == 0 {
                assert_eq!(moves(&p), moves(&alone), "{s:?}: rank 0 lands as a lone engine does");
            } else {
                assert!(moves(&p).is_empty(), "{s:?} rank {rank} lands");
            }
            // The timeline prices the sums on the compute stream.
            let t = simulate(&p, |ins| if matches!(ins.op, Op::AllReduce { .. }) { 1.0 } else { 0.0 });
            assert_eq!(t.busy.get(&Stream::Compute).copied(), Some((s.n_layers + 1) as f64), "{s:?}");
        }
    }
}

/// Lean mode updates each resident unit once, at the program's end, after every backward and
/// after the unit's share of the norm (whose finiteness it checks); exact mode's pending updates
/// check nothing.
#[test]
fn lean_resident_updates_come_last_after_their_share_of_the_norm() {
    for s in all_specs() {
        let p = Program::build(s);
        let anc = ancestors(&p);
        let embed_backward = p.instrs.iter().position(|i| i.op == Op::EmbedBackward).unwrap();
        let first_lean =
            p.instrs.iter().position(|i| matches!(i.op, Op::UpdateResident { if_finite: true, .. }));
        if let Some(first) = first_lean {
            assert!(
                p.instrs[first..].iter().all(|i| matches!(i.op, Op::UpdateResident { if_finite: true, .. })),
                "{s:?}: lean updates are the program's last instructions"
            );
        }
        for (i, ins) in p.instrs.iter().enumerate() {
            let Op::UpdateResident { unit, if_finite } = ins.op else { continue };
            assert_eq!(if_finite, s.mode == OptimMode::Lean, "{s:?}: {unit:?}");
            if if_finite {
                let ss =
                    p.instrs.iter().position(|x| matches!(x.op, Op::SumSquares { unit: u, .. } if u == unit));
                assert!(ss.is_some_and(|ss| anc[i].contains(&ss)), "{s:?}: {unit:?} updated before its norm");
                assert!(anc[i].contains(&embed_backward), "{s:?}: {unit:?} updated before the backward ends");
            }
        }
    }
}

/// Without optimizer overlap (the ablation), whatever the durations, no host instruction runs
/// beside a compute one; with it, the same program's host work runs beside compute.
#[test]
fn without_optimizer_overlap_host_work_never_runs_beside_compute() {
    let cost = |ins: &Instr| match ins.stream {
        Stream::Host => 3.0,
        Stream::Compute => 2.0,
        Stream::H2D | Stream::D2H => 1.0,
    };
    let overlaps = |p: &Program| {
        let t = simulate(p, cost);
        let on = |s: Stream| (0..p.instrs.len()).filter(move |&i| p.instrs[i].stream == s);
        on(Stream::Host)
            .any(|h| on(Stream::Compute).any(|c| t.spans[h].0 < t.spans[c].1 && t.spans[c].0 < t.spans[h].1))
    };
    let mut overlapped = 0;
    for s in all_specs() {
        assert!(!overlaps(&Program::build(ProgramSpec { overlap_optimizer: false, ..s })), "{s:?}");
        overlapped += usize::from(overlaps(&Program::build(s)));
    }
    assert!(overlapped > 0, "no program overlaps host work with compute");
}

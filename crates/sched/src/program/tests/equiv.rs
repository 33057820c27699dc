//! Temporary: the new builder against the old one.
use crate::placement::Placement;
use crate::program::{OptimMode, Program, ProgramSpec};

fn rng(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn same(spec: ProgramSpec) -> bool {
    let new = std::panic::catch_unwind(|| Program::build(spec));
    let old = std::panic::catch_unwind(|| Program::build_old(spec));
    match (new, old) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a.instrs.len(), b.instrs.len(), "{spec:?}");
            for (i, (x, y)) in a.instrs.iter().zip(&b.instrs).enumerate() {
                assert_eq!(x, y, "{spec:?}: instruction {i}");
            }
            true
        }
        (Err(_), Err(_)) => false,
        (a, b) => panic!("{spec:?}: new ok {} old ok {}", a.is_ok(), b.is_ok()),
    }
}

#[test]
fn the_new_builder_builds_what_the_old_one_did() {
    std::panic::set_hook(Box::new(|_| {}));
    let mut built = 0;
    for s in super::all_specs() {
        built += usize::from(same(s));
    }
    let mut st = 0x9e3779b97f4a7c15u64;
    let mut tried = 0;
    let mut combos = [0; 4];
    while tried < 60000 {
        let r = |st: &mut u64, n: usize| (rng(st) % n as u64) as usize;
        let n = r(&mut st, 9);
        let ring = 1 + r(&mut st, 4);
        let mode = if r(&mut st, 4) == 0 { OptimMode::Lean } else { OptimMode::Exact };
        let res = if r(&mut st, 2) == 0 { 0 } else { r(&mut st, n + 1) };
        let held = r(&mut st, n - res + 1);
        let streamed = n - res;
        let gpu = if r(&mut st, 3) == 0 { 0 } else { r(&mut st, streamed + 1) };
        let p0 = Placement {
            resident_outer: r(&mut st, 2) == 0,
            resident_layers: res,
            held_layers: held,
            gpu_updated_layers: gpu,
            ..Placement::default()
        };
        let hg = p0.held_gpu_updated(n).len();
        let late = if hg == 0 || r(&mut st, 3) == 0 { 0 } else { r(&mut st, hg + 1) };
        let p1 = Placement { late_state_downloads: late, ..p0 };
        let pairs = p1.slot_pairs(n, ring).len();
        let early = if pairs == 0 || r(&mut st, 2) == 0 { 0 } else { 1 + r(&mut st, pairs) };
        let spilled = if r(&mut st, 3) == 0 { r(&mut st, n + 1) } else { 0 };
        let pending = r(&mut st, 4) != 0;
        let spec = ProgramSpec {
            n_layers: n,
            ring_depth: ring,
            n_staging: 1 + r(&mut st, 3),
            n_grad_bufs: [2, 4, 1][r(&mut st, 3)],
            n_landing: 1 + r(&mut st, 3),
            mode,
            pending_update: pending,
            placement: Placement {
                early_state_uploads: early,
                spilled_checkpoints: spilled,
                kept_layers: r(&mut st, n + 1),
                ..p1
            },
            early_ready: pending && early > 0 && r(&mut st, 2) == 0,
            reload_slots: if spilled > 0 { 1 + r(&mut st, 2) } else { 0 },
            n_state_bufs: if gpu > 0 { ring + late + r(&mut st, 2) } else { 0 },
        };
        tried += 1;
        let ok = same(spec);
        built += usize::from(ok);
        if ok && early > 0 {
            combos[0] += 1;
        }
        if ok && early > 0 && spec.early_ready {
            combos[1] += 1;
        }
        if ok && late > 0 && spilled > 0 {
            combos[2] += 1;
        }
        if ok && gpu > 0 && res > 0 && held > 0 {
            combos[3] += 1;
        }
    }
    let _ = std::panic::take_hook();
    assert!(built > 30000, "{built}");
    eprintln!("equal programs: {built} {combos:?}");
}

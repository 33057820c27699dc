//! Schedule invariants of the layer-boundary checkpoints, on the program data alone: spilled ones
//! go down and come back in order; every backward finds its input where the program says
//! (checkpoint, kept activations or reload buffer) and every checkpoint is freed once, after its
//! last reader.

use super::*;
use crate::program::BackwardInput;

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

/// Kept activations (the first layer's, every layer's; streamed or resident), which the sweep
/// leaves out: they exclude spilled checkpoints.
fn kept_specs() -> Vec<ProgramSpec> {
    let mut v = Vec::new();
    for l in [1usize, 2, 4, 5] {
        for n in [1, 2, 3] {
            for mode in [OptimMode::Exact, OptimMode::Lean] {
                for (resident_layers, kept_layers) in [(0, 1), (0, l), (1, 1), (1, l), (l, l)] {
                    let placement = Placement { resident_layers, kept_layers, ..Placement::default() };
                    v.push(spec_with(l, n, mode, placement));
                }
            }
        }
    }
    v
}

/// Walked in issue order (the compute stream's, where the ops that write, read and free
/// checkpoints run; a spill waits for its producer), boundary `b` is on the device from the op
/// that writes it (the embedding; layer `b - 1`'s forward) until the one that frees it: its
/// `DropCheckpoint` if it is spilled, else its last reader (its layer's backward, which reads it
/// or what its forward kept; the head input's: the loss). Every forward and every backward from a
/// checkpoint reads one still there, a backward from kept activations follows a forward that kept
/// them, a backward from a reload buffer reads the boundary the last reload into that buffer
/// brought back (and waits for it), and each checkpoint is freed exactly once: none outlives the
/// step. What the executor once decided itself (which checkpoint it frees, which reload buffer a
/// backward reads), so a wrong free or reload buffer in the program fails here.
#[test]
fn every_backward_finds_its_input_and_each_checkpoint_is_freed_once_after_its_last_reader() {
    let mut inputs = HashSet::new();
    for s in all_specs().into_iter().chain(kept_specs()) {
        let p = Program::build(s);
        let anc = ancestors(&p);
        let n = s.n_layers;
        let spilled = |b: usize| b < s.placement.spilled_checkpoints;
        let mut live = HashSet::new();
        let mut freed = Vec::new();
        let mut kept = HashSet::new();
        // Reload buffer -> (the boundary it holds, the reload that brought it).
        let mut reloaded: HashMap<usize, (usize, usize)> = HashMap::new();
        for (i, ins) in p.instrs.iter().enumerate() {
            match ins.op {
                Op::Embed => assert!(live.insert(0), "{s:?}"),
                Op::Forward { layer, keep, .. } => {
                    assert!(live.contains(&layer), "{s:?}: forward {layer} reads a freed checkpoint");
                    assert!(live.insert(layer + 1), "{s:?}: boundary {} written twice", layer + 1);
                    if keep {
                        kept.insert(layer);
                    }
                }
                Op::SpillCheckpoint { boundary } => {
                    assert!(live.contains(&boundary), "{s:?}: spill of freed checkpoint {boundary}")
                }
                Op::DropCheckpoint { boundary } => {
                    assert!(spilled(boundary), "{s:?}: drop of checkpoint {boundary}, which is not spilled");
                    assert!(live.remove(&boundary), "{s:?}: checkpoint {boundary} freed twice");
                    freed.push(boundary);
                }
                Op::Loss => {
                    assert!(live.remove(&n), "{s:?}: the loss reads a freed head input");
                    freed.push(n);
                }
                Op::ReloadCheckpoint { boundary, slot } => {
                    reloaded.insert(slot, (boundary, i));
                }
                Op::Backward { layer, input, .. } => {
                    inputs.insert(std::mem::discriminant(&input));
                    match input {
                        BackwardInput::Checkpoint | BackwardInput::Kept => {
                            assert!(!spilled(layer), "{s:?}: spilled {layer}'s backward reads no reload");
                            assert_eq!(
                                input == BackwardInput::Kept,
                                kept.contains(&layer),
                                "{s:?}: backward {layer} and what its forward kept"
                            );
                            assert!(
                                live.remove(&layer),
                                "{s:?}: backward {layer} finds its checkpoint freed"
                            );
                            freed.push(layer);
                        }
                        BackwardInput::Reload(slot) => {
                            assert!(spilled(layer), "{s:?}: backward {layer} reads a reload, not spilled");
                            let held = reloaded.get(&slot).copied();
                            assert_eq!(
                                held.map(|(b, _)| b),
                                Some(layer),
                                "{s:?}: backward {layer} reads reload buffer {slot}"
                            );
                            assert!(held.is_some_and(|(_, r)| anc[i].contains(&r)), "{s:?}: {layer}");
                        }
                    }
                }
                _ => {}
            }
        }
        assert!(live.is_empty(), "{s:?}: checkpoints {live:?} never freed");
        freed.sort_unstable();
        assert_eq!(freed, (0..=n).collect::<Vec<_>>(), "{s:?}: each checkpoint freed once");
    }
    assert_eq!(inputs.len(), 3, "checkpoint, kept and reload inputs all seen");
}

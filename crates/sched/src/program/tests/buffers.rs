//! Schedule invariants of the reusable buffers, on the program data alone: every compute reads
//! the unit it expects from its slot, the ring holds at most `ring_depth` live slots, each layer
//! crosses twice and its gradient once, and no staging or landing buffer is reused before its
//! reader is done.

use super::*;
use crate::program::HostBuf;

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

/// A streamed layer's gradient is downloaded from the bf16 twin exactly when the spec narrows
/// gradients, and then only after the `SumSquares` that narrowed that buffer for that unit; the
/// outer gradient (never narrowed) from its own buffer. Which buffer a download reads is the
/// program's, not the executor's, so a wrong one fails here.
#[test]
fn a_download_reads_the_buffer_its_gradient_was_narrowed_into() {
    let mut narrowed_downloads = 0;
    for s in all_specs() {
        for narrow_grads in [false, s.mode == OptimMode::Exact] {
            let s = ProgramSpec { narrow_grads, ..s };
            let p = Program::build(s);
            let anc = ancestors(&p);
            for (i, ins) in p.instrs.iter().enumerate() {
                let Op::Download { unit, grad_buf, narrowed, .. } = ins.op else { continue };
                assert_eq!(narrowed, narrow_grads && grad_buf.is_some(), "{s:?}: {unit:?}");
                if narrowed {
                    let narrowing =
                        anc[i].iter().any(|&j| p.instrs[j].op == Op::SumSquares { unit, grad_buf });
                    assert!(narrowing, "{s:?}: {unit:?} downloaded from a twin nothing narrowed into");
                    narrowed_downloads += 1;
                }
            }
        }
    }
    assert!(narrowed_downloads > 1000, "{narrowed_downloads} narrowed downloads checked");
}

//! Schedule invariants of the GPU-updated layers' state slots (late downloads, early uploads),
//! checked on the program data alone; the shared spec sweep and helpers are in `tests/mod.rs`.

use super::*;

/// A state slot is overwritten only after the previous layer's state came back out of it, and a
/// GPU-updated layer's backward re-cast reads its master only once it is back in the record.
#[test]
fn state_slots_are_reused_only_after_their_download() {
    let mut n_gpu = 0;
    for s in all_specs().into_iter().filter(|s| s.placement.gpu_updated_layers > 0) {
        let p = Program::build(s);
        let anc = ancestors(&p);
        // An early-upload layer's state is in its early slot from the last step when ready.
        let early = s.early_upload_layers();
        let own_slot = |e: usize| s.n_state_bufs - s.placement.early_state_uploads + e;
        let mut occupant: HashMap<usize, Unit> = early
            .iter()
            .enumerate()
            .filter(|_| s.early_ready)
            .map(|(e, &l)| (own_slot(e), Unit::Layer(l)))
            .collect();
        let download_of: HashMap<Unit, usize> = p
            .instrs
            .iter()
            .enumerate()
            .filter_map(|(i, x)| match x.op {
                Op::DownloadState { unit, .. } => Some((unit, i)),
                _ => None,
            })
            .collect();
        for (i, ins) in p.instrs.iter().enumerate() {
            match ins.op {
                Op::UploadState { buf, unit } | Op::UploadMoments { buf, unit } => {
                    assert!(buf < s.n_state_bufs, "{s:?}");
                    // An early upload reads the record: after this step's download of the
                    // unit's own updated state (from whichever slot it went to).
                    if let (Op::UploadMoments { .. }, Some(&d)) = (&ins.op, download_of.get(&unit)) {
                        assert!(
                            anc[i].contains(&d),
                            "{s:?}: early upload {i} of {unit:?} before its download {d}"
                        );
                    }
                    // The state the slot held must be back in its record first.
                    if let Some(prev) = occupant.insert(buf, unit) {
                        let d = *download_of
                            .get(&prev)
                            .unwrap_or_else(|| panic!("{s:?}: {prev:?} never downloaded"));
                        assert!(
                            anc[i].contains(&d),
                            "{s:?}: state upload {i} of {unit:?} overwrites slot {buf} before {prev:?}'s download {d}"
                        );
                    }
                    n_gpu += 1;
                }
                Op::CopyGrad { buf, unit, .. } => {
                    // It writes the slot's gradient only: the unit's own slot, or one whose late
                    // state (updated in the forward: its gradient read) waits for its download
                    // and the unit's upload behind it.
                    let occupant_now = occupant.get(&buf).copied();
                    let ok = occupant_now == Some(unit)
                        || occupant_now.is_some_and(|o| {
                            let mt_core::Unit::Layer(l) = o else { return false };
                            let updated = p.instrs[..i]
                                .iter()
                                .any(|x| matches!(x.op, Op::UpdateStreamed { unit, .. } if unit == o));
                            s.is_late_download(l) && updated && download_of.get(&o).is_some_and(|&d| d > i)
                        });
                    assert!(
                        ok,
                        "{s:?}: gradient copy {i} of {unit:?} into slot {buf} holding {occupant_now:?}"
                    );
                }
                Op::DownloadState { buf, unit } => {
                    assert_eq!(
                        occupant.get(&buf),
                        Some(&unit),
                        "{s:?}: download {i} of a slot {unit:?} is not in"
                    );
                }
                Op::Stage { unit, update: false, .. } => {
                    if let Some(&d) = download_of.get(&unit) {
                        assert!(
                            ins.waits.contains(&d),
                            "{s:?}: re-cast {i} of {unit:?} before its state is back"
                        );
                    }
                }
                _ => {}
            }
        }
    }
    assert!(n_gpu > 100, "the specs exercise GPU-updated layers ({n_gpu} state uploads)");
}

/// A late-download layer's state stays in its slot through its forward and comes back in the
/// backward (issued after the loss), before its land, which waits for it (so nothing is marked
/// and no gradient overwritten before the record is whole); the `k`-th late download is issued
/// no later than streamed backward position `k × streamed / late`, so that none is left for the
/// end of the step. Every other GPU-updated layer's comes back right after its update, before
/// the next layer's forward. Exactly `late_downloads` held layers are late.
#[test]
fn late_state_downloads_go_out_in_the_backward_before_their_land_and_others_before_the_next_forward() {
    let mut n_late = 0;
    for s in all_specs().into_iter().filter(|s| s.placement.gpu_updated_layers > 0 && s.pending_update) {
        let p = Program::build(s);
        let late: Vec<usize> = (0..s.n_layers).filter(|&l| s.is_late_download(l)).collect();
        assert_eq!(late.len(), s.placement.late_state_downloads, "{s:?}");
        assert!(
            late.iter().all(|&l| l + s.placement.held_layers >= s.n_layers && s.is_gpu_updated(l)),
            "{s:?}"
        );
        let pos = |f: &dyn Fn(&Op) -> bool| p.instrs.iter().position(|i| f(&i.op));
        let loss = pos(&|o| matches!(o, Op::Loss)).unwrap();
        // Streamed backward computes in program order, and the late downloads.
        let streamed_bwd: Vec<usize> = (0..p.instrs.len())
            .filter(|&i| matches!(p.instrs[i].op, Op::Backward { grad_buf: Some(_), .. }))
            .collect();
        let late_dls: Vec<usize> = (0..p.instrs.len())
            .filter(|&i| matches!(p.instrs[i].op, Op::DownloadState { unit: Unit::Layer(l), .. } if late.contains(&l)))
            .collect();
        for (k, &d) in late_dls.iter().enumerate() {
            let due = k * streamed_bwd.len() / late.len();
            assert!(d < streamed_bwd[due], "{s:?}: late download {k} issued after backward position {due}");
        }
        for l in (0..s.n_layers).filter(|&l| gpu_updates(&s, l)) {
            let u = Unit::Layer(l);
            let dl = pos(&|o| matches!(*o, Op::DownloadState { unit, .. } if unit == u)).unwrap();
            let bwd = pos(&|o| matches!(*o, Op::Backward { layer, .. } if layer == l)).unwrap();
            let grad = pos(&|o| matches!(*o, Op::Download { unit, .. } if unit == u)).unwrap();
            let land = pos(&|o| matches!(*o, Op::Land { unit, .. } if unit == u)).unwrap();
            if late.contains(&l) {
                n_late += 1;
                assert!(
                    dl > loss && dl < land && grad < land && bwd < land,
                    "{s:?}: layer {l}'s late download at {dl}"
                );
                assert!(p.instrs[land].waits.contains(&dl), "{s:?}: land of {l} does not wait for it");
            } else {
                let next_fwd = pos(&|o| matches!(*o, Op::Forward { layer, .. } if layer == l + 1));
                assert!(dl < next_fwd.unwrap_or(usize::MAX), "{s:?}: layer {l}'s download is late");
                assert!(dl < bwd, "{s:?}");
            }
        }
    }
    assert!(n_late > 50, "the specs exercise late downloads ({n_late})");
}

/// Early uploads go to layers (GPU-updated, not late) that each pair with a late layer at least
/// `ring_depth` after them (the pairing proves the forward never runs out of state slots: early
/// slots stay taken until their state has gone back). Each early layer's master and moments go up
/// into its slot (the last `early_uploads`) after the loss: right after it if the slot is empty
/// then, else right behind the download of the late layer whose state is there (waiting for
/// it); its gradient is copied there on the compute stream right after its backward, from the
/// buffer that backward accumulated into; nothing writes the slot after those. A step whose
/// early states are ready uploads none of them in its forward, one whose are not uploads each
/// there.
#[test]
fn early_state_uploads_go_up_in_the_backward_into_their_slot_once_it_is_free() {
    let mut n_early = 0;
    let mut n_after_late = 0;
    for s in all_specs().into_iter().filter(|s| s.placement.early_state_uploads > 0) {
        let p = Program::build(s);
        let pairs = s.early_upload_pairs();
        assert_eq!(pairs.len(), s.placement.early_state_uploads, "{s:?}");
        assert_eq!(s.early_upload_layers(), pairs.iter().map(|&(e, _)| e).collect::<Vec<_>>());
        assert!(pairs.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 != w[1].1), "{s:?}: {pairs:?}");
        let at = |f: &dyn Fn(&Op) -> bool| p.instrs.iter().position(|i| f(&i.op));
        let loss = at(&|o| *o == Op::Loss).unwrap();
        for (i, &(l, late)) in pairs.iter().enumerate() {
            assert!(s.is_gpu_updated(l) && !s.is_late_download(l), "{s:?}: {l} is not a candidate");
            assert!(s.is_late_download(late) && l + s.ring_depth <= late, "{s:?}: {l} paired with {late}");
            let (u, own) = (Unit::Layer(l), s.n_state_bufs - s.placement.early_state_uploads + i);
            let moments = at(&|o| matches!(*o, Op::UploadMoments { unit, .. } if unit == u))
                .unwrap_or_else(|| panic!("{s:?}: no early upload of {l}"));
            assert_eq!(p.instrs[moments].op, Op::UploadMoments { unit: u, buf: own }, "{s:?}");
            assert!(moments > loss, "{s:?}: layer {l}'s early upload in the forward");
            if let Some(dl) = at(&|o| matches!(*o, Op::DownloadState { unit, .. } if unit == u)) {
                assert!(dl < loss, "{s:?}: layer {l} downloads late");
                // The record it reads is whole: its own download is waited for (it may have gone
                // out of another slot).
                assert!(
                    p.instrs[moments].waits.contains(&dl),
                    "{s:?}: {l}'s early upload before its download"
                );
            }
            // The slot's last download before it: waited for; a late one's just before it.
            let last_dl = (0..moments)
                .rev()
                .find(|&j| matches!(p.instrs[j].op, Op::DownloadState { buf, .. } if buf == own));
            if let Some(dl) = last_dl {
                assert!(p.instrs[moments].waits.contains(&dl), "{s:?}: {l}'s early upload before {dl}");
                if dl > loss {
                    assert_eq!(moments, dl + 1, "{s:?}: {l}'s early upload right behind the late download");
                    n_after_late += 1;
                }
            }
            if last_dl.is_none_or(|dl| dl < loss) {
                assert!(
                    p.instrs[loss + 1..moments].iter().all(|x| matches!(x.op, Op::UploadMoments { .. })),
                    "{s:?}: {l}'s early upload right after the loss"
                );
            }
            let bwd = at(&|o| matches!(*o, Op::Backward { layer, .. } if layer == l)).unwrap();
            let Op::Backward { grad_buf: Some(k), .. } = p.instrs[bwd].op else {
                panic!("{s:?}: layer {l} resident")
            };
            let narrowed = s.narrow_grads;
            assert_eq!(
                p.instrs[bwd + 1].op,
                Op::CopyGrad { unit: u, grad_buf: k, buf: own, narrowed },
                "{s:?}"
            );
            assert_eq!(p.instrs[bwd + 1].stream, Stream::Compute);
            let last = moments.max(bwd + 1);
            let later_writes = p.instrs[last + 1..]
                .iter()
                .filter(|i| match i.op {
                    Op::UploadState { buf, .. }
                    | Op::UploadMoments { buf, .. }
                    | Op::UpdateStreamed { buf, .. }
                    | Op::CopyGrad { buf, .. } => buf == own,
                    _ => false,
                })
                .count();
            assert_eq!(later_writes, 0, "{s:?}: slot {own} overwritten after layer {l}'s early state");
            let in_forward = (0..loss)
                .filter(|&i| matches!(p.instrs[i].op, Op::UploadState { unit, .. } if unit == u))
                .count();
            let expected = usize::from(s.pending_update && !s.early_ready);
            assert_eq!(in_forward, expected, "{s:?}: layer {l}'s forward state uploads");
            n_early += 1;
        }
        assert_eq!(p.moment_uploads().count(), s.placement.early_state_uploads, "{s:?}");
    }
    assert!(n_early > 50, "the specs exercise early uploads ({n_early})");
    assert!(n_after_late > 10, "the specs exercise early uploads behind late downloads ({n_after_late})");
}

/// The pairings of 3.6B placements (28 layers, all held, 14 or 17 GPU-updated, 5 late, ring depth
/// 2; the planner picks 14): one early layer for each late one, each near the middle of the
/// stretch before its partner; and a late layer too close to the front has no partner.
#[test]
fn slot_pairs_spread_the_early_layers_between_the_late_ones() {
    assert_eq!(
        Placement {
            resident_layers: 0,
            held_layers: 28,
            gpu_updated_layers: 14,
            late_state_downloads: 5,
            ..Placement::default()
        }
        .slot_pairs(28, 2),
        vec![(0, 2), (4, 8), (10, 12), (14, 18), (20, 24)]
    );
    assert_eq!(
        Placement {
            resident_layers: 0,
            held_layers: 28,
            gpu_updated_layers: 17,
            late_state_downloads: 5,
            ..Placement::default()
        }
        .slot_pairs(28, 2),
        vec![(0, 2), (5, 9), (10, 13), (15, 18), (22, 25)]
    );
    // Late [0, 4, 8, ...]: 0 has nothing before it.
    let pairs = Placement {
        resident_layers: 0,
        held_layers: 28,
        gpu_updated_layers: 14,
        late_state_downloads: 7,
        ..Placement::default()
    }
    .slot_pairs(28, 2);
    assert_eq!(pairs.len(), 6, "{pairs:?}");
    assert!(pairs.iter().all(|&(_, l)| l != 0), "{pairs:?}");
    // Not held: no late layer, no pair.
    assert!(Placement {
        resident_layers: 0,
        held_layers: 0,
        gpu_updated_layers: 17,
        late_state_downloads: 0,
        ..Placement::default()
    }
    .slot_pairs(28, 2)
    .is_empty());
}

/// GPU-updated layers are spread over the streamed ones: exactly `gpu_updated` of them, none
/// resident, and never two more than one apart from an even spacing.
#[test]
fn gpu_updated_layers_are_spread_evenly_over_the_streamed_ones() {
    for (n, r, k) in [(28, 0, 10), (28, 0, 0), (28, 0, 28), (8, 3, 2), (5, 1, 4), (96, 12, 30)] {
        let s = ProgramSpec {
            n_state_bufs: 2,
            reload_slots: 0,
            placement: Placement {
                gpu_updated_layers: k,
                spilled_checkpoints: 0,
                ..spec_held(n, 2, OptimMode::Exact, true, false, r, 0).placement
            },
            ..spec_held(n, 2, OptimMode::Exact, true, false, r, 0)
        };
        let picked: Vec<usize> = (0..n).filter(|&l| s.is_gpu_updated(l)).collect();
        assert_eq!(picked.len(), k, "{n} layers, {r} resident, {k}: {picked:?}");
        assert!(picked.iter().all(|&l| l >= r));
        for w in picked.windows(2) {
            let gap = w[1] - w[0];
            assert!(gap * k >= (n - r) - k && gap * k <= (n - r) + k, "{n}/{r}/{k}: {picked:?}");
        }
    }
}

/// A step whose early states are not ready (the first with an update pending after a failure, or
/// on a store left with one) fetches an early layer's state from the free list, into a slot
/// other than its early one: its early upload must still come after that download, or it would
/// send the record's master and moments from before the update (found in review: 4 layers, all
/// held, 3 GPU-updated, 2 late, 1 early).
#[test]
fn an_early_upload_reads_the_record_after_its_own_download_from_another_slot() {
    let s = ProgramSpec {
        early_ready: false,
        n_state_bufs: 4,
        reload_slots: 0,
        placement: Placement {
            gpu_updated_layers: 3,
            late_state_downloads: 2,
            early_state_uploads: 1,
            spilled_checkpoints: 0,
            ..spec_held(4, 2, OptimMode::Exact, true, false, 0, 4).placement
        },
        ..spec_held(4, 2, OptimMode::Exact, true, false, 0, 4)
    };
    let p = Program::build(s);
    let anc = ancestors(&p);
    let [early] = s.early_upload_layers()[..] else { panic!("{s:?}: one early layer") };
    let u = Unit::Layer(early);
    let find = |f: &dyn Fn(&Op) -> bool| p.instrs.iter().position(|i| f(&i.op)).unwrap();
    let dl = find(&|o| matches!(*o, Op::DownloadState { unit, .. } if unit == u));
    let up = find(&|o| matches!(*o, Op::UploadMoments { unit, .. } if unit == u));
    let (Op::DownloadState { buf: from, .. }, Op::UploadMoments { buf: to, .. }) =
        (&p.instrs[dl].op, &p.instrs[up].op)
    else {
        unreachable!()
    };
    assert_ne!(from, to, "the case needs the state to have gone out of another slot");
    assert!(anc[up].contains(&dl), "early upload {up} of {u:?} may run before its download {dl}");
}

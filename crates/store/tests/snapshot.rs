//! Checkpoint snapshots: a snapshot restores master, moments, applied counters and header state
//! bitwise into another store, takes no disk blocks for gradients, and is refused when it does
//! not belong to the store or an update is pending.

use mt_core::{ModelConfig, ModelLayout, StateDtype, Unit};
use mt_store::{GradDtype, GradMut, HostStore, StoreState};

fn layout() -> ModelLayout {
    ModelLayout::new(&ModelConfig::tiny_llama())
}

/// Fills every record with values that differ per unit, region and element, and sets a state.
fn fill(store: &HostStore, salt: f32) {
    for u in store.layout().units() {
        let mut r = store.record(u);
        let k = u.index() as f32;
        let p = r.parts();
        for (i, x) in p.master.iter_mut().enumerate() {
            *x = salt + k + i as f32 * 1e-3;
        }
        // The moments are bytes of their encoding, whatever it is; below 0x40 each, so every
        // f32 or bf16 they make is finite (snapshots refuse non-finite states).
        for (i, x) in p.m.iter_mut().enumerate() {
            *x = (salt as usize + 3 * i + u.index()) as u8 & 0x3F;
        }
        for (i, x) in p.v.iter_mut().enumerate() {
            *x = (salt as usize * 7 + i + 5 * u.index()) as u8 & 0x3F;
        }
        if let Some(GradMut::Bf16(g)) = r.grad_mut() {
            g.fill(half::bf16::from_f32(salt + 1.0));
        }
        r.set_applied_step(7 + u.index() as u64);
    }
    store.set_state(StoreState {
        step: 7,
        pending_update: false,
        pending_grad_scale: 1.0,
        pending_lr: 1e-3,
        grad_norm: 0.5,
    });
}

fn same(a: &HostStore, b: &HostStore) {
    for u in a.layout().units() {
        let (ra, rb) = (a.record(u), b.record(u));
        assert_eq!(ra.master(), rb.master(), "{u:?} master");
        assert_eq!(ra.m(), rb.m(), "{u:?} m");
        assert_eq!(ra.v(), rb.v(), "{u:?} v");
        assert_eq!(ra.applied_step(), rb.applied_step(), "{u:?} applied");
    }
    assert_eq!(a.state(), b.state());
}

#[test]
fn a_snapshot_restores_the_training_state_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let src = HostStore::anonymous(&layout(), GradDtype::Bf16).unwrap();
    fill(&src, 1.5);
    let path = dir.path().join("step-7.store");
    let n = src.write_snapshot(&path).unwrap().bytes;
    assert_eq!(n as usize, 4096 + 12 * layout().units().map(|u| layout().unit(u).len).sum::<usize>());
    assert!(!dir.path().join("step-7.store.tmp").exists());

    let dst = HostStore::anonymous(&layout(), GradDtype::Bf16).unwrap();
    fill(&dst, 9.0);
    let state = dst.restore_snapshot(&path).unwrap();
    assert_eq!(state.step, 7);
    same(&src, &dst);
    // The gradient buffer is cleared, not left from before.
    let r = dst.record(Unit::Outer);
    assert!(r.grad().unwrap().to_f32(0, 8).iter().all(|&g| g == 0.0));
    drop(r);

    // A snapshot is a valid store file.
    let opened = HostStore::open(&path, &layout()).unwrap();
    same(&src, &opened);
}

/// With bf16 or 8-bit moments a snapshot holds `4 + 2·s` bytes a parameter (8, 6 and the 8-bit
/// scales), restores bitwise, and is refused by a store keeping another encoding, naming both.
#[test]
fn snapshots_of_every_state_dtype_round_trip_and_refuse_another() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let len = |u| l.unit(u).len;
    for states in StateDtype::ALL {
        let src = HostStore::anonymous_with(&l, GradDtype::Bf16, states).unwrap();
        assert_eq!(src.state_dtype(), states);
        fill(&src, 3.0);
        let path = dir.path().join(format!("{states}.store"));
        let n = src.write_snapshot(&path).unwrap().bytes as usize;
        let want: usize = l.units().map(|u| 4 * len(u) + 2 * states.moment_bytes(len(u))).sum();
        assert_eq!(n, 4096 + want, "{states}");
        let dst = HostStore::anonymous_with(&l, GradDtype::Bf16, states).unwrap();
        dst.restore_snapshot(&path).unwrap();
        same(&src, &dst);
        assert_eq!(HostStore::open(&path, &l).unwrap().state_dtype(), states, "the header records it");
        for other in StateDtype::ALL.into_iter().filter(|&o| o != states) {
            let dst = HostStore::anonymous_with(&l, GradDtype::Bf16, other).unwrap();
            let e = dst.restore_snapshot(&path).unwrap_err().to_string();
            let want = format!("keeps {states} optimizer states and this run {other} ones; resume with --optim-states {states}");
            assert!(e.contains(&want), "{e}");
        }
    }
}

#[test]
fn snapshots_leave_gradients_as_holes() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let src = HostStore::anonymous(&layout(), GradDtype::F32).unwrap();
    fill(&src, 0.25);
    let path = dir.path().join("s.store");
    src.write_snapshot(&path).unwrap();
    let md = std::fs::metadata(&path).unwrap();
    assert_eq!(md.len() as usize, src.bytes());
    // 16 B/param logical, about 12 on disk (filesystems without holes would fail this).
    let on_disk = md.blocks() * 512;
    assert!((on_disk as f64) < 0.85 * md.len() as f64, "{on_disk} of {}", md.len());
}

/// The hash returned while writing is the hash of the file as a reader sees it (the holes as
/// zeros), for every moments' encoding and gradient dtype; one flipped byte changes it.
#[test]
fn a_snapshots_hash_is_the_hash_of_its_file() {
    let dir = tempfile::tempdir().unwrap();
    for (i, (grad, states)) in [GradDtype::F32, GradDtype::Bf16, GradDtype::None]
        .into_iter()
        .flat_map(|g| StateDtype::ALL.map(|s| (g, s)))
        .enumerate()
    {
        let src = HostStore::anonymous_with(&layout(), grad, states).unwrap();
        fill(&src, 0.5 + i as f32);
        let path = dir.path().join(format!("{i}.store"));
        let w = src.write_snapshot(&path).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        assert_eq!(w.len, bytes.len() as u64);
        assert_eq!(w.blake3, blake3::hash(&bytes), "{grad:?} {states}");
        let at = bytes.len() / 3;
        bytes[at] ^= 0x10;
        assert_ne!(w.blake3, blake3::hash(&bytes));
    }
}

#[test]
fn snapshots_are_refused_when_they_do_not_belong() {
    let dir = tempfile::tempdir().unwrap();
    let src = HostStore::anonymous(&layout(), GradDtype::Bf16).unwrap();
    fill(&src, 2.0);
    let path = dir.path().join("s.store");
    src.write_snapshot(&path).unwrap();
    // Never overwritten.
    let e = src.write_snapshot(&path).unwrap_err().to_string();
    assert!(e.contains("already exists"), "{e}");

    // Pending update: refused.
    src.set_state(StoreState { pending_update: true, ..src.state() });
    let e = src.write_snapshot(&dir.path().join("p.store")).unwrap_err().to_string();
    assert!(e.contains("pending"), "{e}");

    // Another gradient dtype, another model, a truncated file: refused, target untouched.
    let other_grad = HostStore::anonymous(&layout(), GradDtype::F32).unwrap();
    fill(&other_grad, 3.0);
    let e = other_grad.restore_snapshot(&path).unwrap_err().to_string();
    assert!(e.contains("gradient dtype"), "{e}");
    assert_eq!(other_grad.record(Unit::Layer(0)).master()[0], 4.0);

    let mut cfg = ModelConfig::tiny_llama();
    cfg.num_hidden_layers = 3;
    let other_model = HostStore::anonymous(&ModelLayout::new(&cfg), GradDtype::Bf16).unwrap();
    let e = other_model.restore_snapshot(&path).unwrap_err().to_string();
    assert!(e.contains("different model"), "{e}");

    let cut = dir.path().join("cut.store");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let dst = HostStore::anonymous(&layout(), GradDtype::Bf16).unwrap();
    let e = dst.restore_snapshot(&cut).unwrap_err().to_string();
    assert!(e.contains("truncated"), "{e}");
}

#[test]
fn no_snapshot_is_written_from_a_non_finite_state() {
    // (encoding, the first moment's bytes to poison, the element the refusal names)
    let poison: [(StateDtype, std::ops::Range<usize>, [u8; 4], usize); 3] = [
        (StateDtype::F32, 20..24, f32::INFINITY.to_ne_bytes(), 5),
        (StateDtype::Bf16, 10..12, [0x80, 0x7F, 0, 0], 5),
        // The second 8-bit block's step (the codes themselves are always finite).
        (StateDtype::Int8, 0..0, f32::INFINITY.to_ne_bytes(), 256),
    ];
    for (states, bytes, value, at) in poison {
        let store = HostStore::anonymous_with(&layout(), GradDtype::Bf16, states).unwrap();
        fill(&store, 1.0);
        {
            let mut r = store.record(Unit::Layer(1));
            let n = r.master().len();
            let p = r.parts();
            let range = if states == StateDtype::Int8 {
                let s = StateDtype::scales_offset(n) + 4;
                s..s + 4
            } else {
                bytes
            };
            let k = range.len();
            p.m[range].copy_from_slice(&value[..k]);
        }
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("s.store");
        let e = store.write_snapshot(&path).unwrap_err().to_string();
        assert!(e.contains(&format!("Layer(1)'s first moment holds inf at element {at}")), "{states}: {e}");
        assert!(std::fs::read_dir(d.path()).unwrap().next().is_none(), "no file, not even a .tmp");
    }
}

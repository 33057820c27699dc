//! Host store behaviour: layout, persistence across reopen, refusal of foreign or damaged files.

use mt_core::{ModelConfig, ModelLayout, StateDtype, Unit};
use mt_store::{GradDtype, GradMut, HostStore, StoreState, PAGE};

fn layout() -> ModelLayout {
    ModelLayout::new(&ModelConfig::tiny_llama())
}

#[test]
fn bytes_per_param_is_12_without_grads_14_with_bf16_and_16_with_f32() {
    let l = layout();
    // Page padding (and one metadata page per record) makes a tiny model a little worse than
    // the asymptotic figure; at 3.6B parameters it is below 0.01 B/param.
    for (g, lo) in [(GradDtype::None, 12.0), (GradDtype::Bf16, 14.0), (GradDtype::F32, 16.0)] {
        let s = HostStore::anonymous(&l, g).unwrap();
        assert!((lo..lo + 0.8).contains(&s.bytes_per_param()), "{g:?}: {}", s.bytes_per_param());
    }
    // Moments of 2 and 1 bytes: 4 + 2·s + g (8-bit scales add 8/256).
    for (states, g, lo) in [
        (StateDtype::Bf16, GradDtype::Bf16, 10.0),
        (StateDtype::Bf16, GradDtype::None, 8.0),
        (StateDtype::Int8, GradDtype::Bf16, 8.03),
        (StateDtype::Int8, GradDtype::None, 6.03),
    ] {
        let s = HostStore::anonymous_with(&l, g, states).unwrap();
        assert!((lo..lo + 0.8).contains(&s.bytes_per_param()), "{states} {g:?}: {}", s.bytes_per_param());
    }
}

#[test]
fn a_store_without_gradient_buffers_says_so() {
    let s = HostStore::anonymous(&layout(), GradDtype::None).unwrap();
    assert!(s.record(Unit::Outer).grad().is_none());
    let err = s.read_grad("model.norm.weight").unwrap_err().to_string();
    assert!(err.contains("no gradient buffers"), "{err}");
}

#[test]
fn records_are_page_aligned_and_disjoint() {
    let l = layout();
    let s = HostStore::anonymous(&l, GradDtype::Bf16).unwrap();
    let mut spans = Vec::new();
    for u in l.units() {
        let mut r = s.record(u);
        for p in [r.master().as_ptr() as usize, r.m().as_ptr() as usize, r.v().as_ptr() as usize] {
            assert_eq!(p % PAGE, 0);
            spans.push((p, p + r.master().len() * 4));
        }
        assert_eq!(r.m().len(), r.master().len() * 4, "fp32 moments");
        let Some(GradMut::Bf16(g)) = r.grad_mut() else { panic!("expected bf16 grads") };
        spans.push((g.as_ptr() as usize, g.as_ptr() as usize + g.len() * 2));
    }
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "regions overlap: {w:?}");
    }
}

#[test]
fn params_survive_reopen_and_state_is_persisted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.mt");
    let l = layout();
    let name = "model.layers.2.mlp.up_proj.weight";
    let n = l.resolve(name).unwrap().1.numel();
    let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    {
        let s = HostStore::create(&path, &l, GradDtype::F32).unwrap();
        s.write_param(name, &data).unwrap();
        s.record(Unit::Layer(2)).parts().m[7] = 0x7e;
        s.record(Unit::Layer(2)).set_applied_step(5);
        s.set_state(StoreState {
            step: 7,
            pending_update: true,
            pending_grad_scale: 0.5,
            pending_lr: 1e-3,
            grad_norm: 2.0,
        });
        s.flush().unwrap();
    }
    let s = HostStore::open(&path, &l).unwrap();
    assert_eq!(s.read_param(name).unwrap(), data);
    assert_eq!(s.record(Unit::Layer(2)).m()[7], 0x7e);
    assert_eq!(s.record(Unit::Layer(2)).applied_step(), 5);
    assert_eq!(
        s.state(),
        StoreState {
            step: 7,
            pending_update: true,
            pending_grad_scale: 0.5,
            pending_lr: 1e-3,
            grad_norm: 2.0
        }
    );
}

/// A file-backed store records its moments' encoding; reopened, it keeps it, and its records are
/// laid out for it (reading and writing the whole moments).
#[test]
fn the_header_records_the_state_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    for states in StateDtype::ALL {
        let path = dir.path().join(format!("{states}.mt"));
        {
            let s = HostStore::create_with(&path, &l, GradDtype::Bf16, states).unwrap();
            let mut r = s.record(Unit::Outer);
            assert_eq!(r.states(), states);
            let p = r.parts();
            assert_eq!(p.m.len(), states.moment_bytes(l.outer.len));
            p.v.fill(0xab);
        }
        let s = HostStore::open(&path, &l).unwrap();
        assert_eq!(s.state_dtype(), states);
        assert!(s.record(Unit::Outer).v().iter().all(|&b| b == 0xab));
        assert_eq!(s.record_addrs(Unit::Layer(0)).moment_bytes, states.moment_bytes(l.layer.len));
    }
}

#[test]
fn refuses_to_overwrite_or_to_open_for_another_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.mt");
    let l = layout();
    drop(HostStore::create(&path, &l, GradDtype::Bf16).unwrap());
    let err = HostStore::create(&path, &l, GradDtype::Bf16).unwrap_err().to_string();
    assert!(err.contains("store.mt"), "{err}");
    let mut cfg = ModelConfig::tiny_llama();
    cfg.num_hidden_layers = 3;
    let err = HostStore::open(&path, &ModelLayout::new(&cfg)).unwrap_err().to_string();
    assert!(err.contains("different model layout"), "{err}");
}

#[test]
fn refuses_truncated_or_foreign_files() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let path = dir.path().join("store.mt");
    drop(HostStore::create(&path, &l, GradDtype::Bf16).unwrap());
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(f.metadata().unwrap().len() - PAGE as u64).unwrap();
    drop(f);
    let err = HostStore::open(&path, &l).unwrap_err().to_string();
    assert!(err.contains("truncated"), "{err}");

    let junk = dir.path().join("junk.bin");
    std::fs::write(&junk, vec![7u8; 3 * PAGE]).unwrap();
    let err = HostStore::open(&junk, &l).unwrap_err().to_string();
    assert!(err.contains("not a megatrain host store"), "{err}");
}

#[test]
fn a_second_opener_is_refused_while_the_store_is_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.mt");
    let l = layout();
    let _held = HostStore::create(&path, &l, GradDtype::Bf16).unwrap();
    let err = HostStore::open(&path, &l).unwrap_err().to_string();
    assert!(err.contains("exclusive lock"), "{err}");
}

#[test]
fn wrong_length_param_write_is_a_shape_error() {
    let s = HostStore::anonymous(&layout(), GradDtype::Bf16).unwrap();
    let err = s.write_param("model.norm.weight", &[1.0; 3]).unwrap_err().to_string();
    assert!(err.contains("model.norm.weight") && err.contains("128"), "{err}");
}

/// A parameter written in parts holds each part where it was put and zeroes the moments there
/// only; a part past the parameter's end is refused naming it.
#[test]
fn param_parts_land_at_their_offsets() {
    let s = HostStore::anonymous(&layout(), GradDtype::Bf16).unwrap();
    let name = "model.norm.weight";
    let n = s.read_param(name).unwrap().len();
    {
        let mut r = s.record(Unit::Outer);
        r.parts().m.fill(7);
    }
    s.write_param_part(name, 100, &[1.0, 2.0]).unwrap();
    s.write_param_part(name, 0, &[3.0]).unwrap();
    let v = s.read_param(name).unwrap();
    assert_eq!((v[0], v[1], v[100], v[101], v[102]), (3.0, 0.0, 1.0, 2.0, 0.0));
    let spec = s.layout().resolve(name).unwrap().1.clone();
    let mut r = s.record(Unit::Outer);
    let m = r.parts().m;
    let at = |i: usize| m[4 * (spec.offset + i)];
    assert_eq!((at(0), at(1), at(100), at(101), at(102)), (0, 7, 0, 0, 7));
    drop(r);
    let err = s.write_param_part(name, n - 1, &[1.0, 2.0]).unwrap_err().to_string();
    assert!(err.contains(name) && err.contains(&format!("{}", n - 1)), "{err}");
}

/// Releasing a unit's gradient region zeroes exactly that region of an anonymous store (and
/// gives its pages back); master, moments and every other record are untouched; a file-backed
/// store keeps its gradient (the file is the training state).
#[test]
fn release_grad_zeroes_only_that_units_gradient() {
    let l = layout();
    let fill = |s: &HostStore| {
        for u in l.units() {
            let mut r = s.record(u);
            let p = r.parts();
            let k = u.index() as f32;
            p.master.fill(k + 1.0);
            p.m.fill(u.index() as u8 + 2);
            p.v.fill(u.index() as u8 + 3);
            if let Some(GradMut::F32(g)) = r.grad_mut() {
                g.fill(k + 4.0);
            }
        }
    };
    let s = HostStore::anonymous(&l, GradDtype::F32).unwrap();
    fill(&s);
    let n = l.unit(Unit::Layer(1)).len;
    assert_eq!(s.release_grad(Unit::Layer(1)).unwrap(), (n * 4).div_ceil(PAGE) * PAGE);
    for u in l.units() {
        let r = s.record(u);
        let k = u.index() as f32;
        let i = u.index() as u8;
        assert!(r.master().iter().all(|&x| x == k + 1.0) && r.m().iter().all(|&x| x == i + 2));
        assert!(r.v().iter().all(|&x| x == i + 3));
        let g = r.grad().unwrap().to_f32(0, r.master().len());
        let want = if u == Unit::Layer(1) { 0.0 } else { k + 4.0 };
        assert!(g.iter().all(|&x| x == want), "{u:?}");
    }
    let dir = tempfile::tempdir().unwrap();
    let f = HostStore::create(&dir.path().join("s.mts"), &l, GradDtype::F32).unwrap();
    fill(&f);
    assert_eq!(f.release_grad(Unit::Layer(1)).unwrap(), 0);
    assert!(f.record(Unit::Layer(1)).grad().unwrap().to_f32(0, n).iter().all(|&x| x == 6.0));
    let none = HostStore::anonymous(&l, GradDtype::None).unwrap();
    assert_eq!(none.release_grad(Unit::Outer).unwrap(), 0);
}

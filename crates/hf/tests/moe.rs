//! Mixture-of-experts checkpoints: an export writes each expert's matrices under the family's
//! per-expert names (what transformers' `save_pretrained` writes), an import reads those or
//! transformers 5's packed tensors, bit for bit, and refuses a file that holds both or misses an
//! expert.

mod common;

use common::*;
use mt_hf::{export, import_weights, read_header, Error, ExportOptions, HfModelDir};
use safetensors::Dtype;

fn names_in(path: &std::path::Path) -> Vec<String> {
    read_header(path).unwrap().tensors.into_iter().map(|t| t.name).collect()
}

#[test]
fn export_writes_experts_one_by_one_and_imports_back_bitwise() {
    let cases = [
        ("qwen3_moe", "model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.1.mlp.gate.weight"),
        (
            "mixtral",
            "model.layers.1.block_sparse_moe.experts.3.w2.weight",
            "model.layers.1.block_sparse_moe.gate.weight",
        ),
        ("olmoe", "model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.gate.weight"),
    ];
    for (name, expert, router) in cases {
        let cfg = config_json(name);
        let store = filled_store(&cfg, 3);
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        export(&store, &cfg, &out, &ExportOptions::default()).unwrap();
        let names = names_in(&out.join("model.safetensors"));
        assert!(names.iter().any(|n| n == expert) && names.iter().any(|n| n == router), "{name}: {names:?}");
        assert!(!names.iter().any(|n| n.contains("gate_up_proj")), "{name}: no packed tensor in an export");
        let layout = store.layout();
        assert_eq!(names.len(), layout.hf_tensors().len());

        let src = HfModelDir::open(&out).unwrap();
        let back = empty_store(&src.config_json);
        let report = import_weights(&src, &back).unwrap();
        assert_eq!(report.n_params, layout.n_params(), "{name}");
        assert_eq!(src.n_params(), layout.n_params(), "{name}");
        assert_params_eq(&store, &back, |x| x);
    }
}

#[test]
fn packed_transformers5_tensors_import_bitwise() {
    let cfg = config_json("qwen3_moe");
    let store = filled_store(&cfg, 5);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("packed");
    write_hf_dir(&dir, &config_text("qwen3_moe"), &raw_params(&store));
    let src = HfModelDir::open(&dir).unwrap();
    let back = empty_store(&src.config_json);
    import_weights(&src, &back).unwrap();
    assert_params_eq(&store, &back, |x| x);
}

#[test]
fn both_forms_or_a_missing_expert_are_refused() {
    let cfg = config_json("mixtral");
    let store = filled_store(&cfg, 7);
    let tmp = tempfile::tempdir().unwrap();
    let mut raws = raw_params(&store);
    let extra = "model.layers.0.block_sparse_moe.experts.1.w1.weight";
    raws.push(Raw::floats(extra, Dtype::F32, vec![16, 32], &store.read_param(extra).unwrap()));
    let both = tmp.path().join("both");
    write_hf_dir(&both, &config_text("mixtral"), &raws);
    let err = import_weights(&HfModelDir::open(&both).unwrap(), &empty_store(&cfg)).unwrap_err();
    assert!(matches!(&err, Error::UnexpectedTensor { name, .. } if name == extra), "{err}");

    let out = tmp.path().join("missing");
    export(&store, &cfg, &out, &ExportOptions::default()).unwrap();
    let keep: Vec<Raw> = names_in(&out.join("model.safetensors"))
        .into_iter()
        .filter(|n| n != "model.layers.1.block_sparse_moe.experts.2.w3.weight")
        .map(|n| {
            let v = store.read_param(&n).unwrap();
            let shape = store.layout().resolve_piece(&n).unwrap().shape;
            Raw::floats(&n, Dtype::F32, shape, &v)
        })
        .collect();
    write_hf_dir(&out, &config_text("mixtral"), &keep);
    let err = import_weights(&HfModelDir::open(&out).unwrap(), &empty_store(&cfg)).unwrap_err();
    assert!(err.to_string().contains("experts.2.w3.weight"), "{err}");
}

/// A NaN in an expert-by-expert checkpoint is refused like one in a dense model's, and every
/// piece imported before it (other experts of the same packed tensor included) goes back to zero.
#[test]
fn a_non_finite_expert_weight_is_refused_and_nothing_stays_imported() {
    let cfg = config_json("mixtral");
    let store = filled_store(&cfg, 9);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    export(&store, &cfg, &out, &ExportOptions::default()).unwrap();
    let path = out.join("model.safetensors");
    // The last tensor in file order, read after every other one.
    let last = read_header(&path).unwrap().tensors.into_iter().max_by_key(|t| t.start).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let at = last.start as usize + last.len as usize - 4;
    bytes[at..at + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let back = empty_store(&cfg);
    let err = import_weights(&HfModelDir::open(&out).unwrap(), &back).unwrap_err();
    assert!(matches!(&err, Error::NonFinite { name, .. } if *name == last.name), "{err}");
    for p in back.layout().hf_tensors() {
        let v = back.read_param(&p.name).unwrap();
        assert!(v.iter().all(|&x| x.to_bits() == 0), "{} kept imported values", p.name);
    }
}

//! GPT-OSS checkpoints as released: a tiny model written the way the released shards are (MXFP4
//! expert blocks and scales, everything else bf16, two shards and an index,
//! `scripts/make_mxfp4.py`) imports into exactly the parameters transformers' own MXFP4
//! dequantisation loads from it; a bf16 export holds transformers' parameters under their
//! names, with no quantization left in config.json; damaged MXFP4 tensors are refused by name
//! and leave the store as it was.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use half::bf16;
use mt_hf::{export, import_weights, read_header, ExportDtype, ExportOptions, HfModelDir};
use mt_store::HostStore;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt_oss_mxfp4")
}

/// The parameters transformers loaded from the fixture (bf16, exact), by name, as f32.
fn expected() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(fixture().join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<_> = st
        .tensors()
        .into_iter()
        .filter(|(_, t)| t.dtype() == Dtype::BF16)
        .map(|(name, t)| {
            let values =
                t.data().chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
            (name, t.shape().to_vec(), values)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn imported() -> (HfModelDir, HostStore) {
    let src = HfModelDir::open(&fixture().join("model")).unwrap();
    let store = empty_store(&src.config_json);
    import_weights(&src, &store).unwrap();
    (src, store)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn released_layout_imports_as_transformers_dequantises_it() {
    let src = HfModelDir::open(&fixture().join("model")).unwrap();
    // The headers count the values of the blocks, [E, out, in/32, 16] bytes holding E·out·in.
    let shard = src.shard_paths().next().unwrap().to_owned();
    let header = read_header(&shard).unwrap();
    let blocks = header.tensors.iter().find(|t| t.name == "model.layers.0.mlp.experts.gate_up_proj_blocks");
    assert_eq!(blocks.unwrap().shape, vec![8, 64, 2, 16]);
    assert_eq!(src.n_params(), mt_core::ModelLayout::new(&src.config).n_params());
    let store = empty_store(&src.config_json);
    let report = import_weights(&src, &store).unwrap();
    // Two expert matrices per layer from MXFP4, every other tensor from bf16.
    assert_eq!(report.source_dtypes.get("MXFP4"), Some(&4), "{:?}", report.source_dtypes);
    assert_eq!(report.n_params, store.layout().n_params());
    let want = expected();
    assert_eq!(want.len(), store.layout().all_params().len());
    for (name, shape, values) in &want {
        let (_, spec) = store.layout().resolve(name).unwrap();
        assert_eq!(&spec.shape, shape, "{name}");
        assert!(bits(&store.read_param(name).unwrap()) == bits(values), "{name} differs from transformers'");
    }
    // The fixture's scale-0 block: subnormal values arrive exact.
    let gate_up = store.read_param("model.layers.0.mlp.experts.gate_up_proj").unwrap();
    assert!(gate_up.iter().any(|x| x.is_subnormal()));
}

#[test]
fn a_bf16_export_holds_transformers_parameters_without_the_quantization() {
    let (src, store) = imported();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("export");
    let opts = ExportOptions {
        dtype: ExportDtype::Bf16,
        copy_files_from: Some(src.dir.clone()),
        ..Default::default()
    };
    export(&store, &src.config_json, &out, &opts).unwrap();
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert!(cfg.get("quantization_config").is_none(), "{cfg}");
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    // transformers' parameter names, shapes and values (exact in bf16).
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want = expected();
    assert_eq!(st.len(), want.len());
    for (name, shape, values) in &want {
        let t = st.tensor(name).unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::BF16, shape.as_slice()), "{name}");
        let got: Vec<u16> = t.data().chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        let want: Vec<u16> = values.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        assert!(got == want, "{name}");
    }
    // And back: the bf16 export imports to the same store.
    let back_src = HfModelDir::open(&out).unwrap();
    let back = empty_store(&back_src.config_json);
    import_weights(&back_src, &back).unwrap();
    assert_params_eq(&store, &back, |x| x);
}

/// A copy of the fixture's model whose shards went through `edit` (tensor by tensor).
fn edited(dir: &Path, edit: impl Fn(&mut Raw)) -> PathBuf {
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    for entry in std::fs::read_dir(fixture().join("model")).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap();
        if p.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let mut raws: Vec<Raw> = st
                .tensors()
                .into_iter()
                .map(|(n, t)| Raw {
                    name: n,
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    bytes: t.data().to_vec(),
                })
                .collect();
            raws.iter_mut().for_each(&edit);
            write_safetensors(&model.join(name), &raws);
        } else {
            std::fs::copy(&p, model.join(name)).unwrap();
        }
    }
    model
}

/// The import of `model` fails; its message contains every one of `needles`, and the store
/// is left all zero.
fn refused(model: &Path, needles: &[&str]) {
    let err = match HfModelDir::open(model) {
        Err(e) => e,
        Ok(src) => {
            let store = empty_store(&src.config_json);
            let err = import_weights(&src, &store).unwrap_err();
            for (name, _, _) in store.layout().all_params() {
                assert!(
                    store.read_param(&name).unwrap().iter().all(|&x| x == 0.0),
                    "{name} was left written"
                );
            }
            err
        }
    };
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "{msg:?} lacks {n:?}");
    }
}

#[test]
fn damaged_mxfp4_tensors_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    // E8M0's NaN, in layer 1 (read after layer 0 was written: that goes back to zero).
    let m = edited(&tmp.path().join("nan"), |r| {
        if r.name == "model.layers.1.mlp.experts.down_proj_scales" {
            r.bytes[5] = 255;
        }
    });
    refused(&m, &["model.layers.1.mlp.experts.down_proj_scales", "expert 0, row 5", "scale 255"]);
    // Past f32's range: the largest scale with E2M1's 6.
    let m = edited(&tmp.path().join("overflow"), |r| {
        if r.name == "model.layers.0.mlp.experts.gate_up_proj_scales" {
            r.bytes.fill(254);
        } else if r.name == "model.layers.0.mlp.experts.gate_up_proj_blocks" {
            r.bytes[0] = 0x77;
        }
    });
    refused(&m, &["gate_up_proj_blocks", "expert 0, row 0, column 0", "past the range of f32"]);
    // Blocks of another dtype or shape.
    let m = edited(&tmp.path().join("dtype"), |r| {
        if r.name == "model.layers.0.mlp.experts.down_proj_blocks" {
            r.dtype = Dtype::I8;
        }
    });
    refused(&m, &["down_proj_blocks", "dtype I8, expected U8"]);
    let m = edited(&tmp.path().join("shape"), |r| {
        if r.name == "model.layers.0.mlp.experts.down_proj_scales" {
            let n = r.shape.iter().product::<usize>();
            r.shape = vec![n];
        }
    });
    refused(&m, &["down_proj_scales", "has shape [512]", "[8, 64, 1]"]);
    // A missing half.
    let m = edited(&tmp.path().join("missing"), |r| {
        if r.name == "model.layers.1.mlp.experts.gate_up_proj_scales" {
            r.name = "model.layers.1.mlp.experts.gate_up_proj_scale".into();
        }
    });
    refused(&m, &["model.layers.1.mlp.experts.gate_up_proj_scales", "missing"]);
    // Blocks under a config.json that declares no MXFP4.
    let m = edited(&tmp.path().join("undeclared"), |_| {});
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(m.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(m.join("config.json"), cfg.to_string()).unwrap();
    refused(&m, &["gate_up_proj_blocks", "declares no MXFP4"]);
}

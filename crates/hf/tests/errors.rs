//! Every way a model directory can be wrong is refused with an error naming the file and the
//! tensor, before the store changes; a failed export leaves no `config.json` that would make a
//! partial output look complete.

mod common;

use std::fs::OpenOptions;
use std::path::Path;

use common::*;
use mt_hf::{export, import_weights, Dtype, Error, ExportOptions, HfModelDir};
use serde_json::Value;

/// A valid single-file llama_gqa directory in `dir`; returns the store it was made from.
fn good_dir(dir: &Path) -> mt_store::HostStore {
    let store = filled_store(&config_json("llama_gqa"), 21);
    write_hf_dir(dir, &config_text("llama_gqa"), &raw_params(&store));
    store
}

/// Opens `dir` and imports it into a fresh llama_gqa store, which must stay all zero on error.
fn import_err(dir: &Path) -> Error {
    let src = HfModelDir::open(dir).unwrap();
    let store = empty_store(&src.config_json);
    let err = import_weights(&src, &store).unwrap_err();
    for (name, _, _) in store.layout().all_params() {
        assert!(store.read_param(&name).unwrap().iter().all(|&x| x == 0.0), "refused import wrote {name}");
    }
    err
}

fn sharded_dir(dir: &Path) -> usize {
    let cfg = config_json("llama_gqa");
    let opts = ExportOptions { max_shard_bytes: 50_000, ..ExportOptions::default() };
    export(&filled_store(&cfg, 22), &cfg, dir, &opts).unwrap().n_shards
}

fn assert_mentions(err: &Error, needles: &[&str]) {
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} should mention {n:?}");
    }
}

#[test]
fn a_missing_shard_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let n = sharded_dir(tmp.path());
    let gone = format!("model-00002-of-{n:05}.safetensors");
    std::fs::remove_file(tmp.path().join(&gone)).unwrap();
    let err = HfModelDir::open(tmp.path()).unwrap_err();
    assert!(matches!(err, Error::MissingShard { .. }), "{err:?}");
    assert_mentions(&err, &[&gone, "model.safetensors.index.json"]);
}

#[test]
fn a_truncated_shard_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let n = sharded_dir(tmp.path());
    let name = format!("model-{n:05}-of-{n:05}.safetensors");
    let path = tmp.path().join(&name);
    let len = std::fs::metadata(&path).unwrap().len();
    OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 100).unwrap();
    let err = HfModelDir::open(tmp.path()).unwrap_err();
    assert!(matches!(err, Error::ShardSize { expected, found, .. } if expected == len && found == len - 100));
    assert_mentions(&err, &[&name, "truncated"]);

    // Cut inside the header: its length runs past the end of the file.
    OpenOptions::new().write(true).open(&path).unwrap().set_len(20).unwrap();
    let err = HfModelDir::open(tmp.path()).unwrap_err();
    assert!(matches!(err, Error::BadHeader { .. }), "{err:?}");
    assert_mentions(&err, &[&name]);
}

#[test]
fn a_corrupt_header_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    good_dir(tmp.path());
    let path = tmp.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8] = b'[';
    std::fs::write(&path, &bytes).unwrap();
    let err = HfModelDir::open(tmp.path()).unwrap_err();
    assert!(matches!(err, Error::BadHeader { .. }), "{err:?}");
    assert_mentions(&err, &["model.safetensors"]);

    // Overlapping data offsets are caught by the safetensors crate's validation.
    let t = std::fs::read_to_string(golden_dir().join("llama_gqa.config.json")).unwrap();
    let header = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(&[0; 12]);
    std::fs::write(&path, file).unwrap();
    std::fs::write(tmp.path().join("config.json"), t).unwrap();
    let err = HfModelDir::open(tmp.path()).unwrap_err();
    assert!(matches!(err, Error::BadHeader { .. }), "{err:?}");
}

#[test]
fn a_config_with_another_hidden_size_is_a_shape_mismatch() {
    let tmp = tempfile::tempdir().unwrap();
    let store = filled_store(&config_json("llama_gqa"), 23);
    let mut cfg = config_json("llama_gqa");
    cfg["hidden_size"] = 32.into();
    write_hf_dir(tmp.path(), &cfg.to_string(), &raw_params(&store));
    let err = import_err(tmp.path());
    match &err {
        Error::Shape { name, expected, found, .. } => {
            assert_eq!(name, "model.embed_tokens.weight");
            assert_eq!((&expected[..], &found[..]), (&[128usize, 32][..], &[128usize, 64][..]));
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
    assert_mentions(&err, &["model.embed_tokens.weight", "[128, 32]", "[128, 64]", "model.safetensors"]);
}

#[test]
fn a_missing_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let store = filled_store(&config_json("llama_gqa"), 24);
    let mut tensors = raw_params(&store);
    tensors.retain(|t| t.name != "model.layers.1.self_attn.v_proj.weight");
    write_hf_dir(tmp.path(), &config_text("llama_gqa"), &tensors);
    let err = import_err(tmp.path());
    assert!(matches!(err, Error::MissingTensor { .. }), "{err:?}");
    assert_mentions(&err, &["model.layers.1.self_attn.v_proj.weight", "config.json"]);
}

#[test]
fn an_unexpected_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let store = filled_store(&config_json("llama_gqa"), 25);
    let mut tensors = raw_params(&store);
    tensors.push(Raw::floats("model.layers.0.mlp.extra.weight", Dtype::F32, vec![4], &[0.5; 4]));
    write_hf_dir(tmp.path(), &config_text("llama_gqa"), &tensors);
    let err = import_err(tmp.path());
    assert!(matches!(err, Error::UnexpectedTensor { .. }), "{err:?}");
    assert_mentions(&err, &["model.layers.0.mlp.extra.weight", "model.safetensors"]);

    // A config with fewer layers than the weights: the extra layer is unexpected.
    let mut cfg = config_json("llama_gqa");
    cfg["num_hidden_layers"] = 1.into();
    write_hf_dir(tmp.path(), &cfg.to_string(), &raw_params(&store));
    let err = import_err(tmp.path());
    assert!(
        matches!(&err, Error::UnexpectedTensor { name, .. } if name.starts_with("model.layers.1.")),
        "{err:?}"
    );

    // An untied config with tied weights: lm_head is missing, not silently ignored.
    let mut tied = raw_params(&store);
    tied.retain(|t| t.name != "lm_head.weight");
    write_hf_dir(tmp.path(), &config_text("llama_gqa"), &tied);
    let err = import_err(tmp.path());
    assert!(matches!(&err, Error::MissingTensor { name, .. } if name == "lm_head.weight"), "{err:?}");
}

#[test]
fn an_unknown_model_type_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    good_dir(tmp.path());
    let mut cfg = config_json("llama_gqa");
    cfg["model_type"] = "gpt_neox".into();
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    let err = HfModelDir::open(tmp.path()).unwrap_err();
    assert!(matches!(err, Error::Config { .. }), "{err:?}");
    assert_mentions(&err, &["gpt_neox", "config.json"]);
}

#[test]
fn an_unsupported_dtype_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let store = filled_store(&config_json("llama_gqa"), 26);
    let mut tensors = raw_params(&store);
    let norm = tensors.iter_mut().find(|t| t.name == "model.norm.weight").unwrap();
    norm.dtype = Dtype::I32; // same byte length as F32
    write_hf_dir(tmp.path(), &config_text("llama_gqa"), &tensors);
    let err = import_err(tmp.path());
    assert!(matches!(err, Error::Dtype { .. }), "{err:?}");
    assert_mentions(&err, &["model.norm.weight", "I32"]);
}

#[test]
fn an_index_that_disagrees_with_its_shards_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let n = sharded_dir(tmp.path());
    let path = tmp.path().join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let last = format!("model-{n:05}-of-{n:05}.safetensors");
    index["weight_map"]["model.embed_tokens.weight"] = last.clone().into();
    std::fs::write(&path, index.to_string()).unwrap();
    let err = HfModelDir::open(tmp.path()).unwrap_err();
    assert!(matches!(err, Error::IndexMismatch { .. }), "{err:?}");
    assert_mentions(&err, &["model.embed_tokens.weight", &last]);

    index["weight_map"]["model.embed_tokens.weight"] = "../outside.safetensors".into();
    std::fs::write(&path, index.to_string()).unwrap();
    let err = HfModelDir::open(tmp.path()).unwrap_err();
    assert!(matches!(err, Error::BadIndex { .. }), "{err:?}");
}

#[test]
fn a_directory_without_weights_says_what_was_looked_for() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("config.json"), config_text("llama_gqa")).unwrap();
    std::fs::write(tmp.path().join("pytorch_model.bin"), b"pickle").unwrap();
    let err = HfModelDir::open(tmp.path()).unwrap_err();
    assert!(matches!(err, Error::NoWeights { .. }), "{err:?}");
    assert_mentions(&err, &["model.safetensors", ".bin"]);
    let err = HfModelDir::open(&tmp.path().join("nowhere")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert_mentions(&err, &["config.json"]);
}

#[test]
fn a_store_for_another_model_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    good_dir(tmp.path());
    let src = HfModelDir::open(tmp.path()).unwrap();
    let other = empty_store(&config_json("qwen2_bias"));
    let err = import_weights(&src, &other).unwrap_err();
    assert!(matches!(err, Error::ConfigMismatch(_)), "{err:?}");
    let err =
        export(&other, &src.config_json, &tmp.path().join("out"), &ExportOptions::default()).unwrap_err();
    assert!(matches!(err, Error::ConfigMismatch(_)), "{err:?}");
    assert!(!tmp.path().join("out").exists(), "a refused export creates nothing");
}

#[test]
fn a_failed_export_leaves_no_config_json_and_no_files() {
    let cfg = config_json("llama_gqa");
    let store = filled_store(&cfg, 27);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    // A directory where config.json.tmp must go: every shard is written before it fails.
    std::fs::create_dir_all(out.join("config.json.tmp")).unwrap();
    let opts = ExportOptions { max_shard_bytes: 50_000, ..ExportOptions::default() };
    let err = export(&store, &cfg, &out, &opts).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert_mentions(&err, &["config.json.tmp"]);
    assert_eq!(file_names(&out), ["config.json.tmp"], "only the obstacle may remain");

    // The out path is a regular file.
    let file = tmp.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let err = export(&store, &cfg, &file, &ExportOptions::default()).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
}

#[test]
fn an_export_failing_before_its_commit_leaves_the_earlier_export_intact() {
    let cfg = config_json("llama_gqa");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path();
    let first = filled_store(&cfg, 28);
    let opts = ExportOptions { max_shard_bytes: 50_000, ..ExportOptions::default() };
    export(&first, &cfg, out, &opts).unwrap();
    let before = file_names(out);
    std::fs::create_dir(out.join("config.json.tmp")).unwrap();
    export(&filled_store(&cfg, 29), &cfg, out, &ExportOptions::default()).unwrap_err();
    std::fs::remove_dir(out.join("config.json.tmp")).unwrap();
    assert_eq!(file_names(out), before);
    let src = HfModelDir::open(out).unwrap();
    let back = empty_store(&cfg);
    import_weights(&src, &back).unwrap();
    assert_params_eq(&first, &back, |x| x);
}

#[test]
fn zero_max_shard_bytes_is_refused() {
    let cfg = config_json("llama_gqa");
    let tmp = tempfile::tempdir().unwrap();
    let opts = ExportOptions { max_shard_bytes: 0, ..ExportOptions::default() };
    let err = export(&filled_store(&cfg, 30), &cfg, tmp.path(), &opts).unwrap_err();
    assert!(matches!(err, Error::Options(_)), "{err:?}");
}

#[test]
fn a_shard_cut_after_open_is_a_short_read_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    good_dir(tmp.path());
    let src = HfModelDir::open(tmp.path()).unwrap();
    let path = tmp.path().join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
    let err = import_weights(&src, &empty_store(&src.config_json)).unwrap_err();
    assert!(matches!(err, Error::ReadTensor { .. }), "{err:?}");
    assert_mentions(&err, &["model.safetensors"]);
}

#[test]
fn a_non_finite_weight_is_named_and_nothing_is_imported() {
    let tmp = tempfile::tempdir().unwrap();
    good_dir(tmp.path());
    let path = tmp.path().join("model.safetensors");
    // The last tensor in file order, which the import reads after every other one.
    let h = mt_hf::read_header(&path).unwrap();
    let last = h.tensors.iter().max_by_key(|t| t.start).unwrap().clone();
    let mut bytes = std::fs::read(&path).unwrap();
    let at = last.start as usize + 4 * 3;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = import_err(tmp.path());
    assert!(matches!(err, Error::NonFinite { index: 3, .. }), "{err:?}");
    assert_mentions(&err, &["model.safetensors", &last.name, "NaN at element 3"]);
}

//! Bad input gets a clear error naming the problem, never a panic, and loses nothing.

mod common;

use std::path::Path;

use mt_core::{ModelConfig, ModelLayout};
use mt_sched::{Batch, IGNORE_INDEX};
use mt_store::{GradDtype, HostStore};
use mt_testkit::golden;
use mt_testkit::init::random_params;
use mt_testkit::tol::assert_bitwise_eq;

use common::*;

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn malformed_or_unsupported_config_json_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read_to_string(golden::fixtures_dir().join("llama_gqa.config.json")).unwrap();
    let cases = [
        ("truncated.json", good[..good.len() / 2].to_owned(), "truncated.json"),
        ("gpt2.json", good.replace("\"llama\"", "\"gpt2\""), "gpt2"),
        (
            "no_heads.json",
            good.replace("\"num_attention_heads\"", "\"num_heads_typo\""),
            "num_attention_heads",
        ),
        (
            "bad_kv.json",
            good.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
            "num_key_value_heads",
        ),
        ("longrope.json", good.replace("\"llama3\"", "\"longrope\""), "longrope"),
    ];
    for (file, text, needle) in cases {
        assert_ne!(text, good, "{file}: the edit did not apply");
        let err = ModelConfig::from_file(&write(dir.path(), file, &text)).unwrap_err().to_string();
        assert!(err.contains(needle), "{file}: error {err:?} should mention {needle:?}");
    }
    let err = ModelConfig::from_file(&dir.path().join("missing.json")).unwrap_err().to_string();
    assert!(err.contains("missing.json"), "{err}");
}

#[test]
fn shape_mismatched_fixture_is_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let src = golden::fixtures_dir();
    std::fs::copy(src.join("llama_gqa.config.json"), dir.path().join("llama_gqa.config.json")).unwrap();
    // Same fixture, but the config claims a wider MLP: every MLP tensor is now the wrong shape.
    let cfg = std::fs::read_to_string(dir.path().join("llama_gqa.config.json")).unwrap();
    std::fs::write(
        dir.path().join("llama_gqa.config.json"),
        cfg.replace("\"intermediate_size\": 96", "\"intermediate_size\": 128"),
    )
    .unwrap();
    std::fs::copy(src.join("llama_gqa.safetensors"), dir.path().join("llama_gqa.safetensors")).unwrap();
    let err = golden::load_from(dir.path(), "llama_gqa").unwrap_err().to_string();
    assert!(err.contains("mlp") && err.contains("96") && err.contains("128"), "{err}");

    // And parameters of the wrong shape are refused by the store before anything is written.
    let g = golden::load("llama_gqa").unwrap();
    let store = HostStore::anonymous(&ModelLayout::new(&g.cfg), GradDtype::F32).unwrap();
    let err = store.write_param("model.layers.0.mlp.up_proj.weight", &[0.0; 10]).unwrap_err().to_string();
    assert!(err.contains("model.layers.0.mlp.up_proj.weight") && err.contains("96"), "{err}");
}

#[test]
fn zero_targets_after_masking_is_an_error_and_changes_nothing() {
    let cfg = golden::load("llama_tied").unwrap().cfg;
    let store = store_with(&cfg, &random_params(&cfg, 1), GradDtype::F32);
    let mut e = engine(&cfg, store.clone(), golden_opts(), 0);
    let ok = Batch {
        batch: 1,
        seq: 4,
        input_ids: vec![1, 2, 3, 4],
        targets: vec![2, 3, 4, IGNORE_INDEX],
        positions: None,
    };
    e.step(&ok, 1e-3).unwrap();
    let (before, state) = (params_of(&store), store.state());
    let masked = Batch { targets: vec![IGNORE_INDEX; 4], ..ok.clone() };
    let err = e.step(&masked, 1e-3).unwrap_err().to_string();
    assert!(err.contains("no target tokens"), "{err}");
    let out_of_vocab = Batch { input_ids: vec![1, 2, 3, 999], ..ok };
    let err = e.step(&out_of_vocab, 1e-3).unwrap_err().to_string();
    assert!(err.contains("999") && err.contains("vocabulary"), "{err}");
    // Nothing was lost: the pending update of the good step is still there, params untouched.
    assert_eq!(store.state(), state);
    assert_bitwise_eq(&params_of(&store), &before, "params after refused steps");
}

#[test]
fn a_store_for_another_model_is_refused_by_the_engine() {
    let g = golden::load("llama_gqa").unwrap();
    let mut other = g.cfg.clone();
    other.intermediate_size += 8;
    let store = std::sync::Arc::new(HostStore::anonymous(&ModelLayout::new(&other), GradDtype::F32).unwrap());
    let err =
        mt_sched::Engine::new(&g.cfg, store, mt_sched::CpuBackend::new(Default::default()), golden_opts())
            .unwrap_err()
            .to_string();
    assert!(err.contains("different model layout"), "{err}");
}

#[test]
fn loading_parameters_requires_each_exactly_once() {
    let g = golden::load("qwen3_qknorm").unwrap();
    let store = HostStore::anonymous(&ModelLayout::new(&g.cfg), GradDtype::F32).unwrap();
    let flat: Vec<(String, Vec<f32>)> = g
        .params
        .iter()
        .map(|(n, t)| (n.clone(), t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    let all = || flat.iter().map(|(n, v)| (n, v.as_slice()));
    assert_eq!(mt_sched::load_params(&store, all()).unwrap(), flat.len());
    let err = mt_sched::load_params(&store, all().skip(1)).unwrap_err().to_string();
    assert!(err.contains("1 parameters missing") && err.contains(&flat[0].0), "{err}");
    let err = mt_sched::load_params(&store, all().chain(all().take(1))).unwrap_err().to_string();
    assert!(err.contains("given twice"), "{err}");
}

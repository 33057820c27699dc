//! Tests of the golden fixture loader (on synthetic fixtures written here) and the oracle check
//! that the f64 reference reproduces every committed PyTorch fixture.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use mt_core::ModelConfig;
use serde_json::{json, Value};

use crate::golden::{fixtures_dir, load, load_from, GOLDEN_NAMES};
use crate::init::{random_batch, random_params};
use crate::tol::{assert_close, compare_maps, global_norm, rel_err, Tolerance};
use crate::{Error, ReferenceModel};

/// A scratch directory unique to this process and test.
fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mt-testkit-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tied_config() -> Value {
    json!({"model_type": "qwen2", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": true})
}

/// The tensors of a well-formed fixture for `config`, computed by the f32 reference.
fn synthetic_tensors(config: &Value) -> HashMap<String, Tensor> {
    let cfg = ModelConfig::from_json(config).unwrap();
    let (b, t) = (2, 4);
    let params = random_params(&cfg, 21);
    let (ids, targets) = random_batch(&cfg, b, t, 22, 0.0);
    let x = Tensor::from_slice(&ids, (b, t), &Device::Cpu).unwrap();
    let m = ReferenceModel::new(&cfg, &params, DType::F32).unwrap();
    let (loss, grads) = m.loss_and_grads(&x, &targets).unwrap();
    let mut out = HashMap::new();
    let ids64: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
    out.insert("input_ids".into(), Tensor::from_vec(ids64, (b, t), &Device::Cpu).unwrap());
    out.insert("targets".into(), Tensor::from_vec(targets, (b, t), &Device::Cpu).unwrap());
    out.insert("logits".into(), m.logits(&x).unwrap());
    out.insert("loss".into(), Tensor::new(loss as f32, &Device::Cpu).unwrap());
    let norm = global_norm(&grads).unwrap() as f32;
    out.insert("losses".into(), Tensor::new(&[loss as f32; 3], &Device::Cpu).unwrap());
    out.insert("grad_norms".into(), Tensor::new(&[norm; 3], &Device::Cpu).unwrap());
    for (n, p) in &params {
        out.insert(format!("param.{n}"), p.clone());
        out.insert(format!("grad.{n}"), grads[n].clone());
        out.insert(format!("step3.{n}"), (p * 0.5).unwrap());
    }
    out
}

fn write_fixture(dir: &std::path::Path, name: &str, config: &Value, tensors: &HashMap<String, Tensor>) {
    std::fs::write(dir.join(format!("{name}.config.json")), config.to_string()).unwrap();
    candle_core::safetensors::save(tensors, dir.join(format!("{name}.safetensors"))).unwrap();
}

#[test]
fn synthetic_fixture_round_trips_and_corruptions_are_named() {
    let dir = scratch("golden-roundtrip");
    let config = tied_config();
    let good = synthetic_tensors(&config);
    write_fixture(&dir, "ok", &config, &good);
    let g = load_from(&dir, "ok").unwrap();
    assert_eq!((g.batch, g.seq), (2, 4));
    assert_eq!(g.input_ids.len(), 8);
    assert_eq!(g.losses.len(), 3);
    assert!(!g.params.contains_key("lm_head.weight"));
    assert_eq!(g.params.len(), 2 + 9 + 3); // embed, norm; 9 layer tensors + 3 qkv biases
    let m = ReferenceModel::new(&g.cfg, &g.params, DType::F64).unwrap();
    let (loss, grads) = m.loss_and_grads(&g.input_tensor().unwrap(), &g.targets).unwrap();
    assert!((loss - g.loss).abs() < 1e-5 * g.loss);
    compare_maps(&grads, &g.grads, Tolerance::F32_GOLDEN).assert_ok("synthetic grads");

    let corrupt = |tag: &str, edit: &dyn Fn(&mut HashMap<String, Tensor>)| -> Error {
        let mut t = good.clone();
        edit(&mut t);
        write_fixture(&dir, tag, &config, &t);
        load_from(&dir, tag).unwrap_err()
    };
    let err = corrupt("shape", &|t| {
        t.insert("grad.model.norm.weight".into(), Tensor::zeros(7, DType::F32, &Device::Cpu).unwrap());
    });
    assert!(
        matches!(&err, Error::Shape { what, expected, found }
            if what.contains("grad.model.norm.weight") && expected == &[8] && found == &[7]),
        "{err}"
    );
    let err = corrupt("missing", &|t| {
        t.remove("step3.model.layers.0.mlp.down_proj.weight");
    });
    assert!(err.to_string().contains("step3.model.layers.0.mlp.down_proj.weight"), "{err}");
    let err = corrupt("unknown", &|t| {
        t.insert("param.lm_head.weight".into(), Tensor::zeros((11, 8), DType::F32, &Device::Cpu).unwrap());
    });
    assert!(err.to_string().contains("unknown parameter `lm_head.weight`"), "{err}");
    let err = corrupt("vocab", &|t| {
        t.insert("input_ids".into(), Tensor::new(&[[0i64, 1, 2, 3], [4, 5, 6, 11]], &Device::Cpu).unwrap());
    });
    assert!(err.to_string().contains("input_ids[7] = 11"), "{err}");
    let err = corrupt("targets", &|t| {
        t.insert("targets".into(), Tensor::new(&[[0i64, 1, 2]], &Device::Cpu).unwrap());
    });
    assert!(matches!(&err, Error::Shape { what, .. } if what.contains("targets")), "{err}");
    let err = corrupt("dtype", &|t| {
        t.insert("logits".into(), t["logits"].to_dtype(DType::F64).unwrap());
    });
    assert!(err.to_string().contains("`logits` is F64"), "{err}");

    let err = load_from(&dir, "absent").unwrap_err();
    assert!(matches!(&err, Error::Fixture { path, .. } if path.ends_with("absent.config.json")), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The main oracle check: the f64 reference reproduces PyTorch's logits, loss, gradient norm and
/// every gradient of every committed fixture. Fails (never skips) when a fixture is missing.
#[test]
fn f64_reference_reproduces_every_golden_fixture() {
    let mut failures = Vec::new();
    for name in GOLDEN_NAMES {
        let g = match load(name) {
            Ok(g) => g,
            Err(e) => {
                failures.push(format!("{name}: cannot load from {}: {e}", fixtures_dir().display()));
                continue;
            }
        };
        let m = ReferenceModel::new(&g.cfg, &g.params, DType::F64).unwrap();
        let x = g.input_tensor().unwrap();
        let logits = m.logits(&x).unwrap();
        assert_close(&logits, &g.logits, Tolerance::F32_GOLDEN, &format!("{name} logits"));
        let (loss, grads) = m.loss_and_grads(&x, &g.targets).unwrap();
        assert!((loss - g.loss).abs() <= 1e-5 * g.loss.abs(), "{name}: loss {loss} vs golden {}", g.loss);
        assert!((g.losses[0] - g.loss).abs() <= 1e-5 * g.loss.abs(), "{name}: losses[0] != loss");
        let norm = global_norm(&grads).unwrap();
        assert!(
            (norm - g.grad_norms[0]).abs() <= 1e-5 * g.grad_norms[0],
            "{name}: gradient norm {norm} vs golden grad_norms[0] {}",
            g.grad_norms[0]
        );
        let report = compare_maps(&grads, &g.grads, Tolerance::F32_GOLDEN);
        report.assert_ok(&format!("{name} gradients (f64 reference vs PyTorch fp32)"));
        if let Some(w) = report.worst() {
            eprintln!(
                "{name}: logits rel_err {:.2e}, loss rel_err {:.2e}, grad norm rel_err {:.2e}, worst gradient {} rel_err {:.2e}",
                rel_err(&logits, &g.logits).unwrap(),
                (loss - g.loss).abs() / g.loss.abs(),
                (norm - g.grad_norms[0]).abs() / g.grad_norms[0],
                w.name,
                w.rel_err()
            );
        }
    }
    assert!(failures.is_empty(), "golden fixtures missing or invalid:\n{}", failures.join("\n"));
}

/// The f32 reference meets the tolerance the f32 engine is held to, so `F32_GOLDEN` is
/// achievable by an fp32 implementation of the same math.
#[test]
fn f32_reference_meets_the_f32_golden_tolerance() {
    for name in GOLDEN_NAMES {
        let g = load(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        let m = ReferenceModel::new(&g.cfg, &g.params, DType::F32).unwrap();
        let x = g.input_tensor().unwrap();
        assert_close(&m.logits(&x).unwrap(), &g.logits, Tolerance::F32_GOLDEN, &format!("{name} f32 logits"));
        let (loss, grads) = m.loss_and_grads(&x, &g.targets).unwrap();
        assert!((loss - g.loss).abs() <= 1e-5 * g.loss.abs(), "{name}: f32 loss {loss} vs {}", g.loss);
        let report = compare_maps(&grads, &g.grads, Tolerance::F32_GOLDEN);
        report.assert_ok(&format!("{name} gradients (f32 reference vs PyTorch)"));
        if let Some(w) = report.worst() {
            eprintln!("{name} (f32): worst gradient {} rel_err {:.2e}", w.name, w.rel_err());
        }
    }
}

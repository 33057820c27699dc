//! Tests of the reference model: autograd against central finite differences in f64, f32 against
//! f64, causality, batch independence, RoPE scaling bands, and input validation.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use mt_core::{ModelConfig, ModelLayout};
use serde_json::{json, Value};

use crate::init::{random_batch, random_params, SplitMix64};
use crate::reference::rope_inv_freq;
use crate::tol::{assert_close, compare_maps, to_f64_vec, Tolerance};
use crate::{Error, ReferenceModel};

fn cfg(v: Value) -> ModelConfig {
    ModelConfig::from_json(&v).unwrap()
}

/// Llama with GQA, attention_bias (q/k/v/o biases), head_dim != hidden/heads, llama3 RoPE whose
/// three bands are all hit (wavelengths 6.3, 63, 628, 6283 against thresholds 16 and 64).
fn llama_gqa_bias() -> ModelConfig {
    cfg(json!({"model_type": "llama", "vocab_size": 13, "hidden_size": 12, "intermediate_size": 20,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "attention_bias": true,
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}))
}

/// Tied Qwen2 (q/k/v biases) with linear RoPE scaling.
fn qwen2_tied() -> ModelConfig {
    cfg(json!({"model_type": "qwen2", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6, "rope_theta": 1000.0, "tie_word_embeddings": true,
        "rope_scaling": {"type": "linear", "factor": 2.0}}))
}

/// Qwen3 with q/k norm, MHA.
fn qwen3_qknorm() -> ModelConfig {
    cfg(json!({"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 6,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0}))
}

fn ids_tensor(ids: &[u32], b: usize, t: usize) -> Tensor {
    Tensor::from_slice(ids, (b, t), &Device::Cpu).unwrap()
}

/// Parameters scaled up (matrices std 0.4) so that every gradient is well above finite-difference
/// noise; norm weights and biases keep their init.
fn fd_params(cfg: &ModelConfig, seed: u64) -> BTreeMap<String, Tensor> {
    random_params(cfg, seed)
        .into_iter()
        .map(|(n, t)| {
            let t = if n.ends_with(".weight") && t.rank() == 2 { (t * 20.0).unwrap() } else { t };
            (n, t.to_dtype(DType::F64).unwrap())
        })
        .collect()
}

fn loss_f64(cfg: &ModelConfig, params: &BTreeMap<String, Tensor>, ids: &Tensor, targets: &[i64]) -> f64 {
    let m = ReferenceModel::new(cfg, params, DType::F64).unwrap();
    m.loss(ids, targets).unwrap().to_scalar::<f64>().unwrap()
}

/// Central difference of the loss with respect to one element of one parameter.
fn central_difference(
    cfg: &ModelConfig,
    params: &BTreeMap<String, Tensor>,
    name: &str,
    index: usize,
    ids: &Tensor,
    targets: &[i64],
) -> f64 {
    let h = 1e-5;
    let shape = params[name].dims().to_vec();
    let base = to_f64_vec(&params[name]).unwrap();
    let eval = |delta: f64| {
        let mut v = base.clone();
        v[index] += delta;
        let mut p = params.clone();
        p.insert(name.to_owned(), Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap());
        loss_f64(cfg, &p, ids, targets)
    };
    (eval(h) - eval(-h)) / (2.0 * h)
}

/// Checks autograd against finite differences on `per_tensor` random entries of every parameter.
/// Error measure per entry: |fd - g| / max|G| (the module's rel_err restricted to the entries).
fn check_against_fd(cfg: &ModelConfig, seed: u64, per_tensor: usize) {
    let params = fd_params(cfg, seed);
    let (b, t) = (2, 5);
    let (ids, targets) = random_batch(cfg, b, t, seed + 1, 0.25);
    let ids = ids_tensor(&ids, b, t);
    let model = ReferenceModel::new(cfg, &params, DType::F64).unwrap();
    let (_, grads) = model.loss_and_grads(&ids, &targets).unwrap();
    assert_eq!(grads.len(), ModelLayout::new(cfg).all_params().len());
    let mut rng = SplitMix64::new(seed + 2);
    let mut worst = (0.0f64, String::new());
    for (name, g) in &grads {
        let g = to_f64_vec(g).unwrap();
        let scale = g.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        assert!(scale > 1e-6, "{name}: gradient is (nearly) zero everywhere ({scale:e})");
        for _ in 0..per_tensor {
            let i = rng.below(g.len() as u64) as usize;
            let fd = central_difference(cfg, &params, name, i, &ids, &targets);
            let rel = (fd - g[i]).abs() / scale;
            assert!(
                rel <= 1e-6,
                "{name}[{i}]: autograd {:e} vs finite difference {fd:e} (rel {rel:e})",
                g[i]
            );
            if rel > worst.0 {
                worst = (rel, format!("{name}[{i}]"));
            }
        }
    }
    eprintln!("{:?}: worst finite-difference rel err {:.2e} at {}", cfg.arch, worst.0, worst.1);
}

#[test]
fn gradients_match_finite_differences_llama_gqa_bias_llama3_rope() {
    check_against_fd(&llama_gqa_bias(), 1, 2);
}

#[test]
fn gradients_match_finite_differences_qwen2_tied_linear_rope() {
    check_against_fd(&qwen2_tied(), 2, 2);
}

#[test]
fn gradients_match_finite_differences_qwen3_qknorm() {
    check_against_fd(&qwen3_qknorm(), 3, 2);
}

#[test]
fn tied_embedding_gradient_includes_the_lm_head_contribution() {
    let cfg = qwen2_tied();
    let params = fd_params(&cfg, 4);
    assert!(!params.contains_key("lm_head.weight"));
    // Tokens 0..=4 only, so rows 5.. of the embedding are reached through the LM head alone.
    let ids: Vec<u32> = vec![0, 3, 1, 4, 2, 2, 4, 0, 1, 3];
    let targets: Vec<i64> = vec![3, 1, 4, 2, -100, 4, 0, 1, 3, -100];
    let x = ids_tensor(&ids, 2, 5);
    let model = ReferenceModel::new(&cfg, &params, DType::F64).unwrap();
    let (_, grads) = model.loss_and_grads(&x, &targets).unwrap();
    assert!(!grads.contains_key("lm_head.weight"));
    let g = to_f64_vec(&grads["model.embed_tokens.weight"]).unwrap();
    let h = cfg.hidden_size;
    for (row, col) in [(7usize, 3usize), (9, 0), (1, 5)] {
        let i = row * h + col;
        let fd = central_difference(&cfg, &params, "model.embed_tokens.weight", i, &x, &targets);
        assert!(g[i].abs() > 1e-4, "embedding row {row} should receive the head's gradient");
        assert!((fd - g[i]).abs() <= 1e-6 * g[i].abs().max(1e-3), "row {row}: autograd {} vs fd {fd}", g[i]);
    }
    // Adding an lm_head to a tied model is refused by name.
    let mut with_head = params.clone();
    with_head.insert("lm_head.weight".into(), params["model.embed_tokens.weight"].clone());
    let err = ReferenceModel::new(&cfg, &with_head, DType::F64).unwrap_err();
    assert!(matches!(&err, Error::UnknownParam(n) if n == "lm_head.weight"), "{err}");
}

#[test]
fn f32_and_f64_references_agree() {
    for cfg in [ModelConfig::tiny_llama(), llama_gqa_bias(), qwen2_tied(), qwen3_qknorm()] {
        let params = random_params(&cfg, 5);
        let (b, t) = (2, 16);
        let (ids, targets) = random_batch(&cfg, b, t, 6, 0.2);
        let x = ids_tensor(&ids, b, t);
        let m32 = ReferenceModel::new(&cfg, &params, DType::F32).unwrap();
        let m64 = ReferenceModel::new(&cfg, &params, DType::F64).unwrap();
        assert_close(&m32.logits(&x).unwrap(), &m64.logits(&x).unwrap(), Tolerance::F32_GOLDEN, "logits");
        let (l32, g32) = m32.loss_and_grads(&x, &targets).unwrap();
        let (l64, g64) = m64.loss_and_grads(&x, &targets).unwrap();
        assert!((l32 - l64).abs() <= 1e-5 * l64.abs(), "loss {l32} vs {l64}");
        let report = compare_maps(&g32, &g64, Tolerance::F32_GOLDEN);
        report.assert_ok(&format!("{:?} f32 vs f64 gradients", cfg.arch));
        assert!(g32.values().all(|g| g.dtype() == DType::F32));
    }
}

#[test]
fn later_tokens_do_not_change_earlier_logits() {
    let cfg = llama_gqa_bias();
    let m = ReferenceModel::new(&cfg, &random_params(&cfg, 7), DType::F64).unwrap();
    let mut ids: Vec<u32> = (0..8).map(|i| (i * 5 % 13) as u32).collect();
    let before = m.logits(&ids_tensor(&ids, 1, 8)).unwrap();
    ids[6] = (ids[6] + 1) % 13;
    let after = m.logits(&ids_tensor(&ids, 1, 8)).unwrap();
    let head = |t: &Tensor, n| t.narrow(1, 0, n).unwrap();
    assert_close(&head(&after, 6), &head(&before, 6), Tolerance::F64_STRICT, "positions 0..6");
    let changed = crate::tol::rel_err(&after.narrow(1, 6, 1).unwrap(), &before.narrow(1, 6, 1).unwrap());
    assert!(changed.unwrap() > 1e-6, "position 6 must see its own token");
}

#[test]
fn batch_rows_are_independent() {
    let cfg = qwen3_qknorm();
    let m = ReferenceModel::new(&cfg, &random_params(&cfg, 8), DType::F64).unwrap();
    let (ids, _) = random_batch(&cfg, 3, 6, 9, 0.0);
    let all = m.logits(&ids_tensor(&ids, 3, 6)).unwrap();
    for b in 0..3 {
        let one = m.logits(&ids_tensor(&ids[b * 6..(b + 1) * 6], 1, 6)).unwrap();
        assert_close(&all.narrow(0, b, 1).unwrap(), &one, Tolerance::F64_STRICT, "row");
    }
}

#[test]
fn loss_is_mean_over_unmasked_targets() {
    let cfg = qwen2_tied();
    let m = ReferenceModel::new(&cfg, &random_params(&cfg, 10), DType::F64).unwrap();
    let (ids, targets) = random_batch(&cfg, 2, 4, 11, 0.0);
    let x = ids_tensor(&ids, 2, 4);
    let logp = to_f64_vec(&m.logits(&x).unwrap()).unwrap();
    let v = cfg.vocab_size;
    let (mut sum, mut n) = (0.0, 0);
    for (pos, &y) in targets.iter().enumerate() {
        if y >= 0 {
            let row = &logp[pos * v..(pos + 1) * v];
            let lse = row.iter().map(|z| z.exp()).sum::<f64>().ln();
            sum += lse - row[y as usize];
            n += 1;
        }
    }
    let loss = m.loss(&x, &targets).unwrap().to_scalar::<f64>().unwrap();
    assert!((loss - sum / n as f64).abs() < 1e-12, "{loss} vs {}", sum / n as f64);
}

#[test]
fn zero_valid_targets_is_an_error() {
    let cfg = qwen2_tied();
    let m = ReferenceModel::new(&cfg, &random_params(&cfg, 12), DType::F32).unwrap();
    let (ids, targets) = random_batch(&cfg, 2, 4, 13, 1.0);
    assert!(targets.iter().all(|&y| y == -100));
    let x = ids_tensor(&ids, 2, 4);
    assert!(matches!(m.loss(&x, &targets), Err(Error::NoTargetTokens)));
    assert!(matches!(m.loss_and_grads(&x, &targets), Err(Error::NoTargetTokens)));
}

#[test]
fn bad_inputs_are_refused_with_a_message() {
    let cfg = qwen2_tied();
    let m = ReferenceModel::new(&cfg, &random_params(&cfg, 14), DType::F32).unwrap();
    let x = ids_tensor(&[1, 2, 3, 4], 1, 4);
    let msg = |r: crate::Result<Tensor>| r.unwrap_err().to_string();
    assert!(msg(m.loss(&x, &[1, 2, 3])).contains("3 targets for 4"));
    assert!(msg(m.loss(&x, &[1, 2, -1, -100])).contains("target -1"));
    assert!(msg(m.loss(&x, &[1, 2, 11, -100])).contains("target 11"));
    assert!(msg(m.logits(&ids_tensor(&[1, 11], 1, 2))).contains("token id 11"));
    let wrong_dtype = Tensor::new(&[[1i64, 2]], &Device::Cpu).unwrap();
    assert!(msg(m.logits(&wrong_dtype)).contains("U32"));
}

#[test]
fn parameter_maps_are_validated_by_name() {
    let cfg = llama_gqa_bias();
    let params = random_params(&cfg, 15);
    let mut p = params.clone();
    p.remove("model.layers.1.self_attn.o_proj.bias");
    let err = ReferenceModel::new(&cfg, &p, DType::F32).unwrap_err();
    assert!(err.to_string().contains("model.layers.1.self_attn.o_proj.bias"), "{err}");
    let mut p = params.clone();
    p.insert(
        "model.layers.0.mlp.up_proj.weight".into(),
        Tensor::zeros((20, 11), DType::F32, &Device::Cpu).unwrap(),
    );
    let err = ReferenceModel::new(&cfg, &p, DType::F32).unwrap_err();
    assert!(
        matches!(&err, Error::Shape { what, expected, found }
            if what == "model.layers.0.mlp.up_proj.weight" && expected == &[20, 12] && found == &[20, 11]),
        "{err}"
    );
    let err = ReferenceModel::new(&cfg, &params, DType::BF16).unwrap_err();
    assert!(matches!(err, Error::Unsupported(_)), "{err}");
}

#[test]
fn set_params_replaces_weights_without_touching_earlier_snapshots() {
    let cfg = qwen3_qknorm();
    let p0 = random_params(&cfg, 16);
    let p1 = random_params(&cfg, 17);
    let mut m = ReferenceModel::new(&cfg, &p0, DType::F32).unwrap();
    let snapshot = m.params();
    m.set_params(&p1).unwrap();
    crate::tol::assert_bitwise_eq(&snapshot, &p0, "snapshot after set_params");
    crate::tol::assert_bitwise_eq(&m.params(), &p1, "new params");
}

#[test]
fn llama3_rope_scaling_keeps_high_divides_low_and_blends_the_middle() {
    let c = llama_gqa_bias();
    let mut plain = c.clone();
    plain.rope_scaling = None;
    let (scaled, base) = (rope_inv_freq(&c), rope_inv_freq(&plain));
    assert_eq!(scaled.len(), 4);
    assert_eq!(base[0], 1.0);
    // wavelengths: 2π (< 16: kept), 20π (between 16 and 64: blended), 200π, 2000π (> 64: / 4)
    assert_eq!(scaled[0], base[0]);
    assert!(scaled[1] < base[1] && scaled[1] > base[1] / 4.0, "{} vs {}", scaled[1], base[1]);
    let smooth = (64.0 / (2.0 * std::f64::consts::PI / f64::from(base[1])) - 1.0) / 3.0;
    let blend = (1.0 - smooth) * f64::from(base[1]) / 4.0 + smooth * f64::from(base[1]);
    assert!((f64::from(scaled[1]) - blend).abs() < 1e-7, "{} vs {blend}", scaled[1]);
    assert_eq!(scaled[2], base[2] / 4.0);
    assert_eq!(scaled[3], base[3] / 4.0);
    let linear = rope_inv_freq(&qwen2_tied());
    let mut unscaled = qwen2_tied();
    unscaled.rope_scaling = None;
    for (l, u) in linear.iter().zip(rope_inv_freq(&unscaled)) {
        assert_eq!(*l, u / 2.0);
    }
}

//! Gradient checks in f64: every explicit backward against candle autograd run over the same
//! forward, and the forward against an independent naive transcription of transformers.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::*;
use mt_core::{ModelConfig, ModelLayout};
use mt_layers::{names, DecoderLayer, GradSink, LayerWeights, Outer, OuterWeights, Rope};

/// Tolerance of f64 gradient checks: both sides compute the same derivative in a different
/// order, so they agree to a few hundred ulps.
const F64_TOL: f64 = 1e-10;

fn check_decoder(name: &str, cfg: &ModelConfig, b: usize, t: usize, seed: u64) {
    check_decoder_layer(name, cfg, 0, b, t, seed);
}

/// [`check_decoder`] for layer `layer` of `cfg` (GPT-OSS's layers differ by index); the naive
/// transcription has no sinks or windows.
fn check_decoder_layer(name: &str, cfg: &ModelConfig, layer: usize, b: usize, t: usize, seed: u64) {
    let layout = ModelLayout::new(cfg).layer;
    let mut rng = rng(seed);
    let slot = Var::from_tensor(&random_slot(&mut rng, &layout)).unwrap();
    let x = Var::from_tensor(&randn(&mut rng, &[b, t, cfg.hidden_size], 1.0)).unwrap();
    let r = randn(&mut rng, &[b, t, cfg.hidden_size], 1.0);
    let rope = Rope::new(cfg, 16, DType::F64, &Device::Cpu).unwrap();
    let layer = DecoderLayer::new(cfg).for_layer(layer).unwrap();

    // Autograd over the library's own forward, with weights bound as views of the flat Var.
    let w = LayerWeights::bind(cfg, &layout, slot.as_tensor()).unwrap();
    let out = layer.forward(&w, x.as_tensor(), &rope).unwrap();
    let store = (&out * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let want_slot = store.get(slot.as_tensor()).unwrap();
    let want_dx = store.get(x.as_tensor()).unwrap();

    // The explicit backward with dy = R.
    let plain = slot.as_tensor().detach();
    let w = LayerWeights::bind(cfg, &layout, &plain).unwrap();
    let buf = Tensor::zeros(layout.len, DType::F64, &Device::Cpu).unwrap();
    let sink = GradSink::new(&layout, &buf).unwrap();
    let dx = layer.backward(&w, &x.as_tensor().detach(), &r, &rope, &sink).unwrap();

    let e = rel_err(&dx, want_dx);
    assert!(e <= F64_TOL, "{name}: dx off by {e:e}");
    assert_buffers_close(name, &layout, &buf, want_slot, F64_TOL, &[]);

    if cfg.attention_sinks {
        return;
    }
    // And the forward against the naive transformers transcription.
    let want_out = reference_layer(cfg, &w, &x.as_tensor().detach());
    let e = rel_err(&out.detach(), &want_out);
    assert!(e <= 1e-12, "{name}: forward differs from the reference transcription by {e:e}");
}

#[test]
fn decoder_llama_gqa_llama3_rope_matches_autograd() {
    check_decoder("llama_gqa", &llama_gqa(), 2, 7, 1);
}

#[test]
fn decoder_llama_attention_bias_matches_autograd() {
    check_decoder("llama_bias", &llama_bias(), 2, 6, 2);
}

#[test]
fn decoder_qwen2_qkv_bias_matches_autograd() {
    check_decoder("qwen2", &qwen2(), 3, 5, 3);
}

#[test]
fn decoder_qwen3_qk_norm_matches_autograd() {
    check_decoder("qwen3", &qwen3(), 2, 8, 4);
}

/// GPT-OSS's attention on its windowed layer (3 keys of 7) and its full one: the sinks'
/// gradient, the q/k/v/o biases', YaRN's scaled tables and the norms that multiply their weight
/// before the cast, against autograd over the same forward. With a dense MLP: a mixture of
/// experts routes on the host, out of autograd's sight; GPT-OSS's experts, router and clamped
/// GLU are checked against transformers and the reference model by the golden fixture
/// (`crates/sched/tests/golden_moe.rs`).
#[test]
fn decoder_gpt_oss_attention_with_sinks_and_window_matches_autograd() {
    let cfg = ModelConfig { moe: None, ..gpt_oss() };
    assert_eq!((cfg.layer_window(0), cfg.layer_window(1)), (Some(3), None));
    check_decoder_layer("gpt_oss windowed", &cfg, 0, 2, 7, 6);
    check_decoder_layer("gpt_oss full", &cfg, 1, 2, 7, 7);
}

#[test]
fn decoder_at_offset_positions_is_shift_invariant_and_bounded() {
    // Causal self-attention of a chunk depends only on relative positions, so the same chunk
    // at positions 5..9 gives the output at 0..4 up to the f32 rounding of the RoPE angles;
    // and its backward agrees with autograd there too.
    let cfg = llama_gqa();
    let layout = ModelLayout::new(&cfg).layer;
    let mut rng = rng(5);
    let slot = Var::from_tensor(&random_slot(&mut rng, &layout)).unwrap();
    let x = Var::from_tensor(&randn(&mut rng, &[1, 4, cfg.hidden_size], 1.0)).unwrap();
    let r = randn(&mut rng, &[1, 4, cfg.hidden_size], 1.0);
    let rope = Rope::new(&cfg, 16, DType::F64, &Device::Cpu).unwrap();
    let layer = DecoderLayer::new(&cfg);
    let w = LayerWeights::bind(&cfg, &layout, slot.as_tensor()).unwrap();
    let a = layer.forward_at(&w, x.as_tensor(), &rope, 0).unwrap();
    let b = layer.forward_at(&w, x.as_tensor(), &rope, 5).unwrap();
    let e = rel_err(&b, &a);
    assert!(e > 0.0 && e < 1e-5, "shifted output differs by {e:e}");
    let store = (&b * &r).unwrap().sum_all().unwrap().backward().unwrap();

    let plain = slot.as_tensor().detach();
    let wp = LayerWeights::bind(&cfg, &layout, &plain).unwrap();
    let buf = Tensor::zeros(layout.len, DType::F64, &Device::Cpu).unwrap();
    let sink = GradSink::new(&layout, &buf).unwrap();
    let dx = layer.backward_at(&wp, &x.as_tensor().detach(), &r, &rope, 5, &sink).unwrap();
    assert!(rel_err(&dx, store.get(x.as_tensor()).unwrap()) <= F64_TOL);
    assert_buffers_close("offset 5", &layout, &buf, store.get(slot.as_tensor()).unwrap(), F64_TOL, &[]);

    let err = layer.forward_at(&wp, &x.as_tensor().detach(), &rope, 13).unwrap_err().to_string();
    assert!(err.contains("13..17") && err.contains("16 positions"), "{err}");
}

/// The loss of the outer unit written independently with candle ops (f64, differentiable).
fn reference_loss(
    cfg: &ModelConfig,
    w: &OuterWeights,
    x: &Tensor,
    targets: &Tensor,
    weights: &Tensor,
) -> Tensor {
    let (b, t, h) = x.dims3().unwrap();
    let n = b * t;
    let xf = x.reshape((n, h)).unwrap();
    let var = xf.sqr().unwrap().mean_keepdim(1).unwrap();
    let r = (var + cfg.rms_norm_eps).unwrap().sqrt().unwrap().recip().unwrap();
    let xn = xf.broadcast_mul(&r).unwrap().broadcast_mul(&w.norm).unwrap();
    let logits = xn.matmul(&w.head().t().unwrap()).unwrap();
    let m = logits.max_keepdim(1).unwrap().detach();
    let lse = (logits.broadcast_sub(&m).unwrap().exp().unwrap().sum_keepdim(1).unwrap().log().unwrap() + m)
        .unwrap();
    let picked = logits.gather(&targets.reshape((n, 1)).unwrap(), 1).unwrap();
    let ce = (lse - picked).unwrap();
    (ce * weights.reshape((n, 1)).unwrap()).unwrap().sum_all().unwrap()
}

/// Targets and normalised weights for a `[b, t]` chunk: every fourth position ignored.
fn targets_and_weights(rng: &mut rand::rngs::StdRng, v: usize, b: usize, t: usize) -> (Tensor, Tensor) {
    use rand::Rng;
    let ids: Vec<u32> = (0..b * t).map(|_| rng.random_range(0..v as u32)).collect();
    let keep: Vec<bool> = (0..b * t).map(|i| i % 4 != 1).collect();
    let n_keep = keep.iter().filter(|k| **k).count() as f64;
    let wts: Vec<f64> = keep.iter().map(|k| if *k { 1.0 / n_keep } else { 0.0 }).collect();
    (
        Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap(),
        Tensor::from_vec(wts, (b, t), &Device::Cpu).unwrap(),
    )
}

fn check_outer(name: &str, cfg: &ModelConfig, seed: u64) {
    let (b, t) = (2, 5);
    let layout = ModelLayout::new(cfg).outer;
    let mut rng = rng(seed);
    let slot = Var::from_tensor(&random_slot(&mut rng, &layout)).unwrap();
    let x = Var::from_tensor(&randn(&mut rng, &[b, t, cfg.hidden_size], 1.0)).unwrap();
    let (targets, weights) = targets_and_weights(&mut rng, cfg.vocab_size, b, t);

    let w = OuterWeights::bind(cfg, &layout, slot.as_tensor()).unwrap();
    let want_loss = reference_loss(cfg, &w, x.as_tensor(), &targets, &weights);
    let store = want_loss.backward().unwrap();
    let want_loss = want_loss.to_scalar::<f64>().unwrap();

    let plain = slot.as_tensor().detach();
    let w = OuterWeights::bind(cfg, &layout, &plain).unwrap();
    let xd = x.as_tensor().detach();
    // 10 rows in blocks of 3: three full blocks and a ragged one.
    let outer = Outer::new(cfg, 3);
    let buf = Tensor::zeros(layout.len, DType::F64, &Device::Cpu).unwrap();
    let sink = GradSink::new(&layout, &buf).unwrap();
    let (loss, dx) = outer.loss_backward(&w, &xd, &targets, &weights, &sink).unwrap();

    assert!((loss - want_loss).abs() <= 1e-12 * want_loss.abs(), "{name}: loss {loss} vs {want_loss}");
    let e = rel_err(&dx, store.get(x.as_tensor()).unwrap());
    assert!(e <= F64_TOL, "{name}: dx off by {e:e}");
    let want_slot = store.get(slot.as_tensor()).unwrap();
    // Untied, the embedding takes no part in the loss.
    let zero: &[&str] = if cfg.tie_word_embeddings { &[] } else { &[names::EMBED] };
    assert_buffers_close(name, &layout, &buf, want_slot, F64_TOL, zero);

    // Forward-only loss and one big block give the same numbers.
    let single = Outer::new(cfg, 1000);
    let l2 = single.loss(&w, &xd, &targets, &weights).unwrap();
    assert!((l2 - loss).abs() <= 1e-13 * loss.abs(), "{name}: block size changed the loss");
    let buf2 = Tensor::zeros(layout.len, DType::F64, &Device::Cpu).unwrap();
    let (_, dx2) =
        single.loss_backward(&w, &xd, &targets, &weights, &GradSink::new(&layout, &buf2).unwrap()).unwrap();
    assert!(rel_err(&dx2, &dx) <= 1e-13 && rel_err(&buf2, &buf) <= 1e-13, "{name}: block size changed grads");

    // Ignored positions contribute nothing to dx.
    let wv: Vec<f64> = weights.flatten_all().unwrap().to_vec1().unwrap();
    let dxv = dx.reshape((b * t, cfg.hidden_size)).unwrap();
    for (i, wi) in wv.iter().enumerate() {
        if *wi == 0.0 {
            assert_eq!(max_abs(&dxv.get(i).unwrap()), 0.0, "{name}: ignored row {i} has a gradient");
        }
    }

    // logits() agrees with the reference logits (rounded to f32).
    let logits = outer.logits(&w, &xd).unwrap();
    assert_eq!(logits.dtype(), DType::F32);
    assert_eq!(logits.dims(), &[b, t, cfg.vocab_size]);
}

#[test]
fn outer_loss_untied_matches_autograd() {
    check_outer("untied", &llama_gqa(), 11);
}

#[test]
fn outer_loss_tied_matches_autograd() {
    let cfg = qwen3();
    assert!(cfg.tie_word_embeddings);
    check_outer("tied", &cfg, 12);
}

#[test]
fn embed_backward_matches_autograd_with_repeated_ids() {
    let cfg = llama_gqa();
    let layout = ModelLayout::new(&cfg).outer;
    let mut rng = rng(13);
    let slot = Var::from_tensor(&random_slot(&mut rng, &layout)).unwrap();
    let ids = Tensor::from_vec(vec![3u32, 7, 3, 0, 49, 7, 3, 12], (2, 4), &Device::Cpu).unwrap();
    let r = randn(&mut rng, &[2, 4, cfg.hidden_size], 1.0);
    let outer = Outer::new(&cfg, 4);

    let w = OuterWeights::bind(&cfg, &layout, slot.as_tensor()).unwrap();
    let x = outer.embed(&w, &ids).unwrap();
    assert_eq!(x.dims(), &[2, 4, cfg.hidden_size]);
    let store = (x * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let want = store.get(slot.as_tensor()).unwrap();

    let buf = Tensor::zeros(layout.len, DType::F64, &Device::Cpu).unwrap();
    outer.embed_backward(&ids, &r, &GradSink::new(&layout, &buf).unwrap()).unwrap();
    let e = rel_err(&buf, want);
    assert!(e <= 1e-15, "embedding gradient off by {e:e}");
    // Row 3 got three contributions, row 1 none.
    let h = cfg.hidden_size;
    assert_eq!(max_abs(&buf.narrow(0, h, h).unwrap()), 0.0);
}

#[test]
fn embed_returns_the_rows_of_the_table() {
    let cfg = llama_gqa();
    let layout = ModelLayout::new(&cfg).outer;
    let slot = random_slot(&mut rng(14), &layout);
    let w = OuterWeights::bind(&cfg, &layout, &slot).unwrap();
    let ids = Tensor::from_vec(vec![5u32, 0], (1, 2), &Device::Cpu).unwrap();
    let x = Outer::new(&cfg, 8).embed(&w, &ids).unwrap();
    assert_eq!(rel_err(&x.get(0).unwrap().get(0).unwrap(), &w.embed.get(5).unwrap()), 0.0);
    assert_eq!(rel_err(&x.get(0).unwrap().get(1).unwrap(), &w.embed.get(0).unwrap()), 0.0);
}

//! Shared fixtures of the layer tests: tiny configurations of every family, seeded random
//! tensors, the relative-error metric, and an independent, deliberately naive transcription of
//! transformers' eager decoder layer (repeat_kv, per-head loops) to check the forward against.
#![allow(dead_code, unreachable_pub)]

use candle_core::{DType, Device, Tensor, D};
use mt_core::{Arch, ClampedGlu, ExpertKind, LayerWindows, ModelConfig, MoeConfig, RopeScaling};
use mt_layers::{LayerWeights, MlpWeights, Rope};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A tiny Llama: h 32, 4 query heads, 2 KV heads (GQA), head_dim 8, Llama-3 RoPE scaling with a
/// small original context so that all three frequency bands occur.
pub fn llama_gqa() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab_size: 50,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64.0,
        }),
        max_position_embeddings: 256,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        qk_norm: false,
        qk_norm_full: false,
        moe: None,
        sliding_window: None,
        attention_sinks: false,
        layer_windows: None,
        lora: None,
    }
}

/// Llama with `attention_bias = true` (bias on q, k, v and o), full multi-head attention and
/// linear RoPE scaling.
pub fn llama_bias() -> ModelConfig {
    ModelConfig {
        num_key_value_heads: 4,
        qkv_bias: true,
        o_bias: true,
        rope_scaling: Some(RopeScaling::Linear { factor: 2.0 }),
        ..llama_gqa()
    }
}

/// Qwen2: bias on q, k, v; a single KV head (multi-query), theta 1e6.
pub fn qwen2() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen2,
        num_key_value_heads: 1,
        qkv_bias: true,
        rope_theta: 1_000_000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-6,
        ..llama_gqa()
    }
}

/// Qwen3: q/k norm, head_dim 16 != hidden / heads = 8, tied embeddings.
pub fn qwen3() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen3,
        head_dim: 16,
        qk_norm: true,
        rope_theta: 1_000_000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        ..llama_gqa()
    }
}

/// Every family, with a name for messages.
pub fn all_configs() -> Vec<(&'static str, ModelConfig)> {
    vec![("llama_gqa", llama_gqa()), ("llama_bias", llama_bias()), ("qwen2", qwen2()), ("qwen3", qwen3())]
}

/// Tiny mixtures of experts of each family (4 experts, top-2): Qwen3-MoE (renormalised top-k),
/// Mixtral, OLMoE (q/k norm over the projections).
pub fn moe_configs() -> Vec<(&'static str, ModelConfig)> {
    let moe = |norm_topk_prob| {
        Some(MoeConfig {
            num_experts: 4,
            num_experts_per_tok: 2,
            moe_intermediate_size: 12,
            norm_topk_prob,
            router_aux_loss_coef: 0.01,
            output_router_logits: true,
            experts: ExpertKind::SwiGlu,
        })
    };
    let qwen3_moe = ModelConfig { arch: Arch::Qwen3Moe, moe: moe(true), ..qwen3() };
    let mixtral = ModelConfig { arch: Arch::Mixtral, moe: moe(true), ..llama_gqa() };
    let olmoe = ModelConfig {
        arch: Arch::Olmoe,
        moe: moe(false),
        qk_norm: true,
        qk_norm_full: true,
        rope_scaling: None,
        ..llama_gqa()
    };
    vec![("qwen3_moe", qwen3_moe), ("mixtral", mixtral), ("olmoe", olmoe), ("gpt_oss", gpt_oss())]
}

/// GPT-OSS at a tiny width: q/k/v/o biases, a sink logit per head, even layers windowed over 3
/// keys, YaRN RoPE (the released parameters: at head dim 8 one frequency kept, two blended, one
/// interpolated), 6 biased experts of which the softmax of the top-4 router logits picks, and a
/// GLU clamp at 0.5, which the random weights' gate and up values cross.
pub fn gpt_oss() -> ModelConfig {
    ModelConfig {
        arch: Arch::GptOss,
        qkv_bias: true,
        o_bias: true,
        rope_theta: 150_000.0,
        rope_scaling: Some(RopeScaling::Yarn {
            factor: 32.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 4096.0,
            truncate: false,
            attention_factor: None,
        }),
        moe: Some(MoeConfig {
            num_experts: 6,
            num_experts_per_tok: 4,
            moe_intermediate_size: 12,
            norm_topk_prob: true,
            router_aux_loss_coef: 0.01,
            output_router_logits: true,
            experts: ExpertKind::GptOss(ClampedGlu { limit: 0.5, alpha: 1.702 }),
        }),
        attention_sinks: true,
        layer_windows: Some(LayerWindows { window: 3, listed: None }),
        ..llama_gqa()
    }
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `n` samples of N(0, 1) (Box-Muller).
pub fn normal(rng: &mut StdRng, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let u1: f64 = 1.0 - rng.random::<f64>();
            let u2: f64 = rng.random::<f64>();
            (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        })
        .collect()
}

/// An f64 tensor of N(0, std²) samples.
pub fn randn(rng: &mut StdRng, shape: &[usize], std: f64) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = normal(rng, n).into_iter().map(|x| x * std).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// A flat f64 slot for `layout`: norms `1 + 0.1 N`, biases `0.1 N` (GPT-OSS's `*_bias` too), matrices `0.2 N` (large
/// enough for non-trivial attention patterns at these tiny widths); padding is random too.
pub fn random_slot(rng: &mut StdRng, layout: &mt_core::UnitLayout) -> Tensor {
    let mut v = normal(rng, layout.len);
    for t in &layout.tensors {
        let is_norm = t.name.contains("norm");
        for x in &mut v[t.offset..t.offset + t.numel()] {
            *x = if is_norm {
                1.0 + 0.1 * *x
            } else if t.name.ends_with("bias") {
                0.1 * *x
            } else {
                0.2 * *x
            };
        }
    }
    Tensor::from_vec(v, layout.len, &Device::Cpu).unwrap()
}

/// `max |a - b| / max |b|`, in f64.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    let diff = (a - &b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
    let scale = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
    let (d, s) = (diff.to_scalar::<f64>().unwrap(), scale.to_scalar::<f64>().unwrap());
    assert!(s > 0.0, "reference tensor is all zeros");
    d / s
}

/// `max |x|`.
pub fn max_abs(x: &Tensor) -> f64 {
    x.to_dtype(DType::F64).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

/// Compares two flat buffers laid out by `layout` tensor by tensor (and the padding, which must
/// be zero in both) and panics naming the first tensor off by more than `tol`. Every tensor's
/// reference gradient must be non-zero, so that no parameter escapes the check, except those
/// named in `zero`, whose gradients must be exactly zero on both sides.
pub fn assert_buffers_close(
    what: &str,
    layout: &mt_core::UnitLayout,
    got: &Tensor,
    want: &Tensor,
    tol: f64,
    zero: &[&str],
) {
    for t in &layout.tensors {
        let g = got.narrow(0, t.offset, t.numel()).unwrap();
        let w = want.narrow(0, t.offset, t.numel()).unwrap();
        if zero.contains(&t.name.as_str()) {
            assert_eq!(max_abs(&g), 0.0, "{what}: {} must get no gradient", t.name);
            assert_eq!(max_abs(&w), 0.0, "{what}: reference gradient of {} is not zero", t.name);
            continue;
        }
        assert!(max_abs(&w) > 0.0, "{what}: reference gradient of {} is zero", t.name);
        let e = rel_err(&g, &w);
        assert!(e <= tol, "{what}: gradient of {} off by {e:e} (tolerance {tol:e})", t.name);
    }
    let mut covered = vec![false; layout.len];
    for t in &layout.tensors {
        covered[t.offset..t.offset + t.numel()].iter_mut().for_each(|c| *c = true);
    }
    let got_v: Vec<f64> = got.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
    for (i, c) in covered.iter().enumerate() {
        if !c {
            assert_eq!(got_v[i], 0.0, "{what}: padding element {i} of the gradient buffer was written");
        }
    }
}

fn rms_ref(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let var = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let r = (var + eps).unwrap().sqrt().unwrap().recip().unwrap();
    x.broadcast_mul(&r).unwrap().broadcast_mul(w).unwrap()
}

fn lin_ref(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let y = x.broadcast_matmul(&w.t().unwrap()).unwrap();
    match b {
        Some(b) => y.broadcast_add(b).unwrap(),
        None => y,
    }
}

/// transformers' eager LlamaDecoderLayer / Qwen2 / Qwen3, transcribed naively for f64 inputs:
/// heads handled one at a time, `repeat_kv` by explicit head lookup, the mask as an explicit
/// `-inf` matrix, RoPE angles from `Rope::inv_freq` (f32 products, as transformers) with
/// `cos`/`sin` in f64.
pub fn reference_layer(cfg: &ModelConfig, w: &LayerWeights, x: &Tensor) -> Tensor {
    let (b, t, _) = x.dims3().unwrap();
    let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    let eps = cfg.rms_norm_eps;
    let inv = Rope::inv_freq(cfg);
    let mut cos = Vec::new();
    let mut sin = Vec::new();
    for p in 0..t {
        for j in 0..hd {
            let a = f64::from(p as f32 * inv[j % (hd / 2)]);
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    let cos = Tensor::from_vec(cos, (t, hd), &Device::Cpu).unwrap();
    let sin = Tensor::from_vec(sin, (t, hd), &Device::Cpu).unwrap();
    let rope = |x: &Tensor| -> Tensor {
        // x: [t, hd] for one head of one sequence.
        let x1 = x.narrow(1, 0, hd / 2).unwrap();
        let x2 = x.narrow(1, hd / 2, hd / 2).unwrap();
        let rot = Tensor::cat(&[&x2.neg().unwrap(), &x1], 1).unwrap();
        ((x * &cos).unwrap() + (rot * &sin).unwrap()).unwrap()
    };
    let mut mask = vec![0.0f64; t * t];
    for i in 0..t {
        for j in i + 1..t {
            mask[i * t + j] = f64::NEG_INFINITY;
        }
    }
    let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();

    let mut outs = Vec::new();
    for s in 0..b {
        let xs = x.get(s).unwrap(); // [t, h]
        let a = rms_ref(&xs, &w.input_norm, eps);
        let q = lin_ref(&a, &w.q, w.q_bias.as_ref());
        let k = lin_ref(&a, &w.k, w.k_bias.as_ref());
        let v = lin_ref(&a, &w.v, w.v_bias.as_ref());
        let head = |m: &Tensor, i: usize, norm: Option<&Tensor>| -> Tensor {
            let hx = m.narrow(1, i * hd, hd).unwrap();
            match norm {
                Some(nw) => rms_ref(&hx, nw, eps),
                None => hx,
            }
        };
        let mut head_outs = Vec::new();
        for i in 0..nh {
            let kv = i / (nh / nkv); // repeat_kv
            let qi = rope(&head(&q, i, w.q_norm.as_ref()));
            let ki = rope(&head(&k, kv, w.k_norm.as_ref()));
            let vi = head(&v, kv, None);
            let scores = (qi.matmul(&ki.t().unwrap()).unwrap() * (hd as f64).powf(-0.5)).unwrap();
            let scores = (scores + &mask).unwrap();
            let e = scores.exp().unwrap();
            let p = e.broadcast_div(&e.sum_keepdim(1).unwrap()).unwrap();
            head_outs.push(p.matmul(&vi).unwrap());
        }
        let o = Tensor::cat(&head_outs, 1).unwrap();
        let x1 = (&xs + lin_ref(&o, &w.o, w.o_bias.as_ref())).unwrap();
        let c = rms_ref(&x1, &w.post_norm, eps);
        let MlpWeights::Dense { gate, up, down } = &w.mlp else { panic!("the naive layer is dense only") };
        let mid = (lin_ref(&c, gate, None).silu().unwrap() * lin_ref(&c, up, None)).unwrap();
        outs.push((&x1 + lin_ref(&mid, down, None)).unwrap());
    }
    Tensor::stack(&outs, 0).unwrap()
}

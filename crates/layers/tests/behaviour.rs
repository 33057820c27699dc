//! Behaviour of the templates beyond the gradient values: accumulation, zero-copy binding,
//! the RoPE frequency table, bf16 against f32, and refusal of bad inputs.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use mt_core::{ModelConfig, ModelLayout, RopeScaling};
use mt_layers::{names, DecoderLayer, Error, GradSink, LayerWeights, Outer, OuterWeights, Rope};

fn zeros(n: usize, dtype: DType) -> Tensor {
    Tensor::zeros(n, dtype, &Device::Cpu).unwrap()
}

fn ids(v: Vec<u32>, b: usize, t: usize) -> Tensor {
    Tensor::from_vec(v, (b, t), &Device::Cpu).unwrap()
}

#[test]
fn backward_twice_accumulates_twice() {
    for (name, cfg) in all_configs() {
        let layout = ModelLayout::new(&cfg).layer;
        let mut rng = rng(21);
        let slot = random_slot(&mut rng, &layout);
        let x = randn(&mut rng, &[2, 5, cfg.hidden_size], 1.0);
        let dy = randn(&mut rng, &[2, 5, cfg.hidden_size], 1.0);
        let rope = Rope::new(&cfg, 8, DType::F64, &Device::Cpu).unwrap();
        let w = LayerWeights::bind(&cfg, &layout, &slot).unwrap();
        let layer = DecoderLayer::new(&cfg);
        let once = zeros(layout.len, DType::F64);
        let twice = zeros(layout.len, DType::F64);
        layer.backward(&w, &x, &dy, &rope, &GradSink::new(&layout, &once).unwrap()).unwrap();
        let sink = GradSink::new(&layout, &twice).unwrap();
        layer.backward(&w, &x, &dy, &rope, &sink).unwrap();
        layer.backward(&w, &x, &dy, &rope, &sink).unwrap();
        // g + g = 2g exactly in floating point.
        let doubled = (&once * 2.0).unwrap();
        assert_eq!(rel_err(&twice, &doubled), 0.0, "{name}: second backward did not add");
    }
}

#[test]
fn outer_backward_twice_accumulates_twice_into_f32_buffer() {
    for cfg in [llama_gqa(), qwen3()] {
        let layout = ModelLayout::new(&cfg).outer;
        let mut rng = rng(22);
        let slot = random_slot(&mut rng, &layout).to_dtype(DType::F32).unwrap();
        let w = OuterWeights::bind(&cfg, &layout, &slot).unwrap();
        // One block and distinct ids: each gradient element receives one addition per pass
        // (untied), so the second pass doubles the buffer exactly. Tied, the head's and the
        // embedding's contributions to the same tensor are summed in another order.
        let outer = Outer::new(&cfg, 8);
        let tok = ids(vec![1, 2, 3, 4, 5, 6], 2, 3);
        let wts = Tensor::full(1.0f32 / 6.0, (2, 3), &Device::Cpu).unwrap();
        let x = outer.embed(&w, &tok).unwrap();
        let run = |buf: &Tensor| {
            let sink = GradSink::new(&layout, buf).unwrap();
            let (_, dx) = outer.loss_backward(&w, &x, &tok, &wts, &sink).unwrap();
            outer.embed_backward(&tok, &dx, &sink).unwrap();
        };
        let (once, twice) = (zeros(layout.len, DType::F32), zeros(layout.len, DType::F32));
        run(&once);
        run(&twice);
        run(&twice);
        let e = rel_err(&twice, &(&once * 2.0).unwrap());
        let tol = if cfg.tie_word_embeddings { 1e-6 } else { 0.0 };
        assert!(e <= tol, "tied = {}: second pass off by {e:e}", cfg.tie_word_embeddings);
    }
}

#[test]
fn binding_makes_views_not_copies() {
    let cfg = llama_bias();
    let layout = ModelLayout::new(&cfg).layer;
    let slot = random_slot(&mut rng(23), &layout).to_dtype(DType::F32).unwrap();
    let w = LayerWeights::bind(&cfg, &layout, &slot).unwrap();
    let spec = layout.get(names::O_BIAS).unwrap();
    let fresh = Tensor::arange(0f32, spec.numel() as f32, &Device::Cpu).unwrap();
    slot.slice_set(&fresh, 0, spec.offset).unwrap();
    let bias = w.o_bias.as_ref().unwrap();
    assert_eq!(bias.to_vec1::<f32>().unwrap(), fresh.to_vec1::<f32>().unwrap());

    let spec = layout.get(names::DOWN).unwrap();
    let ones = Tensor::ones(spec.numel(), DType::F32, &Device::Cpu).unwrap();
    slot.slice_set(&ones, 0, spec.offset).unwrap();
    let mt_layers::MlpWeights::Dense { down, .. } = &w.mlp else { panic!("a dense layer's weights") };
    assert_eq!(down.dims(), &[cfg.hidden_size, cfg.intermediate_size]);
    assert_eq!(down.sum_all().unwrap().to_scalar::<f32>().unwrap(), spec.numel() as f32);

    let outer_layout = ModelLayout::new(&cfg).outer;
    let outer_slot = zeros(outer_layout.len + 10, DType::F32); // a longer slot is fine
    let ow = OuterWeights::bind(&cfg, &outer_layout, &outer_slot).unwrap();
    let spec = outer_layout.get(names::LM_HEAD).unwrap();
    outer_slot
        .slice_set(&Tensor::ones(spec.numel(), DType::F32, &Device::Cpu).unwrap(), 0, spec.offset)
        .unwrap();
    assert_eq!(max_abs(ow.lm_head.as_ref().unwrap()), 1.0);
    assert_eq!(max_abs(&ow.embed), 0.0);
}

#[test]
fn grad_sink_writes_through_to_the_buffer_and_its_views() {
    let cfg = llama_gqa();
    let layout = ModelLayout::new(&cfg).layer;
    let buf = zeros(layout.len, DType::F32);
    let spec = layout.get(names::POST_NORM).unwrap().clone();
    let view = buf.narrow(0, spec.offset, spec.numel()).unwrap();
    let sink = GradSink::new(&layout, &buf).unwrap();
    let g = Tensor::ones(cfg.hidden_size, DType::F64, &Device::Cpu).unwrap();
    sink.accumulate(names::POST_NORM, &g).unwrap();
    sink.accumulate(names::POST_NORM, &g).unwrap();
    assert_eq!(view.to_vec1::<f32>().unwrap(), vec![2.0; cfg.hidden_size]);
    assert_eq!(buf.sum_all().unwrap().to_scalar::<f32>().unwrap(), 2.0 * cfg.hidden_size as f32);
    // Wrong shape, unknown name, wrong buffer dtype.
    let bad = sink.accumulate(names::POST_NORM, &Tensor::ones((2, 16), DType::F32, &Device::Cpu).unwrap());
    assert!(matches!(bad, Err(Error::Shape { .. })), "{bad:?}");
    assert!(matches!(sink.accumulate("nope", &g), Err(Error::Core(_))));
    let bf = zeros(layout.len, DType::BF16);
    assert!(matches!(GradSink::new(&layout, &bf), Err(Error::DType { .. })));
}

/// A gradient formed in place (the MoE kernels' expert weight gradients) is formed in the f32
/// buffer's own view, or in f32 zeros then added to an f64 buffer; the name is checked.
#[test]
fn grad_sink_forms_a_gradient_in_place_of_the_buffer() {
    let (_, cfg) = moe_configs().remove(0);
    let layout = ModelLayout::new(&cfg).layer;
    let spec = layout.get(names::EXPERTS_DOWN).unwrap().clone();
    let ones = Tensor::ones(spec.shape.as_slice(), DType::F32, &Device::Cpu).unwrap();
    // `slice_set` overwrites: the f32 buffer holds ones however often, the f64 one sums them.
    let set_ones = |g: &Tensor| -> mt_layers::Result<()> {
        assert_eq!(g.dims(), spec.shape.as_slice());
        assert_eq!(g.dtype(), DType::F32);
        Ok(g.slice_set(&ones, 0, 0)?)
    };
    for (dtype, want) in [(DType::F32, 1.0), (DType::F64, 2.0)] {
        let buf = zeros(layout.len, dtype);
        let sink = GradSink::new(&layout, &buf).unwrap();
        sink.accumulate_in_place(names::EXPERTS_DOWN, set_ones).unwrap();
        sink.accumulate_in_place(names::EXPERTS_DOWN, set_ones).unwrap();
        let total = buf.to_dtype(DType::F64).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        assert_eq!(total, want * spec.numel() as f64, "{dtype:?}");
        let region = buf.narrow(0, spec.offset, spec.numel()).unwrap().to_dtype(DType::F64).unwrap();
        assert_eq!(region.min(0).unwrap().to_scalar::<f64>().unwrap(), want, "{dtype:?}");
        assert!(matches!(sink.accumulate_in_place("nope", set_ones), Err(Error::Core(_))));
    }
}

/// Which MoE layers the device kernels take: SwiGLU experts with widths that are multiples of 8,
/// not GPT-OSS's, not a dense model; never on the CPU.
#[test]
fn the_moe_kernels_take_swiglu_experts_within_their_limits() {
    let (_, mut cfg) = moe_configs().remove(0);
    // Expert width 12: not a multiple of 8.
    assert!(!mt_layers::moe_kernels_fit(&cfg));
    cfg.moe.as_mut().unwrap().moe_intermediate_size = 16;
    assert!(mt_layers::moe_kernels_fit(&cfg));
    cfg.moe.as_mut().unwrap().num_experts_per_tok = 33;
    assert!(!mt_layers::moe_kernels_fit(&cfg), "top-33 of 4 experts");
    cfg.moe.as_mut().unwrap().num_experts_per_tok = 2;
    assert!(!mt_layers::moe_kernels_apply(&cfg, &Device::Cpu, DType::BF16, mt_layers::MoeKernels::Device));
    assert!(!mt_layers::moe_kernels_fit(&gpt_oss()));
    assert!(!mt_layers::moe_kernels_fit(&llama_gqa()));
}

/// `1 / theta^(2i/hd)` in f64.
fn plain_inv_freq(theta: f64, hd: usize, i: usize) -> f64 {
    1.0 / theta.powf((2 * i) as f64 / hd as f64)
}

#[test]
fn llama3_inv_freq_matches_hand_computation_in_each_band() {
    // head_dim 16, theta 1e4: wavelengths 2π·10^(k/2), k = 0..7, i.e. about 6.3, 20, 63, 199,
    // 628, 1987, 6283 and 19869. With old context 8192, low 1, high 4: low_wavelen 8192,
    // high_wavelen 2048. So k ≤ 5 is high frequency (kept), k = 6 medium (smoothed), k = 7 low
    // frequency (divided by the factor).
    let cfg = ModelConfig {
        head_dim: 16,
        rope_theta: 10_000.0,
        rope_scaling: Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        }),
        ..llama_gqa()
    };
    let inv = Rope::inv_freq(&cfg);
    assert_eq!(inv.len(), 8);
    let close = |got: f32, want: f64, what: &str| {
        let e = (f64::from(got) - want).abs() / want;
        assert!(e < 5e-7, "{what}: {got} vs {want} (rel {e:e})");
    };
    // High band: unchanged.
    close(inv[0], 1.0, "k=0");
    close(inv[3], plain_inv_freq(1e4, 16, 3), "k=3");
    close(inv[5], plain_inv_freq(1e4, 16, 5), "k=5");
    // Medium band: smooth = (8192 / wavelen - 1) / (4 - 1), wavelen = 2π / f.
    let f6 = plain_inv_freq(1e4, 16, 6);
    let wavelen = 2.0 * std::f64::consts::PI / f6;
    assert!(wavelen > 2048.0 && wavelen < 8192.0);
    let smooth = (8192.0 / wavelen - 1.0) / 3.0;
    close(inv[6], (1.0 - smooth) * f6 / 8.0 + smooth * f6, "k=6");
    assert!(f64::from(inv[6]) < f6 && f64::from(inv[6]) > f6 / 8.0);
    // Low band: divided by 8.
    close(inv[7], plain_inv_freq(1e4, 16, 7) / 8.0, "k=7");

    let linear = ModelConfig { rope_scaling: Some(RopeScaling::Linear { factor: 4.0 }), ..cfg.clone() };
    close(Rope::inv_freq(&linear)[2], plain_inv_freq(1e4, 16, 2) / 4.0, "linear k=2");
    let none = ModelConfig { rope_scaling: None, ..cfg };
    close(Rope::inv_freq(&none)[7], plain_inv_freq(1e4, 16, 7), "default k=7");
}

#[test]
fn rope_table_holds_cat_freqs_freqs() {
    let cfg = llama_gqa();
    let inv = Rope::inv_freq(&cfg);
    let rope = Rope::new(&cfg, 12, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(rope.max_t(), 12);
    let (cos, sin) = rope.cos_sin(9, 3).unwrap();
    let (cos, sin) = (cos.to_vec2::<f32>().unwrap(), sin.to_vec2::<f32>().unwrap());
    let half = cfg.head_dim / 2;
    for (row, pos) in (9..12).enumerate() {
        for i in 0..cfg.head_dim {
            // transformers' f32 angle, its cosine rounded once to f32.
            let angle = f64::from(pos as f32 * inv[i % half]);
            assert_eq!(cos[row][i], angle.cos() as f32, "cos at pos {pos}, dim {i}");
            assert_eq!(sin[row][i], angle.sin() as f32, "sin at pos {pos}, dim {i}");
        }
    }
    assert!(matches!(rope.cos_sin(10, 3), Err(Error::Positions { start: 10, end: 13, max_t: 12 })));
}

/// Tolerance of bf16 against f32: a few bf16 roundings (2^-8 each) through one layer.
const BF16_TOL: f64 = 3e-2;

#[test]
fn bf16_decoder_agrees_with_f32() {
    for (name, cfg) in all_configs() {
        let layout = ModelLayout::new(&cfg).layer;
        let mut rng = rng(31);
        let slot = random_slot(&mut rng, &layout).to_dtype(DType::F32).unwrap();
        let x = randn(&mut rng, &[2, 8, cfg.hidden_size], 1.0).to_dtype(DType::F32).unwrap();
        let dy = randn(&mut rng, &[2, 8, cfg.hidden_size], 1.0).to_dtype(DType::F32).unwrap();
        let layer = DecoderLayer::new(&cfg);
        let mut results = Vec::new();
        for dtype in [DType::F32, DType::BF16] {
            let slot = slot.to_dtype(dtype).unwrap();
            let w = LayerWeights::bind(&cfg, &layout, &slot).unwrap();
            let rope = Rope::new(&cfg, 8, dtype, &Device::Cpu).unwrap();
            let (x, dy) = (x.to_dtype(dtype).unwrap(), dy.to_dtype(dtype).unwrap());
            let out = layer.forward(&w, &x, &rope).unwrap();
            assert_eq!(out.dtype(), dtype);
            let buf = zeros(layout.len, DType::F32);
            let dx = layer.backward(&w, &x, &dy, &rope, &GradSink::new(&layout, &buf).unwrap()).unwrap();
            assert_eq!(dx.dtype(), dtype);
            results.push((out, dx, buf));
        }
        let (f, h) = (&results[0], &results[1]);
        let e = rel_err(&h.0, &f.0);
        assert!(e <= BF16_TOL, "{name}: bf16 forward off by {e:e}");
        let e = rel_err(&h.1, &f.1);
        assert!(e <= BF16_TOL, "{name}: bf16 dx off by {e:e}");
        assert_buffers_close(&format!("{name} bf16"), &layout, &h.2, &f.2, BF16_TOL, &[]);
    }
}

#[test]
fn bf16_outer_agrees_with_f32() {
    for cfg in [llama_gqa(), qwen3()] {
        let layout = ModelLayout::new(&cfg).outer;
        let mut rng = rng(32);
        let slot = random_slot(&mut rng, &layout).to_dtype(DType::F32).unwrap();
        let tok = ids((0..16).map(|i| (i * 7 % 50) as u32).collect(), 2, 8);
        let wts = Tensor::full(1.0f32 / 16.0, (2, 8), &Device::Cpu).unwrap();
        let outer = Outer::new(&cfg, 5);
        let mut results = Vec::new();
        for dtype in [DType::F32, DType::BF16] {
            let slot = slot.to_dtype(dtype).unwrap();
            let w = OuterWeights::bind(&cfg, &layout, &slot).unwrap();
            let x = outer.embed(&w, &tok).unwrap();
            assert_eq!(x.dtype(), dtype);
            let buf = zeros(layout.len, DType::F32);
            let sink = GradSink::new(&layout, &buf).unwrap();
            let (loss, dx) = outer.loss_backward(&w, &x, &tok, &wts, &sink).unwrap();
            assert_eq!(dx.dtype(), dtype);
            outer.embed_backward(&tok, &dx, &sink).unwrap();
            results.push((loss, buf));
        }
        let (lf, lh) = (results[0].0, results[1].0);
        assert!((lh - lf).abs() <= BF16_TOL * lf, "bf16 loss {lh} vs f32 {lf}");
        assert_buffers_close("outer bf16", &layout, &results[1].1, &results[0].1, BF16_TOL, &[]);
    }
}

#[test]
fn f32_loss_of_uniform_logits_is_ln_vocab() {
    // A zero head gives uniform logits: the mean CE is exactly ln V, and the gradient of x is 0.
    let cfg = llama_gqa();
    let layout = ModelLayout::new(&cfg).outer;
    let slot = zeros(layout.len, DType::F32);
    let norm = layout.get(names::FINAL_NORM).unwrap();
    slot.slice_set(&Tensor::ones(norm.numel(), DType::F32, &Device::Cpu).unwrap(), 0, norm.offset).unwrap();
    let w = OuterWeights::bind(&cfg, &layout, &slot).unwrap();
    let x = randn(&mut rng(33), &[1, 4, cfg.hidden_size], 1.0).to_dtype(DType::F32).unwrap();
    let tok = ids(vec![0, 1, 2, 3], 1, 4);
    let wts = Tensor::new(&[[0.5f32, 0.0, 0.5, 0.0]], &Device::Cpu).unwrap();
    let loss = Outer::new(&cfg, 2).loss(&w, &x, &tok, &wts).unwrap();
    assert!((loss - (cfg.vocab_size as f64).ln()).abs() < 1e-6, "{loss}");
}

#[test]
fn short_slot_is_refused_naming_the_expected_length() {
    let cfg = qwen2();
    let layout = ModelLayout::new(&cfg);
    let short = zeros(layout.layer.len - 1, DType::F32);
    let err = LayerWeights::bind(&cfg, &layout.layer, &short).unwrap_err();
    assert!(matches!(err, Error::SlotTooShort { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&layout.layer.len.to_string()) && msg.contains("weight slot"), "{msg}");
    let short = zeros(layout.outer.len - 64, DType::F32);
    let msg = OuterWeights::bind(&cfg, &layout.outer, &short).unwrap_err().to_string();
    assert!(msg.contains(&layout.outer.len.to_string()), "{msg}");
    let msg = GradSink::new(&layout.layer, &short).unwrap_err().to_string();
    assert!(msg.contains("gradient buffer") && msg.contains(&layout.layer.len.to_string()), "{msg}");
    let two_d = Tensor::zeros((2, layout.layer.len), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(LayerWeights::bind(&cfg, &layout.layer, &two_d), Err(Error::Shape { .. })));
}

#[test]
fn layout_of_another_config_is_refused() {
    // A layer layout without biases cannot be bound as a Qwen2 layer.
    let llama = llama_gqa();
    let layout = ModelLayout::new(&llama).layer;
    let slot = zeros(layout.len, DType::F32);
    let err = LayerWeights::bind(&qwen2(), &layout, &slot).unwrap_err().to_string();
    assert!(err.contains("q_proj.bias"), "{err}");
    let wide = ModelConfig { intermediate_size: 64, ..llama };
    let err = LayerWeights::bind(&wide, &layout, &slot).unwrap_err().to_string();
    assert!(err.contains("gate_proj") && err.contains("64"), "{err}");
}

#[test]
fn loss_inputs_with_wrong_shapes_or_types_are_refused() {
    let cfg = llama_gqa();
    let layout = ModelLayout::new(&cfg).outer;
    let slot = zeros(layout.len, DType::F32);
    let w = OuterWeights::bind(&cfg, &layout, &slot).unwrap();
    let buf = zeros(layout.len, DType::F32);
    let sink = GradSink::new(&layout, &buf).unwrap();
    let outer = Outer::new(&cfg, 4);
    let x = Tensor::zeros((2, 3, cfg.hidden_size), DType::F32, &Device::Cpu).unwrap();
    let good_t = ids(vec![0; 6], 2, 3);
    let good_w = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    let cases: Vec<(Tensor, Tensor, &str)> = vec![
        (ids(vec![0; 6], 3, 2), good_w.clone(), "targets"),
        (good_t.clone(), Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap(), "loss weights"),
        (good_t.to_dtype(DType::I64).unwrap(), good_w.clone(), "targets"),
        (good_t.clone(), good_t.clone(), "loss weights"),
    ];
    for (t, wt, needle) in cases {
        let err = outer.loss_backward(&w, &x, &t, &wt, &sink).unwrap_err();
        assert!(matches!(err, Error::Shape { .. } | Error::DType { .. }), "{err:?}");
        assert!(err.to_string().contains(needle), "{err} should name {needle}");
    }
    let x64 = x.to_dtype(DType::F64).unwrap();
    assert!(matches!(outer.loss_backward(&w, &x64, &good_t, &good_w, &sink), Err(Error::DType { .. })));
    let narrow_x = Tensor::zeros((2, 3, 8), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(outer.loss(&w, &narrow_x, &good_t, &good_w), Err(Error::Shape { .. })));
    let dx_bad = Tensor::zeros((2, 2, cfg.hidden_size), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(outer.embed_backward(&good_t, &dx_bad, &sink), Err(Error::Shape { .. })));
    // Out-of-range ids are an error, not a panic.
    assert!(outer.embed(&w, &ids(vec![50, 0], 1, 2)).is_err());
}

#[test]
fn decoder_inputs_with_wrong_shapes_or_types_are_refused() {
    let cfg = ModelConfig { sliding_window: Some(4), ..llama_gqa() };
    let layout = ModelLayout::new(&cfg).layer;
    let slot = zeros(layout.len, DType::F32);
    let w = LayerWeights::bind(&cfg, &layout, &slot).unwrap();
    let rope = Rope::new(&cfg, 8, DType::F32, &Device::Cpu).unwrap();
    let layer = DecoderLayer::new(&cfg);
    let buf = zeros(layout.len, DType::F32);
    let sink = GradSink::new(&layout, &buf).unwrap();
    let x = Tensor::zeros((1, 4, cfg.hidden_size), DType::F32, &Device::Cpu).unwrap();
    assert!(layer.forward(&w, &x, &rope).is_ok());
    let bad_h = Tensor::zeros((1, 4, 16), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(layer.forward(&w, &bad_h, &rope), Err(Error::Shape { .. })));
    let bad_dtype = x.to_dtype(DType::F64).unwrap();
    assert!(matches!(layer.forward(&w, &bad_dtype, &rope), Err(Error::DType { .. })));
    let rope64 = Rope::new(&cfg, 8, DType::F64, &Device::Cpu).unwrap();
    assert!(matches!(layer.forward(&w, &x, &rope64), Err(Error::DType { .. })));
    let dy_bad = Tensor::zeros((1, 3, cfg.hidden_size), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(layer.backward(&w, &x, &dy_bad, &rope, &sink), Err(Error::Shape { .. })));
    let long = Tensor::zeros((1, 5, cfg.hidden_size), DType::F32, &Device::Cpu).unwrap();
    let err = layer.forward(&w, &long, &rope).unwrap_err().to_string();
    assert!(err.contains("sliding_window"), "{err}");
}

/// What a kept forward holds is exactly what the planner counts for candle's ops (the CPU path;
/// the fused CUDA path is checked on the GPU, `crates/sched/tests/gpu.rs`), and back-propagating
/// from it is bitwise the recomputing backward, for every layer kind, in f32 and bf16.
#[test]
fn a_kept_forward_holds_what_the_planner_counts_and_backs_up_as_the_recompute() {
    for (name, cfg) in all_configs().into_iter().chain(moe_configs()) {
        let layout = ModelLayout::new(&cfg).layer;
        let mut rng = rng(7);
        let slot = random_slot(&mut rng, &layout);
        let x = randn(&mut rng, &[2, 8, cfg.hidden_size], 1.0);
        let dy = randn(&mut rng, &[2, 8, cfg.hidden_size], 1.0);
        let layer = DecoderLayer::new(&cfg).for_layer(0).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let slot = slot.to_dtype(dtype).unwrap();
            let w = LayerWeights::bind(&cfg, &layout, &slot).unwrap();
            let rope = Rope::new(&cfg, 8, dtype, &Device::Cpu).unwrap();
            let (x, dy) = (x.to_dtype(dtype).unwrap(), dy.to_dtype(dtype).unwrap());
            let (out, state) = layer.forward_keep(&w, &x, &rope).unwrap();
            let e = dtype.size_in_bytes() as u64;
            assert_eq!(
                state.bytes(),
                DecoderLayer::kept_state_bytes(&cfg, 2, 8, e, false, false, false),
                "{name} {dtype:?}"
            );
            let plain = layer.forward(&w, &x, &rope).unwrap();
            assert_eq!(rel_err(&out, &plain), 0.0, "{name} {dtype:?}: forward");
            let (kept, recomputed) = (zeros(layout.len, DType::F32), zeros(layout.len, DType::F32));
            let dx_kept =
                layer.backward_kept(&w, state, &dy, &GradSink::new(&layout, &kept).unwrap()).unwrap();
            let dx =
                layer.backward(&w, &x, &dy, &rope, &GradSink::new(&layout, &recomputed).unwrap()).unwrap();
            assert_eq!(rel_err(&dx_kept, &dx), 0.0, "{name} {dtype:?}: dx");
            let bits =
                |t: &Tensor| t.to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(bits(&kept) == bits(&recomputed), "{name} {dtype:?}: weight gradients");
        }
    }
}

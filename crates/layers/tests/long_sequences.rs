//! Long-sequence machinery of the decoder layer on the CPU: packed documents attend only within
//! themselves (a packed row equals its samples run as separate sequences), MLP row tiles change
//! nothing but rounding, RoPE angles at 512k positions are what `RopeAngles` says, and position ids map to the
//! documents transformers' packed SFT sees.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use mt_core::ModelLayout;
use mt_layers::{DecoderLayer, GradSink, LayerOptions, LayerWeights, Positions, Rope, RopeAngles};

fn zeros(n: usize, dtype: DType) -> Tensor {
    Tensor::zeros(n, dtype, &Device::Cpu).unwrap()
}

/// Rows `lo..hi` of token axis 1 of `[b, t, h]`.
fn tokens(x: &Tensor, lo: usize, hi: usize) -> Tensor {
    x.narrow(1, lo, hi - lo).unwrap()
}

/// One row packing three samples (5, 4 and 3 tokens, position ids restarting at each) gives
/// every token the output, and the layer the weight gradient, that the three samples give run as
/// sequences of their own (f64: to rounding), for every family (mixtures of experts: the tokens
/// route alike wherever they sit).
#[test]
fn packed_documents_equal_separate_sequences() {
    let lens = [5usize, 4, 3];
    let t: usize = lens.iter().sum();
    for (name, cfg) in all_configs().into_iter().chain(moe_configs()) {
        let layout = ModelLayout::new(&cfg).layer;
        let mut rng = rng(41);
        let slot = random_slot(&mut rng, &layout);
        let w = LayerWeights::bind(&cfg, &layout, &slot).unwrap();
        let x = randn(&mut rng, &[1, t, cfg.hidden_size], 1.0);
        let dy = randn(&mut rng, &[1, t, cfg.hidden_size], 1.0);
        let rope = Rope::new(&cfg, t, DType::F64, &Device::Cpu).unwrap();
        let ids: Vec<u32> = lens.iter().flat_map(|&n| 0..n as u32).collect();
        let pos = Positions::from_ids(&rope, 1, t, &ids).unwrap();
        assert!(pos.has_docs());
        // Layer 0: GPT-OSS's windowed kind, its 3-key window shorter than the documents.
        let layer = DecoderLayer::new(&cfg).for_layer(0).unwrap();
        let packed_out = layer.forward_pos(&w, &x, &pos).unwrap();
        let packed_g = zeros(layout.len, DType::F64);
        let packed_dx =
            layer.backward_pos(&w, &x, &dy, &pos, &GradSink::new(&layout, &packed_g).unwrap()).unwrap();
        let sep_g = zeros(layout.len, DType::F64);
        let mut lo = 0;
        for &n in &lens {
            let (xs, dys) = (tokens(&x, lo, lo + n), tokens(&dy, lo, lo + n));
            let out = layer.forward(&w, &xs, &rope).unwrap();
            let e = rel_err(&tokens(&packed_out, lo, lo + n), &out);
            assert!(e < 1e-12, "{name}: document at {lo}: packed output off by {e:e}");
            let dx = layer.backward(&w, &xs, &dys, &rope, &GradSink::new(&layout, &sep_g).unwrap()).unwrap();
            let e = rel_err(&tokens(&packed_dx, lo, lo + n), &dx);
            assert!(e < 1e-12, "{name}: document at {lo}: packed dx off by {e:e}");
            lo += n;
        }
        assert_buffers_close(&format!("{name} packed"), &layout, &packed_g, &sep_g, 1e-12, &[]);
        // Without the restarts the row is one document: the output differs.
        let one = layer.forward(&w, &x, &rope).unwrap();
        assert!(rel_err(&tokens(&one, 5, t), &tokens(&packed_out, 5, t)) > 1e-3, "{name}");
    }
}

/// MLP tiles of 3 rows (over two sequences of 7 tokens: tiles straddle the sequences) give the
/// untiled output, input gradient and weight gradients to f64 rounding, kept or recomputed (a
/// mixture of experts routes each tile's rows on their own).
#[test]
fn mlp_tiles_change_only_rounding() {
    for (name, cfg) in all_configs().into_iter().chain(moe_configs()) {
        let layout = ModelLayout::new(&cfg).layer;
        let mut rng = rng(42);
        let slot = random_slot(&mut rng, &layout);
        let w = LayerWeights::bind(&cfg, &layout, &slot).unwrap();
        let x = randn(&mut rng, &[2, 7, cfg.hidden_size], 1.0);
        let dy = randn(&mut rng, &[2, 7, cfg.hidden_size], 1.0);
        let rope = Rope::new(&cfg, 7, DType::F64, &Device::Cpu).unwrap();
        let whole = DecoderLayer::new(&cfg).for_layer(0).unwrap();
        let tiled = DecoderLayer::with_options(&cfg, LayerOptions { mlp_rows: 3, ..LayerOptions::default() })
            .for_layer(0)
            .unwrap();
        let run = |layer: &DecoderLayer, kept: bool| {
            let g = zeros(layout.len, DType::F64);
            let sink = GradSink::new(&layout, &g).unwrap();
            let (out, dx) = if kept {
                let (out, state) = layer.forward_keep(&w, &x, &rope).unwrap();
                (out, layer.backward_kept(&w, state, &dy, &sink).unwrap())
            } else {
                (layer.forward(&w, &x, &rope).unwrap(), layer.backward(&w, &x, &dy, &rope, &sink).unwrap())
            };
            (out, dx, g)
        };
        for kept in [false, true] {
            let (o1, dx1, g1) = run(&whole, kept);
            let (o2, dx2, g2) = run(&tiled, kept);
            assert!(rel_err(&o2, &o1) < 1e-13, "{name} kept={kept}: output");
            assert!(rel_err(&dx2, &dx1) < 1e-13, "{name} kept={kept}: dx");
            assert_buffers_close(&format!("{name} tiles kept={kept}"), &layout, &g2, &g1, 1e-13, &[]);
        }
    }
}

/// RoPE at position 524287 (a 512k-token sequence's last), against the cosine and sine in f64:
/// with exact angles the f32 table is within one f32 rounding of them; with transformers' angles
/// (the default) it is within f32 rounding of the cosine of transformers' f32 angle, which is
/// itself off the exact one by at most `angle · 2^-24` (as `RopeAngles` says: 0.031 rad for an
/// angle near 2^19, here 0.002 for the second pair's 52429 rad).
#[test]
fn rope_angles_at_position_524287() {
    let cfg = mt_core::ModelConfig { rope_scaling: None, ..llama_gqa() };
    let inv = Rope::inv_freq(&cfg);
    let pos = 524_287usize;
    let half = cfg.head_dim / 2;
    let table = |angles| {
        let rope = Rope::with_angles(&cfg, pos + 1, DType::F32, &Device::Cpu, angles).unwrap();
        let (cos, sin) = rope.cos_sin(pos, 1).unwrap();
        (cos.to_vec2::<f32>().unwrap().remove(0), sin.to_vec2::<f32>().unwrap().remove(0))
    };
    let (exact_cos, exact_sin) = table(RopeAngles::Exact);
    let (hf_cos, hf_sin) = table(RopeAngles::Transformers);
    let (mut worst_hf, mut bound) = (0f64, 0f64);
    for i in 0..cfg.head_dim {
        let exact = pos as f64 * f64::from(inv[i % half]);
        let hf = f64::from(pos as f32 * inv[i % half]);
        for (got, want, what) in [
            (exact_cos[i], exact.cos(), "exact cos"),
            (exact_sin[i], exact.sin(), "exact sin"),
            (hf_cos[i], hf.cos(), "transformers cos"),
            (hf_sin[i], hf.sin(), "transformers sin"),
        ] {
            assert!((f64::from(got) - want).abs() <= 6e-8, "{what} dim {i}: {got} vs {want}");
        }
        worst_hf = worst_hf.max((hf - exact).abs());
        bound = bound.max(exact * f64::powi(2.0, -24));
    }
    assert!(worst_hf > 1e-4 && worst_hf <= bound, "transformers' angle error {worst_hf}, bound {bound}");
}

/// Position ids `0..t` in every row are the plain positions (no documents); a 0 after a row's
/// start begins a document; ids past the table are refused, naming them.
#[test]
fn position_ids_define_documents() {
    let cfg = llama_gqa();
    let rope = Rope::new(&cfg, 8, DType::F32, &Device::Cpu).unwrap();
    let plain = Positions::from_ids(&rope, 2, 4, &[0, 1, 2, 3, 0, 1, 2, 3]).unwrap();
    assert!(!plain.has_docs());
    let packed = Positions::from_ids(&rope, 2, 4, &[0, 1, 0, 1, 0, 1, 2, 3]).unwrap();
    assert!(packed.has_docs());
    // Shifted ids with no restart: per-token RoPE rows, one document per row.
    let shifted = Positions::from_ids(&rope, 1, 4, &[3, 4, 5, 6]).unwrap();
    assert!(!shifted.has_docs());
    let e = Positions::from_ids(&rope, 1, 2, &[0, 8]).unwrap_err().to_string();
    assert!(e.contains("8") && e.contains("RoPE table of 8"), "{e}");
    let e = Positions::from_ids(&rope, 1, 3, &[0, 1]).unwrap_err().to_string();
    assert!(e.contains("position ids"), "{e}");
}

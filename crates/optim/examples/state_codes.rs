//! Measures candidate formats of AdamW's moments on the golden models: bf16 (round to nearest or
//! stochastic), and blockwise 8-bit codes (per-block absmax scale; linear, sqrt, fourth-root and
//! the dynamic-tree code of 8-bit optimizers; block sizes; rounding), by
//!
//! 1. the quantisation error of the real moments of an fp32-states run (the golden models trained
//!    on their fixture batch: `m`, `v` after 10, 100 and 300 steps), and of the update
//!    `m̂ / (√v̂ + eps)` they give;
//! 2. training: every format trains every golden model (the golden batch, 300 steps, and 300
//!    seeded random batches of 4 x 16) and its losses are compared with the fp32-states run.
//!
//! Gradients come from mt-testkit's reference model (candle autograd, f32) at the golden
//! models' weights; the update is mt-optim's `step_reference` (exactly the fused pass's f32
//! arithmetic) with the moments quantised after every step, blockwise over each unit's flat
//! record as the store lays it out. `shipped bf16` and `shipped int8` are mt-optim's own fused
//! update over its encodings (what `--optim-states` runs): the chosen formats, to compare with
//! their simulation above them. This is what `docs/decisions/0033-optimizer-state-precision.md`
//! quotes.
//!
//! `cargo run --release -p mt-optim --example state_codes [-- STEPS]`
#![allow(missing_docs, clippy::print_stdout)]

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use mt_core::{ModelLayout, StateDtype};
use mt_optim::{decode_moments, step_fused, step_reference, AdamW, Grad, Moments, StepArgs, Upload};
use mt_testkit::golden::{self, Golden, GOLDEN_NAMES};
use mt_testkit::ReferenceModel;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Code {
    /// `x / absmax` in even steps.
    Linear,
    /// `sqrt(|x| / absmax)` in even steps (the square of a step is decoded).
    Sqrt,
    /// `(|x| / absmax)^(1/4)` in even steps.
    Root4,
    /// The dynamic tree code of 8-bit optimizers (Dettmers et al. 2022), signed for m, unsigned for v.
    Dyn,
}

#[derive(Clone, Copy, Debug)]
enum Fmt {
    F32,
    Bf16 {
        sr: bool,
    },
    Q8 {
        m: Code,
        v: Code,
        block: usize,
        sr: bool,
    },
    /// mt-optim's own update over its encoding.
    Shipped(StateDtype),
}

impl Fmt {
    fn name(&self) -> String {
        match self {
            Fmt::F32 => "fp32".into(),
            Fmt::Bf16 { sr } => format!("bf16{}", if *sr { "+sr" } else { "" }),
            Fmt::Q8 { m, v, block, sr } => {
                format!("q8 m:{m:?} v:{v:?} b{block}{}", if *sr { " +sr" } else { "" })
            }
            Fmt::Shipped(d) => format!("shipped {d}"),
        }
    }
}

/// The code's values in [-1, 1] (signed) or [0, 1], ascending.
fn table(code: Code, signed: bool) -> Vec<f32> {
    let levels = if signed { 127 } else { 255 };
    let pos =
        |f: &dyn Fn(f64) -> f64| -> Vec<f64> { (0..=levels).map(|k| f(k as f64 / levels as f64)).collect() };
    let mags = match code {
        Code::Linear => pos(&|y| y),
        Code::Sqrt => pos(&|y| y * y),
        Code::Root4 => pos(&|y| y * y * y * y),
        Code::Dyn => return dynamic_tree(signed),
    };
    let mut t: Vec<f64> = mags.clone();
    if signed {
        t.extend(mags.iter().skip(1).map(|x| -x));
    }
    t.sort_by(f64::total_cmp);
    t.into_iter().map(|x| x as f32).collect()
}

/// The dynamic tree code of Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (2022),
/// built from the paper's description of its bit layout (signed for m, unsigned for v).
fn dynamic_tree(signed: bool) -> Vec<f32> {
    // Every 8-bit pattern decoded as the paper's format: [sign] zeros* 1 fraction*, where the
    // run of zeros z is the decimal exponent (magnitude 10^-z) and the bits after the indicator
    // are a linear fraction in [0.1, 1], taken at the middle of its bin. Unsigned codes spend
    // the sign bit on the fraction. The all-zero pattern is 0; the code also holds 1.
    let bits = if signed { 7u32 } else { 8 };
    let mut values = vec![0.0f64, 1.0];
    for pattern in 1u32..(1 << bits) {
        let zeros = pattern.leading_zeros() - (32 - bits);
        let fraction_bits = bits - zeros - 1;
        if zeros >= 7 {
            continue; // the pattern's exponent lies below the code's range (unsigned: 0000_0001)
        }
        let fraction = pattern & ((1 << fraction_bits) - 1);
        let mid = (fraction as f64 + 0.5) / (1u64 << fraction_bits) as f64;
        let x = 10f64.powi(-(zeros as i32)) * (0.1 + 0.9 * mid);
        values.push(x);
        if signed {
            values.push(-x);
        }
    }
    values.sort_by(f64::total_cmp);
    values.dedup();
    values.into_iter().map(|x| x as f32).collect()
}

fn mix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// A uniform in [0, 1) from (key, index).
fn uniform(key: u32, i: usize) -> f32 {
    (mix32((i as u32) ^ key) >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// Quantises then decodes `x` in blocks of `block` with `table`.
fn q8(x: &mut [f32], table: &[f32], block: usize, sr: Option<u32>) {
    for (bi, blk) in x.chunks_mut(block).enumerate() {
        let absmax = blk.iter().fold(0f32, |a, &b| a.max(b.abs()));
        if absmax == 0.0 {
            continue;
        }
        for (j, xi) in blk.iter_mut().enumerate() {
            let y = *xi / absmax;
            let k = table.partition_point(|&t| t <= y);
            let c = if k == 0 {
                table[0]
            } else if k == table.len() {
                table[k - 1]
            } else {
                let (lo, hi) = (table[k - 1], table[k]);
                match sr {
                    Some(key) => {
                        let p = (y - lo) / (hi - lo);
                        if uniform(key, bi * block + j) < p {
                            hi
                        } else {
                            lo
                        }
                    }
                    None => {
                        if y - lo <= hi - y {
                            lo
                        } else {
                            hi
                        }
                    }
                }
            };
            *xi = c * absmax;
        }
    }
}

fn bf16_round(x: &mut [f32], sr: Option<u32>) {
    for (i, xi) in x.iter_mut().enumerate() {
        *xi = match sr {
            None => half::bf16::from_f32(*xi).to_f32(),
            Some(key) => {
                let r = mix32((i as u32) ^ key) & 0xFFFF;
                f32::from_bits((xi.to_bits().wrapping_add(r)) & 0xFFFF_0000)
            }
        };
    }
}

struct Tables {
    m: BTreeMap<String, Vec<f32>>,
    v: BTreeMap<String, Vec<f32>>,
}

fn tables() -> Tables {
    let codes = [Code::Linear, Code::Sqrt, Code::Root4, Code::Dyn];
    Tables {
        m: codes.iter().map(|&c| (format!("{c:?}"), table(c, true))).collect(),
        v: codes.iter().map(|&c| (format!("{c:?}"), table(c, false))).collect(),
    }
}

/// Applies the format's storage rounding to one unit's moments after an update.
fn store_moments(fmt: Fmt, t: &Tables, m: &mut [f32], v: &mut [f32], step: u64, unit: usize) {
    let key = |which: u32| mix32(mix32(step as u32).wrapping_add(unit as u32 * 0x9E37_79B9) ^ which);
    match fmt {
        Fmt::F32 | Fmt::Shipped(_) => {}
        Fmt::Bf16 { sr } => {
            bf16_round(m, sr.then(|| key(1)));
            bf16_round(v, sr.then(|| key(2)));
        }
        Fmt::Q8 { m: cm, v: cv, block, sr } => {
            q8(m, &t.m[&format!("{cm:?}")], block, sr.then(|| key(1)));
            q8(v, &t.v[&format!("{cv:?}")], block, sr.then(|| key(2)));
        }
    }
}

struct Model {
    layout: ModelLayout,
    /// Per unit: master, m, v.
    p: Vec<Vec<f32>>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Per unit, for a shipped format: `[master | m | v]` as a device state slot holds it.
    state: Vec<Vec<f32>>,
}

impl Model {
    fn new(g: &Golden) -> Self {
        let layout = ModelLayout::new(&g.cfg);
        let mut p: Vec<Vec<f32>> = layout.units().map(|u| vec![0.0; layout.unit(u).len]).collect();
        for (name, u, spec) in layout.all_params() {
            let x = g.params[&name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
            p[u.index()][spec.offset..spec.offset + x.len()].copy_from_slice(&x);
        }
        let z: Vec<Vec<f32>> = p.iter().map(|x| vec![0.0; x.len()]).collect();
        Model { layout, m: z.clone(), v: z, p, state: Vec::new() }
    }

    fn params(&self) -> BTreeMap<String, Tensor> {
        self.layout
            .all_params()
            .into_iter()
            .map(|(name, u, spec)| {
                let x = self.p[u.index()][spec.offset..spec.offset + spec.numel()].to_vec();
                (name, Tensor::from_vec(x, spec.shape.clone(), &Device::Cpu).unwrap())
            })
            .collect()
    }

    fn flat_grads(&self, grads: &BTreeMap<String, Tensor>) -> Vec<Vec<f32>> {
        let mut g: Vec<Vec<f32>> = self.p.iter().map(|x| vec![0.0; x.len()]).collect();
        for (name, u, spec) in self.layout.all_params() {
            let x =
                grads[&name].to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            g[u.index()][spec.offset..spec.offset + x.len()].copy_from_slice(&x);
        }
        g
    }
}

const H: AdamW = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };

type Batch = (Tensor, Vec<i64>);
/// A snapshot of the fp32-moment run: step, m, v.
type Snapshot = (u64, Vec<f32>, Vec<f32>);

/// One unit's update with a shipped format: mt-optim's fused pass over its encoding (stream =
/// the unit's index, as the engine's), then the master and decoded moments copied out.
fn shipped_step(model: &mut Model, u: usize, d: StateDtype, a: &StepArgs, g: &[f32]) {
    let n = model.p[u].len();
    if model.state.len() <= u {
        model.state.resize(u + 1, Vec::new());
    }
    let st = &mut model.state[u];
    if st.is_empty() {
        *st = vec![0.0; d.state_words(n)];
        st[..n].copy_from_slice(&model.p[u]);
    }
    let (p, mom) = Moments::split_state(d, n, st, u as u64).unwrap();
    step_fused(&H, a, Grad::F32(g), p, mom, Upload::None).unwrap();
    model.p[u].copy_from_slice(&st[..n]);
    let bytes: &[u8] = bytemuck::cast_slice(&st[n..]);
    let (mb, vb) = bytes.split_at(d.moment_bytes(n));
    (model.m[u], model.v[u]) = decode_moments(d, n, mb, vb).unwrap();
}

/// Trains with `fmt`; returns each step's loss and the fp32 states at `snap_at` steps.
fn train(g: &Golden, fmt: Fmt, t: &Tables, batches: &[Batch], snap_at: &[u64]) -> (Vec<f64>, Vec<Snapshot>) {
    let mut model = Model::new(g);
    let mut reference = ReferenceModel::new(&g.cfg, &model.params(), DType::F32).unwrap();
    let (mut losses, mut snaps) = (Vec::new(), Vec::new());
    for (k, (ids, targets)) in batches.iter().enumerate() {
        let step = k as u64 + 1;
        reference.set_params(&model.params()).unwrap();
        let (loss, grads) = reference.loss_and_grads(ids, targets).unwrap();
        losses.push(loss);
        let gf = model.flat_grads(&grads);
        let norm = gf.iter().flatten().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
        let a = StepArgs { step, lr: H.lr, grad_scale: mt_optim::clip_coef(norm, 1.0) };
        for (u, g) in gf.iter().enumerate() {
            if let Fmt::Shipped(d) = fmt {
                shipped_step(&mut model, u, d, &a, g);
                continue;
            }
            step_reference(&H, &a, g, &mut model.p[u], &mut model.m[u], &mut model.v[u]);
            let (m, v) = (&mut model.m[u], &mut model.v[u]);
            store_moments(fmt, t, m, v, step, u);
        }
        if snap_at.contains(&step) {
            snaps.push((step, model.m.concat(), model.v.concat()));
        }
    }
    (losses, snaps)
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Quantisation error of one snapshot under one 8-bit (or bf16) format: the fraction of
/// non-zero v decoded as zero, the relative error of √v over non-zero v (median, p99, max),
/// and the relative L2 error of the update m̂/(√v̂ + eps).
fn static_error(fmt: Fmt, t: &Tables, units: &[usize], step: u64, m: &[f32], v: &[f32]) -> String {
    let (mut mq, mut vq) = (m.to_vec(), v.to_vec());
    let mut at = 0;
    for (u, &n) in units.iter().enumerate() {
        let fmt_nearest = match fmt {
            Fmt::Bf16 { .. } => Fmt::Bf16 { sr: false },
            Fmt::Q8 { m, v, block, .. } => Fmt::Q8 { m, v, block, sr: false },
            f => f,
        };
        store_moments(fmt_nearest, t, &mut mq[at..at + n], &mut vq[at..at + n], step, u);
        at += n;
    }
    let bc1 = 1.0 - H.beta1.powi(step as i32);
    let bc2 = (1.0 - H.beta2.powi(step as i32)).sqrt();
    let upd = |m: f32, v: f32| (f64::from(m) / bc1) / (f64::from(v).sqrt() / bc2 + H.eps);
    let (mut zeroed, mut nz) = (0usize, 0usize);
    let mut rel = Vec::new();
    let (mut du2, mut u2) = (0.0, 0.0);
    for i in 0..m.len() {
        if v[i] > 0.0 {
            nz += 1;
            if vq[i] == 0.0 {
                zeroed += 1;
            }
            rel.push((f64::from(vq[i]).sqrt() - f64::from(v[i]).sqrt()).abs() / f64::from(v[i]).sqrt());
        }
        let (a, b) = (upd(mq[i], vq[i]), upd(m[i], v[i]));
        du2 += (a - b) * (a - b);
        u2 += b * b;
    }
    rel.sort_by(f64::total_cmp);
    format!(
        "v>0 zeroed {:>6.3}%  rel err sqrt(v) p50 {:.2e} p99 {:.2e} max {:.2e}  update rel L2 {:.2e}",
        100.0 * zeroed as f64 / nz.max(1) as f64,
        pct(&rel, 0.5),
        pct(&rel, 0.99),
        rel.last().copied().unwrap_or(0.0),
        (du2 / u2).sqrt()
    )
}

fn main() {
    let steps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(300);
    let t = tables();
    let mut fmts = vec![
        Fmt::Bf16 { sr: false },
        Fmt::Bf16 { sr: true },
        Fmt::Shipped(StateDtype::Bf16),
        Fmt::Shipped(StateDtype::Int8),
    ];
    fmts.push(Fmt::Q8 { m: Code::Linear, v: Code::Linear, block: 256, sr: false });
    for v in [Code::Sqrt, Code::Root4, Code::Dyn] {
        for m in [Code::Linear, Code::Sqrt, Code::Dyn] {
            fmts.push(Fmt::Q8 { m, v, block: 256, sr: false });
        }
    }
    for block in [64, 256, 2048] {
        for sr in [false, true] {
            for (m, v) in [(Code::Sqrt, Code::Root4), (Code::Dyn, Code::Dyn)] {
                if block != 256 || sr {
                    fmts.push(Fmt::Q8 { m, v, block, sr });
                }
            }
        }
    }
    let snap_at = [10u64, 100, steps as u64];
    println!("# state_codes: {steps} steps, AdamW lr 1e-3 betas (0.9, 0.999) eps 1e-8 wd 0.1, clip 1.0");
    for name in GOLDEN_NAMES {
        let g = golden::load(name).unwrap();
        let layout = ModelLayout::new(&g.cfg);
        let units: Vec<usize> = layout.units().map(|u| layout.unit(u).len).collect();
        let golden_batch = (g.input_tensor().unwrap(), g.targets.clone());
        let regimes: Vec<(&str, Vec<Batch>)> = vec![
            ("golden batch", vec![golden_batch; steps]),
            (
                "random 4x16",
                (0..steps as u64)
                    .map(|s| {
                        let (ids, targets) = mt_testkit::init::random_batch(&g.cfg, 4, 16, 1000 + s, 0.1);
                        (Tensor::from_vec(ids, (4, 16), &Device::Cpu).unwrap(), targets)
                    })
                    .collect(),
            ),
        ];
        for (regime, batches) in &regimes {
            let (base, snaps) = train(&g, Fmt::F32, &t, batches, &snap_at);
            println!("\n## {name}, {regime}: fp32 loss {:.4} -> {:.4}", base[0], base[steps - 1]);
            if *regime == "golden batch" {
                for (step, m, v) in &snaps {
                    println!("### states after step {step}: quantisation error (round to nearest)");
                    for fmt in fmts.iter().filter(|f| {
                        !matches!(f, Fmt::Q8 { sr: true, .. } | Fmt::Bf16 { sr: true } | Fmt::Shipped(_))
                    }) {
                        println!("{:<28} {}", fmt.name(), static_error(*fmt, &t, &units, *step, m, v));
                    }
                }
            }
            println!("### training: loss vs fp32 states (max over steps of |dloss|/loss, mean of the last 20 steps' dloss/loss, final loss)");
            for fmt in &fmts {
                let (l, _) = train(&g, *fmt, &t, batches, &[]);
                let rel: Vec<f64> = l.iter().zip(&base).map(|(a, b)| (a - b) / b).collect();
                let max = rel.iter().fold(0f64, |m, r| m.max(r.abs()));
                let tail = rel[steps.saturating_sub(20)..].iter().sum::<f64>() / 20f64.min(steps as f64);
                let dfinal = l[steps - 1] - base[steps - 1];
                println!(
                    "{:<28} max {:>9.3e}  last20 {:>+10.3e}  final {:.4} ({:+.2e})",
                    fmt.name(),
                    max,
                    tail,
                    l[steps - 1],
                    dfinal
                );
            }
        }
    }
}

//! GPU vs CPU for the engine's device-side building blocks (compiled only with the `cuda` feature
//! and run on the GPU machine, like `tests/gpu.rs`): the embedding backward's row scatter-add, the
//! bias gradients' column sums and the fused device AdamW, each against the CPU's own arithmetic,
//! bitwise where the kernels promise it.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use mt_testkit::init::randn;

/// The embedding backward's row scatter-add on the GPU (`kernels/embed.cu`, one block per
/// distinct id) adds each id's rows in the order of the CPU's sequential scatter-add: the same
/// f32 sums bit for bit, from bf16 and f32 sources, with heavily repeated ids.
#[test]
fn cuda_embedding_rows_add_is_bitwise_the_cpu_scatter_add() {
    use mt_layers::{names, GradSink};
    let cfg = mt_core::ModelConfig::tiny_llama();
    let layout = mt_core::ModelLayout::new(&cfg);
    let v = cfg.vocab_size;
    let gpu = Device::new_cuda(0).unwrap();
    let k = 4099;
    // A third of the tokens are one id; the rest spread over the vocabulary (with repeats).
    let ids: Vec<u32> = (0..k)
        .map(|i: usize| if i.is_multiple_of(3) { 7 } else { (i.wrapping_mul(2_654_435_761) % v) as u32 })
        .collect();
    // The embedding sits at the start of the outer unit's buffer, the (untied) head further in:
    // both a view at offset 0 and one at an offset.
    for (dtype, name) in
        [(DType::BF16, names::EMBED), (DType::F32, names::EMBED), (DType::BF16, names::LM_HEAD)]
    {
        let src = randn((k, cfg.hidden_size), 1).to_dtype(dtype).unwrap();
        let init = randn(layout.outer.len, 2);
        let run = |d: &Device| -> Vec<f32> {
            let buf = if d.is_cpu() { init.copy().unwrap() } else { init.to_device(d).unwrap() };
            let sink = GradSink::new(&layout.outer, &buf).unwrap();
            let rows = Tensor::new(ids.as_slice(), d).unwrap();
            sink.index_add_rows(name, &rows, &src.to_device(d).unwrap()).unwrap();
            buf.to_device(&Device::Cpu).unwrap().to_vec1().unwrap()
        };
        let (on_cpu, on_gpu) = (run(&Device::Cpu), run(&gpu));
        let differing = on_cpu.iter().zip(&on_gpu).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        let moved = on_cpu.iter().zip(init.to_vec1::<f32>().unwrap()).filter(|(a, b)| **a != *b).count();
        eprintln!("SUMMARY gpu rows add {name} {dtype:?}: {differing} of {} elements differ from the CPU ({moved} changed)", on_cpu.len());
        assert!(moved > 0 && differing == 0, "{name} {dtype:?}: {differing} elements differ");
    }
}

/// A bias gradient on the GPU (`GradSink::accumulate_col_sums`, two-pass column-sum kernel) is
/// the CPU's cast-and-sum within f32 summation-order rounding, over shapes with one, several and
/// a ragged last row segment, added into a buffer that already holds a gradient; and it is the
/// same bits on a second run (no atomics).
#[test]
fn cuda_bias_gradient_column_sums_match_the_cpu() {
    use mt_layers::{names, GradSink};
    let cfg = mt_core::ModelConfig { qkv_bias: true, ..mt_core::ModelConfig::tiny_llama() };
    let layout = mt_core::ModelLayout::new(&cfg);
    let w = layout.layer.get(names::Q_BIAS).unwrap().numel();
    let gpu = Device::new_cuda(0).unwrap();
    for n in [5usize, 256, 4099, 32768] {
        let dy = randn((n, w), 3 + n as u64).to_dtype(DType::BF16).unwrap();
        let init = randn(layout.layer.len, 4 + n as u64);
        let run = |d: &Device| -> Vec<f32> {
            let buf = if d.is_cpu() { init.copy().unwrap() } else { init.to_device(d).unwrap() };
            GradSink::new(&layout.layer, &buf)
                .unwrap()
                .accumulate_col_sums(names::Q_BIAS, &dy.to_device(d).unwrap())
                .unwrap();
            buf.to_device(&Device::Cpu).unwrap().to_vec1().unwrap()
        };
        let (on_cpu, on_gpu, again) = (run(&Device::Cpu), run(&gpu), run(&gpu));
        // Sequential f32 sums of n unit normals drift by up to ~n·2^-24 from any other order; a
        // row left out or counted twice moves a sum by ~1.
        let worst =
            on_cpu.iter().zip(&on_gpu).map(|(a, b)| f64::from((a - b).abs())).fold(0.0, f64::max) / n as f64;
        // Which elements the sum changed, on each device: the bias's w columns (a column whose
        // rows sum to exactly zero stays, as one of 128 did on an unseeded draw, on both devices;
        // the seeded inputs change all 128 at every n).
        let init = init.to_vec1::<f32>().unwrap();
        let changed = |x: &[f32]| -> Vec<usize> { (0..x.len()).filter(|&i| x[i] != init[i]).collect() };
        let (moved_cpu, moved_gpu) = (changed(&on_cpu), changed(&on_gpu));
        let repeat = on_gpu.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits());
        eprintln!(
            "SUMMARY gpu bias column sums n={n} w={w}: worst |gpu - cpu| / n {worst:.2e}; {} changed on the GPU, {} on the CPU; repeat bitwise {repeat}",
            moved_gpu.len(),
            moved_cpu.len()
        );
        assert!(
            moved_gpu == moved_cpu
                && moved_cpu.len() + 1 >= w
                && moved_cpu.len() <= w
                && worst < 1e-6
                && repeat,
            "n={n}: worst {worst:.2e}, moved {} (CPU {}), repeat {repeat}",
            moved_gpu.len(),
            moved_cpu.len()
        );
    }
}

/// The fused device AdamW (`kernels/adamw.cu`) writes exactly the bf16 cast of the new master
/// weights into the slot, on its 16-byte path (n a multiple of 4, aligned) and its scalar path
/// (other n, views at an odd offset), and its state agrees with mt-optim's CPU update.
#[test]
fn cuda_fused_adamw_writes_the_cast_of_its_master_and_matches_the_cpu() {
    use mt_core::StateDtype;
    use mt_kernels::device_optim::{adamw_step_into, StateKind};
    use mt_optim::{AdamW, StepArgs};
    let gpu = Device::new_cuda(0).unwrap();
    let (h, a) = (AdamW::default(), StepArgs { step: 3, lr: 1e-3, grad_scale: 0.5 });
    let cpu = Device::Cpu;
    for n in [4096usize, 4097, 4098, 4099] {
        for off in [0usize, 1] {
            let seed = 8 * n as u64 + 4 * off as u64;
            let master = randn(n, seed);
            let m = (randn(n, seed + 1) * 0.1).unwrap();
            let v = (randn(n, seed + 2).sqr().unwrap() * 0.01).unwrap();
            let pad = Tensor::zeros(off, DType::F32, &cpu).unwrap();
            let state = Tensor::cat(&[&pad, &master, &m, &v], 0).unwrap();
            let grad = randn(n, seed + 3);
            let run = |d: &Device| -> (Vec<f32>, Vec<half::bf16>) {
                let st = if d.is_cpu() { state.copy().unwrap() } else { state.to_device(d).unwrap() };
                let w = Tensor::zeros(n + off, DType::BF16, d).unwrap();
                let (st_view, w_view) = (st.narrow(0, off, 3 * n).unwrap(), w.narrow(0, off, n).unwrap());
                let kind = StateKind { dtype: StateDtype::F32, stream: 0 };
                adamw_step_into(&st_view, &grad.to_device(d).unwrap(), &h, &a, kind, &w_view).unwrap();
                let st = st_view.to_device(&Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
                (st, w_view.to_device(&Device::Cpu).unwrap().to_vec1::<half::bf16>().unwrap())
            };
            let ((st_c, _), (st_g, w_g)) = (run(&cpu), run(&gpu));
            let cast: Vec<half::bf16> = st_g[..n].iter().map(|&x| half::bf16::from_f32(x)).collect();
            let slot_diff = cast.iter().zip(&w_g).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            let bitwise = st_c.iter().zip(&st_g).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            let worst = st_c
                .iter()
                .zip(&st_g)
                .map(|(a, b)| f64::from((a - b).abs()) / f64::from(a.abs()).max(1e-6))
                .fold(0.0, f64::max);
            eprintln!(
                "SUMMARY gpu fused adamw n={n} offset={off}: slot vs cast of master: {slot_diff} differ; state vs CPU: {bitwise} of {} not bitwise, worst rel {worst:.2e}",
                3 * n
            );
            assert_eq!(slot_diff, 0, "n={n} offset={off}: the slot is not the cast of the new master");
            assert!(worst <= 1e-6, "n={n} offset={off}: state differs from the CPU update by {worst:.2e}");
        }
    }
}

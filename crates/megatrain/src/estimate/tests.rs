//! Tests of `megatrain estimate`: the plan's bytes, the priced step and the refusals.

use clap::Parser;

use crate::cli::{Cli, Command};

fn estimate_3_6b(extra: &[&str]) -> super::Estimate {
    super::estimate(&args_of(extra)).unwrap()
}

/// `megatrain estimate` of the 3.6B at 4 x 2048 in bf16 on a 139.8 GiB GPU, with `extra`.
fn args_of(extra: &[&str]) -> crate::cli::EstimateArgs {
    let config =
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench-harness/configs/llama3-3.6b.json").to_string();
    let mut argv = vec!["megatrain", "estimate", "--config", &config, "--device", "cuda"];
    argv.extend(["--batch-size", "4", "--seq-len", "2048", "--gpu-mem", "139.8", "--host-mem", "120"]);
    argv.extend(["--precision", "bf16"]);
    argv.extend(extra);
    let Command::Estimate(args) = Cli::try_parse_from(argv).unwrap().command else { unreachable!() };
    args
}

/// `megatrain estimate` of `config` (a file in bench-harness/configs/) at `batch x seq` in bf16
/// on one CUDA GPU of `gpu_mem` GiB with 125 GiB of host memory, with `extra`: the command of a
/// measured run on the GPU machines, whose step time a test compares with the estimate's.
fn estimate_of(config: &str, batch: usize, seq: usize, gpu_mem: &str, extra: &[&str]) -> super::Estimate {
    let config = format!("{}/../../bench-harness/configs/{config}", env!("CARGO_MANIFEST_DIR"));
    let (b, s) = (batch.to_string(), seq.to_string());
    let mut argv =
        vec!["megatrain", "estimate", "--config", &config, "--device", "cuda", "--precision", "bf16"];
    argv.extend(["--batch-size", &b, "--seq-len", &s, "--gpu-mem", gpu_mem, "--host-mem", "125"]);
    argv.extend(extra);
    let Command::Estimate(args) = Cli::try_parse_from(argv).unwrap().command else { unreachable!() };
    super::estimate(&args).unwrap()
}

/// With --gpus each GPU is planned for its share of the batch with no optimizer state on it,
/// pays the ring all-reduce of every f32 gradient, and has rings of its own; the step's tokens
/// and FLOPs are the whole batch's.
#[test]
fn several_gpus_plan_each_for_its_share_and_pay_the_all_reduce() {
    let one =
        estimate_3_6b(&["--resident-outer", "off", "--resident-layers", "0", "--gpu-updated-layers", "0"]);
    let two = estimate_3_6b(&["--gpus", "2"]);
    let p = &two.plan;
    assert_eq!(
        (p.batch, p.placement.resident_layers, p.placement.resident_outer, p.placement.gpu_updated_layers),
        (2, 0, false, 0)
    );
    assert_eq!(two.nccl_bytes_per_gpu, 4 * p.n_params);
    assert_eq!(two.pinned_bytes, 2 * p.host.pinned);
    assert_eq!(two.tokens_per_step, 4 * 2048);
    assert!((two.global_flops() - one.plan.flops_per_step).abs() <= 1e-9 * one.plan.flops_per_step);
    assert!(two.compute_s < one.compute_s, "{} vs {}", two.compute_s, one.compute_s);
    assert!(two.to_string().contains("data parallel: 2 GPUs"));
}

/// Resident units cost the host optimizer nothing: with every layer and the outer unit on
/// an H200 the host's share of the step is zero; streamed, it counts every streamed
/// parameter by its bytes, and exact mode's update cannot overlap the backward.
#[test]
fn the_host_optimizer_time_counts_streamed_units_by_their_bytes() {
    let all = estimate_3_6b(&[]);
    assert_eq!((all.plan.placement.resident_layers, all.plan.placement.resident_outer), (28, true));
    assert_eq!(all.host_s, 0.0);
    let ring = [
        "--resident-layers",
        "0",
        "--resident-outer",
        "on",
        "--held-layers",
        "0",
        "--gpu-updated-layers",
        "0",
    ];
    let streamed = estimate_3_6b(&ring);
    // 28 layers of 100_669_440 parameters at the default 140 GB/s: the update 28 B each
    // (bf16 gradient, master/m/v, bf16 copy), the backward's re-cast 6 B, the land 4 B.
    let n = 28.0 * 100_669_440.0;
    assert!((streamed.host_update_s - n * 28.0 / 140e9).abs() < 1e-9);
    assert!((streamed.host_s - n * 38.0 / 140e9).abs() < 1e-9);
    // Held layers are not re-cast for the backward: 6 B a parameter less.
    let held =
        estimate_3_6b(&["--resident-layers", "0", "--resident-outer", "on", "--gpu-updated-layers", "0"]);
    assert_eq!(held.plan.placement.held_layers, 28);
    assert!((held.host_s - n * 32.0 / 140e9).abs() < 1e-9);
    // GPU-updated layers (auto: 10 of 28) take their 28 B of AdamW off the host, but their
    // state's DMA (26 B: master, m, v and the bf16 gradient up, master, m, v down) is priced
    // at the same host bandwidth, in the same window; late downloads (auto: 5) bring their
    // 12 B back in the backward instead.
    let on_time = [
        "--resident-layers",
        "0",
        "--resident-outer",
        "on",
        "--late-state-downloads",
        "0",
        "--early-state-uploads",
        "0",
    ];
    let gpu = estimate_3_6b(&on_time);
    assert_eq!(gpu.plan.placement.gpu_updated_layers, 11);
    let k = 11.0 * 100_669_440.0;
    assert!((gpu.host_update_s - ((n - k) * 28.0 + k * 26.0) / 140e9).abs() < 1e-9, "{}", gpu.host_update_s);
    assert!(gpu.step_s < held.step_s, "{} vs {}", gpu.step_s, held.step_s);
    let late = estimate_3_6b(&[&on_time[..4], &on_time[6..]].concat());
    assert_eq!((late.plan.placement.gpu_updated_layers, late.plan.placement.late_state_downloads), (10, 5));
    let (k, d) = (10.0 * 100_669_440.0, 5.0 * 100_669_440.0);
    let want = ((n - k) * 28.0 + k * 26.0 - d * 12.0) / 140e9;
    assert!((late.host_update_s - want).abs() < 1e-9, "{}", late.host_update_s);
    assert!((late.host_s - late.host_update_s - (n * 4.0 + d * 12.0) / 140e9).abs() < 1e-9);
    assert!(late.step_s < gpu.step_s, "{} vs {}", late.step_s, gpu.step_s);
    // Early uploads (auto: 5, one per late download, with 14 GPU-updated) take their 14 B
    // (master, m, v and the bf16 gradient) out of the forward, and bring 12 B (master, m, v)
    // into the backward: the gradient is copied on the device.
    let early = estimate_3_6b(&on_time[..4]);
    let p = &early.plan;
    assert_eq!(
        (p.placement.gpu_updated_layers, p.placement.late_state_downloads, p.placement.early_state_uploads),
        (14, 5, 5)
    );
    let (k, d, x) = (14.0 * 100_669_440.0, 5.0 * 100_669_440.0, 5.0 * 100_669_440.0);
    let want = ((n - k) * 28.0 + k * 26.0 - d * 12.0 - x * 14.0) / 140e9;
    assert!((early.host_update_s - want).abs() < 1e-9, "{}", early.host_update_s);
    let backward = (n * 4.0 + d * 12.0 + x * 12.0) / 140e9;
    assert!((early.host_s - early.host_update_s - backward).abs() < 1e-9);
    assert!(early.step_s < late.step_s, "{} vs {}", early.step_s, late.step_s);
    // More GPU-updated layers move more state up in the forward, beside the host's pass, at
    // the planner's slower state-upload rate: 17 ranks behind the planner's 14, as measured
    // (docs/decisions/0041).
    let n17 = estimate_3_6b(&[&on_time[..4], &["--gpu-updated-layers", "17"]].concat());
    assert!(n17.step_s > early.step_s, "{} vs {}", n17.step_s, early.step_s);
    assert!(streamed.step_s > streamed.host_update_s + streamed.compute_s * 0.5, "{}", streamed.step_s);
    assert!(streamed.step_s > all.step_s);
    // Lean overlaps everything: no serial update, but more host bytes: the landed f32 is read
    // (and stored in bf16) in the update pass, and each upload copy is a cast of its own.
    let lean = estimate_3_6b(&[&ring[..], &["--optim-mode", "lean"]].concat());
    let want = n * (4.0 + 2.0 + 24.0 + 6.0 + 6.0) / 140e9;
    assert!((lean.host_s - want).abs() < 1e-9, "{}", lean.host_s);
    // A streamed outer unit lands in f32 (cast + sum of squares: 6 B) and is uploaded once.
    // (the ring arguments with the outer unit streamed: the later `--resident-outer` wins)
    let outer = estimate_3_6b(&[&ring[..], &["--resident-outer", "off"]].concat());
    let o = 788_007_936.0;
    assert!((outer.host_s - (n * 38.0 + o * (28.0 + 6.0)) / 140e9).abs() < 1e-9, "{}", outer.host_s);
}

/// The step times measured with the portable flash kernels on one H200 and with the Hopper
/// kernels on one H100 and one H200 (compute-bound; where: docs/decisions/0041)
/// against the estimate of the same command: within 10% each, where pricing attention at the
/// GEMMs' rate put the 7B at 128k 2.2x too fast.
#[test]
fn the_step_time_follows_the_measured_flash_runs() {
    let lean: &[&str] = &["--optim-mode", "lean", "--grad-dtype", "none"];
    // (config, batch, seq, attention, GPU GiB, extra arguments, measured seconds a step)
    let runs = [
        ("llama3-3.6b.json", 4, 2048, "portable", "139.8", &[][..], 0.3733),
        ("llama3-3.6b.json", 16, 2048, "portable", "139.8", &[], 1.450),
        ("llama3-3.6b.json", 4, 2048, "materialized", "139.8", &[], 0.3985),
        ("llama3-3.6b.json", 16, 2048, "materialized", "139.8", &[], 1.827),
        ("qwen2.5-7b.json", 1, 32768, "portable", "139.8", &[], 7.52),
        ("qwen2.5-7b.json", 1, 131072, "portable", "139.8", &[], 82.46),
        ("qwen2.5-7b.json", 1, 262144, "portable", "139.8", &[], 304.46),
        ("llama3-3.6b.json", 4, 2048, "auto", "79.2", &[], 0.4085),
        ("llama3-3.6b.json", 1, 16384, "auto", "79.2", &[], 1.199),
        ("qwen2.5-7b.json", 1, 131072, "auto", "79.2", lean, 43.44),
        ("qwen2.5-7b.json", 1, 262144, "auto", "79.2", lean, 148.87),
        // The Hopper kernels on an H200 (results/2026-11-28-long-context-h200,
        // results/2026-11-28-512k-two-steps-h200): estimated 41.1, 140 and 511 s.
        ("qwen2.5-7b.json", 1, 131072, "auto", "139.8", lean, 39.6),
        ("qwen2.5-7b.json", 1, 262144, "auto", "139.8", lean, 136.5),
        ("qwen2.5-7b.json", 1, 524288, "auto", "139.8", lean, 563.6),
    ];
    for (config, batch, seq, attention, gpu_mem, extra, measured) in runs {
        let e = estimate_of(config, batch, seq, gpu_mem, &[&["--attention", attention][..], extra].concat());
        assert_eq!(e.plan.flash_attention, attention != "materialized", "{config} {batch}x{seq}");
        assert_eq!(e.plan.hopper_attention, attention == "auto", "{config} {batch}x{seq}");
        let ratio = e.step_s / measured;
        assert!(
            (0.9..1.1).contains(&ratio),
            "{config} {batch}x{seq} ({attention}): {:.3} s vs {measured} s measured",
            e.step_s
        );
    }
}

/// LoRA r 16 step times measured on one H200 (the 8B's base kept on the GPU, the 70B's partly
/// streamed; compute 99-100% busy; `results/2026-11-29-lora-kept-base-h200/`,
/// `results/2026-11-29-lora-70b-16x2048-h200/`) against the estimate of the same
/// command: within 5% each, where pricing the adapters by their FLOPs alone put them 7-12% low.
#[test]
fn the_step_time_follows_the_measured_lora_runs() {
    // (config, batch, base dtype, measured seconds a step)
    let runs = [
        ("llama3-8b.json", 4, "bf16", 0.581),
        ("llama3-8b.json", 16, "bf16", 2.565),
        ("llama3-70b.json", 4, "int8", 6.14),
        // Not among the runs the adapters' memory term was fitted to
        // (results/2026-11-29-lora-70b-16x2048-h200): estimated 24.2 s each.
        ("llama3-70b.json", 16, "int8", 24.83),
        ("llama3-70b.json", 16, "nf4", 25.06),
    ];
    for (config, batch, base, measured) in runs {
        let e = estimate_of(config, batch, 2048, "139.8", &["--lora-rank", "16", "--base-dtype", base]);
        let ratio = e.step_s / measured;
        eprintln!(
            "SUMMARY LoRA {config} {batch}x2048 on {base}: estimate {:.3} s, measured {measured} s",
            e.step_s
        );
        assert!(
            (0.95..1.05).contains(&ratio),
            "{config} {batch}x2048: {:.3} s vs {measured} s measured",
            e.step_s
        );
    }
}

/// A GPU older than compute capability 8.0 runs candle's ops, whose transient memory is
/// counted larger: the same 3.6B step on a 7.5 device plans more workspace and keeps fewer
/// layers' activations; 8.0 (A100) and 8.9 (L40S) plan as 9.0.
#[test]
fn the_compute_capability_decides_which_workspace_is_counted() {
    let hopper = estimate_3_6b(&[]);
    let turing = estimate_3_6b(&["--compute-capability", "7.5"]);
    assert!(hopper.plan.gpu.workspace < turing.plan.gpu.workspace / 2, "{} vs {}", hopper.plan, turing.plan);
    assert!(
        hopper.plan.placement.kept_layers > turing.plan.placement.kept_layers,
        "{} vs {}",
        hopper.plan,
        turing.plan
    );
    for cc in ["9.0", "8.9", "8.0"] {
        let plan = estimate_3_6b(&["--compute-capability", cc]).plan;
        assert_eq!(plan.gpu.workspace, hopper.plan.gpu.workspace, "{cc}");
    }
}

/// A Qwen2.5-7B-shaped store (107 GB exact) on a 60 GiB host: refused without a file, paged
/// through a window with `--store` (nothing created; its untied embedding and LM head are one
/// 14.2 GiB record, and the window needs three: below ~51 GiB it is refused too).
#[test]
fn a_store_larger_than_the_host_is_paged_only_from_a_file() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench-harness/configs/qwen2.5-7b.json");
    let argv = |extra: &[&str]| {
        let mut v =
            vec!["megatrain", "estimate", "--config", config, "--device", "cuda", "--precision", "bf16"];
        v.extend(["--batch-size", "1", "--seq-len", "2048", "--gpu-mem", "79", "--host-mem", "60"]);
        v.extend_from_slice(extra);
        match Cli::parse_from(v).command {
            Command::Estimate(a) => super::estimate(&a),
            _ => unreachable!(),
        }
    };
    let e = argv(&[]).unwrap_err().to_string();
    assert!(e.contains("--store FILE"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("never-created.mts");
    let est = argv(&["--store", file.to_str().unwrap()]).unwrap();
    let window = est.plan.host.store_window.expect("paged");
    assert!(est.plan.host.total <= 60 << 30 && window < est.plan.host.store / 2, "{:?}", est.plan.host);
    assert!(!file.exists(), "estimate creates nothing");
    let text = est.to_string();
    assert!(text.contains("disk tier: the store pages from its file"), "{text}");
}

/// A LoRA run is priced as it runs: the host updates and lands the adapters alone and stages
/// the frozen base into each upload in its encoding (`--base-dtype`: fp32 cast, 4 + 2 B a
/// parameter read and written; bf16 copied, 2 + 2; an int8 or NF4 layer's encoded bytes copied,
/// twice 17/16 or 9/16 a matrix parameter and 2 + 2 for the rest), each layer goes up in those
/// bytes, the backward forms no gradient of a frozen weight (2 FLOPs a parameter a token fewer),
/// and every layer fits held on the GPU.
#[test]
fn a_lora_run_is_priced_by_its_adapters_and_its_frozen_base() {
    let streamed = [
        "--resident-layers",
        "0",
        "--resident-outer",
        "off",
        "--held-layers",
        "0",
        "--kept-layers",
        "0",
        "--gpu-updated-layers",
        "0",
    ];
    let full = estimate_3_6b(&streamed);
    let layout = &full.plan;
    let n = layout.n_params as f64;
    // Rank 16 on the seven linear layers of 28 layers of the 3.6B (hidden 3072, kv 1024, ffn 8192).
    let a = 28.0 * 16.0 * (2.0 * 6144.0 + 2.0 * 4096.0 + 3.0 * 11264.0);
    // A layer's matrices and norms; the outer unit: embedding and LM head, the final norm.
    let mats = 2.0 * 3072.0 * 3072.0 + 2.0 * 3072.0 * 1024.0 + 3.0 * 3072.0 * 8192.0;
    let (norms, outer) = (2.0 * 3072.0, 128256.0 * 3072.0 * 2.0 + 3072.0);
    assert_eq!(n, 28.0 * (mats + norms) + outer);
    let mut h2d = Vec::new();
    for (dtype, matrix_bytes, other_bytes) in
        [("fp32", 4.0, 4.0), ("bf16", 2.0, 2.0), ("int8", 17.0 / 16.0, 2.0), ("nf4", 9.0 / 16.0, 2.0)]
    {
        let lora = estimate_3_6b(&[&streamed[..], &["--lora-rank", "16", "--base-dtype", dtype]].concat());
        let p = &lora.plan;
        assert_eq!((p.n_params as f64, p.trainable_params as f64), (n + a, a), "{dtype}");
        let held = 28.0 * (mats * matrix_bytes + norms * other_bytes) + outer * other_bytes;
        assert_eq!(p.host.frozen_base as f64, held, "{dtype}: the base in host memory");
        // Staged: the base read as held, then written as it goes up (bf16 weights, or an int8 or
        // NF4 layer's encoding again); the adapters cast beside it.
        let encoded = matrix_bytes < 2.0;
        let layer_up = if encoded { mats * matrix_bytes + norms * 2.0 } else { (mats + norms) * 2.0 };
        let layer_stage = mats * matrix_bytes + norms * other_bytes + layer_up;
        // The update (28 B: bf16 gradient, master, m, v, the bf16 copy) over the adapters, the
        // forward's staging of the layers' base (the outer unit's stays in its slot after the
        // first step).
        let update = (a * 28.0 + 28.0 * layer_stage) / 140e9;
        assert!((lora.host_update_s - update).abs() < 1e-9, "{dtype}: {} vs {update}", lora.host_update_s);
        // The backward re-stages each layer (the adapters cast, 6 B) and lands the adapters'
        // bf16 gradients (4 B).
        let backward = (28.0 * layer_stage + a * 6.0 + a * 4.0) / 140e9;
        let b = lora.host_s - update;
        assert!((b - backward).abs() < 1e-6, "{dtype}: {b} vs {backward}");
        assert!(lora.host_s < 0.3 * full.host_s, "{dtype}: {} vs {}", lora.host_s, full.host_s);
        // Each layer up twice, in bf16 but for an encoded layer's base; the outer unit's base
        // is in its slot from the first step on.
        let up = 2.0 * 28.0 * (layer_up + a / 28.0 * 2.0);
        assert_eq!(p.pcie_h2d_per_step as f64, up, "{dtype}: the uploads");
        h2d.push(p.pcie_h2d_per_step);
        // No weight gradient of the base: 2·N·T fewer GEMM FLOPs, 6 for each adapter's parameter,
        // and the adapters' memory passes (15 B a token for each element of their targets'
        // in + out, which is a / 16 over the layers, at 4080 GB/s).
        let t = 4.0 * 2048.0;
        let fewer = (2.0 * n - 6.0 * a) * t / 600e12 - 15.0 * (a / 16.0) * t / 4080e9;
        let d = full.compute_s - lora.compute_s;
        assert!((d - fewer).abs() < 0.02 * fewer, "{dtype}: {d} vs {fewer}");
        let text = lora.to_string();
        assert!(
            text.contains(&format!("frozen base ({dtype})")) && text.contains(&format!("as {dtype} (")),
            "{text}"
        );
        assert!(text.contains("uploaded encoded and dequantised on the GPU") == encoded, "{text}");
        let json = lora.to_json(&args_of(&["--lora-rank", "16", "--base-dtype", dtype]));
        assert_eq!(json["base_dtype"], dtype);
    }
    assert!(h2d[3] < h2d[2] && h2d[2] < h2d[1] && h2d[1] == h2d[0], "{h2d:?}");
    // Auto on an H200: no optimizer state on the GPU, every layer held.
    let auto = estimate_3_6b(&["--lora-rank", "16"]);
    let q = &auto.plan.placement;
    assert_eq!((q.resident_layers, q.resident_outer, q.gpu_updated_layers, q.held_layers), (0, false, 0, 28));
    assert!(auto.to_string().contains("frozen base (bf16)"), "{auto}");
    assert_eq!(auto.plan.base.dtype, mt_core::BaseDtype::Bf16, "bf16 weights: a bf16 base by default");
}

/// The OLMoE-1B-7B shape: a bf16 GPU of compute capability 8.0+ prices its MoE layers as the
/// device kernels run them unless `--moe-kernels portable` says otherwise; below 8.0 (no fused
/// kernels) and in fp32 the portable path runs whatever is asked. The JSON says which.
#[test]
fn the_moe_kernels_are_priced_where_they_run() {
    let config =
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench-harness/configs/olmoe-1b-7b.json").to_string();
    let run = |extra: &[&str]| {
        let mut argv = vec!["megatrain", "estimate", "--config", &config, "--device", "cuda"];
        argv.extend(["--batch-size", "16", "--seq-len", "2048", "--host-mem", "200"]);
        argv.extend(extra);
        let Command::Estimate(args) = Cli::try_parse_from(argv).unwrap().command else { unreachable!() };
        let e = super::estimate(&args).unwrap();
        assert_eq!(e.to_json(&args)["moe_kernels"], e.plan.moe_kernels, "{extra:?}");
        e.plan
    };
    let device = run(&["--precision", "bf16"]);
    assert!(device.moe_kernels, "{device}");
    let portable = run(&["--precision", "bf16", "--moe-kernels", "portable"]);
    assert!(!portable.moe_kernels, "{portable}");
    assert_ne!(device.gpu.workspace, portable.gpu.workspace, "{device}\n{portable}");
    assert!(!run(&["--precision", "bf16", "--compute-capability", "7.5"]).moe_kernels);
    assert!(!run(&["--precision", "fp32"]).moe_kernels);
}

/// GPT-OSS-20B's shape (the released `config.json`'s attention: 64 query over 8 KV heads of 64,
/// a 128-token window on even layers, sinks) on an H200: `--attention auto` and `hopper` plan
/// flash attention on the Hopper kernels (which take its sinks and windows; their dQ buffer is
/// planned), `portable` on the portable ones, none refused; the materialised scores and fp32 are
/// what train refuses, in its words.
#[test]
fn gpt_oss_plans_the_hopper_flash_kernels_and_names_what_train_refuses() {
    let layer_types: Vec<&str> =
        (0..24).map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" }).collect();
    let config = serde_json::json!({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": true,
        "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880, "layer_types": layer_types,
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
        "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": false,
        "vocab_size": 201088
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let path = path.to_str().unwrap();
    let estimate = |precision: &str, attention: &str| {
        let mut argv =
            vec!["megatrain", "estimate", "--config", path, "--device", "cuda", "--gpu-mem", "139.8"];
        argv.extend([
            "--host-mem",
            "500",
            "--batch-size",
            "1",
            "--seq-len",
            "2048",
            "--precision",
            precision,
        ]);
        argv.extend(["--attention", attention]);
        let Command::Estimate(args) = Cli::try_parse_from(argv).unwrap().command else { unreachable!() };
        super::estimate(&args).unwrap()
    };
    for attention in ["auto", "hopper"] {
        let e = estimate("bf16", attention);
        assert!(e.plan.flash_attention && e.plan.hopper_attention, "{attention}: {}", e.plan);
        assert_eq!(e.refused, None, "{attention}");
    }
    let portable = estimate("bf16", "portable");
    assert!(portable.plan.flash_attention && !portable.plan.hopper_attention, "{}", portable.plan);
    assert_eq!(portable.refused, None);
    let refusal = |precision, attention| estimate(precision, attention).refused.unwrap_or_default();
    let flash_only = "in the flash attention kernels only";
    assert!(refusal("bf16", "materialized").contains(flash_only));
    assert!(refusal("fp32", "auto").contains(flash_only));
}

/// The OLMoE-1B-7B shape's steps measured on one H200 (bf16, exact mode, every layer resident
/// and updated on the GPU: `results/2026-11-28-olmoe-engine-h200/`) against the estimate of the
/// same command: within 10% each on the device MoE kernels and on the portable path, where
/// pricing the experts at the dense GEMMs' rate and leaving the GPU's AdamW pass out put the
/// device path's 16 x 2048 step at half its time.
#[test]
fn the_step_time_follows_the_measured_moe_runs() {
    // (batch, --moe-kernels, measured seconds a step)
    let runs =
        [(16, "device", 1.1706), (4, "device", 0.3274), (16, "portable", 10.5011), (4, "portable", 2.4476)];
    for (batch, kernels, measured) in runs {
        let e = estimate_of("olmoe-1b-7b.json", batch, 2048, "139.8", &["--moe-kernels", kernels]);
        assert_eq!(e.plan.moe_kernels, kernels == "device", "{batch} x 2048 {kernels}");
        let ratio = e.step_s / measured;
        assert!(
            (0.9..1.1).contains(&ratio),
            "{batch} x 2048 {kernels}: {:.3} s vs {measured} s measured",
            e.step_s
        );
    }
}

//! `megatrain train --lora-rank`: checkpoints hold the adapters and their optimizer state, not
//! the base, and a resumed run ends bitwise where an uninterrupted one does, whatever
//! `--base-dtype` holds the base; the losses on an int8 or NF4 base stay within stated bounds of
//! the bf16 base's; the export is peft's adapter directory (`--merge`: the merged model), and the
//! run says which; `--lora-from` refuses contradicting options, and a LoRA option without
//! adapters is refused; `megatrain estimate` counts the store and frozen base the run allocates
//! and the bytes it uploads.

mod common;

use common::*;

/// The adapters of these tests' runs and estimates.
const ADAPTERS: [&str; 6] =
    ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,down_proj"];

fn args<'a>(model: &'a str, data: &'a str, out: &'a str, steps: &'a str) -> Vec<&'a str> {
    let mut a = vec!["train", "--model", model, "--data", data, "--out", out, "--steps", steps];
    a.extend(ADAPTERS);
    a.extend(["--batch-size", "2", "--seq-len", "16", "--save-every", "1", "--schedule-steps", "6"]);
    a
}

/// With every base dtype (fp32, the default of an fp32 run, bf16, int8, nf4) a run's checkpoints
/// hold the adapters alone and a run killed after step 2 and resumed ends bitwise where the
/// uninterrupted one does; the run says what it exported and how its base is held; a resume that
/// would hold the base otherwise (int8 after nf4) is refused, naming it.
#[test]
fn lora_checkpoints_hold_the_adapters_and_resume_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.jsonl");
    write_data(&data);
    let model = model_fixture();
    let (m, d) = (s(&model), s(&data));
    let base_bytes = std::fs::metadata(model.join("model.safetensors")).unwrap().len();
    for dtype in ["fp32", "bf16", "int8", "nf4"] {
        let (one, two) = (dir.path().join(format!("one-{dtype}")), dir.path().join(format!("two-{dtype}")));
        let run = |out: &std::path::Path, steps: &str, more: &[&str]| {
            let mut a = args(m, d, s(out), steps);
            // fp32: the default of this fp32 run.
            a.extend(if dtype == "fp32" { vec![] } else { vec!["--base-dtype", dtype] });
            a.extend(more);
            megatrain(&a)
        };
        let o = run(&one, "4", &[]);
        assert!(o.status.success(), "{dtype}: {}", stderr(&o));
        assert!(run(&two, "2", &[]).status.success());
        let o = run(&two, "4", &["--resume"]);
        assert!(o.status.success(), "{dtype}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("resumed from checkpoint") || stdout(&o).contains("resumed from checkpoint")
        );
        let read = |p: &std::path::Path| std::fs::read(p.join("adapter_model.safetensors")).unwrap();
        assert!(
            read(&one) == read(&two),
            "{dtype}: a resumed LoRA run ends where the uninterrupted one does"
        );
        // The resumed run's end says what it wrote, and where.
        let said = format!(
            "LoRA adapter exported to {} (peft's format: adapter_config.json and adapter_model.safetensors",
            two.display()
        );
        assert!(stdout(&o).contains("exported the LoRA adapter (peft's format) to"), "{}", stdout(&o));
        assert!(stdout(&o).contains(&said), "{}", stdout(&o));
        assert!(stdout(&o).contains(&format!("in host memory ({dtype};")), "{dtype}: {}", stdout(&o));
        assert!(!stdout(&o).contains("(Hugging Face format)"), "{}", stdout(&o));
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(one.join("adapter_config.json")).unwrap()).unwrap();
        assert_eq!(cfg["peft_type"], "LORA");
        assert_eq!(cfg["r"], 4);
        assert_eq!(cfg["target_modules"], serde_json::json!(["q_proj", "v_proj", "down_proj"]));
        // A checkpoint holds master, m, v and gradient of the adapters: far less than the base.
        let snap = std::fs::read_dir(one.join("checkpoints"))
            .unwrap()
            .flatten()
            .find(|e| e.path().extension().is_some_and(|x| x == "store"))
            .unwrap();
        let snap_bytes = snap.metadata().unwrap().len();
        assert!(snap_bytes < base_bytes / 2, "{dtype}: checkpoint {snap_bytes} B vs base {base_bytes} B");
    }
    // An NF4 run resumed on an int8 base would train another model.
    let nf4 = dir.path().join("one-nf4");
    let mut a = args(m, d, s(&nf4), "6");
    a.extend(["--base-dtype", "int8", "--resume"]);
    let o = megatrain(&a);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("base_dtype"), "{}", stderr(&o));
}

#[test]
fn lora_from_refuses_other_options_and_merge_exports_a_model() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.jsonl");
    write_data(&data);
    let model = model_fixture();
    let (m, d) = (s(&model), s(&data));
    let first = dir.path().join("first");
    assert!(megatrain(&args(m, d, s(&first), "1")).status.success());
    let next = dir.path().join("next");
    let mut a = args(m, d, s(&next), "1");
    a.extend(["--lora-from", s(&first)]);
    let rank = a.iter().position(|x| *x == "--lora-rank").unwrap() + 1;
    a[rank] = "8";
    let o = megatrain(&a);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("holds an adapter of rank 4"), "{}", stderr(&o));
    let merged = dir.path().join("merged");
    let mut a = vec!["train", "--model", m, "--data", d, "--out", s(&merged), "--steps", "1", "--merge"];
    a.extend(["--lora-from", s(&first), "--batch-size", "2", "--seq-len", "16"]);
    let o = megatrain(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(merged.join("config.json").is_file() && merged.join("model.safetensors").is_file());
    let said = format!(
        "model with its LoRA adapters merged in exported to {} (Hugging Face format)",
        merged.display()
    );
    assert!(stdout(&o).contains(&said), "{}", stdout(&o));
    let o = megatrain(&["train", "--model", m, "--data", d, "--lora-rank", "4", "--lora-dropout", "0.1"]);
    assert!(stderr(&o).contains("not implemented yet"), "{}", stderr(&o));
}

/// `--merge` puts the adapters into the base as `--model` gives it, not into the run's encoding
/// of it: on an NF4 base every weight the adapters leave alone is exported bitwise as the model
/// had it, and each adapted one is `W + (alpha / r) B A` with the adapters a second run of the
/// same options exports without `--merge` (runs are deterministic; the merge peft does over the
/// same base).
#[test]
fn merge_adds_the_adapters_to_the_weights_as_given() {
    use candle_core::{DType, Device, Tensor};
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.jsonl");
    write_data(&data);
    let model = model_fixture();
    let (m, d) = (s(&model), s(&data));
    let (merged, adapter) = (dir.path().join("merged"), dir.path().join("adapter"));
    for (out, merge) in [(&merged, true), (&adapter, false)] {
        let mut a = args(m, d, s(out), "2");
        a.extend(["--base-dtype", "nf4"]);
        if merge {
            a.push("--merge");
        }
        let o = megatrain(&a);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let load = |p: std::path::PathBuf| candle_core::safetensors::load(p, &Device::Cpu).unwrap();
    let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let (given, got) = (load(model.join("model.safetensors")), load(merged.join("model.safetensors")));
    let ad = load(adapter.join("adapter_model.safetensors"));
    let (mut kept, mut adapted) = (0, 0);
    for (name, w) in &given {
        let w = f64s(w);
        let m = f64s(&got[name]);
        let lora = |ab: &str| {
            ad.get(&format!("base_model.model.{}", name.replace(".weight", &format!(".lora_{ab}.weight"))))
        };
        match (lora("A"), lora("B")) {
            (Some(a), Some(b)) => {
                // alpha 8 over rank 4 (ADAPTERS): W + 2 B A.
                let delta =
                    (b.to_dtype(DType::F64).unwrap().matmul(&a.to_dtype(DType::F64).unwrap()).unwrap() * 2.0)
                        .unwrap();
                let delta = f64s(&delta);
                let scale = w.iter().fold(0f64, |s, x| s.max(x.abs()));
                let worst = (0..w.len()).map(|i| (m[i] - (w[i] + delta[i])).abs()).fold(0f64, f64::max);
                assert!(
                    worst <= 1e-6 * scale,
                    "{name}: merged differs from W + 2 B A by {worst:e} (|W| {scale})"
                );
                assert!(delta.iter().any(|x| *x != 0.0), "{name}: the adapter was not trained");
                adapted += 1;
            }
            _ => {
                assert!(w == m, "{name}: the merged export changed a weight no adapter touches");
                kept += 1;
            }
        }
    }
    eprintln!("SUMMARY --merge on an NF4 base: {kept} weights exported as given, {adapted} as W + 2 B A");
    assert!(kept > 0 && adapted > 0, "{kept} kept, {adapted} adapted");
}

/// `megatrain estimate --lora-rank` counts what a LoRA run of the same options allocates and
/// moves (its `--metrics` run and step records), byte for byte, for every base dtype: the host
/// store, the frozen base in its encoding and the bytes uploaded a step (an int8 or NF4 base's
/// layers encoded); far less than the same model's full fine-tune: the adapters' training state,
/// the base once.
#[test]
fn estimate_counts_what_a_lora_run_allocates() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.jsonl");
    write_data(&data);
    let model = model_fixture();
    let estimate = |lora: &[&str]| {
        let mut e = vec!["estimate", "--model", s(&model), "--batch-size", "2", "--seq-len", "16", "--json"];
        e.extend(lora);
        let o = megatrain(&e);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let full = estimate(&[]);
    assert_eq!(full["host_frozen_base_bytes"], 0);
    let n = full["n_params"].as_u64().unwrap();
    let mut bytes = Vec::new();
    for (dtype, precision) in
        [("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "bf16"), ("int8", "bf16"), ("nf4", "bf16")]
    {
        let (out, metrics) = (
            dir.path().join(format!("{dtype}-{precision}")),
            dir.path().join(format!("{dtype}-{precision}.jsonl")),
        );
        let mut a = args(s(&model), s(&data), s(&out), "2");
        a.extend(["--metrics", s(&metrics), "--base-dtype", dtype, "--precision", precision]);
        let o = megatrain(&a);
        assert!(o.status.success(), "{dtype}: {}", stderr(&o));
        let text = std::fs::read_to_string(&metrics).unwrap();
        let records: Vec<serde_json::Value> =
            text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        // The estimate prices a step after the first (the held layers' and the outer unit's base
        // stay in their slots from the first step on); the first uploads every base.
        let steps: Vec<_> = records.iter().filter(|r| r["type"] == "step").collect();
        let (run, first, step) = (&records[0], steps[0], steps[1]);
        assert_eq!((&run["type"], &run["base_dtype"]), (&"run".into(), &dtype.into()));
        let lora = estimate(&[&ADAPTERS[..], &["--base-dtype", dtype, "--precision", precision]].concat());
        let what = format!("{dtype} base, {precision}: {lora}");
        assert_eq!(lora["host_store_bytes"], run["store_bytes"], "the adapters' store, {what}");
        assert_eq!(lora["host_frozen_base_bytes"], run["frozen_base_bytes"], "the frozen base, {what}");
        assert_eq!(lora["pcie_h2d_bytes_per_step"], step["h2d_bytes"], "the uploads, {what}");
        assert_eq!(lora["base_dtype"], dtype);
        let (l, f) = (&lora["host_store_bytes"], &full["host_store_bytes"]);
        assert!(l.as_u64().unwrap() * 10 < f.as_u64().unwrap(), "LoRA store {l} vs full {f}");
        assert!(lora["host_bytes"].as_u64() < full["host_bytes"].as_u64(), "{what}\n{full}");
        assert!(
            lora["pcie_d2h_bytes_per_step"].as_u64().unwrap() * 10
                < full["pcie_d2h_bytes_per_step"].as_u64().unwrap()
        );
        bytes.push((run["frozen_base_bytes"].as_u64().unwrap(), first["h2d_bytes"].as_u64().unwrap()));
    }
    eprintln!("SUMMARY tiny Llama LoRA (frozen base bytes, H2D bytes of the first step): fp32 in fp32 and bf16, bf16, int8, nf4 in bf16: {bytes:?}");
    let base = bytes[0].0;
    assert!((4 * n..4 * n + 4 * n / 20).contains(&base), "fp32 base {base} B for {n} parameters");
    // bf16 slots: an fp32 or a bf16 base goes up as bf16 weights, int8 and NF4 layers encoded.
    assert!(bytes[1].0 == 2 * bytes[2].0 && bytes[4].0 < bytes[3].0 && bytes[3].0 < bytes[2].0, "{bytes:?}");
    assert!(bytes[1].1 == bytes[2].1 && bytes[4].1 < bytes[3].1 && bytes[3].1 < bytes[2].1, "{bytes:?}");
}

/// An option that shapes adapters, given without `--lora-rank` (or `--lora-from`), is refused
/// with a sentence naming it (from the command line or a config file), by `train` and
/// `estimate`, instead of being ignored.
#[test]
fn lora_options_without_adapters_are_refused() {
    let refused = |a: &[&str], flag: &str| {
        let o = megatrain(a);
        assert_eq!(o.status.code(), Some(2), "{a:?}: {}", stdout(&o));
        let want = format!("{flag} applies to LoRA adapters, but this is not a LoRA run: give --lora-rank R");
        assert!(stderr(&o).contains(&want), "{a:?}: {}", stderr(&o));
    };
    for (flag, value) in [
        ("--base-dtype", Some("int8")),
        ("--lora-alpha", Some("8")),
        ("--lora-targets", Some("q_proj")),
        ("--lora-dropout", Some("0.1")),
        ("--rslora", None),
    ] {
        for cmd in ["train", "estimate"] {
            let mut a = vec![cmd, flag];
            a.extend(value);
            refused(&a, flag);
        }
    }
    refused(&["train", "--merge"], "--merge");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("run.toml");
    std::fs::write(&file, "lora-alpha = 16\n").unwrap();
    refused(&["train", "--config-file", s(&file)], "--lora-alpha");
}

/// The per-step losses of a run's `--metrics` file.
fn losses(metrics: &std::path::Path) -> Vec<f64> {
    let text = std::fs::read_to_string(metrics).unwrap();
    let records = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
    records.filter(|r| r["type"] == "step").map(|r| r["loss"].as_f64().unwrap()).collect()
}

/// Bounds of a LoRA run's losses on an int8 or NF4 base, relative to the same run's on a bf16
/// base: `--precision bf16`, 8 steps of 2 x 16 tokens on a base that has learned its data (the
/// tiny Llama fixture fine-tuned 40 steps to count up mod 128, so its loss is far below ln 128
/// and its weights matter). The fp32 base is the bf16 one bitwise (the upload rounds it to the
/// same bf16); int8 stays within 1e-2 and NF4 within 1e-1 of each step's loss (relative). Why
/// those: int8's error is at most 1/254 of a block's largest magnitude (~0.4%), NF4's about 15%
/// (half its widest gap); a loss moves by about the logits' relative change, which a layer's
/// error bounds, and the errors of two layers add; the bounds leave room for that on this tiny
/// model, whose blocks are whole rows of 64 (its largest magnitude per block is ~3 RMS). The
/// measured worst differences are printed (SUMMARY lines) and in decision 0048.
#[test]
fn losses_on_each_base_dtype_stay_within_bounds_of_the_bf16_base() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("count.jsonl");
    // Sequences counting up mod 128 from seeded starts: learnable in a few dozen steps.
    let mut x: u64 = 99;
    let lines: Vec<String> = (0..40)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let start = (x >> 33) % 128;
            let ids: Vec<String> = (0..16).map(|i| ((start + i) % 128).to_string()).collect();
            format!("{{\"input_ids\": [{}]}}", ids.join(", "))
        })
        .collect();
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    let base = dir.path().join("base");
    let o = megatrain(&[
        "train",
        "--model",
        s(&model_fixture()),
        "--data",
        s(&data),
        "--out",
        s(&base),
        "--steps",
        "40",
        "--lr",
        "0.01",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = |dtype: &str| {
        let (out, metrics) = (dir.path().join(dtype), dir.path().join(format!("{dtype}.jsonl")));
        let mut a = args(s(&base), s(&data), s(&out), "8");
        a.extend(["--base-dtype", dtype, "--precision", "bf16", "--lr", "0.002", "--metrics", s(&metrics)]);
        let o = megatrain(&a);
        assert!(o.status.success(), "{dtype}: {}", stderr(&o));
        losses(&metrics)
    };
    let bf16 = run("bf16");
    assert_eq!(bf16.len(), 8);
    assert!(bf16[0] < 0.75 * 128f64.ln(), "the base has learned its data: {bf16:?}");
    assert_eq!(run("fp32"), bf16, "an fp32 base goes up as the same bf16 weights");
    for (dtype, bound) in [("int8", 1e-2), ("nf4", 1e-1)] {
        let l = run(dtype);
        let worst = l.iter().zip(&bf16).map(|(a, b)| (a - b).abs() / b).fold(0.0, f64::max);
        eprintln!("SUMMARY LoRA losses on a {dtype} base vs bf16: worst relative difference {worst:.2e} (bound {bound:.0e}); {l:?} vs {bf16:?}");
        assert!(worst <= bound && worst > 0.0, "{dtype}: {l:?} vs {bf16:?}");
    }
}

/// A model given by `--config` alone trains its adapters on a base initialised from the seed (a
/// run for measuring speed and memory, which says so), and that base is the one `megatrain init`
/// writes from the same config and seed: a LoRA run on each, bf16 base, has bitwise equal losses.
#[test]
fn lora_on_a_config_trains_on_the_base_init_writes() {
    let dir = tempfile::tempdir().unwrap();
    let config = model_fixture().join("config.json");
    let init = dir.path().join("init");
    let o = megatrain(&["init", "--config", s(&config), "--out", s(&init), "--seed", "7"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let data = dir.path().join("d.jsonl");
    write_data(&data);
    let run = |source: &str, path: &std::path::Path, name: &str| {
        let metrics = dir.path().join(format!("{name}.jsonl"));
        let mut a = vec!["train", source, s(path), "--data", s(&data), "--steps", "3", "--seed", "7"];
        a.extend(ADAPTERS);
        a.extend(["--base-dtype", "bf16", "--batch-size", "2", "--seq-len", "16", "--metrics", s(&metrics)]);
        let o = megatrain(&a);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        (stdout(&o), losses(&metrics))
    };
    let (said, from_config) = run("--config", &config, "config");
    assert!(said.contains("LoRA base: initialised from the seed"), "{said}");
    let (said, from_dir) = run("--model", &init, "dir");
    assert!(!said.contains("LoRA base: initialised"), "{said}");
    assert_eq!(from_config.len(), 3);
    assert!(from_config.iter().all(|l| l.is_finite()), "{from_config:?}");
    assert_eq!(from_config, from_dir, "the --config base differs from init's");
}

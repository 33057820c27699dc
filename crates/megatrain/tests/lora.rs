//! `megatrain train --lora-rank`: checkpoints hold the adapters and their optimizer state, not
//! the base, and a resumed run ends bitwise where an uninterrupted one does; the export is peft's
//! adapter directory (`--merge`: the merged model), and the run says which; `--lora-from` refuses
//! contradicting options, and a LoRA option without adapters is refused; `megatrain estimate`
//! counts the store and frozen base the run allocates.

mod common;

use common::*;

fn args<'a>(model: &'a str, data: &'a str, out: &'a str, steps: &'a str) -> Vec<&'a str> {
    let mut a = vec!["train", "--model", model, "--data", data, "--out", out, "--steps", steps];
    a.extend([
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--lora-targets",
        "q_proj,v_proj,down_proj",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--save-every",
        "1",
        "--schedule-steps",
        "6",
    ]);
    a
}

#[test]
fn lora_checkpoints_hold_the_adapters_and_resume_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.jsonl");
    write_data(&data);
    let model = model_fixture();
    let (m, d) = (s(&model), s(&data));
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    let o = megatrain(&args(m, d, s(&one), "4"));
    assert!(o.status.success(), "{}", stderr(&o));
    let o = megatrain(&args(m, d, s(&two), "2"));
    assert!(o.status.success(), "{}", stderr(&o));
    let mut resume = args(m, d, s(&two), "4");
    resume.push("--resume");
    let o = megatrain(&resume);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resumed from checkpoint") || stdout(&o).contains("resumed from checkpoint"));
    let read = |p: &std::path::Path| std::fs::read(p.join("adapter_model.safetensors")).unwrap();
    assert!(read(&one) == read(&two), "a resumed LoRA run ends where the uninterrupted one does");
    // The resumed run's end says what it wrote, and where.
    let said = format!(
        "LoRA adapter exported to {} (peft's format: adapter_config.json and adapter_model.safetensors",
        two.display()
    );
    assert!(stdout(&o).contains("exported the LoRA adapter (peft's format) to"), "{}", stdout(&o));
    assert!(stdout(&o).contains(&said), "{}", stdout(&o));
    assert!(stdout(&o).contains("frozen base: "), "{}", stdout(&o));
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
    let base_bytes = std::fs::metadata(model.join("model.safetensors")).unwrap().len();
    let snap_bytes = snap.metadata().unwrap().len();
    assert!(snap_bytes < base_bytes / 2, "checkpoint {snap_bytes} B vs base {base_bytes} B");
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
    let o = megatrain(&["train", "--lora-rank", "4", "--steps", "1"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("pretrained model"), "{}", stderr(&o));
    let o = megatrain(&["train", "--model", m, "--data", d, "--lora-rank", "4", "--lora-dropout", "0.1"]);
    assert!(stderr(&o).contains("not implemented yet"), "{}", stderr(&o));
}

/// `megatrain estimate --lora-rank` counts the host store and the frozen base a LoRA run of the
/// same options allocates (its `--metrics` run record), byte for byte, and far less than the
/// same model's full fine-tune: the adapters' training state, the base once in fp32.
#[test]
fn estimate_counts_what_a_lora_run_allocates() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.jsonl");
    write_data(&data);
    let model = model_fixture();
    let metrics = dir.path().join("m.jsonl");
    let out = dir.path().join("out");
    let mut a = args(s(&model), s(&data), s(&out), "1");
    a.extend(["--metrics", s(&metrics)]);
    let o = megatrain(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&metrics).unwrap();
    let run: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(run["type"], "run");

    let estimate = |lora: &[&str]| {
        let mut e = vec!["estimate", "--model", s(&model), "--batch-size", "2", "--seq-len", "16", "--json"];
        e.extend(lora);
        let o = megatrain(&e);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let lora =
        estimate(&["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,down_proj"]);
    let full = estimate(&[]);
    assert_eq!(lora["host_store_bytes"], run["store_bytes"], "the adapters' store: {lora}");
    assert_eq!(lora["host_frozen_base_bytes"], run["frozen_base_bytes"], "the frozen base: {lora}");
    assert_eq!(full["host_frozen_base_bytes"], 0);
    let (l, f) = (&lora["host_store_bytes"], &full["host_store_bytes"]);
    assert!(l.as_u64().unwrap() * 10 < f.as_u64().unwrap(), "LoRA store {l} vs full {f}");
    let base = run["frozen_base_bytes"].as_u64().unwrap();
    let n = full["n_params"].as_u64().unwrap();
    assert!((4 * n..4 * n + 4 * n / 20).contains(&base), "base {base} B for {n} parameters");
    assert!(lora["host_bytes"].as_u64() < full["host_bytes"].as_u64(), "{lora}\n{full}");
    assert!(
        lora["pcie_d2h_bytes_per_step"].as_u64().unwrap() * 10
            < full["pcie_d2h_bytes_per_step"].as_u64().unwrap()
    );
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

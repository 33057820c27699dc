//! `megatrain train --lora-rank`: checkpoints hold the adapters and their optimizer state, not
//! the base, and a resumed run ends bitwise where an uninterrupted one does; the export is peft's
//! adapter directory (`--merge`: the merged model); `--lora-from` refuses contradicting options.

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
    let o = megatrain(&["train", "--lora-rank", "4", "--steps", "1"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("pretrained model"), "{}", stderr(&o));
    let o = megatrain(&["train", "--model", m, "--data", d, "--lora-rank", "4", "--lora-dropout", "0.1"]);
    assert!(stderr(&o).contains("not implemented yet"), "{}", stderr(&o));
}

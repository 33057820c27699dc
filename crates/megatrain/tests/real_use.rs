//! REAL-USE through the `megatrain` binary: a run killed after a checkpoint and resumed ends
//! bitwise where an uninterrupted run does; bad input (missing or corrupt shard, config/weights
//! mismatch, unknown architecture, empty data, a sample longer than --seq-len, a plan larger than
//! the host) fails with a message naming the problem and leaves no `config.json` in --out (an
//! export is complete exactly when its config.json exists); `estimate` and `init` work.

use std::fs;
use std::path::{Path, PathBuf};

mod common;
use common::{megatrain, model_fixture, s, stderr, write_data, FINE_TUNE};

#[test]
fn a_run_killed_after_a_checkpoint_resumes_bitwise() {
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("data.jsonl");
    write_data(&data);
    let model = model_fixture();
    let (a, b) = (t.path().join("a"), t.path().join("b"));
    let common =
        [&["train", "--model", s(&model), "--data", s(&data), "--steps", "7"][..], &FINE_TUNE].concat();
    let run = |out: &Path, extra: &[&str]| {
        let mut v = common.to_vec();
        v.extend_from_slice(&["--out", s(out)]);
        v.extend_from_slice(extra);
        megatrain(&v)
    };
    let whole = run(&a, &[]);
    assert!(whole.status.success(), "{}", stderr(&whole));

    // Killed after step 5 (checkpoint at 3): no export, a checkpoint of step 3.
    let crashed = run(&b, &["--save-every", "3", "--abort-after-step", "5"]);
    assert!(!crashed.status.success(), "the hook must abort");
    assert!(!b.join("config.json").exists(), "a crashed run must not leave an export");
    let ckpts: Vec<String> = fs::read_dir(b.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(ckpts.contains(&"step-000000003.json".to_owned()), "{ckpts:?}");

    let resumed = run(&b, &["--save-every", "3", "--resume"]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let out = String::from_utf8_lossy(&resumed.stdout);
    assert!(out.contains("resumed from checkpoint") && out.contains("at step 3"), "{out}");
    assert!(out.contains("global steps 4..=7"), "{out}");
    assert_eq!(
        fs::read(a.join("model.safetensors")).unwrap(),
        fs::read(b.join("model.safetensors")).unwrap(),
        "the resumed run's weights must equal the uninterrupted run's bit for bit"
    );

    // A fresh run (no --resume) into a directory holding checkpoints is refused before any work.
    let fresh = run(&b, &["--save-every", "3"]);
    assert!(!fresh.status.success());
    assert!(stderr(&fresh).contains("continue that run with --resume"), "{}", stderr(&fresh));

    // Resuming with a different learning rate is refused, naming the option.
    let other = megatrain(&[&common[..], &["--out", s(&b), "--resume", "--lr", "0.004"]].concat());
    assert!(!other.status.success());
    assert!(stderr(&other).contains("lr: checkpoint 0.003 vs now 0.004"), "{}", stderr(&other));
}

/// Copies the fixture model into `dir` and returns it.
fn copy_model(dir: &Path) -> PathBuf {
    fs::create_dir_all(dir).unwrap();
    for e in fs::read_dir(model_fixture()).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    dir.to_owned()
}

/// Runs a short training of `model` on `data` into `out`, expecting failure with `needle`.
fn refused(model: &Path, data: &Path, out: &Path, extra: &[&str], needle: &str) {
    let mut v = vec![
        "train",
        "--model",
        s(model),
        "--data",
        s(data),
        "--out",
        s(out),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
    ];
    v.extend_from_slice(extra);
    let o = megatrain(&v);
    let e = stderr(&o);
    assert!(!o.status.success(), "must fail: {needle}");
    assert!(e.contains(needle), "expected {needle:?} in: {e}");
    assert!(!out.join("config.json").exists(), "{needle}: no export may be left behind");
}

#[test]
fn bad_input_is_refused_with_a_clear_error_and_no_output() {
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("data.jsonl");
    write_data(&data);
    let out = t.path().join("out");

    // Missing shard (the index names a file that is not there).
    let m = copy_model(&t.path().join("missing"));
    fs::rename(m.join("model.safetensors"), m.join("model-00001-of-00001.safetensors")).unwrap();
    fs::write(
        m.join("model.safetensors.index.json"),
        r#"{"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    refused(&m, &data, &out, &[], "model-00002-of-00002.safetensors");

    // Corrupt shard (truncated in the data section).
    let m = copy_model(&t.path().join("corrupt"));
    let bytes = fs::read(m.join("model.safetensors")).unwrap();
    fs::write(m.join("model.safetensors"), &bytes[..bytes.len() - 1000]).unwrap();
    refused(&m, &data, &out, &[], "model.safetensors");

    // Config and weights disagree (hidden size).
    let m = copy_model(&t.path().join("shape"));
    let cfg = fs::read_to_string(m.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 96", "\"intermediate_size\": 80");
    fs::write(m.join("config.json"), cfg).unwrap();
    refused(&m, &data, &out, &[], "mlp.");

    // Unknown architecture.
    let m = copy_model(&t.path().join("arch"));
    let cfg = fs::read_to_string(m.join("config.json"))
        .unwrap()
        .replace("\"model_type\": \"llama\"", "\"model_type\": \"gpt_neox\"");
    fs::write(m.join("config.json"), cfg).unwrap();
    refused(&m, &data, &out, &[], "gpt_neox");

    let m = model_fixture();
    // Empty data.
    let empty = t.path().join("empty.jsonl");
    fs::write(&empty, "\n\n").unwrap();
    refused(&m, &empty, &out, &[], "empty.jsonl");

    // A sample longer than --seq-len.
    let long = t.path().join("long.jsonl");
    fs::write(&long, format!("{{\"input_ids\": [{}]}}\n", vec!["7"; 17].join(","))).unwrap();
    refused(&m, &long, &out, &[], "long.jsonl:1");

    // --out naming the --model directory: refused (an export would overwrite the source).
    let o = megatrain(&[
        "train",
        "--model",
        s(&m),
        "--data",
        s(&data),
        "--out",
        s(&m),
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
    ]);
    assert!(!o.status.success() && stderr(&o).contains("is the --model directory"), "{}", stderr(&o));

    // Not enough RAM for the plan: refused before anything is allocated.
    refused(&m, &data, &out, &["--host-mem", "0.0001"], "exceed the host");
    assert!(!out.exists() || fs::read_dir(&out).unwrap().next().is_none(), "nothing written to --out");
}

#[test]
fn estimate_prints_the_plan_and_init_writes_a_loadable_model() {
    let t = tempfile::tempdir().unwrap();
    let cfg = model_fixture().join("config.json");
    let o = megatrain(&["estimate", "--config", s(&cfg), "--batch-size", "2", "--seq-len", "16", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(e["n_params"], 78144);
    // fp32 default: 16 B/param store (f32 gradients) plus staging/landing plus the process.
    assert!(e["host_store_bytes"].as_u64().unwrap() >= 16 * 78144, "{e}");
    assert!(e["host_bytes"].as_u64().unwrap() > e["host_store_bytes"].as_u64().unwrap());
    // The CPU backend's step is priced only from this machine's rates; a GPU's from its defaults.
    assert!(e["step_s"].is_null(), "{e}");
    let o = megatrain(&["estimate", "--config", s(&cfg), "--device", "cuda", "--json"]);
    let e: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(e["step_s"].as_f64().unwrap() > 0.0, "{e}");

    let out = t.path().join("init");
    let o = megatrain(&["init", "--config", s(&cfg), "--out", s(&out), "--seed", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let hf = mt_hf::HfModelDir::open(&out).unwrap();
    assert_eq!(hf.n_params(), 78144);
    // And it trains, starting from exactly those weights.
    let data = t.path().join("d.jsonl");
    write_data(&data);
    let o = megatrain(&[
        "train",
        "--model",
        s(&out),
        "--data",
        s(&data),
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

//! Fail fast: what a run needs at its end or along the way is checked at its start, so a long run
//! never dies at its export. An `--out` that cannot be made, outputs (export, checkpoints, a new
//! `--store` file) larger than their file system's free space, `text` data without a tokenizer
//! and `messages` data without a chat template are refused before the first step, with a message
//! naming the problem, and nothing is left behind.

mod common;

use std::fs;
use std::path::Path;

use common::*;

fn refused(args: &[&str], needle: &str) {
    let o = megatrain(args);
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(!o.status.success(), "must fail: {needle}");
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
    assert!(!out.contains("step "), "{needle}: refused before any step: {out}");
}

#[test]
fn what_a_run_needs_at_its_end_is_checked_at_its_start() {
    let t = tempfile::tempdir().unwrap();
    let file = t.path().join("file");
    fs::write(&file, "x").unwrap();
    let out_under_file = file.join("out");
    refused(
        &["train", "--out", s(&out_under_file), "--steps", "1000"],
        &format!("--out {}: {} is not a directory", out_under_file.display(), file.display()),
    );

    // A model whose export (2.6 TB in f32) and checkpoints fit no test machine's disk: refused
    // before the data is read, the step planned or the store created.
    let big = t.path().join("big.json");
    fs::write(
        &big,
        r#"{"model_type": "llama", "vocab_size": 1048576, "hidden_size": 16384, "intermediate_size": 53248,
            "num_hidden_layers": 200, "num_attention_heads": 128, "num_key_value_heads": 8,
            "max_position_embeddings": 4096}"#,
    )
    .unwrap();
    let out = t.path().join("out");
    let store = t.path().join("big.store");
    refused(
        &[
            "train",
            "--config",
            s(&big),
            "--out",
            s(&out),
            "--save-every",
            "100",
            "--store",
            s(&store),
            "--steps",
            "1000",
        ],
        "not enough free space: the export (--out) ",
    );
    assert!(!out.exists() && !store.exists(), "nothing is created");

    // Data the model directory cannot tokenise.
    let model = model_fixture();
    let text = t.path().join("text.jsonl");
    fs::write(&text, "{\"text\": \"hello\"}\n").unwrap();
    let args = |data: &Path, model: &Path| -> Vec<String> {
        [
            "train",
            "--model",
            s(model),
            "--data",
            s(data),
            "--out",
            s(&out),
            "--steps",
            "1000",
            "--seq-len",
            "16",
        ]
        .map(String::from)
        .to_vec()
    };
    let run =
        |a: Vec<String>, needle: &str| refused(&a.iter().map(String::as_str).collect::<Vec<_>>(), needle);
    run(
        args(&text, &model),
        "a \"text\" sample must be tokenised: pass a --model dir that contains tokenizer.json",
    );
    let with_tok = t.path().join("with_tok");
    fs::create_dir(&with_tok).unwrap();
    for e in fs::read_dir(&model).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), with_tok.join(e.file_name())).unwrap();
    }
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/fixtures/tiny_tok/tokenizer.json");
    fs::copy(tok, with_tok.join("tokenizer.json")).unwrap();
    let chat = t.path().join("chat.jsonl");
    fs::write(&chat, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n").unwrap();
    run(args(&chat, &with_tok), "has no chat template");
    assert!(!out.join("config.json").exists());
}

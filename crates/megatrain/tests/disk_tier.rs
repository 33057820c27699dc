//! The disk tier through the `megatrain` binary: a `--store` file larger than `--host-mem` is
//! paged through a RAM window, and the run (a checkpoint, a kill and a resume included) ends
//! with the same weights, bit for bit, as one that holds the whole store in RAM.

use std::path::Path;
use std::process::{Command, Output};

fn megatrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_megatrain")).args(args).output().expect("run megatrain")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A Llama shape of 12 layers of 0.79M parameters: a 0.16 GB store of 12.6 MB records (f32
/// moments and gradients, the CPU default), large beside the run's own ~70 MB (process, rings,
/// device buffers, a checkpoint's writes), small enough to train in a second.
const CONFIG: &str = r#"{"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 12, "vocab_size": 512,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": true, "hidden_act": "silu"}"#;
const RUN: [&str; 11] =
    ["train", "--data", "synthetic", "--steps", "5", "--batch-size", "2", "--seq-len", "16", "--lr", "0.003"];
/// Host memory for the paged runs: 125 MiB, below the store with its rings, room for a window
/// of a few records beside the rest.
const SMALL_HOST: &str = "0.122";

#[test]
fn a_paged_store_trains_resumes_and_ends_bitwise_as_one_in_ram() {
    // On the build's disk: a tmpfs would keep every page anyway.
    let t = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = t.path().join("config.json");
    std::fs::write(&config, CONFIG).unwrap();
    let run = [&RUN[..], &["--config", s(&config)]].concat();
    let (a, b, c) = (t.path().join("a"), t.path().join("b"), t.path().join("c"));
    let whole = megatrain(&[&run[..], &["--store", s(&t.path().join("a.mts")), "--out", s(&a)]].concat());
    assert!(whole.status.success(), "{}", text(&whole));
    assert!(!text(&whole).contains("paged from its file"), "{}", text(&whole));

    let paged = |out: &Path, store: &str, extra: &[&str]| {
        let store = t.path().join(store);
        let args =
            [&run[..], &["--store", s(&store), "--out", s(out), "--host-mem", SMALL_HOST], extra].concat();
        megatrain(&args)
    };
    let p = paged(&b, "b.mts", &[]);
    assert!(p.status.success(), "{}", text(&p));
    let out = text(&p);
    assert!(out.contains("store (paged from its file)") && out.contains("store window in RAM"), "{out}");
    assert!(out.contains("disk tier: "), "the summary reports the pager:\n{out}");
    let weights = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert_eq!(weights(&a), weights(&b), "paging changes no byte of the training");

    // Killed after a checkpoint, resumed, paged throughout.
    let killed = paged(&c, "c.mts", &["--save-every", "2", "--abort-after-step", "3"]);
    assert!(!killed.status.success(), "the hook must abort");
    let resumed = paged(&c, "c.mts", &["--save-every", "2", "--resume"]);
    assert!(resumed.status.success(), "{}", text(&resumed));
    assert_eq!(weights(&a), weights(&c), "a paged run resumed from its checkpoint ends as the whole one");

    // Too little host memory even for the window: refused before anything is written.
    let d = t.path().join("d");
    let refused = megatrain(
        &[&run[..], &["--store", s(&t.path().join("d.mts")), "--out", s(&d), "--host-mem", "0.05"]].concat(),
    );
    assert!(!refused.status.success());
    assert!(text(&refused).contains("paging it from its file needs"), "{}", text(&refused));
    assert!(!t.path().join("d.mts").exists() && !d.exists(), "a refused run creates nothing");
}

//! End-to-end tests of the `megatrain` binary: training lowers the loss, a run split over two
//! invocations with a file-backed store continues bitwise, bad input fails with a clear message,
//! the metrics log follows its schema, and `--trace` writes a Chrome trace of one step.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

/// Small sizes so each run takes a few seconds in a debug build.
const SMALL: &[&str] = &["--batch-size", "2", "--seq-len", "16"];

fn megatrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_megatrain"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("running the megatrain binary")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs and asserts success, returning stdout.
fn ok(args: &[&str]) -> String {
    let out = megatrain(args);
    assert!(
        out.status.success(),
        "megatrain {args:?} failed ({:?}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Runs and asserts failure with exit code `code`, returning stderr.
fn fails(args: &[&str], code: i32) -> String {
    let out = megatrain(args);
    assert_eq!(out.status.code(), Some(code), "megatrain {args:?}: stdout:\n{}", text(&out.stdout));
    text(&out.stderr)
}

/// First and last loss from the summary line `loss: first X last Y`.
fn summary_losses(stdout: &str) -> (f64, f64) {
    let line = stdout.lines().find(|l| l.starts_with("loss: first ")).expect("a loss summary line");
    let words: Vec<&str> = line.split_whitespace().collect();
    match words[..] {
        ["loss:", "first", a, "last", b] => (a.parse().unwrap(), b.parse().unwrap()),
        _ => panic!("unexpected summary line {line:?}"),
    }
}

fn records(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
        .collect()
}

fn steps_of(recs: &[Value]) -> Vec<&Value> {
    recs.iter().filter(|r| r["type"] == "step").collect()
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn training_lowers_the_loss() {
    let out = ok(&["train", "--steps", "8", "--batch-size", "4", "--seq-len", "32"]);
    let (first, last) = summary_losses(&out);
    assert!(first > 5.0, "the first loss of a fresh model is near ln(256) = 5.55, got {first}");
    assert!(last < first - 0.5, "loss did not fall: first {first}, last {last}\n{out}");
    for needle in [
        "trained 8 steps",
        "bytes/param",
        "copies per step between host and device buffers (mean of 8 steps)",
        "streams (mean of 8 steps",
    ] {
        assert!(out.contains(needle), "summary lacks {needle:?}:\n{out}");
    }
}

#[test]
fn resuming_from_a_store_continues_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let (f, g) = (dir.path().join("f.store"), dir.path().join("g.store"));
    let (mf, mg) = (dir.path().join("f.jsonl"), dir.path().join("g.jsonl"));
    // A cosine schedule over 8 global steps in both cases, so the rates agree.
    let run = |store: &Path, metrics: &Path, steps: &str| {
        let mut args = vec!["train", "--store", path_str(store), "--metrics", path_str(metrics)];
        args.extend(["--steps", steps, "--schedule-steps", "8"]);
        args.extend(SMALL);
        ok(&args)
    };
    let first = run(&f, &mf, "4");
    assert!(!first.contains("resumed"), "{first}");
    let second = run(&f, &mf, "4");
    assert!(second.contains(&format!("resumed from {} at step 4", f.display())), "{second}");
    assert!(second.contains("global steps 5..=8"), "{second}");
    run(&g, &mg, "8");

    let (split, whole) = (records(&mf), records(&mg));
    assert_eq!(split.iter().filter(|r| r["type"] == "run").count(), 2, "one run record per invocation");
    assert_eq!(split[0]["resumed"], false);
    assert_eq!(split.iter().filter(|r| r["type"] == "run").nth(1).unwrap()["start_step"], 4);
    let (split, whole) = (steps_of(&split), steps_of(&whole));
    assert_eq!(split.len(), 8);
    assert_eq!(whole.len(), 8);
    for (a, b) in split.iter().zip(&whole) {
        assert_eq!(a["step"], b["step"]);
        // Shortest round-trip floats: equal numbers are equal bits.
        let (la, lb) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
        assert_eq!(la.to_bits(), lb.to_bits(), "step {}: loss {la} (resumed) vs {lb} (one run)", a["step"]);
        assert_eq!(a["lr"], b["lr"]);
        assert_eq!(a["grad_norm"], b["grad_norm"]);
    }
}

#[test]
fn bad_input_fails_with_a_message_that_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("broken_config.json");
    std::fs::write(&bad, "{ \"model_type\": \"llama\", ").unwrap();
    let e = fails(&["train", "--config", path_str(&bad)], 1);
    assert!(e.contains("broken_config.json"), "{e}");

    let gpt2 = dir.path().join("gpt2.json");
    std::fs::write(&gpt2, r#"{"model_type": "gpt2", "vocab_size": 256, "n_embd": 64}"#).unwrap();
    let e = fails(&["train", "--config", path_str(&gpt2)], 1);
    assert!(e.contains("gpt2"), "{e}");

    let e = fails(&["train", "--device", "cuda"], 1);
    assert!(e.contains("cuda feature"), "{e}");

    // Usage errors are clap's: exit status 2 and the offending option named.
    let e = fails(&["train", "--seq-len", "0"], 2);
    assert!(e.contains("--seq-len") && e.contains("at least 1"), "{e}");

    let e = fails(&["train", "--chunks", "3", "--batch-size", "2"], 1);
    assert!(e.contains("--chunks 3 exceeds --batch-size 2"), "{e}");

    let e = fails(&["train", "--grad-dtype", "none"], 1);
    assert!(e.contains("--optim-mode lean"), "{e}");

    let e = fails(&["train", "--seq-len", "5000"], 1);
    assert!(e.contains("max_position_embeddings"), "{e}");

    // --gpus: refused on the CPU, with fewer sequences than GPUs, with device-owned state.
    let e = fails(&["train", "--gpus", "2"], 1);
    assert!(e.contains("--gpus 2 needs --device cuda"), "{e}");
    let e = fails(&["train", "--device", "cuda", "--gpus", "4", "--batch-size", "2"], 1);
    assert!(e.contains("--batch-size 2 is smaller than --gpus 4"), "{e}");
    let e = fails(&["train", "--device", "cuda", "--gpus", "2", "--resident-layers", "1"], 1);
    assert!(e.contains("--resident-layers keeps optimizer state on the GPU"), "{e}");
    let e = fails(&["train", "--gpus", "0"], 2);
    assert!(e.contains("--gpus"), "{e}");

    // A store for another model is refused, not overwritten.
    let store = dir.path().join("s.store");
    let s = path_str(&store);
    ok(&["train", "--store", s, "--steps", "1", "--batch-size", "1", "--seq-len", "4"]);
    let small = small_config(dir.path());
    let e = fails(&["train", "--store", s, "--config", path_str(&small), "--data", "synthetic"], 1);
    assert!(e.contains("s.store") && e.contains("different model"), "{e}");
}

/// A valid Llama config with a 64-symbol vocabulary.
fn small_config(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("small_vocab.json");
    let cfg = r#"{"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu"}"#;
    std::fs::write(&p, cfg).unwrap();
    p
}

#[test]
fn byte_data_needs_a_byte_vocabulary_and_synthetic_data_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let e = fails(&["train", "--config", path_str(&cfg), "--steps", "1"], 1);
    assert!(e.contains("vocab_size") && e.contains("--data synthetic"), "{e}");

    let mut args = vec!["train", "--config", path_str(&cfg), "--data", "synthetic", "--steps", "12"];
    args.extend(SMALL);
    let (first, last) = summary_losses(&ok(&args));
    assert!(last < first, "synthetic loss did not fall: {first} -> {last}");
}

#[test]
fn lean_mode_bf16_weights_and_chunks_train() {
    let mut args = vec!["train", "--steps", "6", "--optim-mode", "lean", "--precision", "bf16"];
    args.extend(["--chunks", "2", "--ring-depth", "1", "--grad-dtype", "none", "--delay-us", "50"]);
    args.extend(SMALL);
    let out = ok(&args);
    let (first, last) = summary_losses(&out);
    assert!(last < first, "loss did not fall: {first} -> {last}");
    let bpp = store_bytes_per_param(&out);
    assert!((12.0..12.5).contains(&bpp), "lean mode without gradient buffers: {bpp} B/param\n{out}");

    let mut args = vec!["train", "--steps", "1", "--grad-dtype", "f32"];
    args.extend(SMALL);
    let bpp = store_bytes_per_param(&ok(&args));
    assert!((16.0..16.5).contains(&bpp), "f32 gradient buffers: {bpp} B/param");
}

/// Bytes per parameter from the summary line `host store: X MB, Y bytes/param (...)`.
fn store_bytes_per_param(stdout: &str) -> f64 {
    let line = stdout.lines().find(|l| l.starts_with("host store: ")).expect("a host store line");
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words.iter().position(|&w| w == "bytes/param").expect("bytes/param");
    words[at - 1].parse().unwrap()
}

#[test]
fn metrics_log_has_a_run_record_and_one_record_per_step() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m.jsonl");
    let mut args = vec!["train", "--steps", "3", "--metrics", path_str(&m), "--log-every", "1"];
    args.extend(SMALL);
    let out = ok(&args);
    assert_eq!(out.lines().filter(|l| l.starts_with("step ")).count(), 3, "--log-every 1:\n{out}");

    let recs = records(&m);
    assert_eq!(recs.len(), 4);
    let run = &recs[0];
    assert_eq!(run["type"], "run");
    assert_eq!(run["schema_version"], 1);
    assert_eq!(run["model"]["source"], "builtin:tiny_llama");
    assert_eq!(run["model"]["vocab_size"], 256);
    assert_eq!(run["options"]["batch_size"], 2);
    assert_eq!(run["options"]["moe_kernels"], "device");
    assert_eq!(run["tokens_per_step"], 32);
    let n_params = run["n_params"].as_u64().unwrap();
    let bpp = run["store_bytes_per_param"].as_f64().unwrap();
    assert!(n_params > 100_000 && (16.0..17.0).contains(&bpp), "{run}"); // f32 gradients with fp32
    assert!(run["model_flops_per_step"].as_f64().unwrap() > 6.0 * n_params as f64 * 32.0);

    for (i, r) in recs[1..].iter().enumerate() {
        assert_eq!(r["type"], "step");
        assert_eq!(r["step"], i as u64 + 1);
        for key in ["loss", "lr", "grad_norm", "tokens_per_s", "step_ms"] {
            let x = r[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {r}"));
            assert!(x.is_finite() && x > 0.0, "{key} = {x}");
        }
        assert_eq!(r["tokens"], 32);
        for key in ["h2d_bytes", "d2h_bytes"] {
            assert!(r[key].as_u64().unwrap() as f64 >= 4.0 * n_params as f64 * 0.99, "{key} in {r}");
        }
        for s in ["host", "h2d", "compute", "d2h"] {
            let busy = r[format!("{s}_busy_frac")].as_f64().unwrap();
            assert!((0.0..=1.0 + 1e-9).contains(&busy), "{s} busy {busy}");
            assert!(r[format!("{s}_max_gap_ms")].as_f64().unwrap() >= 0.0);
        }
    }
    // Warmup: the rate rises over the first steps.
    assert!(recs[1]["lr"].as_f64() < recs[2]["lr"].as_f64());
}

/// Parses `compute idle: X% of step time, ...` from the summary.
fn compute_idle_percent(stdout: &str) -> f64 {
    let line = stdout.lines().find(|l| l.starts_with("compute idle: ")).expect("a compute idle line");
    let pct = line["compute idle: ".len()..].split('%').next().unwrap();
    pct.parse().unwrap_or_else(|e| panic!("{line:?}: {e}"))
}

#[test]
fn trace_of_a_step_has_compute_spans_inside_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("t.json");
    let out = ok(&["train", "--steps", "2", "--batch-size", "4", "--seq-len", "16", "--trace", path_str(&t)]);
    assert!(out.contains("trace of step 2 (") && out.contains(&t.display().to_string()), "{out}");
    let idle = compute_idle_percent(&out);
    assert!((0.0..100.0).contains(&idle), "compute idle {idle}%\n{out}");

    let v: Value = serde_json::from_str(&std::fs::read_to_string(&t).unwrap()).expect("the trace is JSON");
    assert_eq!(v["otherData"]["step"], 2, "the default traced step is the second");
    let step_us = v["otherData"]["step_s"].as_f64().unwrap() * 1e6;
    assert!(step_us > 0.0);
    assert!(v["otherData"]["h2d_bytes"].as_u64().unwrap() > 0);
    let events = v["traceEvents"].as_array().unwrap();
    let spans: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    for e in &spans {
        let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        assert!(
            ts >= 0.0 && dur >= 0.0 && ts + dur <= step_us * (1.0 + 1e-9),
            "{e} outside [0, {step_us}] us"
        );
    }
    let compute_tid = events
        .iter()
        .find(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == "compute")
        .expect("a compute thread name")["tid"]
        .clone();
    let compute: Vec<&&Value> = spans.iter().filter(|e| e["tid"] == compute_tid).collect();
    // The tiny Llama: embed, forward and backward of each layer, loss, embedding backward.
    assert!(compute.len() >= 5, "{} compute spans", compute.len());
    let busy_us: f64 = compute.iter().map(|e| e["dur"].as_f64().unwrap()).sum();
    assert!(busy_us > 0.0 && busy_us <= step_us, "compute busy {busy_us} us of {step_us} us");
    for kind in ["Stage", "Upload", "Forward", "Backward", "Download", "Land"] {
        assert!(spans.iter().any(|e| e["cat"] == kind), "no {kind} span");
    }
    let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(leftovers, 1, "only the trace, no temporary file");
}

#[test]
fn a_bad_trace_request_fails_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s.store");
    let t = dir.path().join("t.json");
    let mut args = vec!["train", "--steps", "2", "--trace", path_str(&t), "--trace-step", "3"];
    args.extend(["--store", path_str(&store)]);
    args.extend(SMALL);
    let e = fails(&args, 1);
    assert!(e.contains("--trace-step 3") && e.contains("--steps 2"), "{e}");
    assert!(!store.exists() && !t.exists(), "nothing was created");

    let missing = dir.path().join("no_such_dir").join("t.json");
    let e = fails(&["train", "--steps", "1", "--trace", path_str(&missing)], 1);
    assert!(e.contains("no_such_dir") && e.contains("does not exist"), "{e}");

    let e = fails(&["train", "--trace-step", "1"], 2);
    assert!(e.contains("--trace"), "--trace-step needs --trace: {e}");
}

/// Resident units on the CPU backend (asked for explicitly: `auto` keeps none on the CPU): the
/// plan says so, the losses are those of the streamed run, and bad counts are refused by name.
#[test]
fn resident_layers_from_the_command_line_train_as_streamed_ones() {
    let base = ["train", "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--precision", "fp32"];
    let streamed = ok(&base);
    let args: Vec<&str> =
        base.iter().copied().chain(["--resident-layers", "1", "--resident-outer", "on"]).collect();
    let out = megatrain(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("outer unit: resident") && err.contains("  0       resident  "), "{err}");
    assert_eq!(summary_losses(&text(&out.stdout)), summary_losses(&streamed));
    let e = fails(&["train", "--resident-layers", "many"], 2);
    assert!(e.contains("--resident-layers") && e.contains("expected `auto` or a layer count"), "{e}");
    let e = fails(&["train", "--resident-layers", "9"], 1);
    assert!(e.contains("9 resident layers asked of a 4-layer model"), "{e}");
}

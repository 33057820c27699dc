//! What a user sees: help that fits the terminal, no colour codes in redirected output, sizes in
//! human units, negative values explained by the option's own check, the tokenizer asked for
//! only by data that needs one, and an estimate on the CPU that does not invent a step time.

mod common;

use std::fs;
use std::process::Command;

use common::*;

/// Runs `megatrain` with `args` and the environment variable `env` set.
fn megatrain_env(args: &[&str], env: (&str, &str)) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_megatrain")).args(args).env(env.0, env.1).output().unwrap()
}

#[test]
fn help_is_wrapped_to_the_terminal_width() {
    for (cmd, width) in [("train", 80), ("train", 100), ("estimate", 80), ("verify", 60)] {
        let o = megatrain_env(&[cmd, "--help"], ("COLUMNS", &width.to_string()));
        assert!(o.status.success(), "{}", stderr(&o));
        let text = stdout(&o);
        let widest = text.lines().map(|l| l.chars().count()).max().unwrap();
        assert!(widest <= width, "{cmd} --help at {width} columns has a line of {widest}:\n{text}");
        assert!(text.lines().count() > 5, "{text}");
    }
}

#[test]
fn redirected_output_has_no_colour_codes() {
    // A warning (tracing) and an error, both to a pipe.
    let t = tempfile::tempdir().unwrap();
    let o = megatrain_env(
        &["train", "--steps", "1", "--batch-size", "1", "--seq-len", "8"],
        ("RUST_LOG", "info"),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).is_empty(), "info logs were written");
    let bad = megatrain(&["train", "--data", &t.path().join("missing.jsonl").display().to_string()]);
    for text in [stdout(&o), stderr(&o), stderr(&bad)] {
        assert!(!text.contains('\u{1b}'), "an escape code in redirected output: {text:?}");
    }
}

#[test]
fn negative_values_reach_the_range_checks() {
    for (flag, value, says) in [
        ("--eps", "-1", "must be a finite number > 0, found -1"),
        ("--beta1", "-0.5", "must be in [0, 1), found -0.5"),
        ("--steps", "-3", "must be at least 1, found -3"),
        ("--lr", "-1e-3", "must be a finite number >= 0, found -0.001"),
    ] {
        let o = megatrain(&["train", flag, value]);
        assert_eq!(o.status.code(), Some(2), "{flag} {value}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains(flag) && e.contains(says), "{flag} {value}: {e}");
    }
    let o = megatrain(&["estimate", "--gpu-mem", "-2"]);
    assert!(stderr(&o).contains("must be a finite number > 0, found -2"), "{}", stderr(&o));
}

#[test]
fn small_sizes_are_shown_in_small_units() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("tiny");
    let config = model_fixture().join("config.json");
    let o = megatrain(&["init", "--config", s(&config), "--out", s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains(" KB)") && !stdout(&o).contains("0.00 GB"), "{}", stdout(&o));
    let data = t.path().join("data.jsonl");
    write_data(&data);
    let o_dir = t.path().join("o");
    let run = ["train", "--model", s(&out), "--data", s(&data), "--out", s(&o_dir), "--steps", "1"];
    let o = megatrain(&run);
    assert!(o.status.success(), "{}", stderr(&o));
    let all = stdout(&o) + &stderr(&o);
    assert!(!all.contains("0.00 GB") && !all.contains("0.00 MB"), "{all}");
    assert!(stdout(&o).contains("exported") && stdout(&o).contains(" KB)"), "{}", stdout(&o));
}

/// `input_ids` data needs no tokenizer: a model directory whose tokenizer.json this build cannot
/// load still trains on it; text data there is refused, naming the tokenizer.
#[test]
fn the_tokenizer_is_loaded_only_for_data_that_needs_one() {
    let t = tempfile::tempdir().unwrap();
    let model = t.path().join("model");
    fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "model.safetensors"] {
        fs::copy(model_fixture().join(f), model.join(f)).unwrap();
    }
    fs::write(model.join("tokenizer.json"), b"{ not a tokenizer").unwrap();
    let ids = t.path().join("ids.jsonl");
    write_data(&ids);
    let run = |data: &std::path::Path| {
        let args = ["train", "--model", s(&model), "--data", s(data), "--steps", "1"];
        megatrain(&[&args[..], &["--batch-size", "2", "--seq-len", "16"]].concat())
    };
    let o = run(&ids);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = t.path().join("text.jsonl");
    fs::write(&text, "{\"text\": \"hello\"}\n").unwrap();
    let o = run(&text);
    assert!(!o.status.success() && stderr(&o).contains("tokenizer"), "{}", stderr(&o));
}

#[test]
fn estimate_on_the_cpu_prices_the_step_only_from_measured_rates() {
    let o = megatrain(&["estimate"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("step time: not estimated") && stdout(&o).contains("--tflops"),
        "{}",
        stdout(&o)
    );
    assert!(!stdout(&o).contains("0.000 s"), "{}", stdout(&o));
    let o = megatrain(&["estimate", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["step_s"].is_null() && v["assumed"]["tflops"].is_null(), "{v}");
    let o = megatrain(&["estimate", "--tflops", "0.05", "--host-gbs", "5"]);
    let line = stdout(&o).lines().find(|l| l.starts_with("step time:")).unwrap_or_default().to_owned();
    assert!(line.contains(" ms (compute") && line.contains("model TFLOP/s"), "{line}");
}

/// Runs `megatrain launch-info` with none of the launchers' variables but `vars`.
fn launch_info(vars: &[(&str, &str)]) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_megatrain"));
    c.arg("launch-info");
    for v in mt_dist::launch::VARIABLES {
        c.env_remove(v);
    }
    c.envs(vars.iter().copied()).output().unwrap()
}

#[test]
fn launch_info_prints_the_launchers_place_or_names_the_variable_at_fault() {
    let o = launch_info(&[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).starts_with("one process alone (no torchrun or Slurm variables)\nthis host: "),
        "{}",
        stdout(&o)
    );
    let slurm = [
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_STEP_NODELIST", "gpu[07-08]"),
    ];
    let o = launch_info(&slurm);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).starts_with(
            "Slurm: rank 3 of 4, local rank 1; rank 0 at gpu07:29500 (host from SLURM_STEP_NODELIST, port from the default)\n"
        ),
        "{}",
        stdout(&o)
    );
    let o = launch_info(&[
        ("RANK", "4"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "n0"),
        ("MASTER_PORT", "1"),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stderr(&o).trim_end(), "error: RANK=4 is not below WORLD_SIZE=4");
}

/// `megatrain train` started by a launcher as one process of several refuses what such a job
/// cannot run before it waits for the others at the rendezvous (rank 1 here: its rank 0 never
/// comes): the CPU device, and in a build without NCCL any device.
#[test]
fn a_job_of_several_processes_refuses_what_it_cannot_run_before_the_rendezvous() {
    let run = |device: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_megatrain"));
        c.args(["train", "--steps", "1", "--device", device]);
        for v in mt_dist::launch::VARIABLES {
            c.env_remove(v);
        }
        let vars = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "9"),
        ];
        c.envs(vars).output().unwrap()
    };
    let place = "torchrun: rank 1 of 2, local rank 1; rank 0 at 127.0.0.1:9 (host from MASTER_ADDR, port from MASTER_PORT)";
    let o = run("cpu");
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o).trim_end(),
        format!(
            "error: {place}: a job of several processes trains on GPUs, in one NCCL group: add --device cuda"
        )
    );
    if !cfg!(feature = "nccl") {
        let o = run("cuda");
        assert_eq!(o.status.code(), Some(1));
        assert!(
            stderr(&o).starts_with(&format!(
                "error: {place}: a job of several processes needs a megatrain built with the nccl feature"
            )),
            "{}",
            stderr(&o)
        );
    }
}

//! Every `megatrain train` run the suites plan asks for a sequence length its model config
//! accepts, by the check `megatrain train` applies to `--seq-len`
//! (`mt_core::ModelConfig::check_train_seq_len`): each suite with its default models and tokens,
//! and the long-context suite on the 3.6B and 7B shapes from 16k to 512k tokens a sequence. A
//! real model's config is still refused past its own length.

use std::path::Path;

use bench_harness::suites::{plan, Options, Suite, System};
use mt_core::ModelConfig;

/// A suite's options as the command line gives them when only `--suite` (and what is passed
/// here) is set; the megatrain binary is this test executable (planning only checks that it
/// exists).
fn options(suite: Suite, models: Option<&[&str]>, tokens: Option<&[(usize, usize)]>) -> Options {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("bench-harness is one level down");
    Options {
        suite,
        out: std::env::temp_dir().join("bench-harness-lengths"),
        megatrain: std::env::current_exe().expect("the test executable"),
        python: "python3".into(),
        steps: 4,
        systems: match suite {
            Suite::Smoke | Suite::Scale => vec![System::Ours],
            Suite::Longctx => vec![System::Ours, System::Torch],
            _ => vec![System::Ours, System::Torch, System::Deepspeed],
        },
        models: models.map_or_else(|| suite.default_models(), |m| m.iter().map(|s| s.to_string()).collect()),
        tokens: tokens.map_or_else(|| suite.default_tokens(), <[_]>::to_vec),
        depths: vec![7, 14, 28],
        slices: vec![1, 2],
        device: if suite == Suite::Smoke { "cpu" } else { "cuda" }.into(),
        model_config: (suite == Suite::Ablate).then(|| repo.join("bench-harness/configs/llama3-3.6b.json")),
        run_timeout_s: 60,
        megatrain_args: vec![],
        largest: None,
        ours_streamed: false,
        ours_streamed_host: false,
        ours_noclip: false,
        gpus: vec![1, 2, 4],
        processes: 2,
    }
}

/// Each planned `megatrain train` run (not the kernel benchmark, a script): its key, the model config it trains (the built-in tiny Llama
/// without `--config`; a config the suite writes first, from the plan), its sequence length.
fn our_runs(opts: &Options) -> Vec<(String, ModelConfig, usize)> {
    let plan = plan(opts).unwrap_or_else(|e| panic!("{:?} plan: {e}", opts.suite));
    plan.jobs
        .iter()
        .filter(|j| j.program == opts.megatrain)
        .map(|j| {
            let cfg = match &j.run.model_config {
                None => ModelConfig::tiny_llama(),
                Some(path) => match plan.configs.iter().find(|(p, _)| p.display().to_string() == *path) {
                    Some((_, written)) => ModelConfig::from_json(written),
                    None => ModelConfig::from_file(Path::new(path)),
                }
                .unwrap_or_else(|e| panic!("{}: {path}: {e}", j.run.key)),
            };
            (j.run.key.clone(), cfg, j.run.seq_len)
        })
        .collect()
}

fn assert_accepted(runs: &[(String, ModelConfig, usize)]) {
    for (key, cfg, seq) in runs {
        if let Err(e) = cfg.check_train_seq_len(*seq) {
            panic!("{key}: megatrain train would refuse --seq-len {seq}: {e}");
        }
    }
}

#[test]
fn every_suite_plans_lengths_its_configs_accept() {
    for suite in [Suite::Smoke, Suite::Paper, Suite::Ablate, Suite::Longctx, Suite::Scale] {
        let runs = our_runs(&options(suite, None, None));
        assert!(!runs.is_empty(), "{suite:?} plans none of our runs");
        assert_accepted(&runs);
    }
}

#[test]
fn long_context_runs_the_3_6b_and_7b_shapes_from_16k_to_512k() {
    let lengths = [16_384, 32_768, 65_536, 131_072, 262_144, 524_288];
    let tokens: Vec<(usize, usize)> = lengths.iter().map(|&t| (1, t)).collect();
    let runs = our_runs(&options(Suite::Longctx, Some(&["3.6b", "7b"]), Some(&tokens)));
    for model in ["3.6b", "7b"] {
        for t in lengths {
            let key = format!("/{model}/b1x{t}/");
            assert!(runs.iter().any(|(k, _, s)| k.contains(&key) && *s == t), "no run {key} in {runs:?}");
        }
    }
    assert_accepted(&runs);
}

#[test]
fn a_real_models_config_is_still_refused_past_its_length() {
    // Llama-3-8B as released: 8192 positions.
    let runs = our_runs(&options(Suite::Longctx, Some(&["8b"]), Some(&[(1, 8192), (1, 16_384)])));
    let check = |seq: usize| {
        let (_, cfg, _) = runs.iter().find(|r| r.2 == seq).expect("the planned run");
        cfg.check_train_seq_len(seq)
    };
    assert!(check(8192).is_ok());
    let e = check(16_384).expect_err("16k tokens on an 8192-position config").to_string();
    assert!(e.contains("max_position_embeddings (8192)"), "{e}");
}

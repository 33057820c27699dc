//! The `longctx` suite: one model (default the Qwen2.5-7B shape) trained one sequence a step at
//! each context length (default 32k, 128k, 256k, 512k), ours and resident PyTorch in the same run;
//! MegaTrain's published GH200 step times beside them as reference points (status `published`,
//! never a ratio); and the attention kernel benchmark (ours against each SDPA backend torch has,
//! `scripts/attention_bench.py`), whose document goes into `results.json` as `attention`.

use serde_json::Value;

use crate::schema::{Run, Status};
use crate::suites::{repo_root, Ctx, Spec, System};
use crate::Result;

/// MegaTrain (arXiv 2604.05091), its long-context table: a 7B model, one sequence a step, on one
/// GH200 (a CPU-GPU link of ~7x PCIe Gen5): (tokens, seconds per step).
pub const MEGATRAIN_GH200: [(usize, f64); 3] = [(131_072, 26.1), (262_144, 236.0), (524_288, 871.0)];

/// Why the published entries are not measured.
const PUBLISHED: &str = "published by MegaTrain (arXiv 2604.05091, long-context table: a 7B model on one \
                         GH200), not measured here; model TFLOP/s from its step time with this run's formula \
                         and our run's parameter count";

/// Our runs at long context use lean mode without store gradients (12 B/param of host memory):
/// the 7B's exact-mode store (14 B/param) leaves no host memory for 512k's spilled checkpoints
/// on a 128 GiB machine.
fn lean() -> Vec<String> {
    ["--optim-mode", "lean", "--grad-dtype", "none"].map(String::from).to_vec()
}

/// The suite's runs: every model x context length x system, the published points, the kernel
/// benchmark (one job).
pub(crate) fn plan(cx: &mut Ctx<'_>) -> Result<()> {
    let opts = cx.opts;
    for m in &opts.models {
        let config = crate::suites::model_config_path(m)?;
        let label = crate::suites::model_label(m);
        for &tokens in &opts.tokens {
            for &sys in &opts.systems {
                let variant = if sys == System::Ours { "lean" } else { "default" };
                let mut s = Spec::new("context", sys, &label, Some(config.clone()), tokens, variant);
                if sys == System::Ours {
                    s.extra = lean();
                }
                cx.add(s);
            }
            if let Some(&(_, secs)) = MEGATRAIN_GH200.iter().find(|(t, _)| tokens == (1, *t)) {
                let s = Spec::new(
                    "context",
                    System::MegatrainPaper,
                    &label,
                    Some(config.clone()),
                    tokens,
                    "published",
                );
                let mut run = cx.entry(&s, Status::Published, Some(PUBLISHED.into()));
                run.measured.step_ms = Some(secs * 1e3);
                run.measured.tokens_per_s = Some(tokens.1 as f64 / secs);
                cx.plan.fixed.push(run);
            }
        }
    }
    let seqs: Vec<String> = [4096usize, 16384, 65536, 131072].iter().map(usize::to_string).collect();
    cx.plan.jobs.push(crate::run::Job {
        run: cx.entry(
            &Spec::new("kernel", System::Ours, "attention", None, (1, 131072), "default"),
            Status::NotRun,
            Some("not started".into()),
        ),
        program: opts.python.clone(),
        args: vec![
            repo_root().join("scripts/attention_bench.py").display().to_string(),
            "--out".into(),
            opts.out.join("attention.json").display().to_string(),
            "--seqs".into(),
            seqs.join(","),
        ],
        metrics: opts.out.join("attention.json"),
        log: opts.out.join("logs").join("kernel_attention.log"),
        trace: None,
        document: true,
        processes: 1,
    });
    Ok(())
}

/// Model TFLOP/s of each published entry: its step time against this run's FLOPs per step of the
/// same model and length (the ours run's, which knows the parameter count).
pub fn fill_published(runs: &mut [Run]) {
    let ours: Vec<(String, usize, f64)> = runs
        .iter()
        .filter(|r| r.system == "ours" && r.status == Status::Ok)
        .filter_map(|r| {
            let m = &r.measured;
            Some((r.model.clone(), r.seq_len, m.model_tflops? * m.step_ms? / 1e3))
        })
        .collect();
    for r in runs.iter_mut().filter(|r| r.status == Status::Published) {
        let flops = ours.iter().find(|(m, s, _)| *m == r.model && *s == r.seq_len).map(|o| o.2);
        if let (Some(tf), Some(ms)) = (flops, r.measured.step_ms) {
            r.measured.model_tflops = Some(tf / (ms / 1e3));
        }
    }
}

/// The kernel benchmark's document, if it ran and wrote one.
pub fn attention_doc(out: &std::path::Path) -> Option<Value> {
    let text = std::fs::read_to_string(out.join("attention.json")).ok()?;
    serde_json::from_str(&text).ok()
}

//! Running a suite's plan: each job in turn, `results.json` rewritten after every one (so a
//! suite killed half-way keeps what it measured), then the figures.

use std::io::Write;
use std::time::Duration;

use serde_json::Value;

use super::{Options, Plan};
use crate::run::{execute as execute_job, progress};
use crate::schema::{Commit, Machine, Results, Run, Status, FLOPS_FORMULA, SCHEMA_VERSION};
use crate::{io_err, Result};

/// Runs the plan, writes `OUT/results.json` and the figures, and returns the results. Progress
/// goes to `log`. A system that fails is recorded as `failed` and the suite goes on.
pub fn execute(opts: &Options, plan: &Plan, log: &mut dyn Write) -> Result<Results> {
    let out = &opts.out;
    for sub in ["metrics", "logs", "traces", "configs"] {
        std::fs::create_dir_all(out.join(sub)).map_err(io_err(out.join(sub)))?;
    }
    for (path, cfg) in &plan.configs {
        std::fs::write(path, format!("{cfg:#}\n")).map_err(io_err(path))?;
    }
    let machine = Machine::detect();
    let date = crate::schema::utc_now_iso();
    let commit = Commit::detect();
    let timeout = Duration::from_secs(opts.run_timeout_s);
    // Written after every job too (without figures), the runs not started yet as `not_run`:
    // a suite killed half-way (a machine's time limit) keeps what it measured.
    let assemble = |runs: Vec<Run>| -> Result<Results> {
        let mut runs = runs;
        runs.extend(plan.fixed.iter().cloned());
        crate::extrapolate::extrapolate_120b(&mut runs, machine.ram_bytes)?;
        crate::longctx::fill_published(&mut runs);
        let mut results = Results {
            schema_version: SCHEMA_VERSION,
            suite: format!("{:?}", opts.suite).to_lowercase(),
            machine: machine.clone(),
            commit: commit.clone(),
            date: date.clone(),
            config: serde_json::to_value(opts).unwrap_or(Value::Null),
            flops_formula: FLOPS_FORMULA.into(),
            runs,
            ratios: vec![],
            figures: vec![],
            attention: crate::longctx::attention_doc(out),
        };
        results.compute_ratios();
        Ok(results)
    };
    let mut runs = Vec::new();
    for (i, job) in plan.jobs.iter().enumerate() {
        progress(log, &format!("[{}/{}] {}", i + 1, plan.jobs.len(), job.run.key));
        let sample_gpu = machine.gpu.is_some() && job.run.device == "cuda";
        let run = execute_job(job, out, timeout, sample_gpu);
        let line = match (run.status, run.measured.tokens_per_s) {
            (Status::Ok, Some(t)) => format!(
                "    ok: {t:.1} tokens/s, {:.1} ms/step, {:.3} model TFLOP/s, loss {:.4} -> {:.4}",
                run.measured.step_ms.unwrap_or(0.0),
                run.measured.model_tflops.unwrap_or(0.0),
                run.measured.loss_first.unwrap_or(f64::NAN),
                run.measured.loss_last.unwrap_or(f64::NAN)
            ),
            _ => {
                let reason: Vec<&str> = run.reason.as_deref().unwrap_or("").lines().collect();
                let last = reason[reason.len().saturating_sub(3)..].join("\n    | ");
                format!("    {:?}: {last}\n    (full reason in results.json)", run.status)
            }
        };
        progress(log, &line);
        runs.push(run);
        let so_far = runs.iter().cloned().chain(plan.jobs[i + 1..].iter().map(|j| j.run.clone()));
        assemble(so_far.collect())?.save(&out.join("results.json"))?;
    }
    let mut results = assemble(runs)?;
    results.figures = crate::plot::draw_all(&results, out)?;
    results.save(&out.join("results.json"))?;
    progress(
        log,
        &format!("wrote {} ({} figures)", out.join("results.json").display(), results.figures.len()),
    );
    Ok(results)
}

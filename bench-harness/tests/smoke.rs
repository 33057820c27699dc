//! The smoke suite end to end: runs the real `megatrain` binary (built by `cargo test
//! --workspace` into the same target directory) on tiny models on the CPU, then checks the
//! results file, the measurements and the figures.

use std::path::PathBuf;

use bench_harness::schema::{Results, Status, SCHEMA_VERSION};
use bench_harness::suites::{default_megatrain, execute, plan, Options, Suite, System};

fn megatrain() -> PathBuf {
    let path = default_megatrain();
    assert!(
        path.is_file(),
        "no megatrain binary next to the test executable ({}): run `cargo build -p megatrain` with \
         the same target directory first (`cargo test --workspace` builds it)",
        path.display()
    );
    path
}

/// The smoke suite's options (CPU, 4 x 64 tokens, 4 steps), writing into `out`.
fn smoke_options(out: &std::path::Path) -> Options {
    Options {
        suite: Suite::Smoke,
        out: out.to_path_buf(),
        megatrain: megatrain(),
        python: "python3".into(),
        steps: 4,
        systems: vec![System::Ours],
        models: vec![],
        tokens: vec![(4, 64)],
        depths: vec![],
        slices: vec![],
        device: "cpu".into(),
        model_config: None,
        run_timeout_s: 300,
        megatrain_args: vec![],
        largest: None,
        ours_streamed: false,
        ours_streamed_host: false,
        ours_noclip: false,
        gpus: vec![1],
        processes: 1,
    }
}

#[test]
fn smoke_suite_runs_megatrain_and_writes_results_and_figures() {
    let out = std::env::temp_dir().join(format!("bench-harness-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let opts = smoke_options(&out);
    let plan = plan(&opts).expect("smoke plan");
    let mut log = Vec::new();
    let returned = execute(&opts, &plan, &mut log).expect("smoke suite");
    let log = String::from_utf8_lossy(&log);

    // The file on disk is the schema, not just the value returned.
    let r = Results::load(&out.join("results.json")).expect("results.json parses");
    assert_eq!(r.schema_version, SCHEMA_VERSION);
    assert_eq!((r.suite.as_str(), r.runs.len()), ("smoke", returned.runs.len()));
    assert!(r.machine.cpus > 0 && !r.date.is_empty());

    let ran: Vec<_> = r.runs.iter().filter(|x| x.status != Status::Skipped).collect();
    assert_eq!(ran.len(), plan.jobs.len());
    for run in &ran {
        let m = &run.measured;
        assert_eq!(run.status, Status::Ok, "{}: {:?}\n{log}", run.key, run.reason);
        assert_eq!(m.steps_measured, Some(3), "{}", run.key);
        assert!(m.tokens_per_s.is_some_and(|t| t > 0.0), "{}: {m:?}", run.key);
        assert!(m.model_tflops.is_some_and(|t| t > 0.0) && m.step_ms.is_some_and(|t| t > 0.0));
        let (first, last) = (m.loss_first.expect("loss"), m.loss_last.expect("loss"));
        assert!(last < first, "{}: loss did not decrease: {first} -> {last}", run.key);
        assert!(m.n_params.is_some_and(|n| n > 1000) && m.num_hidden_layers.is_some());
        assert!(m.host_rss_peak_bytes_per_param.is_some_and(|b| b > 12.0), "{}: {m:?}", run.key);
        assert!(m.h2d_bytes_per_step.is_some_and(|b| b > 0.0) && m.compute_busy_frac.is_some());
        assert_eq!(m.gpu_peak_bytes, None);
    }
    // Every layer's checkpoint spilled to host memory: it ran (and was checked above).
    let spilled = r.runs.iter().find(|x| x.variant == "checkpoints_host").expect("listed");
    assert!(spilled.command.windows(2).any(|w| w == ["--spill-checkpoints", "4"]), "{:?}", spilled.command);
    // Depth: the three tiny configs have growing layer counts and parameter counts.
    let depth: Vec<_> = r.runs.iter().filter(|x| x.part == "depth").collect();
    let layers: Vec<_> = depth.iter().map(|x| x.measured.num_hidden_layers).collect();
    assert_eq!(layers, [Some(1), Some(2), Some(4)]);
    assert!(depth.windows(2).all(|w| w[0].measured.n_params < w[1].measured.n_params));

    // Figures: smoke has no baselines, so no ratio figure; the rest exist and are not empty.
    for stem in ["throughput", "ablation", "depth", "host-memory", "timeline-throughput-tiny-4x64-default"] {
        for ext in ["png", "svg"] {
            let name = format!("{stem}.{ext}");
            assert!(r.figures.contains(&name), "{name} not in {:?}", r.figures);
            let bytes = std::fs::read(out.join(&name)).expect("figure exists");
            assert!(bytes.len() > 5_000, "{name}: only {} bytes", bytes.len());
            let magic: &[u8] = if ext == "png" { b"\x89PNG" } else { b"<svg" };
            assert!(bytes.starts_with(magic), "{name} is not a {ext}");
        }
    }
    assert!(!r.figures.iter().any(|f| f.starts_with("ratio")));

    // Redrawn from results.json alone, the same figures come back and the file is untouched.
    let json = std::fs::read(out.join("results.json")).unwrap();
    for f in &r.figures {
        std::fs::remove_file(out.join(f)).unwrap();
    }
    assert_eq!(bench_harness::plot::draw_all(&r, &out).expect("redraw"), r.figures);
    assert!(r.figures.iter().all(|f| out.join(f).is_file()));
    assert_eq!(std::fs::read(out.join("results.json")).unwrap(), json);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn paper_plan_runs_each_of_our_variants_with_its_own_arguments() {
    let opts = Options {
        suite: Suite::Paper,
        steps: 3,
        systems: vec![System::Ours, System::Deepspeed],
        models: vec!["3.6b".into()],
        tokens: vec![(4, 2048)],
        device: "cuda".into(),
        ours_streamed: true,
        ours_streamed_host: true,
        ours_noclip: true,
        ..smoke_options(&std::env::temp_dir().join("bench-harness-plan-only"))
    };
    let plan = plan(&opts).expect("paper plan");
    let keys: Vec<_> = plan.jobs.iter().map(|j| j.run.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "throughput/ours/3.6b/b4x2048/default",
            "throughput/ours/3.6b/b4x2048/streamed",
            "throughput/ours/3.6b/b4x2048/streamed_host",
            "throughput/ours/3.6b/b4x2048/noclip",
            "throughput/deepspeed/3.6b/b4x2048/default",
        ]
    );
    let args = |i: usize| plan.jobs[i].args.join(" ");
    assert!(!args(0).contains("--clip") && !args(0).contains("--resident-layers"), "{}", args(0));
    assert!(args(1).contains("--resident-layers 0"), "{}", args(1));
    assert!(!args(1).contains("--gpu-updated-layers"), "{}", args(1));
    assert!(args(2).contains("--resident-layers 0 --gpu-updated-layers 0"), "{}", args(2));
    assert!(args(3).contains("--clip 0 --optim-mode lean --grad-dtype none"), "{}", args(3));
}

#[test]
fn results_are_written_after_every_run_so_a_killed_suite_keeps_what_it_measured() {
    let out = std::env::temp_dir().join(format!("bench-harness-partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let opts = smoke_options(&out);
    let mut p = plan(&opts).expect("smoke plan");
    p.jobs.truncate(2);
    p.fixed.clear();
    // The second job copies the results file as it stands when it starts.
    let seen = out.join("seen.json");
    p.jobs[1].program = "sh".into();
    p.jobs[1].args =
        vec!["-c".into(), format!("cp {} {}", out.join("results.json").display(), seen.display())];
    execute(&opts, &p, &mut Vec::new()).expect("suite");
    let r = Results::load(&seen).expect("results.json existed after the first run");
    let status: Vec<_> = r.runs.iter().map(|x| (x.key.as_str(), x.status)).collect();
    assert_eq!(
        status,
        [(p.jobs[0].run.key.as_str(), Status::Ok), (p.jobs[1].run.key.as_str(), Status::NotRun)]
    );
    assert!(r.runs[0].measured.tokens_per_s.is_some() && r.figures.is_empty());
    let _ = std::fs::remove_dir_all(&out);
}

/// The long-context suite: ours (lean mode) and resident PyTorch at each length, MegaTrain's
/// published GH200 points as `published` entries (no process), and the kernel benchmark as one
/// job writing `attention.json`; DeepSpeed is left out.
#[test]
fn longctx_plan_runs_each_length_and_lists_the_published_points() {
    let out = std::env::temp_dir().join("bench-harness-longctx-plan-only");
    let opts = Options {
        suite: Suite::Longctx,
        steps: 2,
        systems: vec![System::Ours, System::Torch],
        models: vec!["7b".into()],
        tokens: vec![(1, 32768), (1, 131072), (1, 524288)],
        device: "cuda".into(),
        ..smoke_options(&out)
    };
    let p = plan(&opts).expect("longctx plan");
    let keys: Vec<&str> = p.jobs.iter().map(|j| j.run.key.as_str()).collect();
    assert_eq!(keys.len(), 7, "{keys:?}");
    assert!(
        keys.contains(&"context/ours/7b/b1x524288/lean")
            && keys.contains(&"context/torch/7b/b1x131072/default")
    );
    let ours = p.jobs.iter().find(|j| j.run.key == "context/ours/7b/b1x32768/lean").unwrap();
    assert!(ours.args.windows(2).any(|w| w == ["--optim-mode", "lean"]), "{:?}", ours.args);
    let kernel = p.jobs.last().unwrap();
    assert!(kernel.document && kernel.args[0].ends_with("scripts/attention_bench.py"), "{:?}", kernel.args);
    // 32k has no published point; 256k has one but is not asked for here.
    let published: Vec<(usize, Option<f64>)> =
        p.fixed.iter().map(|r| (r.seq_len, r.measured.step_ms)).collect();
    assert_eq!(published, [(131072, Some(26100.0)), (524288, Some(871000.0))]);
    assert!(p.fixed.iter().all(|r| r.status == Status::Published && r.system == "megatrain_paper"));
}

#[test]
fn scale_plan_runs_each_gpu_count_with_the_same_placement() {
    let opts = Options {
        suite: Suite::Scale,
        steps: 3,
        models: vec!["3.6b".into()],
        tokens: vec![(16, 2048)],
        device: "cuda".into(),
        gpus: vec![1, 2, 4],
        ..smoke_options(&std::env::temp_dir().join("bench-harness-scale-plan-only"))
    };
    let plan = plan(&opts).expect("scale plan");
    let keys: Vec<_> = plan.jobs.iter().map(|j| j.run.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "scale/ours/3.6b/b16x2048/gpus1",
            "scale/ours/3.6b/b16x2048/gpus2",
            "scale/ours/3.6b/b16x2048/gpus4"
        ]
    );
    for (job, g) in plan.jobs.iter().zip([1, 2, 4]) {
        let args = job.args.join(" ");
        assert!(args.contains(&format!("--gpus {g}")), "{args}");
        assert!(args.contains("--resident-outer off --resident-layers 0 --gpu-updated-layers 0"), "{args}");
        assert_eq!(job.processes, 1);
    }
    // With --processes 2, each GPU count two divides also runs as a job of two processes with
    // half its GPUs each (4 GPUs as two "hosts" of two).
    let plan = bench_harness::suites::plan(&Options { processes: 2, ..opts }).expect("scale plan");
    let jobs: Vec<_> =
        plan.jobs.iter().map(|j| (j.run.key.as_str(), j.processes, j.args.join(" "))).collect();
    assert_eq!(jobs.len(), 5, "{jobs:?}");
    for (key, procs, gpus) in [("gpus2_procs2", 2, "--gpus 1"), ("gpus4_procs2", 2, "--gpus 2")] {
        let key = format!("scale/ours/3.6b/b16x2048/{key}");
        let job = jobs.iter().find(|j| j.0 == key).unwrap_or_else(|| panic!("{key}: {jobs:?}"));
        assert!(job.1 == procs && job.2.contains(gpus), "{job:?}");
    }
}

/// A job of two processes starts both with the launcher's variables (the same arguments, the
/// same rendezvous address and port, their own ranks), keeps each one's output, reads process
/// 0's metrics, and fails naming the process and its status when one of them fails.
#[test]
fn a_job_of_two_processes_starts_both_as_a_launcher_does() {
    let out = std::env::temp_dir().join(format!("bench-harness-procs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    for sub in ["logs", "metrics"] {
        std::fs::create_dir_all(out.join(sub)).unwrap();
    }
    let opts = Options { processes: 2, ..smoke_options(&out) };
    let mut p = plan(&opts).expect("smoke plan");
    p.jobs.truncate(1);
    p.fixed.clear();
    let records = "{\"type\":\"run\",\"n_params\":1000,\"tokens_per_step\":256}\n\
                   {\"type\":\"step\",\"step\":1,\"loss\":4.0,\"step_ms\":10.0,\"tokens_per_s\":25600.0}\n\
                   {\"type\":\"step\",\"step\":2,\"loss\":3.5,\"step_ms\":10.0,\"tokens_per_s\":25600.0}\n";
    let metrics = p.jobs[0].metrics.display().to_string();
    let script = |fail_rank: &str| {
        format!(
            "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $*\"; \
             if [ \"$RANK\" = 0 ]; then printf '{records}' > {metrics}; fi; [ \"$RANK\" != {fail_rank} ]"
        )
    };
    let job = &mut p.jobs[0];
    job.processes = 2;
    job.program = "sh".into();
    job.args = vec!["-c".into(), script("none"), "sh".into(), "--gpus".into(), "1".into()];
    let log = job.log.clone();
    let r = bench_harness::run::execute(job, &out, std::time::Duration::from_secs(60), false);
    assert_eq!(r.status, Status::Ok, "{:?}", r.reason);
    assert_eq!(r.measured.loss_last, Some(3.5));
    let lines: Vec<String> = [log.clone(), std::path::PathBuf::from(format!("{}.rank1", log.display()))]
        .iter()
        .map(|l| std::fs::read_to_string(l).unwrap().trim().to_owned())
        .collect();
    let port = lines[0].split(' ').nth(5).unwrap().to_owned();
    assert_eq!(lines[0], format!("0 2 0 2 127.0.0.1 {port} --gpus 1"));
    assert_eq!(lines[1], format!("1 2 1 2 127.0.0.1 {port} --gpus 1"));
    p.jobs[0].args[1] = script("1");
    let r = bench_harness::run::execute(&p.jobs[0], &out, std::time::Duration::from_secs(60), false);
    assert_eq!(r.status, Status::Failed);
    assert!(
        r.reason.as_deref().unwrap_or("").starts_with("process 1 of 2: exit status: 1"),
        "{:?}",
        r.reason
    );
    let _ = std::fs::remove_dir_all(&out);
}

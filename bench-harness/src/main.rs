//! bench-harness CLI: `--suite smoke|paper|ablate|regress|replot|curves`; see the library docs
//! and `results/README.md` for what each suite runs and the results schema.
#![forbid(unsafe_code)]

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use bench_harness::regress::compare;
use bench_harness::run::parse_metrics;
use bench_harness::schema::{Machine, Results};
use bench_harness::suites::{self, Options, Suite, System};
use clap::Parser;

/// Runs megatrain and the baselines side by side; writes results JSON and figures.
#[derive(Debug, Parser)]
#[command(name = "bench-harness", version, about)]
struct Cli {
    /// Which suite.
    #[arg(long, value_enum)]
    suite: Suite,
    /// Output directory [default: results/DATE-SUITE-MACHINE].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// The megatrain binary [default: `megatrain` next to this executable].
    #[arg(long, value_name = "PATH")]
    megatrain: Option<PathBuf>,
    /// Python interpreter for the baselines.
    #[arg(long, value_name = "PATH", default_value = "python3")]
    python: PathBuf,
    /// Steps per run; the first is warm-up and excluded from the means.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Systems (paper).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "ours,torch,deepspeed")]
    systems: Vec<System>,
    /// Models (paper, longctx): 3.6b, 7b, 8b, 14b, 32b, 120b, olmoe, 30b-a3b or config.json
    /// paths; `none` for no throughput part [default: paper 3.6b,14b; longctx 7b].
    #[arg(long, value_delimiter = ',')]
    models: Option<Vec<String>>,
    /// Tokens per step as BATCHxSEQ [default: smoke 4x64, paper 4x2048,16x2048, ablate 4x2048,
    /// longctx 1x32768,1x131072,1x262144,1x524288].
    #[arg(long, value_delimiter = ',', value_parser = parse_tokens)]
    tokens: Option<Vec<(usize, usize)>>,
    /// Paper: also train this model (a label or config path) as the "largest model" part.
    #[arg(long, value_name = "MODEL")]
    largest: Option<String>,
    /// Paper: also run our engine with every decoder layer streamed (`--resident-layers 0`,
    /// variant `streamed`) beside the planner's placement (variant `default`).
    #[arg(long)]
    ours_streamed: bool,
    /// Paper: also run our engine with every decoder layer streamed and every update on the host
    /// (`--resident-layers 0 --gpu-updated-layers 0`, variant `streamed_host`).
    #[arg(long)]
    ours_streamed_host: bool,
    /// Paper: also run our engine without gradient clipping, as the DeepSpeed baseline is
    /// configured (`--clip 0 --optim-mode lean --grad-dtype none`, variant `noclip`; without
    /// clipping lean mode's update is bitwise exact mode's, tests/modes.rs).
    #[arg(long)]
    ours_noclip: bool,
    /// Paper: layer counts of the slices of the dense 120B shape (`configs/dense-120b.json`)
    /// measured to extrapolate the full model's step time and host memory; 0: none.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    slices: Vec<usize>,
    /// Scale: GPU counts to run at the same global batch.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    gpus_list: Vec<usize>,
    /// Scale: also run each GPU count this divides as a job of this many processes on this
    /// machine, started as torchrun starts a job of as many hosts (each with its own store), e.g.
    /// 2: 4 GPUs as two processes of two; 1: none.
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// Layer counts of the depth-scaling part (paper; width of the first model); 0: none.
    #[arg(long, value_delimiter = ',', default_value = "7,14,28")]
    depths: Vec<usize>,
    /// An extra argument for every `megatrain train` run (repeat for more), e.g.
    /// `--megatrain-arg=--host-mem --megatrain-arg=480` where MemAvailable starts low.
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    megatrain_arg: Vec<String>,
    /// Device of megatrain runs [default: cpu for smoke, cuda otherwise].
    #[arg(long, value_parser = ["cpu", "cuda"])]
    device: Option<String>,
    /// Model config of the ablations ("builtin" = megatrain's tiny Llama).
    #[arg(long, value_name = "PATH", default_value = "bench-harness/configs/llama3-3.6b.json")]
    model_config: PathBuf,
    /// Kill a run after this many seconds.
    #[arg(long, default_value_t = 1800)]
    run_timeout_s: u64,
    /// regress: the baseline results file.
    #[arg(long, value_name = "FILE")]
    against: Option<PathBuf>,
    /// regress: the current results file [default: run the baseline's suite now].
    #[arg(long, value_name = "FILE")]
    current: Option<PathBuf>,
    /// regress: relative tokens/s drop that fails.
    #[arg(long, default_value_t = 0.05)]
    threshold: f64,
    /// Print the commands the suite would run, and run nothing.
    #[arg(long)]
    dry_run: bool,
    /// curves: a megatrain metrics file (JSON Lines; repeat for more, the first is the reference
    /// of the ratio figure); each curve is named by its file's stem.
    #[arg(long, value_name = "FILE")]
    metrics: Vec<PathBuf>,
    /// curves: what the figures' captions end with [default: the first run's parameter count and
    /// tokens per step].
    #[arg(long, value_name = "TEXT")]
    title: Option<String>,
}

/// `--suite curves`: the loss curves of the `--metrics` files into `--out`.
fn draw_curves(cli: &Cli) -> Result<()> {
    let out = cli.out.as_ref().context("--suite curves needs --out DIR")?;
    if cli.metrics.is_empty() {
        bail!("--suite curves needs at least one --metrics FILE");
    }
    let mut runs = Vec::new();
    for path in &cli.metrics {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let metrics = parse_metrics(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let name =
            path.file_stem().map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into());
        runs.push((name, metrics));
    }
    let title = cli.title.clone().unwrap_or_else(|| {
        let run = runs[0].1.run.as_ref();
        let get = |k: &str| run.and_then(|r| r.get(k)).and_then(serde_json::Value::as_f64);
        match (get("n_params"), get("tokens_per_step")) {
            (Some(n), Some(t)) => format!("{:.2}M parameters, {t} tokens a step", n / 1e6),
            _ => "megatrain runs".to_owned(),
        }
    });
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let figures = bench_harness::plot::draw_curves(&runs, &title, out)?;
    eprintln!("drew {} in {}", figures.join(", "), out.display());
    Ok(())
}

fn parse_tokens(s: &str) -> std::result::Result<(usize, usize), String> {
    let (b, t) = s.split_once('x').ok_or_else(|| format!("{s:?}: expected BATCHxSEQ, e.g. 4x2048"))?;
    match (b.parse(), t.parse()) {
        (Ok(b), Ok(t)) if b > 0 && t > 0 => Ok((b, t)),
        _ => Err(format!("{s:?}: batch and sequence length must be positive integers")),
    }
}

fn options(cli: &Cli, suite: Suite) -> Options {
    let name = format!("{:?}", suite).to_lowercase();
    let date = bench_harness::schema::utc_now_iso();
    let out = cli.out.clone().unwrap_or_else(|| {
        PathBuf::from("results").join(format!("{}-{name}-{}", &date[..10], Machine::detect().short_name()))
    });
    let builtin = cli.model_config.as_os_str() == "builtin";
    let model_config = match &cli.model_config {
        p if p.is_relative() && !p.exists() => suites::repo_root().join(p),
        p => p.clone(),
    };
    Options {
        suite,
        out,
        megatrain: cli.megatrain.clone().unwrap_or_else(suites::default_megatrain),
        python: cli.python.clone(),
        steps: cli.steps,
        systems: match suite {
            Suite::Smoke | Suite::Scale => vec![System::Ours],
            // DeepSpeed offload at 7B and 32k+ tokens a sequence is out of scope of this suite.
            Suite::Longctx => cli.systems.iter().copied().filter(|&s| s != System::Deepspeed).collect(),
            _ => cli.systems.clone(),
        },
        models: match &cli.models {
            Some(m) => m.iter().filter(|m| m.as_str() != "none").cloned().collect(),
            None => suite.default_models(),
        },
        tokens: cli.tokens.clone().unwrap_or_else(|| suite.default_tokens()),
        depths: cli.depths.iter().copied().filter(|&d| d > 0).collect(),
        slices: cli.slices.iter().copied().filter(|&d| d > 0).collect(),
        megatrain_args: cli.megatrain_arg.clone(),
        largest: cli.largest.clone(),
        ours_streamed: cli.ours_streamed,
        ours_streamed_host: cli.ours_streamed_host,
        ours_noclip: cli.ours_noclip,
        gpus: cli.gpus_list.iter().copied().filter(|&g| g > 0).collect(),
        processes: cli.processes.max(1),
        device: cli
            .device
            .clone()
            .unwrap_or_else(|| if suite == Suite::Smoke { "cpu" } else { "cuda" }.into()),
        model_config: (!builtin && suite == Suite::Ablate).then_some(model_config),
        run_timeout_s: cli.run_timeout_s,
    }
}

fn run_suite(cli: &Cli, suite: Suite) -> Result<Option<Results>> {
    let opts = options(cli, suite);
    let plan = suites::plan(&opts)?;
    if cli.dry_run {
        let mut out = std::io::stdout().lock();
        for job in &plan.jobs {
            writeln!(out, "# {}\n{}", job.run.key, job.command().join(" "))?;
        }
        for r in &plan.fixed {
            writeln!(out, "# {} {:?}: {}", r.key, r.status, r.reason.as_deref().unwrap_or(""))?;
        }
        return Ok(None);
    }
    Ok(Some(suites::execute(&opts, &plan, &mut std::io::stderr())?))
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if cli.suite == Suite::Curves {
        return draw_curves(&cli);
    }
    if cli.suite == Suite::Replot {
        let out = cli.out.as_ref().context("--suite replot needs --out DIR (a run's directory)")?;
        // The measurements are left as they are: results.json is only read.
        let results = Results::load(&out.join("results.json"))?;
        let figures = bench_harness::plot::draw_all(&results, out)?;
        eprintln!("redrew {} figures in {}", figures.len(), out.display());
        return Ok(());
    }
    if cli.suite != Suite::Regress {
        run_suite(&cli, cli.suite)?;
        return Ok(());
    }
    let against = cli.against.as_ref().context("--suite regress needs --against FILE")?;
    let baseline = Results::load(against)?;
    let current = match &cli.current {
        Some(path) => Results::load(path)?,
        None => {
            let suite = match baseline.suite.as_str() {
                "smoke" => Suite::Smoke,
                "ablate" => Suite::Ablate,
                "paper" => Suite::Paper,
                other => bail!("{}: cannot rerun suite {other:?}", against.display()),
            };
            match run_suite(&cli, suite)? {
                Some(r) => r,
                None => return Ok(()),
            }
        }
    };
    let report = compare(&baseline, &current, cli.threshold);
    report.write(&mut std::io::stdout().lock())?;
    if !report.passed() {
        bail!("throughput regressed (or nothing to compare) against {}", against.display());
    }
    Ok(())
}

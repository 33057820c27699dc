//! The suites as data: which systems run on which configurations ([`plan`]), then running the
//! plan, writing `results.json` and the figures ([`execute`], `execute.rs`).
//!
//! - `smoke`: CPU only, megatrain on tiny models (throughput, ablation, depth parts).
//! - `ablate`: ring depth 1/2/3, optimizer overlap off, chunk sweep on one model config (every
//!   layer through the ring), and the planner's held layers and kept activations on top, and
//!   every layer's checkpoint spilled to host memory.
//! - `paper`: every system on every model and tokens-per-step setting, depth scaling at the
//!   first model's width, and the largest-model part recorded as not run.
//! - `longctx`: one sequence a step at each context length, ours and resident PyTorch, the
//!   published MegaTrain points, the attention kernel benchmark (`longctx.rs`).

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{json, Value};

use crate::run::Job;
use crate::schema::{Measured, Run, Status};
use crate::{io_err, Error, Result};

mod execute;
pub use execute::execute;

/// A suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Suite {
    /// CPU-only check of the whole path on tiny models (CI).
    Smoke,
    /// Throughput against the baselines, depth scaling, largest model.
    Paper,
    /// megatrain's ablations.
    Ablate,
    /// Context lengths 32k-512k against resident PyTorch and MegaTrain's published figures, and
    /// the attention kernel against PyTorch SDPA.
    Longctx,
    /// Data parallel: our engine on 1, 2, 4 (`--gpus-list`) GPUs of this host at the same global
    /// batch, in one run; throughput ratios against one GPU (efficiency = ratio / N).
    Scale,
    /// Compare results with a baseline file.
    Regress,
    /// Redraw the figures of an earlier run from its `results.json` (`--out DIR`).
    Replot,
    /// Loss curves of megatrain metrics files (`--metrics FILE`, repeated) into `--out DIR`.
    Curves,
}

impl Suite {
    /// Tokens per step as (batch, seq) when `--tokens` is not given.
    pub fn default_tokens(self) -> Vec<(usize, usize)> {
        match self {
            Suite::Smoke => vec![(4, 64)],
            Suite::Paper => vec![(4, 2048), (16, 2048)],
            Suite::Longctx => vec![(1, 32768), (1, 131072), (1, 262144), (1, 524288)],
            // Four sequences per GPU at 4 GPUs.
            Suite::Scale => vec![(16, 2048)],
            _ => vec![(4, 2048)],
        }
    }

    /// Model labels when `--models` is not given (paper, longctx, scale).
    pub fn default_models(self) -> Vec<String> {
        let labels: &[&str] = if self == Suite::Longctx { &["7b"] } else { &["3.6b", "14b"] };
        labels.iter().map(|m| m.to_string()).collect()
    }
}

/// A system under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum System {
    /// megatrain.
    Ours,
    /// `scripts/baselines/resident_torch.py`.
    Torch,
    /// `scripts/baselines/deepspeed_zero3.py`.
    Deepspeed,
    /// A published figure of MegaTrain's (never run).
    #[value(skip)]
    MegatrainPaper,
}

impl System {
    /// Name in the results file.
    pub fn name(self) -> &'static str {
        match self {
            System::Ours => "ours",
            System::Torch => "torch",
            System::Deepspeed => "deepspeed",
            System::MegatrainPaper => "megatrain_paper",
        }
    }
}

/// Options of a suite run (the `config` of the results file).
#[derive(Debug, Clone, Serialize)]
pub struct Options {
    /// The suite (not `regress`).
    pub suite: Suite,
    /// Output directory.
    pub out: PathBuf,
    /// The `megatrain` binary.
    pub megatrain: PathBuf,
    /// Python interpreter for the baselines.
    pub python: PathBuf,
    /// Steps per run (the first is warm-up and excluded from the means).
    pub steps: usize,
    /// Systems to run (paper).
    pub systems: Vec<System>,
    /// Model labels (`3.6b`, `14b`, `8b`) or config paths (paper).
    pub models: Vec<String>,
    /// Tokens per step as (batch, seq); ablate uses the first.
    pub tokens: Vec<(usize, usize)>,
    /// Layer counts of the depth-scaling part (paper).
    pub depths: Vec<usize>,
    /// Layer counts of the measured slices of the dense 120B shape (paper; empty: the 120B
    /// extrapolation is recorded as not run).
    pub slices: Vec<usize>,
    /// `cpu` or `cuda` (paper, ablate).
    pub device: String,
    /// Model config of the ablations (None: megatrain's built-in tiny Llama).
    pub model_config: Option<PathBuf>,
    /// Each subprocess is killed after this long.
    pub run_timeout_s: u64,
    /// Extra arguments of every `megatrain train` run.
    pub megatrain_args: Vec<String>,
    /// Paper: the model of the "largest model" part (ours only), if any.
    pub largest: Option<String>,
    /// Paper: also run ours with every decoder layer streamed (variant `streamed`).
    pub ours_streamed: bool,
    /// Paper: also run ours streamed with every update on the host (variant `streamed_host`).
    pub ours_streamed_host: bool,
    /// Paper: also run ours without gradient clipping (variant `noclip`).
    pub ours_noclip: bool,
    /// Scale: the GPU counts (`--gpus N`), each a variant `gpusN`.
    pub gpus: Vec<usize>,
    /// Scale: P > 1 also runs each GPU count G that P divides as a job of P processes of G / P
    /// GPUs each, variant `gpusG_procsP`: torchrun's launch of a P-host job, emulated on this
    /// machine (each process with its own host store; they share its RAM and cores).
    pub processes: usize,
}

/// The repository root: from the build's manifest directory where it still exists, else `.`.
pub fn repo_root() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf);
    built.filter(|p| p.join("bench-harness/configs").is_dir()).unwrap_or_else(|| PathBuf::from("."))
}

/// The `megatrain` binary beside the running executable (`target/<profile>/megatrain`), also
/// from a test executable one level down (`target/<profile>/deps/`).
pub fn default_megatrain() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dirs: Vec<&Path> = exe.ancestors().skip(1).take(2).collect();
    let candidates: Vec<PathBuf> = dirs.iter().map(|d| d.join("megatrain")).collect();
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| PathBuf::from("target/release/megatrain"))
}

/// Config file of a model label: a known label or a path to a config.json.
pub fn model_config_path(label: &str) -> Result<PathBuf> {
    let file = match label {
        "3.6b" => "llama3-3.6b.json",
        "7b" => "qwen2.5-7b.json",
        "8b" => "llama3-8b.json",
        "14b" => "qwen2.5-14b.json",
        "32b" => "qwen2.5-32b.json",
        "120b" => "dense-120b.json",
        "olmoe" => "olmoe-1b-7b.json",
        "30b-a3b" => "qwen3-30b-a3b.json",
        other if other.ends_with(".json") => return Ok(PathBuf::from(other)),
        other => {
            return Err(Error::Options(format!(
                "unknown model {other:?}: use 3.6b, 7b, 8b, 14b, 32b, 120b, olmoe, 30b-a3b or a .json path"
            )))
        }
    };
    Ok(repo_root().join("bench-harness/configs").join(file))
}

/// A model's name in run keys: a known label as given (`3.6b`), a config path's file stem.
pub(crate) fn model_label(label: &str) -> String {
    if !label.ends_with(".json") {
        return label.to_owned();
    }
    Path::new(label).file_stem().map_or(label.to_owned(), |s| s.to_string_lossy().into_owned())
}

/// `megatrain train` arguments that stream every decoder layer (no GPU-resident layers; the planner
/// may still hold, keep and GPU-update streamed layers, as it would for a user).
fn streamed_layers() -> Vec<String> {
    vec!["--resident-layers".into(), "0".into()]
}

/// [`streamed_layers`], every update on the host: variant `streamed_host` (`--ours-streamed-host`).
fn streamed_host_updates() -> Vec<String> {
    ["--resident-layers", "0", "--gpu-updated-layers", "0"].map(String::from).to_vec()
}

/// Every decoder layer through the weight ring, twice a step, recomputed, updated on the host:
/// the streaming engine the ring-depth, overlap and chunk ablations measure.
fn ring_streamed_layers() -> Vec<String> {
    ["--resident-layers", "0", "--held-layers", "0", "--kept-layers", "0", "--gpu-updated-layers", "0"]
        .map(String::from)
        .to_vec()
}

/// No gradient clipping, as the DeepSpeed baseline runs: each update as its gradient lands
/// (lean mode, which without clipping is bitwise exact mode) and no store gradient buffer.
fn no_clipping() -> Vec<String> {
    ["--clip", "0", "--optim-mode", "lean", "--grad-dtype", "none"].map(String::from).to_vec()
}

/// A tiny Llama config (byte vocabulary) for the smoke suite's depth part.
fn tiny_config(layers: usize) -> Value {
    json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": layers, "vocab_size": 256,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})
}

/// Everything a suite will do: subprocesses, files to write first, entries that do not run.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Subprocesses, in order.
    pub jobs: Vec<Job>,
    /// Config files the jobs read (depth scaling), written before the first job.
    pub configs: Vec<(PathBuf, Value)>,
    /// Skipped and not-run entries.
    pub fixed: Vec<Run>,
}

pub(crate) struct Ctx<'a> {
    pub(crate) opts: &'a Options,
    pub(crate) plan: Plan,
}

/// What one run is, before it runs.
pub(crate) struct Spec {
    part: &'static str,
    system: System,
    model: String,
    config: Option<PathBuf>,
    tokens: (usize, usize),
    variant: String,
    pub(crate) extra: Vec<String>,
    trace: bool,
    /// Processes of the job ([`Job::processes`]).
    processes: usize,
}

impl Spec {
    pub(crate) fn new(
        part: &'static str,
        system: System,
        model: &str,
        config: Option<PathBuf>,
        tokens: (usize, usize),
        variant: &str,
    ) -> Self {
        Spec {
            part,
            system,
            model: model.to_owned(),
            config,
            tokens,
            variant: variant.to_owned(),
            extra: vec![],
            trace: false,
            processes: 1,
        }
    }
}

/// Decoder layers of a model config file (megatrain's built-in tiny Llama's 4 without one).
fn layers_of(config: Option<&PathBuf>) -> Result<usize> {
    let Some(path) = config else { return Ok(4) };
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    let cfg: Value =
        serde_json::from_str(&text).map_err(|e| Error::Parse { path: path.clone(), msg: e.to_string() })?;
    cfg["num_hidden_layers"]
        .as_u64()
        .map(|n| n as usize)
        .ok_or_else(|| Error::Parse { path: path.clone(), msg: "no num_hidden_layers".into() })
}

impl Ctx<'_> {
    pub(crate) fn entry(&self, s: &Spec, status: Status, reason: Option<String>) -> Run {
        let (b, t) = s.tokens;
        Run {
            key: Run::make_key(s.part, s.system.name(), &s.model, b, t, &s.variant),
            part: s.part.into(),
            system: s.system.name().into(),
            model: s.model.clone(),
            model_config: s.config.as_ref().map(|p| p.display().to_string()),
            batch_size: b,
            seq_len: t,
            tokens_per_step: b * t,
            variant: s.variant.clone(),
            device: self.opts.device.clone(),
            status,
            reason,
            command: vec![],
            metrics_file: None,
            log_file: None,
            trace_file: None,
            wall_s: None,
            measured: Measured::default(),
        }
    }

    pub(crate) fn add(&mut self, s: Spec) {
        let o = self.opts;
        let run = self.entry(&s, Status::NotRun, Some("not started".into()));
        let stem = run.key.replace('/', "_");
        let metrics = o.out.join("metrics").join(format!("{stem}.jsonl"));
        let (b, t) = s.tokens;
        let mut args: Vec<String> = Vec::new();
        let arg = |args: &mut Vec<String>, k: &str, v: &dyn std::fmt::Display| {
            args.extend([k.to_owned(), v.to_string()])
        };
        let (program, trace) = if s.system == System::Ours {
            let trace = s.trace.then(|| o.out.join("traces").join(format!("{stem}.json")));
            args.push("train".into());
            arg(&mut args, "--device", &o.device);
            if let Some(c) = &s.config {
                arg(&mut args, "--config", &c.display());
                arg(&mut args, "--data", &"synthetic");
            }
            if o.device == "cuda" {
                arg(&mut args, "--precision", &"bf16");
            }
            if let Some(tr) = &trace {
                arg(&mut args, "--trace", &tr.display());
                arg(&mut args, "--trace-step", &2);
            }
            arg(&mut args, "--log-every", &0);
            args.extend(o.megatrain_args.iter().cloned());
            (o.megatrain.clone(), trace)
        } else {
            let script = if s.system == System::Torch { "resident_torch.py" } else { "deepspeed_zero3.py" };
            args.push(repo_root().join("scripts/baselines").join(script).display().to_string());
            if let Some(c) = &s.config {
                arg(&mut args, "--config", &c.display());
            }
            (o.python.clone(), None)
        };
        arg(&mut args, "--batch-size", &b);
        arg(&mut args, "--seq-len", &t);
        arg(&mut args, "--steps", &o.steps);
        arg(&mut args, "--metrics", &metrics.display());
        args.extend(s.extra);
        let log = o.out.join("logs").join(format!("{stem}.log"));
        let processes = s.processes;
        self.plan.jobs.push(Job { run, program, args, metrics, log, trace, document: false, processes });
    }
}

/// The runs of `opts.suite`, with nothing started and nothing written.
pub fn plan(opts: &Options) -> Result<Plan> {
    if opts.steps < 2 {
        return Err(Error::Options("--steps must be at least 2 (the first step is warm-up)".into()));
    }
    let mut cx = Ctx { opts, plan: Plan { jobs: vec![], configs: vec![], fixed: vec![] } };
    let first_tokens = *opts.tokens.first().ok_or_else(|| Error::Options("--tokens is empty".into()))?;
    let spec = Spec::new;
    let ablations = |cx: &mut Ctx<'_>, model: &str, config: Option<PathBuf>| {
        let (b, _) = first_tokens;
        let mut variants: Vec<(String, Vec<String>)> = (1..=3)
            .map(|d| (format!("ring{d}"), vec!["--ring-depth".into(), d.to_string()]))
            .chain([("no_opt_overlap".to_owned(), vec!["--no-optimizer-overlap".to_owned()])])
            .collect();
        for c in [1usize, 2, 4].into_iter().filter(|&c| c <= b) {
            variants.push((format!("chunks{c}"), vec!["--chunks".into(), c.to_string()]));
        }
        // The ablations measure the streaming engine: every decoder layer streams through the
        // ring in all of them; `held_kept` adds what the planner does with the GPU memory left
        // (layers held from forward to backward, activations kept instead of recomputed).
        for (v, extra) in &variants {
            let s = spec("ablation", System::Ours, model, config.clone(), first_tokens, v);
            let extra = extra.iter().cloned().chain(ring_streamed_layers()).collect();
            cx.add(Spec { extra, trace: v == "ring2", ..s });
        }
        let s = spec("ablation", System::Ours, model, config.clone(), first_tokens, "held_kept");
        cx.add(Spec { extra: streamed_layers(), ..s });
        // Every layer's input checkpoint down to host memory and back.
        let layers = layers_of(config.as_ref())?;
        let s = spec("ablation", System::Ours, model, config, first_tokens, "checkpoints_host");
        let extra =
            ["--spill-checkpoints".to_owned(), layers.to_string()].into_iter().chain(ring_streamed_layers());
        cx.add(Spec { extra: extra.collect(), ..s });
        Ok(())
    };
    match opts.suite {
        Suite::Smoke => {
            let s = spec("throughput", System::Ours, "tiny", None, first_tokens, "default");
            cx.add(Spec { trace: true, ..s });
            ablations(&mut cx, "tiny", None)?;
            for layers in [1, 2, 4] {
                let path = opts.out.join("configs").join(format!("tiny-L{layers}.json"));
                cx.plan.configs.push((path.clone(), tiny_config(layers)));
                cx.add(spec(
                    "depth",
                    System::Ours,
                    &format!("tiny-L{layers}"),
                    Some(path),
                    first_tokens,
                    "default",
                ));
            }
        }
        Suite::Ablate => {
            let label =
                opts.model_config.as_ref().map_or("tiny".into(), |p| model_label(&p.display().to_string()));
            ablations(&mut cx, &label, opts.model_config.clone())?;
        }
        Suite::Longctx => crate::longctx::plan(&mut cx)?,
        Suite::Scale => {
            for m in &opts.models {
                let config = model_config_path(m)?;
                for &tokens in &opts.tokens {
                    // Each GPU count in one process, then as a job of `processes` processes.
                    let one = opts.gpus.iter().map(|&g| (g, 1));
                    let p = opts.processes;
                    let jobs = opts.gpus.iter().filter(|&&g| p > 1 && g % p == 0).map(|&g| (g, p));
                    for (g, procs) in one.chain(jobs) {
                        let variant =
                            if procs == 1 { format!("gpus{g}") } else { format!("gpus{g}_procs{procs}") };
                        let s = spec(
                            "scale",
                            System::Ours,
                            &model_label(m),
                            Some(config.clone()),
                            tokens,
                            &variant,
                        );
                        // The placements data parallel allows, at every GPU count (so that one
                        // GPU is the same engine as N): no optimizer state on a GPU.
                        let mut extra: Vec<String> = ["--resident-outer", "off", "--resident-layers", "0"]
                            .into_iter()
                            .chain(["--gpu-updated-layers", "0", "--gpus"])
                            .map(String::from)
                            .collect();
                        extra.push((g / procs).to_string());
                        cx.add(Spec { extra, processes: procs, ..s });
                    }
                }
            }
        }
        Suite::Paper => {
            for m in &opts.models {
                let config = model_config_path(m)?;
                for &tokens in &opts.tokens {
                    for &sys in &opts.systems {
                        let s =
                            spec("throughput", sys, &model_label(m), Some(config.clone()), tokens, "default");
                        cx.add(Spec { trace: sys == System::Ours, ..s });
                        // Our further variants, each with its own arguments.
                        let variants = [
                            (opts.ours_streamed, "streamed", streamed_layers()),
                            (opts.ours_streamed_host, "streamed_host", streamed_host_updates()),
                            (opts.ours_noclip, "noclip", no_clipping()),
                        ];
                        for (_, variant, extra) in variants.into_iter().filter(|v| v.0 && sys == System::Ours)
                        {
                            let s = spec(
                                "throughput",
                                sys,
                                &model_label(m),
                                Some(config.clone()),
                                tokens,
                                variant,
                            );
                            cx.add(Spec { trace: true, extra, ..s });
                        }
                    }
                }
            }
            if let Some(m) = opts.models.first() {
                let base_path = model_config_path(m)?;
                let text = std::fs::read_to_string(&base_path).map_err(io_err(&base_path))?;
                let base: Value = serde_json::from_str(&text)
                    .map_err(|e| Error::Parse { path: base_path.clone(), msg: e.to_string() })?;
                for &layers in &opts.depths {
                    let label = format!("{}-L{layers}", model_label(m));
                    let path = opts.out.join("configs").join(format!("{label}.json"));
                    let mut cfg = base.clone();
                    cfg["num_hidden_layers"] = json!(layers);
                    cx.plan.configs.push((path.clone(), cfg));
                    // Depth scaling is a property of our engine's schedule (time per step linear
                    // in layers); the peers are compared in the throughput part.
                    if opts.systems.contains(&System::Ours) {
                        let s =
                            spec("depth", System::Ours, &label, Some(path.clone()), first_tokens, "default");
                        // Every layer streamed, so that each added layer costs the same.
                        cx.add(Spec { extra: streamed_layers(), ..s });
                    }
                }
            }
            if let Some(m) = &opts.largest {
                let s = spec(
                    "largest",
                    System::Ours,
                    &model_label(m),
                    Some(model_config_path(m)?),
                    first_tokens,
                    "default",
                );
                cx.add(s);
            }
            // The 120B case: slices of the dense 120B shape (a few layers, placed as the full
            // model's plan places them: every decoder layer streamed, the outer unit resident),
            // measured; the full model's step time, FLOPs and host memory extrapolated from them
            // after the runs (`extrapolate_120b`).
            let base_path = model_config_path("120b")?;
            let text = std::fs::read_to_string(&base_path).map_err(io_err(&base_path))?;
            let base: Value = serde_json::from_str(&text)
                .map_err(|e| Error::Parse { path: base_path.clone(), msg: e.to_string() })?;
            if opts.systems.contains(&System::Ours) {
                for &layers in &opts.slices {
                    let label = format!("120b-L{layers}");
                    let path = opts.out.join("configs").join(format!("{label}.json"));
                    let mut cfg = base.clone();
                    cfg["num_hidden_layers"] = json!(layers);
                    cx.plan.configs.push((path.clone(), cfg));
                    let s = spec("slice", System::Ours, &label, Some(path), first_tokens, "default");
                    let extra =
                        ["--resident-layers", "0", "--resident-outer", "on"].map(String::from).to_vec();
                    cx.add(Spec { extra, ..s });
                }
            }
            let s = spec("largest", System::Ours, "120b", Some(base_path), first_tokens, "extrapolated");
            let reason = if opts.slices.len() >= 2 {
                "computed after the slices ran"
            } else {
                "needs at least two slice layer counts (--slices)"
            };
            cx.plan.fixed.push(cx.entry(&s, Status::NotRun, Some(reason.into())));
        }
        Suite::Regress | Suite::Replot | Suite::Curves => {
            return Err(Error::Options(format!("{:?} has no runs of its own", opts.suite)))
        }
    }
    if cx.plan.jobs.iter().any(|j| j.run.system == "ours") && !opts.megatrain.is_file() {
        return Err(Error::Options(format!(
            "no megatrain binary at {}: build it (`cargo build --release -p megatrain`, with \
             `--features cuda` for --device cuda) or pass --megatrain PATH",
            opts.megatrain.display()
        )));
    }
    Ok(cx.plan)
}

#[cfg(test)]
mod tests {
    use super::{model_config_path, model_label};

    #[test]
    fn model_labels_keep_their_dots_and_paths_lose_their_directory() {
        assert_eq!(model_label("3.6b"), "3.6b");
        assert_eq!(model_label("14b"), "14b");
        assert_eq!(model_label("bench-harness/configs/llama3-3.6b.json"), "llama3-3.6b");
    }

    #[test]
    fn every_known_label_names_a_committed_config() {
        for label in ["3.6b", "7b", "8b", "14b", "32b", "120b", "olmoe", "30b-a3b"] {
            let path = model_config_path(label).unwrap();
            assert!(path.is_file(), "{label}: {} is missing", path.display());
        }
        assert!(model_config_path("13b").is_err());
    }
}

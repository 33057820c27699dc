//! The results JSON written by every suite: one file per harness run, documented in
//! `results/README.md` ("bench-harness results"). Units are in the field names.

use std::path::Path;
use std::process::Command;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{io_err, Error, Result};

/// Version of the layout below; bump on any incompatible change.
pub const SCHEMA_VERSION: u32 = 1;

/// The model-FLOPs convention of `model_tflops` (as megatrain's metrics and `mt_core`).
pub const FLOPS_FORMULA: &str = "6*N*T + 6*L*S*H*T";

/// One harness run: where, which code, when, what was asked, and every system's runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// `smoke`, `paper` or `ablate`.
    pub suite: String,
    /// The machine everything ran on.
    pub machine: Machine,
    /// The harness's working tree (null outside a git checkout).
    pub commit: Option<Commit>,
    /// Start of the harness run, UTC, ISO 8601.
    pub date: String,
    /// The suite's options.
    pub config: Value,
    /// [`FLOPS_FORMULA`].
    pub flops_formula: String,
    /// One entry per (part, system, model, batch, seq, variant).
    pub runs: Vec<Run>,
    /// Throughput ratios between systems measured in this same run.
    pub ratios: Vec<Ratio>,
    /// Figures written beside the file (PNG and SVG), relative to it.
    pub figures: Vec<String>,
    /// longctx: the attention kernel benchmark's document (`scripts/attention_bench.py`), when
    /// it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<Value>,
}

/// The machine.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    /// Host name.
    pub hostname: String,
    /// Logical CPUs available to the harness.
    pub cpus: usize,
    /// MemTotal of /proc/meminfo (null where unreadable).
    pub ram_bytes: Option<u64>,
    /// The first GPU per `nvidia-smi` (null without one).
    pub gpu: Option<Gpu>,
}

/// A GPU as `nvidia-smi --query-gpu=name,driver_version,memory.total` reports it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Gpu {
    /// e.g. `NVIDIA H200`.
    pub name: String,
    /// Driver version.
    pub driver_version: String,
    /// Total device memory.
    pub memory_total_bytes: Option<u64>,
}

/// The source tree the harness was run from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Commit {
    /// `git rev-parse --short HEAD`.
    pub hash: String,
    /// Whether `git status --porcelain` listed anything.
    pub dirty: bool,
}

/// Outcome of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Ran; measurements are filled in.
    Ok,
    /// Started and failed (`reason` holds the system's error or its output's tail).
    Failed,
    /// Deliberately not started (`reason` says why, e.g. not implemented by the engine).
    Skipped,
    /// Part of the suite that is not automated yet (`reason` says what is missing).
    NotRun,
    /// Not run: computed from measured runs (`reason` says which and how). Only the fields the
    /// computation fills are set.
    Extrapolated,
    /// Not run here: a figure a publication reports (`reason` cites it), drawn beside the
    /// measurements as a reference point and never part of a ratio.
    Published,
}

/// One system on one configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Run {
    /// Stable identity used by `regress`: `part/system/model/bBATCHxSEQ/variant`.
    pub key: String,
    /// `throughput`, `depth`, `ablation`, `largest` or `slice` (a few layers of a model too large
    /// for the machine, measured for the `largest` extrapolation).
    pub part: String,
    /// `ours`, `torch` or `deepspeed`.
    pub system: String,
    /// Model label (`3.6b`, `14b`, `tiny`, `3.6b-L7`, ...).
    pub model: String,
    /// Config file given to the system (null: megatrain's built-in tiny Llama).
    pub model_config: Option<String>,
    /// Sequences per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// `batch_size * seq_len`.
    pub tokens_per_step: usize,
    /// `default`, the ablation's name (`ring1`, `no_opt_overlap`, `chunks2`, ...), `streamed`
    /// (every decoder layer streamed) or `extrapolated`.
    pub variant: String,
    /// `cpu` or `cuda`.
    pub device: String,
    /// Outcome.
    pub status: Status,
    /// Why a run is not `ok`.
    pub reason: Option<String>,
    /// The command line (program first).
    pub command: Vec<String>,
    /// Files beside the JSON, relative to it.
    pub metrics_file: Option<String>,
    /// The system's stdout and stderr.
    pub log_file: Option<String>,
    /// Chrome trace of one step (megatrain only).
    pub trace_file: Option<String>,
    /// Wall time of the whole process.
    pub wall_s: Option<f64>,
    /// What the metrics say.
    #[serde(flatten)]
    pub measured: Measured,
}

/// Measurements of one run: means over the steps after the first (warm-up) unless named
/// otherwise; null where a system does not report the quantity.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Measured {
    /// Steps the means are over.
    pub steps_measured: Option<usize>,
    /// Parameters of the model as the system counts them.
    pub n_params: Option<u64>,
    /// Transformer layers.
    pub num_hidden_layers: Option<u64>,
    /// Version of the system (`megatrain_version`, `torch_version`, ...).
    pub system_version: Option<String>,
    /// Mean step time.
    pub step_ms: Option<f64>,
    /// Tokens over time of the measured steps.
    pub tokens_per_s: Option<f64>,
    /// Model FLOPs ([`FLOPS_FORMULA`]) over time of the measured steps, in 1e12/s.
    pub model_tflops: Option<f64>,
    /// Loss of the first step (nats).
    pub loss_first: Option<f64>,
    /// Loss of the last step (nats).
    pub loss_last: Option<f64>,
    /// Largest host resident set reported over all steps.
    pub host_rss_peak_bytes: Option<u64>,
    /// `host_rss_peak_bytes / n_params`.
    pub host_rss_peak_bytes_per_param: Option<f64>,
    /// Host store bytes per parameter (megatrain: master weights, AdamW moments, gradients).
    pub host_store_bytes_per_param: Option<f64>,
    /// Peak device memory.
    pub gpu_peak_bytes: Option<u64>,
    /// Where `gpu_peak_bytes` comes from: `reported` by the system, or `nvidia-smi` (whole-GPU
    /// `memory.used` sampled every 0.25 s by the harness).
    pub gpu_peak_source: Option<String>,
    /// Bytes copied host to device per step.
    pub h2d_bytes_per_step: Option<f64>,
    /// Bytes copied device to host per step.
    pub d2h_bytes_per_step: Option<f64>,
    /// CPU optimizer stream busy time / step time.
    pub host_busy_frac: Option<f64>,
    /// Upload stream busy fraction.
    pub h2d_busy_frac: Option<f64>,
    /// Compute stream busy fraction.
    pub compute_busy_frac: Option<f64>,
    /// Download stream busy fraction.
    pub d2h_busy_frac: Option<f64>,
}

/// Ours against a peer on the same (part, model, batch, seq, variant), same harness run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Ratio {
    /// Part of the suite.
    pub part: String,
    /// Model label.
    pub model: String,
    /// Sequences per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Variant.
    pub variant: String,
    /// `torch` or `deepspeed`; `ours-gpus1` in the scale suite (our engine on one GPU).
    pub peer: String,
    /// ours tokens/s ÷ peer tokens/s.
    pub tokens_per_s_ratio_ours_over_peer: f64,
}

impl Run {
    /// The stable key of a configuration.
    pub fn make_key(
        part: &str,
        system: &str,
        model: &str,
        batch: usize,
        seq: usize,
        variant: &str,
    ) -> String {
        format!("{part}/{system}/{model}/b{batch}x{seq}/{variant}")
    }
}

impl Results {
    /// Reads a results file and checks its schema version.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(io_err(path))?;
        let r: Results = serde_json::from_str(&text)
            .map_err(|e| Error::Parse { path: path.to_owned(), msg: format!("not a results file: {e}") })?;
        if r.schema_version != SCHEMA_VERSION {
            return Err(Error::Parse {
                path: path.to_owned(),
                msg: format!("schema_version {} (this harness reads {SCHEMA_VERSION})", r.schema_version),
            });
        }
        Ok(r)
    }

    /// Writes the file, pretty-printed.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Parse { path: path.to_owned(), msg: format!("cannot serialise: {e}") })?;
        std::fs::write(path, text + "\n").map_err(io_err(path))
    }

    /// Fills `ratios` from the `ok` runs: ours over each peer on the same configuration (each of
    /// our variants against the peer's own variant of that name, else its `default`).
    pub fn compute_ratios(&mut self) {
        self.ratios.clear();
        let ok = |r: &&Run| r.status == Status::Ok && r.measured.tokens_per_s.is_some_and(|t| t > 0.0);
        for ours in self.runs.iter().filter(ok).filter(|r| r.system == "ours") {
            for peer in self.runs.iter().filter(ok).filter(|r| r.system != "ours") {
                let same = (&peer.part, &peer.model, peer.batch_size, peer.seq_len)
                    == (&ours.part, &ours.model, ours.batch_size, ours.seq_len)
                    && (peer.variant == ours.variant
                        || (peer.variant == "default"
                            && !self.runs.iter().any(|r| {
                                r.status == Status::Ok
                                    && r.system == peer.system
                                    && r.variant == ours.variant
                                    && (&r.part, &r.model, r.batch_size, r.seq_len)
                                        == (&peer.part, &peer.model, peer.batch_size, peer.seq_len)
                            })));
                if let (true, Some(a), Some(b)) =
                    (same, ours.measured.tokens_per_s, peer.measured.tokens_per_s)
                {
                    self.ratios.push(Ratio {
                        part: ours.part.clone(),
                        model: ours.model.clone(),
                        batch_size: ours.batch_size,
                        seq_len: ours.seq_len,
                        variant: ours.variant.clone(),
                        peer: peer.system.clone(),
                        tokens_per_s_ratio_ours_over_peer: a / b,
                    });
                }
            }
        }
        // Scale: each GPU count against one GPU at the same model and batch (peer `ours-gpus1`;
        // efficiency is the ratio over the GPU count).
        for many in self.runs.iter().filter(ok).filter(|r| r.part == "scale" && r.variant != "gpus1") {
            let one = self.runs.iter().filter(ok).find(|r| {
                r.part == "scale"
                    && r.variant == "gpus1"
                    && (&r.model, r.batch_size, r.seq_len) == (&many.model, many.batch_size, many.seq_len)
            });
            if let (Some(one), Some(a)) = (one, many.measured.tokens_per_s) {
                if let Some(b) = one.measured.tokens_per_s {
                    self.ratios.push(Ratio {
                        part: many.part.clone(),
                        model: many.model.clone(),
                        batch_size: many.batch_size,
                        seq_len: many.seq_len,
                        variant: many.variant.clone(),
                        peer: "ours-gpus1".into(),
                        tokens_per_s_ratio_ours_over_peer: a / b,
                    });
                }
            }
        }
    }
}

fn command_stdout(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

impl Machine {
    /// This machine, read from /proc and `nvidia-smi`.
    pub fn detect() -> Self {
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| command_stdout("hostname", &[]))
            .map_or_else(|| "unknown".into(), |h| h.trim().to_owned());
        let ram_bytes = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
            Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
        });
        let gpu = command_stdout(
            "nvidia-smi",
            &["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        )
        .and_then(|s| parse_gpu_line(s.lines().next()?));
        Machine {
            hostname,
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            ram_bytes,
            gpu,
        }
    }

    /// A short name for directories: the GPU model (`h200`) or the host name.
    pub fn short_name(&self) -> String {
        let raw = match &self.gpu {
            Some(g) => g.name.split_whitespace().last().unwrap_or("gpu").to_owned(),
            None => self.hostname.clone(),
        };
        let s: String =
            raw.to_lowercase().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
        s.chars().take(24).collect()
    }
}

/// `NVIDIA H200, 580.159.04, 143771 MiB` → [`Gpu`].
pub fn parse_gpu_line(line: &str) -> Option<Gpu> {
    let mut f = line.split(',').map(str::trim);
    let (name, driver, mem) = (f.next()?, f.next()?, f.next());
    let memory_total_bytes = mem.and_then(|m| Some(m.strip_suffix("MiB")?.trim().parse::<u64>().ok()? << 20));
    Some(Gpu { name: name.to_owned(), driver_version: driver.to_owned(), memory_total_bytes })
}

impl Commit {
    /// `MT_COMMIT` when set (the binaries were built elsewhere, e.g. carried to a GPU machine
    /// whose copy of the repository is not the build's), else the git checkout around the
    /// current directory (None outside one).
    pub fn detect() -> Option<Self> {
        if let Some(hash) = std::env::var("MT_COMMIT").ok().filter(|h| !h.is_empty()) {
            return Some(Commit { hash, dirty: false });
        }
        let hash = command_stdout("git", &["rev-parse", "--short", "HEAD"])?;
        let dirty = command_stdout("git", &["status", "--porcelain"]).is_some_and(|s| !s.is_empty());
        Some(Commit { hash, dirty })
    }
}

/// Now, UTC, as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now_iso() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    utc_iso(secs)
}

/// Seconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ` (proleptic Gregorian calendar).
pub fn utc_iso(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
impl Run {
    /// A run for tests: 4 x 2048 tokens on cuda, the key made from the other fields.
    pub(crate) fn for_test(
        part: &str,
        system: &str,
        model: &str,
        variant: &str,
        status: Status,
        measured: Measured,
    ) -> Run {
        Run {
            key: Run::make_key(part, system, model, 4, 2048, variant),
            part: part.into(),
            system: system.into(),
            model: model.into(),
            model_config: None,
            batch_size: 4,
            seq_len: 2048,
            tokens_per_step: 4 * 2048,
            variant: variant.into(),
            device: "cuda".into(),
            status,
            reason: None,
            command: vec![],
            metrics_file: None,
            log_file: None,
            trace_file: None,
            wall_s: None,
            measured,
        }
    }
}

#[cfg(test)]
impl Results {
    /// Results of `runs` for tests.
    pub(crate) fn for_test(runs: Vec<Run>) -> Results {
        Results {
            schema_version: SCHEMA_VERSION,
            suite: "paper".into(),
            machine: Machine { hostname: "h".into(), cpus: 2, ram_bytes: None, gpu: None },
            commit: None,
            date: String::new(),
            config: serde_json::Value::Null,
            flops_formula: String::new(),
            runs,
            ratios: vec![],
            figures: vec![],
            attention: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_of_our_variants_is_compared_with_the_peers_default() {
        let run = |system: &str, variant: &str, tps: f64| {
            let m = Measured { tokens_per_s: Some(tps), ..Measured::default() };
            Run::for_test("throughput", system, "m", variant, Status::Ok, m)
        };
        let mut r = Results::for_test(vec![
            run("ours", "default", 300.0),
            run("ours", "streamed", 200.0),
            run("deepspeed", "default", 100.0),
        ]);
        r.compute_ratios();
        let got: Vec<(String, f64)> =
            r.ratios.iter().map(|x| (x.variant.clone(), x.tokens_per_s_ratio_ours_over_peer)).collect();
        assert_eq!(got, vec![("default".into(), 3.0), ("streamed".into(), 2.0)]);
        // A peer run of the same variant name is preferred to its default.
        r.runs.push(run("deepspeed", "streamed", 50.0));
        r.compute_ratios();
        let got: Vec<f64> = r.ratios.iter().map(|x| x.tokens_per_s_ratio_ours_over_peer).collect();
        assert_eq!(got, vec![3.0, 4.0]);
    }

    #[test]
    fn utc_iso_known_dates() {
        assert_eq!(utc_iso(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_iso(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_iso(1_795_865_543), "2026-11-28T11:32:23Z");
    }

    #[test]
    fn gpu_line_parses() {
        let g = parse_gpu_line("NVIDIA H200, 580.159.04, 143771 MiB").expect("parses");
        assert_eq!((g.name.as_str(), g.driver_version.as_str()), ("NVIDIA H200", "580.159.04"));
        assert_eq!(g.memory_total_bytes, Some(143_771 << 20));
    }
}

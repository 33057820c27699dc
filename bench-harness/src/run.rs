//! Launching one system as a subprocess and reading what it measured: the JSON Lines metrics
//! (megatrain's `--metrics` schema, `crates/megatrain/src/metrics.rs`; the baselines write the
//! same `run` / `step` records, plus `{"type": "error", "reason": ...}` when they cannot run)
//! and megatrain's Chrome trace of one step.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::schema::{Measured, Run, Status};

/// One subprocess to run and the run entry it fills in.
#[derive(Debug, Clone)]
pub struct Job {
    /// Identity of the run (status and measurements are filled in by [`execute`]).
    pub run: Run,
    /// Program to start.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// The metrics file the arguments point the system at.
    pub metrics: PathBuf,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
    /// The Chrome trace the arguments ask for, if any.
    pub trace: Option<PathBuf>,
    /// The program writes one JSON document (`metrics`), not training metrics: it ran when it
    /// exits 0 having written it (the kernel benchmark).
    pub document: bool,
    /// How many processes run it: 1, or a job of N processes with the same arguments, started
    /// on this machine as torchrun starts one (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`, `MASTER_ADDR` 127.0.0.1, `MASTER_PORT`): each process has its own host
    /// store and GPUs, as one host of a multi-host job would, but they share this machine's RAM
    /// and cores. Process 0 writes the metrics and `log`, process r its output to `log` with
    /// `.rank{r}` added.
    pub processes: usize,
}

impl Job {
    /// The command line, program first (for `--dry-run` and the results file).
    pub fn command(&self) -> Vec<String> {
        std::iter::once(self.program.display().to_string()).chain(self.args.iter().cloned()).collect()
    }
}

/// What a metrics file holds.
#[derive(Debug, Default, Clone)]
pub struct Metrics {
    /// The (last) `run` record.
    pub run: Option<Value>,
    /// `step` records in file order.
    pub steps: Vec<Value>,
    /// `eval` records (held-out loss) in file order.
    pub evals: Vec<Value>,
    /// The reason of an `error` record.
    pub error: Option<String>,
}

/// Parses JSON Lines metrics; records of other types are skipped.
pub fn parse_metrics(text: &str) -> Result<Metrics, String> {
    let mut m = Metrics::default();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("line {}: not JSON: {e}", i + 1))?;
        match v.get("type").and_then(Value::as_str) {
            Some("run") => m.run = Some(v),
            Some("step") => m.steps.push(v),
            Some("eval") => m.evals.push(v),
            Some("error") => {
                m.error = Some(v.get("reason").and_then(Value::as_str).unwrap_or("(no reason)").to_owned())
            }
            Some(_) => {}
            None => return Err(format!("line {}: a record without a string \"type\"", i + 1)),
        }
    }
    Ok(m)
}

fn mean(vals: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let (sum, n) = vals.flatten().fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

/// Summarises the steps after the first (all of them if there is only one): time-weighted
/// tokens/s and TFLOP/s, mean step time, bytes and busy fractions; peaks over every step.
pub fn summarize(m: &Metrics) -> Measured {
    let steps = if m.steps.len() > 1 { &m.steps[1..] } else { &m.steps[..] };
    let total_ms: f64 = steps.iter().filter_map(|s| num(s, "step_ms")).sum();
    let tokens: f64 = steps.iter().filter_map(|s| num(s, "tokens")).sum();
    let flop_ms: Option<f64> = steps.iter().map(|s| Some(num(s, "model_tflops")? * num(s, "step_ms")?)).sum();
    let peak = |key| m.steps.iter().filter_map(|s| s.get(key)?.as_u64()).max();
    let run = m.run.as_ref();
    let n_params = run.and_then(|r| r.get("n_params")?.as_u64());
    // The baselines also report the process high-water mark (`rss_peak_bytes`).
    let host_rss_peak_bytes = peak("rss_bytes").max(peak("rss_peak_bytes"));
    let gpu_peak_bytes = peak("gpu_peak_bytes");
    let field = |s: &str| mean(steps.iter().map(|v| num(v, s)));
    Measured {
        steps_measured: Some(steps.len()),
        n_params,
        num_hidden_layers: run.and_then(|r| {
            r.pointer("/model/num_hidden_layers").or_else(|| r.get("num_hidden_layers"))?.as_u64()
        }),
        system_version: run.and_then(|r| {
            ["megatrain_version", "deepspeed_version", "torch_version"]
                .iter()
                .find_map(|k| Some(format!("{k} {}", r.get(*k)?.as_str()?)))
        }),
        step_ms: (total_ms > 0.0).then(|| total_ms / steps.len() as f64),
        tokens_per_s: (total_ms > 0.0 && tokens > 0.0).then(|| tokens / total_ms * 1e3),
        model_tflops: flop_ms.filter(|_| total_ms > 0.0).map(|f| f / total_ms),
        loss_first: m.steps.first().and_then(|s| num(s, "loss")),
        loss_last: m.steps.last().and_then(|s| num(s, "loss")),
        host_rss_peak_bytes,
        host_rss_peak_bytes_per_param: host_rss_peak_bytes.zip(n_params).map(|(r, n)| r as f64 / n as f64),
        host_store_bytes_per_param: run.and_then(|r| num(r, "store_bytes_per_param")),
        gpu_peak_source: gpu_peak_bytes.map(|_| "reported".into()),
        gpu_peak_bytes,
        h2d_bytes_per_step: field("h2d_bytes"),
        d2h_bytes_per_step: field("d2h_bytes"),
        host_busy_frac: field("host_busy_frac"),
        h2d_busy_frac: field("h2d_busy_frac"),
        compute_busy_frac: field("compute_busy_frac"),
        d2h_busy_frac: field("d2h_busy_frac"),
    }
}

/// The last lines of a log (at most ~2000 characters): the reason of a failure.
pub fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut out = lines[lines.len().saturating_sub(15)..].join("\n");
    while out.len() > 2000 {
        out = out.split_once('\n').map_or_else(|| out[out.len() - 2000..].to_owned(), |(_, r)| r.to_owned());
    }
    out
}

fn gpu_used_bytes() -> Option<u64> {
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=memory.used", "--format=csv,noheader,nounits"])
        .output()
        .ok()?;
    let mib: u64 = String::from_utf8_lossy(&out.stdout).lines().next()?.trim().parse().ok()?;
    Some(mib << 20)
}

/// Starts process `r` of `job` with its output to `out` / `err` (a job of several processes: with
/// the launcher's variables; the port is this harness's own, so two suites on one machine do not
/// meet).
fn spawn(job: &Job, r: usize, out: File, err: File) -> std::io::Result<std::process::Child> {
    let mut cmd = Command::new(&job.program);
    cmd.args(&job.args).stdin(Stdio::null()).stdout(out).stderr(err);
    if job.processes > 1 {
        let n = job.processes.to_string();
        cmd.env("RANK", r.to_string()).env("WORLD_SIZE", &n).env("LOCAL_RANK", r.to_string());
        cmd.env("LOCAL_WORLD_SIZE", &n).env("MASTER_ADDR", "127.0.0.1");
        cmd.env("MASTER_PORT", (29500 + std::process::id() % 2000).to_string());
    }
    cmd.spawn()
}

/// A job's exit status as its failure reasons say it: "exit status: 1", or in a job of several
/// processes "process 1 of 2: exit status: 1".
struct Said {
    rank: usize,
    of: usize,
    status: std::process::ExitStatus,
}

impl Said {
    fn success(&self) -> bool {
        self.status.success()
    }
}

impl std::fmt::Display for Said {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.of {
            1 => write!(f, "{}", self.status),
            n => write!(f, "process {} of {n}: {}", self.rank, self.status),
        }
    }
}

/// Kills and reaps every process of a job still running.
fn stop(children: &mut [Option<std::process::Child>]) {
    for child in children.iter_mut().flatten() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn rel(path: &Path, base: &Path) -> String {
    path.strip_prefix(base).unwrap_or(path).display().to_string()
}

/// Runs `job` to completion (or `timeout`), sampling the GPU's memory if `sample_gpu`, and
/// returns its run entry: `ok` with measurements, or `failed` with the reason. Never panics
/// on what the subprocess does.
pub fn execute(job: &Job, out_dir: &Path, timeout: Duration, sample_gpu: bool) -> Run {
    let mut run = job.run.clone();
    run.command = job.command();
    run.metrics_file = Some(rel(&job.metrics, out_dir));
    run.log_file = Some(rel(&job.log, out_dir));
    let fail = |mut run: Run, reason: String| {
        run.status = Status::Failed;
        run.reason = Some(reason);
        run
    };
    // megatrain appends to its metrics file: start from an empty one.
    let _ = std::fs::remove_file(&job.metrics);
    let streams = File::create(&job.log).and_then(|f| Ok((f.try_clone()?, f)));
    let Ok((out, err)) = streams else {
        return fail(run, format!("cannot create log {}", job.log.display()));
    };
    let start = Instant::now();
    let mut children = Vec::with_capacity(job.processes.max(1));
    let mut first = Some((out, err));
    for r in 0..job.processes.max(1) {
        let child = match first.take() {
            Some((out, err)) => spawn(job, r, out, err),
            None => {
                let log = PathBuf::from(format!("{}.rank{r}", job.log.display()));
                match File::create(&log).and_then(|f| Ok((f.try_clone()?, f))) {
                    Ok((o, e)) => spawn(job, r, o, e),
                    Err(_) => {
                        stop(&mut children);
                        return fail(run, format!("cannot create log {}", log.display()));
                    }
                }
            }
        };
        match child {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                stop(&mut children);
                return fail(run, format!("cannot start {} (process {r}): {e}", job.program.display()));
            }
        }
    }
    let mut gpu_peak = None;
    // The job's status: process 0's when every process succeeded, else that of the first seen to
    // fail, with its rank (the others are stopped then: the job is over).
    let n = children.len();
    let mut statuses: Vec<Option<std::process::ExitStatus>> = vec![None; n];
    let (rank, status) = loop {
        for (r, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(Some(status)) => {
                    statuses[r] = Some(status);
                    *slot = None;
                }
                Ok(None) => {}
                Err(e) => {
                    stop(&mut children);
                    return fail(run, format!("waiting for process {r} failed: {e}"));
                }
            }
        }
        let failed =
            statuses.iter().enumerate().find_map(|(r, s)| s.filter(|s| !s.success()).map(|s| (r, s)));
        if let Some(f) = failed {
            stop(&mut children);
            break f;
        }
        if let Some(all) = statuses.iter().copied().collect::<Option<Vec<_>>>() {
            break (0, all[0]);
        }
        if sample_gpu {
            gpu_peak = gpu_peak.max(gpu_used_bytes());
        }
        if start.elapsed() > timeout {
            stop(&mut children);
            return fail(run, format!("timed out after {} s (--run-timeout-s)", timeout.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(if sample_gpu { 250 } else { 20 }));
    };
    run.wall_s = Some(start.elapsed().as_secs_f64());
    // The log of the process the status is of; a job of several names it.
    let rank_log =
        if rank == 0 { job.log.clone() } else { PathBuf::from(format!("{}.rank{rank}", job.log.display())) };
    let log_tail = tail(&std::fs::read_to_string(&rank_log).unwrap_or_default());
    let status = Said { rank, of: n, status };
    if job.document {
        return match (status.success(), job.metrics.is_file()) {
            (true, true) => {
                run.status = Status::Ok;
                run.reason = None;
                run
            }
            (true, false) => fail(run, format!("exited 0 but wrote no {}", job.metrics.display())),
            (false, _) => fail(run, format!("{status}; output ends:\n{log_tail}")),
        };
    }
    let metrics =
        std::fs::read_to_string(&job.metrics).map_err(|e| e.to_string()).and_then(|t| parse_metrics(&t));
    match (status.success(), metrics) {
        (_, Ok(Metrics { error: Some(reason), .. })) => fail(run, format!("{status}: {reason}")),
        (false, _) => fail(run, format!("{status}; output ends:\n{log_tail}")),
        (true, Err(e)) => fail(run, format!("metrics {}: {e}", job.metrics.display())),
        (true, Ok(m)) if m.steps.is_empty() => fail(run, "exited 0 but wrote no step records".into()),
        (true, Ok(m)) => {
            run.status = Status::Ok;
            run.reason = None;
            run.measured = summarize(&m);
            if run.measured.gpu_peak_bytes.is_none() && gpu_peak.is_some() {
                run.measured.gpu_peak_bytes = gpu_peak;
                run.measured.gpu_peak_source = Some("nvidia-smi".into());
            }
            run.trace_file = job.trace.as_ref().filter(|t| t.exists()).map(|t| rel(t, out_dir));
            run
        }
    }
}

/// One operation of a Chrome trace (`"ph": "X"` event).
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// Stream index (`tid`): 0 host, 1 h2d, 2 compute, 3 d2h.
    pub lane: usize,
    /// Operation category (`cat`, e.g. `Upload`).
    pub cat: String,
    /// Start since the step began.
    pub start_ms: f64,
    /// Duration.
    pub dur_ms: f64,
}

/// The complete events of megatrain's `--trace` file (µs in the file, ms here).
pub fn parse_trace(text: &str) -> Result<Vec<Span>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let events = v.get("traceEvents").and_then(Value::as_array).ok_or("no traceEvents array")?;
    Ok(events
        .iter()
        .filter(|e| e.get("ph").and_then(Value::as_str) == Some("X"))
        .filter_map(|e| {
            Some(Span {
                lane: e.get("tid")?.as_u64()? as usize,
                cat: e.get("cat").and_then(Value::as_str).unwrap_or("").to_owned(),
                start_ms: num(e, "ts")? / 1e3,
                dur_ms: num(e, "dur")? / 1e3,
            })
        })
        .collect())
}

/// Writes a line of progress (best effort: progress never fails a suite).
pub fn progress(w: &mut dyn Write, line: &str) {
    let _ = writeln!(w, "{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"{"type":"run","schema_version":1,"megatrain_version":"0.1.0","n_params":1000,"model":{"num_hidden_layers":4},"store_bytes_per_param":16.5}
{"type":"step","step":1,"loss":5.0,"tokens":100,"step_ms":900.0,"model_tflops":1.0,"rss_bytes":30000,"h2d_bytes":10,"d2h_bytes":20,"compute_busy_frac":0.1}
{"type":"eval","step":1,"eval_loss":4.0}
{"type":"step","step":2,"loss":4.0,"tokens":100,"step_ms":100.0,"model_tflops":2.0,"rss_bytes":20000,"h2d_bytes":10,"d2h_bytes":20,"compute_busy_frac":0.5}

{"type":"step","step":3,"loss":3.0,"tokens":100,"step_ms":300.0,"model_tflops":1.0,"rss_bytes":25000,"h2d_bytes":10,"d2h_bytes":40,"compute_busy_frac":0.7}
"#;

    #[test]
    fn metrics_parser_skips_warmup_and_weights_by_time() {
        let m = parse_metrics(SAMPLE).expect("parses");
        assert_eq!(m.steps.len(), 3);
        assert_eq!(m.evals.len(), 1);
        let s = summarize(&m);
        assert_eq!(s.steps_measured, Some(2));
        assert_eq!(s.step_ms, Some(200.0));
        assert!((s.tokens_per_s.expect("tokens/s") - 500.0).abs() < 1e-9);
        // (2*100 + 1*300) / 400
        assert!((s.model_tflops.expect("tflops") - 1.25).abs() < 1e-12);
        assert_eq!((s.loss_first, s.loss_last), (Some(5.0), Some(3.0)));
        assert_eq!(s.host_rss_peak_bytes, Some(30000));
        assert_eq!(s.host_rss_peak_bytes_per_param, Some(30.0));
        assert_eq!(s.d2h_bytes_per_step, Some(30.0));
        assert!((s.compute_busy_frac.expect("busy") - 0.6).abs() < 1e-12);
        assert_eq!(s.h2d_busy_frac, None);
        assert_eq!(s.num_hidden_layers, Some(4));
        assert_eq!(s.gpu_peak_bytes, None);
    }

    #[test]
    fn metrics_parser_reads_errors_and_refuses_garbage() {
        let m = parse_metrics(
            "{\"type\":\"run\",\"system\":\"deepspeed\"}\n{\"type\":\"error\",\"reason\":\"CUDA OOM\"}\n",
        )
        .expect("parses");
        assert_eq!(m.error.as_deref(), Some("CUDA OOM"));
        assert!(parse_metrics("{\"type\":\"step\"}\nnot json\n").unwrap_err().starts_with("line 2"));
        assert!(parse_metrics("{\"step\":1}\n").is_err());
    }

    #[test]
    fn trace_parser_keeps_complete_events() {
        let t = r#"{"traceEvents":[{"ph":"M","tid":0,"name":"thread_name"},
            {"ph":"X","tid":2,"cat":"Forward","ts":1500.0,"dur":250.0,"name":"Forward"}]}"#;
        let spans = parse_trace(t).expect("parses");
        assert_eq!(spans, vec![Span { lane: 2, cat: "Forward".into(), start_ms: 1.5, dur_ms: 0.25 }]);
    }

    #[test]
    fn tail_keeps_the_end() {
        let log: String = (0..100).map(|i| format!("line {i}\n")).collect();
        let t = tail(&log);
        assert!(t.ends_with("line 99") && t.starts_with("line 85"));
    }
}

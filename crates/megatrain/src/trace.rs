//! `--trace`: one training step as a Chrome trace (the "Trace Event Format" read by Perfetto
//! and `chrome://tracing`), so the overlap of the host, copy and compute streams can be seen.
//!
//! Layout of the file:
//! - `traceEvents`: first one `"ph": "M"` metadata event naming the process and one naming each
//!   stream's thread (`tid` = stream index: 0 `host` (CPU optimizer: `Stage*`/`Land*` ops),
//!   1 `h2d`, 2 `compute`, 3 `d2h`); then one complete event (`"ph": "X"`) per executed
//!   operation, with `name` = the operation, `cat` = its kind (the name's leading word, e.g.
//!   `Stage`, `Upload`, `Forward`), `ts`/`dur` in microseconds since the step began, `pid` 0,
//!   and `args.stream` = the stream's name.
//! - `displayTimeUnit`: `"ms"`.
//! - `otherData`: `step` (global step, 1-based), `step_s`, `h2d_bytes`, `d2h_bytes`.
//!
//! The file is written to a temporary file in the same directory and renamed into place, so an
//! error never leaves a half-written trace at the target path.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use mt_sched::program::Stream;
use mt_sched::StepReport;
use serde_json::{json, Value};

use mt_train::stream_name;

/// The streams in `tid` order.
pub const STREAMS: [Stream; 4] = [Stream::Host, Stream::H2D, Stream::Compute, Stream::D2H];

/// Thread id of a stream in the trace (its index in [`STREAMS`]).
pub fn stream_tid(s: Stream) -> usize {
    match s {
        Stream::Host => 0,
        Stream::H2D => 1,
        Stream::Compute => 2,
        Stream::D2H => 3,
    }
}

/// Category of an operation: the leading identifier of its name (`"Stage { .. }"` → `Stage`).
fn category(name: &str) -> &str {
    let end = name.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(name.len());
    &name[..end]
}

/// The trace of global step `step` (1-based) as a JSON value (see the module docs).
pub fn chrome_trace(report: &StepReport, step: u64) -> Value {
    let mut events = Vec::with_capacity(report.spans.len() + STREAMS.len() + 1);
    events.push(json!({
        "name": "process_name", "ph": "M", "pid": 0, "tid": 0,
        "args": { "name": format!("megatrain step {step}") },
    }));
    for s in STREAMS {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": stream_tid(s),
            "args": { "name": stream_name(s) },
        }));
    }
    for span in &report.spans {
        events.push(json!({
            "name": span.name,
            "cat": category(&span.name),
            "ph": "X",
            "ts": span.start_s * 1e6,
            "dur": (span.end_s - span.start_s) * 1e6,
            "pid": 0,
            "tid": stream_tid(span.stream),
            "args": { "stream": stream_name(span.stream) },
        }));
    }
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "step": step,
            "step_s": report.step_s,
            "h2d_bytes": report.h2d_bytes,
            "d2h_bytes": report.d2h_bytes,
        },
    })
}

/// Writes the Chrome trace of global step `step` (1-based) to `path`, replacing any file there.
/// Writes a temporary file beside `path` first and renames it, so on error `path` is untouched.
pub fn write_chrome_trace(path: &Path, report: &StepReport, step: u64) -> Result<()> {
    let tmp = temp_path(path)?;
    let written = write_json(&tmp, &chrome_trace(report, step)).and_then(|()| {
        std::fs::rename(&tmp, path).with_context(|| format!("cannot rename it to {}", path.display()))
    });
    if let Err(e) = written {
        // Best effort: the error that matters is the one returned.
        let _ = std::fs::remove_file(&tmp);
        return Err(e.context(format!("cannot write the trace {}", path.display())));
    }
    Ok(())
}

/// `dir/.name.tmp-<pid>` for `dir/name`.
fn temp_path(path: &Path) -> Result<PathBuf> {
    let Some(name) = path.file_name() else {
        bail!("--trace {}: expected a file path, found a directory", path.display());
    };
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    Ok(path.with_file_name(tmp_name))
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut out = BufWriter::new(file);
    serde_json::to_writer(&mut out, value).with_context(|| format!("writing {}", path.display()))?;
    out.write_all(b"\n").with_context(|| format!("writing {}", path.display()))?;
    let file = out
        .into_inner()
        .map_err(|e| e.into_error())
        .with_context(|| format!("writing {}", path.display()))?;
    file.sync_all().with_context(|| format!("syncing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use mt_sched::backend::Span;
    use mt_sched::stats::stream_stats;

    use super::*;

    fn span(stream: Stream, name: &str, start_s: f64, end_s: f64) -> Span {
        Span { stream, name: name.to_owned(), start_s, end_s }
    }

    fn report() -> StepReport {
        let spans = vec![
            span(Stream::Host, "Stage { unit: Layer(0), staging: Ring(0), update: true }", 0.0, 0.001),
            span(Stream::H2D, "Upload { unit: Layer(0), staging: Ring(0), slot: Ring(0) }", 0.001, 0.0015),
            span(Stream::Compute, "Forward { layer: 0, slot: 0 }", 0.0015, 0.004),
            span(Stream::D2H, "Download { unit: Layer(0) }", 0.004, 0.0045),
            span(Stream::Host, "Land { unit: Layer(0) }", 0.0045, 0.005),
        ];
        let step_s = 0.005;
        StepReport {
            loss: 5.5,
            grad_norm: 1.0,
            n_tokens: 64,
            n_targets: 60,
            step_s,
            h2d_bytes: 1234,
            d2h_bytes: 567,
            kept_bytes: 0,
            device_peak: None,
            streams: stream_stats(&spans, step_s),
            spans,
            skipped: None,
        }
    }

    #[test]
    fn a_written_trace_parses_back_with_every_span_and_thread_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        write_chrome_trace(&path, &report(), 7).unwrap();
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();

        let events = v["traceEvents"].as_array().unwrap();
        assert_eq!(events.len(), 5 + 1 + 4, "5 spans, a process name and 4 thread names");
        let spans: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(spans.len(), 5);

        let fwd = spans.iter().find(|e| e["cat"] == "Forward").expect("the forward span");
        assert_eq!(fwd["name"], "Forward { layer: 0, slot: 0 }");
        assert_eq!(fwd["tid"], 2);
        assert!((fwd["ts"].as_f64().unwrap() - 1500.0).abs() < 1e-6, "{fwd}");
        assert!((fwd["dur"].as_f64().unwrap() - 2500.0).abs() < 1e-6, "{fwd}");
        let cats: Vec<&str> = spans.iter().map(|e| e["cat"].as_str().unwrap()).collect();
        assert_eq!(cats, ["Stage", "Upload", "Forward", "Download", "Land"]);
        assert!(spans.iter().filter(|e| e["cat"] == "Stage" || e["cat"] == "Land").all(|e| e["tid"] == 0));

        let mut names: Vec<(u64, &str)> = events
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
            .map(|e| (e["tid"].as_u64().unwrap(), e["args"]["name"].as_str().unwrap()))
            .collect();
        names.sort_unstable();
        assert_eq!(names, [(0, "host"), (1, "h2d"), (2, "compute"), (3, "d2h")]);

        assert_eq!(v["displayTimeUnit"], "ms");
        assert_eq!(v["otherData"]["step"], 7);
        assert_eq!(v["otherData"]["step_s"], 0.005);
        assert_eq!(v["otherData"]["h2d_bytes"], 1234);
        assert_eq!(v["otherData"]["d2h_bytes"], 567);
        let leftovers: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(leftovers, ["t.json"], "no temporary file is left behind");
    }

    #[test]
    fn a_failed_write_leaves_no_file_behind() {
        let dir = tempfile::tempdir().unwrap();
        // The target is an existing directory: the rename fails after the temporary file was written.
        let target = dir.path().join("taken");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("keep"), "x").unwrap();
        let e = write_chrome_trace(&target, &report(), 1).expect_err("cannot replace a directory");
        assert!(format!("{e:#}").contains("taken"), "{e:#}");
        let mut left: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        assert_eq!(left, ["taken"], "the temporary file was removed");

        let missing = dir.path().join("no_such_dir").join("t.json");
        let e = write_chrome_trace(&missing, &report(), 1).expect_err("no directory");
        assert!(format!("{e:#}").contains("no_such_dir"), "{e:#}");
    }

    #[test]
    fn categories_are_the_leading_word() {
        assert_eq!(category("Stage { unit: Layer(1) }"), "Stage");
        assert_eq!(category("Embed"), "Embed");
        assert_eq!(category("EmbedBackward"), "EmbedBackward");
        assert_eq!(category(""), "");
    }
}

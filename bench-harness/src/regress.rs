//! `--suite regress`: compare a current results file with a baseline, run by run, matched by
//! the stable key (`part/system/model/bBATCHxSEQ/variant`), and fail on a throughput drop.

use std::io::Write;

use crate::schema::{Results, Status};

/// How one baseline run fared.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Within the threshold (or faster).
    Pass,
    /// tokens/s dropped by more than the threshold, or the run no longer succeeds.
    Regressed,
    /// Not in the current results (a different selection of systems or models).
    Missing,
}

/// One compared configuration.
#[derive(Debug, Clone)]
pub struct Row {
    /// The run's key.
    pub key: String,
    /// Baseline tokens/s.
    pub baseline_tokens_per_s: f64,
    /// Current tokens/s (None: missing or not `ok`).
    pub current_tokens_per_s: Option<f64>,
    /// `current / baseline - 1`.
    pub change: Option<f64>,
    /// Verdict.
    pub verdict: Verdict,
}

/// The comparison of two results files.
#[derive(Debug, Clone)]
pub struct Report {
    /// Relative drop that fails (0.05 = 5%).
    pub threshold: f64,
    /// One row per `ok` baseline run.
    pub rows: Vec<Row>,
    /// Notes (different machine, different suite).
    pub notes: Vec<String>,
}

impl Report {
    /// No run regressed (and at least one was compared).
    pub fn passed(&self) -> bool {
        self.rows.iter().all(|r| r.verdict != Verdict::Regressed)
            && self.rows.iter().any(|r| r.verdict == Verdict::Pass)
    }

    /// A table for humans.
    pub fn write(&self, w: &mut dyn Write) -> std::io::Result<()> {
        for n in &self.notes {
            writeln!(w, "note: {n}")?;
        }
        writeln!(w, "{:<56} {:>12} {:>12} {:>8}  verdict", "run", "base tok/s", "now tok/s", "change")?;
        for r in &self.rows {
            let now = r.current_tokens_per_s.map_or("-".into(), |t| format!("{t:.1}"));
            let ch = r.change.map_or("-".into(), |c| format!("{:+.1}%", 100.0 * c));
            writeln!(
                w,
                "{:<56} {:>12.1} {now:>12} {ch:>8}  {:?}",
                r.key, r.baseline_tokens_per_s, r.verdict
            )?;
        }
        let verdict = if self.passed() { "PASS" } else { "FAIL" };
        writeln!(w, "{verdict}: threshold {:.1}% drop in tokens/s", 100.0 * self.threshold)
    }
}

/// Compares `current` with `baseline`: every `ok` baseline run is looked up by key; a drop in
/// tokens/s by more than `threshold` (relative), or a run that is no longer `ok`, regresses.
pub fn compare(baseline: &Results, current: &Results, threshold: f64) -> Report {
    let mut notes = Vec::new();
    if baseline.suite != current.suite {
        notes.push(format!("suites differ: baseline {}, current {}", baseline.suite, current.suite));
    }
    let gpu = |r: &Results| r.machine.gpu.as_ref().map(|g| g.name.clone());
    if (baseline.machine.hostname.as_str(), gpu(baseline))
        != (current.machine.hostname.as_str(), gpu(current))
    {
        notes.push(format!(
            "machines differ: baseline {} ({:?}), current {} ({:?})",
            baseline.machine.hostname,
            gpu(baseline),
            current.machine.hostname,
            gpu(current)
        ));
    }
    let rows = baseline
        .runs
        .iter()
        .filter(|b| b.status == Status::Ok)
        .filter_map(|b| {
            let base = b.measured.tokens_per_s.filter(|t| *t > 0.0)?;
            let cur = current.runs.iter().find(|c| c.key == b.key);
            let now = cur.filter(|c| c.status == Status::Ok).and_then(|c| c.measured.tokens_per_s);
            let change = now.map(|n| n / base - 1.0);
            let verdict = match (cur, change) {
                (None, _) => Verdict::Missing,
                (Some(_), Some(c)) if c >= -threshold => Verdict::Pass,
                (Some(_), _) => Verdict::Regressed,
            };
            Some(Row {
                key: b.key.clone(),
                baseline_tokens_per_s: base,
                current_tokens_per_s: now,
                change,
                verdict,
            })
        })
        .collect();
    Report { threshold, rows, notes }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{Measured, Run};

    fn results(runs: &[(&str, Status, f64)]) -> Results {
        let run = |&(model, status, t): &(&str, Status, f64)| {
            let m = Measured { tokens_per_s: Some(t), ..Measured::default() };
            Run::for_test("throughput", "ours", model, "default", status, m)
        };
        Results::for_test(runs.iter().map(run).collect())
    }

    #[test]
    fn six_percent_drop_fails_four_percent_passes() {
        let base = results(&[("a", Status::Ok, 1000.0), ("b", Status::Ok, 500.0)]);
        let pass = compare(&base, &results(&[("a", Status::Ok, 960.0), ("b", Status::Ok, 600.0)]), 0.05);
        assert!(pass.passed(), "{pass:?}");
        let fail = compare(&base, &results(&[("a", Status::Ok, 940.0), ("b", Status::Ok, 500.0)]), 0.05);
        assert!(!fail.passed());
        assert_eq!(fail.rows[0].verdict, Verdict::Regressed);
        assert!((fail.rows[0].change.expect("change") + 0.06).abs() < 1e-12);
        assert_eq!(fail.rows[1].verdict, Verdict::Pass);
    }

    #[test]
    fn failed_run_regresses_missing_run_does_not() {
        let base = results(&[("a", Status::Ok, 1000.0), ("b", Status::Ok, 500.0)]);
        let r = compare(&base, &results(&[("a", Status::Failed, 0.0), ("b", Status::Ok, 500.0)]), 0.05);
        assert_eq!(r.rows[0].verdict, Verdict::Regressed);
        assert!(!r.passed());
        let r = compare(&base, &results(&[("b", Status::Ok, 500.0)]), 0.05);
        assert_eq!(r.rows[0].verdict, Verdict::Missing);
        assert!(r.passed());
        // Nothing compared at all is not a pass.
        assert!(!compare(&base, &results(&[]), 0.05).passed());
    }
}

//! What the user sees of a run: the [`CliObserver`] of `megatrain train`, which shows the setup
//! on stderr, the progress bar (indicatif, on stderr, hidden when stderr is not a terminal) and
//! log lines on stdout, writes the `--metrics` log and the `--trace` of one step, and aborts
//! where the `--abort-after-step` test hook says.
// The CLI is the one place in megatrain-rs that prints: libraries below it use tracing only.
#![allow(clippy::print_stdout)]

use std::fmt;

use indicatif::{ProgressBar, ProgressStyle};
use mt_train::{Event, Observer, ObserverResult, StepEvent};

use crate::cli::TrainArgs;
use crate::metrics::{self, MetricsLog};
use crate::trace::write_chrome_trace;

/// The progress bar and log lines of one training run.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
    log_every: usize,
    end_step: u64,
}

/// One step, as shown on the bar and in log lines.
#[derive(Debug, Clone, Copy)]
pub struct StepLine {
    /// Global step number after this step (1-based).
    pub step: u64,
    /// Loss of the step.
    pub loss: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens per second of the step.
    pub tokens_per_s: f64,
}

impl Progress {
    /// A bar for `steps` steps ending at global step `end_step`; a log line every `log_every`
    /// steps (0 = none).
    pub fn new(steps: usize, end_step: u64, log_every: usize) -> Self {
        let bar = ProgressBar::new(steps as u64);
        let style = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise} eta {eta}] {bar:30} {pos}/{len} steps  {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        Progress { bar, log_every, end_step }
    }

    /// Prints a line above the bar.
    pub fn note(&self, msg: impl fmt::Display) {
        self.bar.suspend(|| println!("{msg}"));
    }

    /// Advances the bar by one step.
    pub fn step(&self, s: &StepLine) {
        self.bar.set_message(format!("loss {:.4}  {:.0} tok/s", s.loss, s.tokens_per_s));
        self.bar.inc(1);
        let every = self.log_every as u64;
        // `checked_rem` is `None` for `--log-every 0` (no log lines).
        if every > 0 && (s.step.checked_rem(every) == Some(0) || s.step == self.end_step) {
            self.note(format_args!(
                "step {:>6}  loss {:.6}  lr {:.3e}  grad_norm {:.4}  {:.0} tok/s",
                s.step, s.loss, s.lr, s.grad_norm, s.tokens_per_s
            ));
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// The observer of `megatrain train`.
#[derive(Debug)]
pub struct CliObserver<'a> {
    args: &'a TrainArgs,
    /// The step of this invocation `--trace` records (1-based).
    trace_step: usize,
    /// From the run's start on.
    progress: Option<Progress>,
    metrics: Option<MetricsLog>,
}

impl<'a> CliObserver<'a> {
    /// The observer of a run of `args`, tracing step `trace_step` of it if `--trace` is given.
    pub fn new(args: &'a TrainArgs, trace_step: usize) -> Self {
        CliObserver { args, trace_step, progress: None, metrics: None }
    }

    fn note(&self, msg: impl fmt::Display) {
        match &self.progress {
            Some(p) => p.note(msg),
            None => println!("{msg}"),
        }
    }

    fn log(&mut self, record: &serde_json::Value) -> ObserverResult {
        if let Some(log) = &mut self.metrics {
            log.write(record)?;
        }
        Ok(())
    }
}

impl Observer for CliObserver<'_> {
    fn event(&mut self, event: &Event<'_>) -> ObserverResult {
        if event.is_setup() {
            eprintln!("{event}");
            return Ok(());
        }
        match event {
            Event::Started(s) => {
                let steps = (s.end_step - s.start_step) as usize;
                self.progress = Some(Progress::new(steps, s.end_step, self.args.log_every));
                self.note(event);
                if let Some(p) = &self.args.metrics {
                    self.metrics = Some(MetricsLog::open(p)?);
                    self.log(&metrics::run_record(self.args, s))?;
                }
            }
            Event::Eval(e) => {
                self.note(event);
                self.log(&metrics::eval_record(e))?;
            }
            _ => {
                // The steps are over: the bar goes, the rest are log lines.
                if let Some(p) = &self.progress {
                    p.finish();
                }
                self.note(event);
            }
        }
        Ok(())
    }

    fn step(&mut self, s: &StepEvent<'_>) -> ObserverResult {
        let r = s.report;
        self.log(&metrics::step_record(s, mt_train::host::rss_bytes()))?;
        if let (Some(path), true) = (&self.args.trace, s.steps_done == self.trace_step as u64) {
            write_chrome_trace(path, r, s.step)?;
            self.note(format_args!(
                "trace of step {} ({} operations) written to {}",
                s.step,
                r.spans.len(),
                path.display()
            ));
        }
        if let Some(p) = &self.progress {
            p.step(&StepLine {
                step: s.step,
                loss: r.loss,
                lr: s.lr,
                grad_norm: r.grad_norm,
                tokens_per_s: s.tokens_per_s(),
            });
        }
        if let Some(k) = &r.skipped {
            let lean = if k.units_updated > 0 {
                format!(
                    "; lean mode: the {} units with a finite gradient were updated as it landed, the {} others not",
                    k.units_updated,
                    k.not_finite.len()
                )
            } else {
                " (no update applied)".to_owned()
            };
            self.note(format_args!(
                "step {} skipped: {}{lean}; {} in a row (--max-skipped-steps {}), {} in the run",
                s.step, k.cause, s.skipped_in_row, self.args.max_skipped_steps, s.skipped_steps
            ));
        }
        if let Some(e) = &s.eval {
            self.note(e);
            self.log(&metrics::eval_record(e))?;
        }
        if let Some(c) = &s.checkpoint {
            self.note(format_args!("step {}: checkpoint {} ({:.1} s)", s.step, c.manifest.display(), c.secs));
        }
        if self.args.abort_after_step == Some(s.step) {
            self.note(format_args!("--abort-after-step {}: aborting", s.step));
            std::process::abort();
        }
        Ok(())
    }
}

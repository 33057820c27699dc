//! What the user sees: the progress bar (indicatif, on stderr, hidden when stderr is not a
//! terminal), periodic log lines and the final summary (on stdout).
// The CLI is the one place in megatrain-rs that prints: libraries below it use tracing only.
#![allow(clippy::print_stdout)]

use std::fmt;
use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use mt_sched::stats::StreamStats;

use crate::metrics::stream_name;

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
        let style =
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} steps  {msg}")
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

/// What a training run did, printed at its end.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// Where the model came from.
    pub model: String,
    /// Model parameters.
    pub n_params: usize,
    /// Decoder layers.
    pub n_layers: usize,
    /// Global step the run started at.
    pub start_step: u64,
    /// Global step the run ended at (after the final pending update).
    pub end_step: u64,
    /// Loss of the first step of this run.
    pub first_loss: f64,
    /// Loss of the last step of this run.
    pub last_loss: f64,
    /// Tokens per step.
    pub tokens_per_step: usize,
    /// Sum of the step times.
    pub train_s: f64,
    /// Wall time of the whole run (setup, init and final update included).
    pub wall_s: f64,
    /// Host store size.
    pub store_bytes: usize,
    /// Host store bytes per parameter.
    pub store_bytes_per_param: f64,
    /// Backing file of the store (`None` = anonymous memory).
    pub store_path: Option<PathBuf>,
    /// Host-to-device bytes of the last step.
    pub h2d_bytes_per_step: u64,
    /// Device-to-host bytes of the last step.
    pub d2h_bytes_per_step: u64,
    /// Per-stream statistics of the last step.
    pub last_streams: Vec<StreamStats>,
}

impl TrainSummary {
    /// Steps run.
    pub fn steps(&self) -> u64 {
        self.end_step - self.start_step
    }

    /// Mean throughput: all tokens over the summed step times.
    pub fn tokens_per_s(&self) -> f64 {
        if self.train_s > 0.0 {
            (self.steps() as usize * self.tokens_per_step) as f64 / self.train_s
        } else {
            0.0
        }
    }

    /// Prints the summary to stdout.
    pub fn print(&self) {
        print!("{self}");
    }
}

fn mb(bytes: f64) -> String {
    format!("{:.2} MB", bytes / 1e6)
}

impl fmt::Display for TrainSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "trained {} steps (global steps {}..={}) of {} ({} parameters, {} layers) in {:.1} s",
            self.steps(),
            self.start_step + 1,
            self.end_step,
            self.model,
            self.n_params,
            self.n_layers,
            self.wall_s
        )?;
        writeln!(f, "loss: first {:.6} last {:.6}", self.first_loss, self.last_loss)?;
        writeln!(
            f,
            "throughput: {:.0} tokens/s mean ({} tokens/step, {:.1} ms/step)",
            self.tokens_per_s(),
            self.tokens_per_step,
            1e3 * self.train_s / self.steps().max(1) as f64
        )?;
        let place = match &self.store_path {
            Some(p) => format!("file {}", p.display()),
            None => "anonymous memory".to_owned(),
        };
        writeln!(
            f,
            "host store: {}, {:.2} bytes/param ({place})",
            mb(self.store_bytes as f64),
            self.store_bytes_per_param
        )?;
        writeln!(
            f,
            "pcie per step: h2d {}, d2h {}",
            mb(self.h2d_bytes_per_step as f64),
            mb(self.d2h_bytes_per_step as f64)
        )?;
        let streams: Vec<String> = self
            .last_streams
            .iter()
            .map(|s| {
                format!(
                    "{} busy {:.1}% max gap {:.2} ms",
                    stream_name(s.stream),
                    100.0 * s.busy_frac,
                    1e3 * s.max_gap_s
                )
            })
            .collect();
        writeln!(f, "streams (last step): {}", streams.join(" | "))
    }
}

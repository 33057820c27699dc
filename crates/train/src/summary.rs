//! What a run did: the summary a [`crate::Trainer`] returns (printed by `megatrain train` at the
//! end of a run, in the words of its device), with the per-step totals and per-stream means
//! ([`StepTotals`]) it reports.

use std::fmt;
use std::path::PathBuf;

use mt_sched::placement::DeviceKind;
use mt_sched::program::Stream;
use mt_sched::{DevicePeak, StepReport};

/// Short name of a stream, as used in metrics field names and the summary.
pub fn stream_name(s: Stream) -> &'static str {
    match s {
        Stream::Host => "host",
        Stream::H2D => "h2d",
        Stream::Compute => "compute",
        Stream::D2H => "d2h",
    }
}

/// What a run's export writes into `--out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportKind {
    /// The model, as a Hugging Face model directory (config.json, safetensors, tokenizer).
    Model,
    /// A LoRA run's adapters, as peft's adapter directory (`adapter_config.json`,
    /// `adapter_model.safetensors`), without the base.
    Adapter,
    /// A LoRA run's base with its adapters merged in (`--merge`), as a Hugging Face model
    /// directory.
    Merged,
}

impl ExportKind {
    /// The export of a run: the model, or a LoRA run's (`lora`) adapter or, with `merge`, the
    /// merged model.
    pub fn of(lora: bool, merge: bool) -> Self {
        match (lora, merge) {
            (false, _) => ExportKind::Model,
            (true, false) => ExportKind::Adapter,
            (true, true) => ExportKind::Merged,
        }
    }

    /// What it is, in a few words.
    pub fn noun(self) -> &'static str {
        match self {
            ExportKind::Model => "the model",
            ExportKind::Adapter => "the LoRA adapter (peft's format)",
            ExportKind::Merged => "the model with its LoRA adapters merged in",
        }
    }

    /// What was written into `dir`, in a sentence's words.
    pub fn written_to(self, dir: &std::path::Path) -> String {
        let dir = dir.display();
        match self {
            ExportKind::Model => format!("model exported to {dir} (Hugging Face format)"),
            ExportKind::Adapter => format!(
                "LoRA adapter exported to {dir} (peft's format: adapter_config.json and adapter_model.safetensors, without the base; PeftModel.from_pretrained loads it over the base model)"
            ),
            ExportKind::Merged => {
                format!("model with its LoRA adapters merged in exported to {dir} (Hugging Face format)")
            }
        }
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
    /// Loss of the first step of this run that was not skipped.
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
    /// A LoRA run's frozen base in host memory, bytes (0 without LoRA).
    pub frozen_base_bytes: usize,
    /// How a LoRA run holds its frozen base (`None` without LoRA).
    pub frozen_base_dtype: Option<mt_core::BaseDtype>,
    /// The precision of the store's AdamW moments.
    pub optim_states: mt_core::StateDtype,
    /// Resident set size of the process at the end (`None` where it cannot be read).
    pub rss_bytes: Option<u64>,
    /// A store paged from its file (the disk tier): the pager's counters and the store's bytes
    /// in RAM at the end (`None`: the whole store is in RAM).
    pub paging: Option<(mt_store::PagingStats, u64)>,
    /// Model FLOPs per step (the planner's `6·N·T + attention`).
    pub flops_per_step: f64,
    /// Mean step time of the run's steps after the first (warm-up excluded); `None` for a
    /// one-step run.
    pub later_step_s: Option<f64>,
    /// Backing file of the store (`None` = anonymous memory).
    pub store_path: Option<PathBuf>,
    /// Host-to-device bytes per step, mean over the run's steps.
    pub h2d_bytes_per_step: f64,
    /// Device-to-host bytes per step, mean over the run's steps.
    pub d2h_bytes_per_step: f64,
    /// Host-to-device and device-to-host bytes of the run's last step: with GPU-updated layers
    /// a step that applies a pending update moves their state, which is what the plan counts; a
    /// step with none pending (a run's first, or the first after a checkpoint's flush) moves
    /// only weights.
    pub last_step_bytes: (u64, u64),
    /// Per-stream busy fractions and idle gaps, averaged over the run's steps.
    pub streams: Vec<StreamMean>,
    /// Host bytes the plan counted (store + staging/landing + process overhead; on the CPU also
    /// the device buffers), to set against the RSS: `megatrain estimate`'s host RAM.
    pub planned_host_bytes: u64,
    /// Forward activations kept for the backward (the most a step held), and what the plan
    /// counted for them.
    pub kept_bytes: (u64, u64),
    /// The device memory high-water marks (the CUDA memory pool's: every tensor the engine
    /// allocated, from setup to the last step; `None` on the CPU), and the device bytes the plan
    /// counted.
    pub device_peak: (Option<DevicePeak>, u64),
    /// Held-out losses `(global step, loss)`, in order.
    pub evals: Vec<(u64, f64)>,
    /// Steps of this run skipped for a non-finite loss or gradient norm (no update applied).
    pub skipped_steps: u64,
    /// Where the model was exported (`--out`).
    pub exported: Option<PathBuf>,
    /// What the export is (the model, a LoRA run's adapter or merged model).
    pub export_kind: ExportKind,
    /// The run was already complete and `exported` already held its export, left as it was.
    pub export_kept: bool,
    /// The device it ran on (the summary's wording).
    pub device: DeviceKind,
}

/// One stream's busy fraction and idle gaps, averaged over the steps of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamMean {
    /// Stream (`Host` is the CPU optimizer: staging casts, updates, gradient landing).
    pub stream: Stream,
    /// Mean over steps of the step's busy fraction (busy time / step time): the mean of the
    /// metrics log's `S_busy_frac` column.
    pub busy_frac: f64,
    /// Mean over steps of the step's longest idle gap between two operations.
    pub max_gap_s: f64,
    /// Longest idle gap between two operations in any step.
    pub worst_gap_s: f64,
}

/// Running sums of the per-step PCIe bytes and stream statistics of a run, for its summary.
#[derive(Debug, Clone, Default)]
pub struct StepTotals {
    steps: u64,
    h2d_bytes: u64,
    d2h_bytes: u64,
    /// The last step's bytes, (h2d, d2h).
    last: (u64, u64),
    /// The most bytes of kept activations a step held.
    kept_bytes: u64,
    /// The device's memory high-water marks, after the last step that reported them.
    device_peak: Option<DevicePeak>,
    /// Per stream: sums of busy fractions and of longest gaps, and the longest gap.
    streams: Vec<StreamMean>,
}

impl StepTotals {
    /// Adds one step.
    pub fn add(&mut self, r: &StepReport) {
        self.steps += 1;
        self.h2d_bytes += r.h2d_bytes;
        self.d2h_bytes += r.d2h_bytes;
        self.last = (r.h2d_bytes, r.d2h_bytes);
        self.kept_bytes = self.kept_bytes.max(r.kept_bytes);
        self.device_peak = self.device_peak.max(r.device_peak);
        for s in &r.streams {
            let i = match self.streams.iter().position(|t| t.stream == s.stream) {
                Some(i) => i,
                None => {
                    let zero =
                        StreamMean { stream: s.stream, busy_frac: 0.0, max_gap_s: 0.0, worst_gap_s: 0.0 };
                    self.streams.push(zero);
                    self.streams.len() - 1
                }
            };
            let t = &mut self.streams[i];
            t.busy_frac += s.busy_frac;
            t.max_gap_s += s.max_gap_s;
            t.worst_gap_s = t.worst_gap_s.max(s.max_gap_s);
        }
    }

    /// The most bytes of kept activations a step held.
    pub fn kept_bytes(&self) -> u64 {
        self.kept_bytes
    }

    /// The device memory high-water marks, where the backend measures them.
    pub fn device_peak(&self) -> Option<DevicePeak> {
        self.device_peak
    }

    /// Steps added.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    fn mean(&self, sum: f64) -> f64 {
        if self.steps > 0 {
            sum / self.steps as f64
        } else {
            0.0
        }
    }

    /// Mean host-to-device bytes per step (0 before any step).
    pub fn h2d_bytes_per_step(&self) -> f64 {
        self.mean(self.h2d_bytes as f64)
    }

    /// The last step's (h2d, d2h) bytes ((0, 0) before any step).
    pub fn last_step_bytes(&self) -> (u64, u64) {
        self.last
    }

    /// Mean device-to-host bytes per step (0 before any step).
    pub fn d2h_bytes_per_step(&self) -> f64 {
        self.mean(self.d2h_bytes as f64)
    }

    /// Per-stream means, in the order the streams first appeared.
    pub fn stream_means(&self) -> Vec<StreamMean> {
        self.streams
            .iter()
            .map(|t| StreamMean {
                busy_frac: self.mean(t.busy_frac),
                max_gap_s: self.mean(t.max_gap_s),
                ..*t
            })
            .collect()
    }
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
}

fn mb(bytes: f64) -> String {
    mt_core::units::bytes(bytes)
}

impl fmt::Display for TrainSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.steps() == 0 {
            writeln!(
                f,
                "nothing to train: the run of {} ({} parameters, {} layers) is complete at global step {}",
                self.model, self.n_params, self.n_layers, self.end_step
            )?;
            return match (&self.exported, self.export_kept) {
                (Some(out), true) => {
                    writeln!(f, "its export in {} is of that step: left as it is", out.display())
                }
                (Some(out), false) => writeln!(f, "{}", self.export_kind.written_to(out)),
                (None, _) => Ok(()),
            };
        }
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
        if self.skipped_steps > 0 {
            writeln!(
                f,
                "skipped steps: {} (a non-finite loss or gradient norm; no update applied)",
                self.skipped_steps
            )?;
        }
        writeln!(
            f,
            "throughput: {:.0} tokens/s mean ({} tokens/step, {:.1} ms/step)",
            self.tokens_per_s(),
            self.tokens_per_step,
            1e3 * self.train_s / self.steps().max(1) as f64
        )?;
        if let Some(t) = self.later_step_s {
            writeln!(
                f,
                "steady state (steps after the first): {:.1} ms/step, {:.0} tokens/s, {:.1} model TFLOP/s",
                1e3 * t,
                self.tokens_per_step as f64 / t,
                self.flops_per_step / t / 1e12
            )?;
        }
        let place = match &self.store_path {
            Some(p) => format!("file {}", p.display()),
            None => "anonymous memory".to_owned(),
        };
        writeln!(
            f,
            "host store: {}, {:.2} bytes/param ({} optimizer states, {place})",
            mb(self.store_bytes as f64),
            self.store_bytes_per_param,
            self.optim_states
        )?;
        if let Some(dtype) = self.frozen_base_dtype {
            writeln!(
                f,
                "frozen base: {} in host memory ({dtype}; the store above is the adapters')",
                mb(self.frozen_base_bytes as f64)
            )?;
        }
        if let Some((p, in_ram)) = self.paging {
            writeln!(
                f,
                "disk tier: {} of the store in RAM at the end; over the run (setup included) {} \
                 read ahead in {:.2} s, {} dropped (dirty pages written first) in {:.2} s; {} \
                 records touched before they were read in; the step waited {:.2} s for write-back{}",
                mb(in_ram as f64),
                mb(p.read_ahead_bytes as f64),
                p.read_ahead_s,
                mb(p.evicted_bytes as f64),
                p.write_back_s,
                p.misses,
                p.stalled_s,
                if p.errors > 0 {
                    format!("; {} advice calls failed (page faults did their work)", p.errors)
                } else {
                    String::new()
                }
            )?;
        }
        if let Some(rss) = self.rss_bytes {
            writeln!(
                f,
                "host RSS at end: {} = {:.2} bytes/param (store, {}, code, allocator); \
                 the plan (and `megatrain estimate`) counted {}: RSS is {:.1}% of it",
                mb(rss as f64),
                rss as f64 / self.n_params.max(1) as f64,
                match self.device {
                    DeviceKind::Gpu => "pinned rings",
                    DeviceKind::Cpu => "rings and device buffers",
                },
                mb(self.planned_host_bytes as f64),
                100.0 * rss as f64 / self.planned_host_bytes.max(1) as f64
            )?;
        }
        if let (Some((s0, l0)), Some((s1, l1))) = (self.evals.first(), self.evals.last()) {
            writeln!(
                f,
                "eval loss: {l0:.6} at step {s0} -> {l1:.6} at step {s1} ({} evaluations)",
                self.evals.len()
            )?;
        }
        if let Some(out) = &self.exported {
            writeln!(f, "{}", self.export_kind.written_to(out))?;
        }
        let n = self.steps();
        let copies = match self.device {
            DeviceKind::Gpu => "PCIe per step",
            DeviceKind::Cpu => "copies per step between host and device buffers",
        };
        writeln!(
            f,
            "{copies} (mean of {n} steps): h2d {}, d2h {}; last step: h2d {} B, d2h {} B",
            mb(self.h2d_bytes_per_step),
            mb(self.d2h_bytes_per_step),
            self.last_step_bytes.0,
            self.last_step_bytes.1
        )?;
        if self.kept_bytes != (0, 0) {
            writeln!(
                f,
                "kept activations (no recompute): {} at the loss; the plan counted {}",
                mb(self.kept_bytes.0 as f64),
                mb(self.kept_bytes.1 as f64)
            )?;
        }
        if let (Some(peak), planned) = self.device_peak {
            writeln!(
                f,
                "GPU memory in use at most: {}, held by the memory pool at most: {} (every tensor; not \
                 the CUDA context or library workspaces); the plan counted {}: in use {:.1}%, held \
                 {:.1}% of it",
                mb(peak.used as f64),
                mb(peak.reserved as f64),
                mb(planned as f64),
                100.0 * peak.used as f64 / planned.max(1) as f64,
                100.0 * peak.reserved as f64 / planned.max(1) as f64
            )?;
        }
        let streams: Vec<String> = self
            .streams
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
        writeln!(f, "streams (mean of {n} steps; host = CPU optimizer): {}", streams.join(" | "))?;
        if let Some(c) = self.streams.iter().find(|s| s.stream == Stream::Compute) {
            writeln!(
                f,
                "compute idle: {:.1}% of step time, longest gap {:.2} ms (mean per step), {:.2} ms (worst step)",
                100.0 * (1.0 - c.busy_frac).max(0.0),
                1e3 * c.max_gap_s,
                1e3 * c.worst_gap_s
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use mt_sched::backend::Span;
    use mt_sched::stats::stream_stats;

    use super::*;

    fn step(step_s: f64, compute: &[(f64, f64)], h2d_bytes: u64) -> StepReport {
        let spans: Vec<Span> = compute
            .iter()
            .map(|&(start_s, end_s)| Span { stream: Stream::Compute, name: "Forward".into(), start_s, end_s })
            .collect();
        StepReport {
            loss: 1.0,
            grad_norm: 1.0,
            n_tokens: 8,
            n_targets: 8,
            step_s,
            h2d_bytes,
            d2h_bytes: 2 * h2d_bytes,
            kept_bytes: 0,
            device_peak: Some(DevicePeak { used: h2d_bytes, reserved: 2 * h2d_bytes }),
            streams: stream_stats(&spans, step_s),
            spans,
            skipped: None,
        }
    }

    #[test]
    fn totals_average_busy_fractions_gaps_and_bytes_over_steps() {
        let mut t = StepTotals::default();
        // Step 1: compute busy 0.5 of 1 s, longest gap 0.3 s; step 2: busy 1.0 of 2 s, gap 0.
        t.add(&step(1.0, &[(0.0, 0.2), (0.5, 0.8)], 100));
        t.add(&step(2.0, &[(0.0, 2.0)], 300));
        assert_eq!(t.steps(), 2);
        assert_eq!(t.h2d_bytes_per_step(), 200.0);
        assert_eq!(t.d2h_bytes_per_step(), 400.0);
        let means = t.stream_means();
        assert_eq!(means.len(), 4, "every stream, even those without operations");
        let c = means.iter().find(|s| s.stream == Stream::Compute).unwrap();
        assert!((c.busy_frac - 0.75).abs() < 1e-12, "{c:?}");
        assert!((c.max_gap_s - 0.15).abs() < 1e-12, "{c:?}");
        assert!((c.worst_gap_s - 0.3).abs() < 1e-12, "{c:?}");
        let h = means.iter().find(|s| s.stream == Stream::Host).unwrap();
        assert_eq!((h.busy_frac, h.max_gap_s, h.worst_gap_s), (0.0, 0.0, 0.0));
        assert_eq!(StepTotals::default().h2d_bytes_per_step(), 0.0);
    }

    #[test]
    fn the_summary_shows_mean_stream_figures_and_compute_idle_time() {
        let mut t = StepTotals::default();
        t.add(&step(1.0, &[(0.0, 0.2), (0.5, 0.8)], 1_000_000));
        t.add(&step(2.0, &[(0.0, 2.0)], 3_000_000));
        let s = TrainSummary {
            model: "m".into(),
            n_params: 10,
            n_layers: 1,
            start_step: 0,
            end_step: 2,
            first_loss: 2.0,
            last_loss: 1.0,
            tokens_per_step: 8,
            train_s: 3.0,
            wall_s: 3.5,
            store_bytes: 140,
            store_bytes_per_param: 14.0,
            frozen_base_bytes: 0,
            frozen_base_dtype: None,
            optim_states: mt_core::StateDtype::F32,
            rss_bytes: Some(200),
            paging: None,
            flops_per_step: 8e12,
            later_step_s: Some(2.0),
            store_path: None,
            h2d_bytes_per_step: t.h2d_bytes_per_step(),
            d2h_bytes_per_step: t.d2h_bytes_per_step(),
            last_step_bytes: t.last_step_bytes(),
            streams: t.stream_means(),
            planned_host_bytes: 180,
            kept_bytes: (3_000_000, 3_000_000),
            device_peak: (t.device_peak(), 8_000_000),
            evals: vec![(1, 3.0), (2, 2.5)],
            skipped_steps: 2,
            exported: Some(PathBuf::from("/tmp/out")),
            export_kind: ExportKind::Model,
            export_kept: false,
            device: DeviceKind::Gpu,
        }
        .to_string();
        assert!(s.contains("counted 180 B: RSS is 111.1% of it"), "{s}");
        assert!(s.contains("eval loss: 3.000000 at step 1 -> 2.500000 at step 2 (2 evaluations)"), "{s}");
        assert!(s.contains("model exported to /tmp/out"), "{s}");
        assert!(s.contains("skipped steps: 2 (a non-finite loss or gradient norm"), "{s}");
        assert!(
            s.contains("kept activations (no recompute): 3.00 MB at the loss; the plan counted 3.00 MB"),
            "{s}"
        );
        assert!(
            s.contains("PCIe per step (mean of 2 steps): h2d 2.00 MB, d2h 4.00 MB; last step: h2d 3000000 B, d2h 6000000 B"),
            "{s}"
        );
        assert!(
            s.contains("GPU memory in use at most: 3.00 MB, held by the memory pool at most: 6.00 MB"),
            "{s}"
        );
        assert!(s.contains("the plan counted 8.00 MB: in use 37.5%, held 75.0% of it"), "{s}");
        assert!(
            s.contains("steady state (steps after the first): 2000.0 ms/step, 4 tokens/s, 4.0 model TFLOP/s"),
            "{s}"
        );
        assert!(s.contains("host RSS at end: 200 B = 20.00 bytes/param"), "{s}");
        assert!(s.contains("compute busy 75.0% max gap 150.00 ms"), "{s}");
        assert!(s.contains("compute idle: 25.0% of step time, longest gap 150.00 ms (mean per step), 300.00 ms (worst step)"), "{s}");
    }
}

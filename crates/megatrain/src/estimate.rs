//! `megatrain estimate`: what a run would need and how fast it would go, from the same planner
//! the trainer uses ([`mt_sched::plan::plan`]), without allocating anything.
//!
//! Memory is the planner's byte count, place by place. Host RAM adds what the process itself
//! holds besides the planned buffers (code, libraries, allocator, the CUDA context's host side):
//! [`PROCESS_OVERHEAD_CPU`] / [`PROCESS_OVERHEAD_CUDA`], measured as the RSS of runs minus their
//! planned bytes (`results/2026-11-22-real-use-h200x4.json`). On the CPU backend the device pool
//! is host memory too and is added; transients are not, so small CPU runs sit below or above the
//! figure by the size of their activations.
//!
//! Step time is a bound from three overlapped pipelines, each at a sustained rate the user can
//! override (defaults measured by this project on the H200 machine):
//! compute `= (6·N·T + attention + recompute) / tflops`, the recompute being each layer's forward
//! up to its down projection (`2·(N_layer - N_down)·T` per layer), PCIe `= max(H2D, D2H) bytes / bandwidth`, host
//! optimizer `= N / host_gparams`. The step takes the longest of the three plus the pipeline
//! fill (one layer's upload and one layer's optimizer work, which cannot overlap).

use anyhow::{Context, Result};
use mt_core::ModelLayout;
use mt_sched::plan::{plan, Plan, PlanInput};
use serde_json::{json, Value};

use crate::cli::{DeviceKind, EstimateArgs};
use crate::train::ModelSource;

/// RSS of a CPU run beyond its planned bytes (binary, libraries, allocator arenas): the
/// built-in tiny run holds 36 MB, 13 MB of it store.
pub const PROCESS_OVERHEAD_CPU: u64 = 24_000_000;
/// RSS of a CUDA run beyond its planned host bytes (binary, libraries, the CUDA context, cuBLAS
/// and NVRTC host-side state). Measured on the H200 machines (commit 80e8b16) as RSS at the end
/// minus store + staging/landing: 513 MB for Llama-3-8B, 524 MB for SmolLM2-135M.
pub const PROCESS_OVERHEAD_CUDA: u64 = 520_000_000;

/// Host RAM a run of `plan` holds while it trains: store + staging/landing + the process
/// overhead, less the resident units' gradient pages (given back once the engine has loaded
/// them), and on the CPU backend the device pool too (weight ring, outer slot, gradient buffers,
/// checkpoints; not the planner's GPU workspace reserve, which on the CPU is transient heap).
pub fn host_bytes(plan: &Plan, device: DeviceKind) -> u64 {
    let held = plan.host.total - plan.host.released_by_resident;
    match device {
        DeviceKind::Cuda => held + PROCESS_OVERHEAD_CUDA,
        DeviceKind::Cpu => held + plan.gpu.total - plan.gpu.workspace + PROCESS_OVERHEAD_CPU,
    }
}
/// Default GPU memory: one H200 as the driver reports it.
pub const DEFAULT_GPU_GIB: f64 = 139.8;

/// An estimate of a run.
#[derive(Debug, Clone)]
pub struct Estimate {
    /// The planner's answer.
    pub plan: Plan,
    /// Host RAM the process will hold, bytes.
    pub host_bytes: u64,
    /// Page-locked host RAM (CUDA), bytes.
    pub pinned_bytes: u64,
    /// Device memory, bytes (on the CPU backend: part of `host_bytes`).
    pub device_bytes: u64,
    /// Seconds per step of each pipeline: compute, PCIe, host optimizer.
    pub compute_s: f64,
    /// PCIe seconds per step (the busier direction).
    pub pcie_s: f64,
    /// Host optimizer seconds per step.
    pub host_s: f64,
    /// Expected seconds per step.
    pub step_s: f64,
}

fn gib_to_bytes(g: f64) -> u64 {
    (g * (1u64 << 30) as f64) as u64
}

/// Plans the run and prices it.
pub fn estimate(args: &EstimateArgs) -> Result<Estimate> {
    let model = ModelSource::from_args(args.model.as_deref(), args.config.as_deref())?;
    let cfg = &model.cfg;
    let host_avail = args.host_mem.map_or_else(crate::train::host_available_bytes, gib_to_bytes);
    let gpu = match args.device {
        DeviceKind::Cuda => gib_to_bytes(args.gpu_mem.unwrap_or(DEFAULT_GPU_GIB)),
        DeviceKind::Cpu => host_avail,
    };
    let p = plan(&PlanInput {
        cfg: cfg.clone(),
        batch: args.batch_size,
        seq: args.seq_len,
        weight_dtype: args.precision.into(),
        grad_dtype: crate::cli::default_grad_dtype(args.grad_dtype, args.precision).into(),
        mode: args.optim_mode.into(),
        gpu_bytes: gpu,
        host_bytes: host_avail,
        ring_depth: Some(args.ring_depth),
        n_chunks: args.chunks,
        rows_per_block: 4096,
        resident_outer: args.resident_outer.choice(args.device, false),
        resident_layers: args.resident_layers.choice(args.device, false),
    })
    .context("no memory plan fits")?;
    let pinned = if args.device == DeviceKind::Cuda { p.host.pinned } else { 0 };
    let host_bytes = host_bytes(&p, args.device);
    let layout = ModelLayout::new(cfg);
    let tokens = (args.batch_size * args.seq_len) as f64;
    // Model FLOPs plus the recomputed forward of every layer, which stops before down_proj.
    let down = layout.layer.get(mt_core::names::DOWN).map_or(0, |s| s.numel());
    let recompute = 2.0 * (layout.n_layers * (layout.layer.n_params() - down)) as f64 * tokens;
    let compute_s = (p.flops_per_step + recompute) / (args.tflops * 1e12);
    let pcie_s = p.pcie_h2d_per_step.max(p.pcie_d2h_per_step) as f64 / (args.pcie_gbs * 1e9);
    // The host optimizer updates the streamed units only: resident ones are updated on the GPU.
    let streamed_layers = layout.n_layers - p.resident_layers;
    let host_params = (streamed_layers * layout.layer.n_params()
        + if p.resident_outer { 0 } else { layout.outer.n_params() }) as f64;
    let host_s = host_params / (args.host_gparams * 1e9);
    // The first streamed layer's upload and update are not hidden behind anything.
    let fill = if streamed_layers > 0 {
        layout.layer.n_params() as f64 * (2.0 / (args.pcie_gbs * 1e9) + 1.0 / (args.host_gparams * 1e9))
    } else {
        0.0
    };
    let step_s = compute_s.max(pcie_s).max(host_s) + fill;
    Ok(Estimate {
        device_bytes: p.gpu.total,
        plan: p,
        host_bytes,
        pinned_bytes: pinned,
        compute_s,
        pcie_s,
        host_s,
        step_s,
    })
}

impl Estimate {
    /// The estimate as JSON (bytes and seconds; the plan's figures included).
    pub fn to_json(&self, args: &EstimateArgs) -> Value {
        let p = &self.plan;
        json!({
            "n_params": p.n_params,
            "batch_size": p.batch, "seq_len": p.seq, "n_chunks": p.n_chunks, "ring_depth": p.ring_depth,
            "host_bytes": self.host_bytes, "host_store_bytes": p.host.store, "host_staging_bytes": p.host.pinned,
            "host_peak_bytes": p.host.total, "host_released_by_resident_bytes": p.host.released_by_resident,
            "pinned_bytes": self.pinned_bytes, "device_bytes": self.device_bytes,
            "pcie_h2d_bytes_per_step": p.pcie_h2d_per_step, "pcie_d2h_bytes_per_step": p.pcie_d2h_per_step,
            "model_flops_per_step": p.flops_per_step,
            "compute_s": self.compute_s, "pcie_s": self.pcie_s, "host_optimizer_s": self.host_s,
            "step_s": self.step_s,
            "tokens_per_s": (p.batch * p.seq) as f64 / self.step_s,
            "model_tflops": p.flops_per_step / self.step_s / 1e12,
            "assumed": {"tflops": args.tflops, "pcie_gbs": args.pcie_gbs, "host_gparams": args.host_gparams},
        })
    }
}

impl std::fmt::Display for Estimate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let p = &self.plan;
        writeln!(f, "{p}")?;
        writeln!(
            f,
            "host RAM: {:.2} GiB ({:.2} bytes/param; store {:.2}, staging/landing {:.2}, process)",
            gib(self.host_bytes),
            self.host_bytes as f64 / p.n_params.max(1) as f64,
            gib(p.host.store),
            gib(p.host.pinned)
        )?;
        writeln!(
            f,
            "pinned RAM: {:.2} GiB   device memory: {:.2} GiB",
            gib(self.pinned_bytes),
            gib(self.device_bytes)
        )?;
        write!(
            f,
            "step time: {:.3} s (compute {:.3} s, PCIe {:.3} s, host optimizer {:.3} s) -> {:.0} tokens/s, {:.1} model TFLOP/s",
            self.step_s,
            self.compute_s,
            self.pcie_s,
            self.host_s,
            (p.batch * p.seq) as f64 / self.step_s,
            p.flops_per_step / self.step_s / 1e12
        )
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::cli::{Cli, Command};

    fn estimate_3_6b(extra: &[&str]) -> super::Estimate {
        let config =
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench-harness/configs/llama3-3.6b.json").to_string();
        let mut argv = vec!["megatrain", "estimate", "--config", &config, "--device", "cuda"];
        argv.extend(["--batch-size", "4", "--seq-len", "2048", "--gpu-mem", "139.8", "--host-mem", "120"]);
        argv.extend(extra);
        let Command::Estimate(args) = Cli::try_parse_from(argv).unwrap().command else { unreachable!() };
        super::estimate(&args).unwrap()
    }

    /// Resident units cost the host optimizer nothing: with every layer and the outer unit on
    /// an H200 the host's share of the step is zero; streamed, it counts every parameter.
    #[test]
    fn the_host_optimizer_time_counts_streamed_units_only() {
        let all = estimate_3_6b(&[]);
        assert_eq!((all.plan.resident_layers, all.plan.resident_outer), (28, true));
        assert_eq!(all.host_s, 0.0);
        let streamed = estimate_3_6b(&["--resident-layers", "0", "--resident-outer", "off"]);
        // The default host throughput: 2.5 Gparam/s.
        assert_eq!(streamed.host_s, streamed.plan.n_params as f64 / 2.5e9);
        assert!(streamed.step_s > all.step_s);
    }
}

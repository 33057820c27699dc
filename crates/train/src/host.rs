//! The host a run is on and the plan for it: memory available to the plan, the process's
//! resident set, the step planned for a configuration ([`plan_for`]) and the host RAM a plan
//! will hold (the figure a run's RSS is set against, and `megatrain estimate` prints).

use mt_core::ModelConfig;
use mt_sched::plan::{plan, Plan, PlanInput};

use crate::error::{Context, Result};
use crate::{Device, TrainConfig};

/// RSS of a CPU run beyond its planned bytes (binary, libraries, allocator arenas): the
/// built-in tiny run holds 36 MB, 13 MB of it store.
pub const PROCESS_OVERHEAD_CPU: u64 = 24_000_000;
/// RSS of a CUDA run beyond its planned host bytes (binary, libraries, the CUDA context, cuBLAS
/// and NVRTC host-side state), measured as RSS at the end minus store + staging/landing, about
/// the same for an 8B and a 135M model (docs/decisions/0041).
pub const PROCESS_OVERHEAD_CUDA: u64 = 520_000_000;

/// Host RAM a run of `plan` holds while it trains: store + staging/landing + the process
/// overhead, less the resident units' gradient pages (given back once the engine has loaded
/// them), and on the CPU backend the device pool too (weight ring, outer slot, gradient buffers,
/// checkpoints; not the planner's GPU workspace reserve, which on the CPU is transient heap).
pub fn planned_host_bytes(plan: &Plan, device: Device) -> u64 {
    let held = plan.host.total - plan.host.released_by_resident;
    match device {
        Device::Cuda => held + PROCESS_OVERHEAD_CUDA,
        Device::Cpu => held + plan.gpu.total - plan.gpu.workspace + PROCESS_OVERHEAD_CPU,
    }
}

/// Host memory available: MemAvailable of /proc/meminfo (no limit where that cannot be read).
pub fn available_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            let line = t.lines().find(|l| l.starts_with("MemAvailable:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
        })
        .unwrap_or(u64::MAX)
}

/// Resident set size of this process in bytes (Linux; `None` elsewhere).
pub fn rss_bytes() -> Option<u64> {
    let t = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = t.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// `g` GiB in bytes.
pub fn gib_to_bytes(g: f64) -> u64 {
    (g * (1u64 << 30) as f64) as u64
}

/// Which of our kernels the device runs, as the planner prices them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceKernels {
    /// The fused bf16 kernels (`mt_layers::fused_kernels`).
    pub fused: bool,
    /// Flash attention on the Hopper kernels (`mt_layers::hopper_attention`).
    pub hopper_attention: bool,
    /// A mixture of experts on the device MoE kernels (`mt_layers::moe_kernels_apply`).
    pub moe: bool,
}

/// The step `c` asks for, planned for a device of `device_bytes` (the GPU's; on the CPU, host
/// memory) and a host of `host_bytes`, with the `kernels` the device runs; the placement's
/// `auto`s resolved for `c.device` and its store.
pub fn plan_for(
    c: &TrainConfig,
    cfg: &ModelConfig,
    device_bytes: u64,
    host_bytes: u64,
    kernels: DeviceKernels,
) -> Result<Plan> {
    let reserve = paged_reserve(c, cfg);
    let p = plan_with(c, cfg, (device_bytes, host_bytes, reserve), kernels)?;
    if p.host.store_window.is_none() {
        return Ok(p);
    }
    if c.ranks() > 1 {
        return Err(crate::Error::Options(format!(
            "data parallel over {} GPUs with a store paged from its file (larger than --host-mem): data parallel keeps the whole store in RAM; give it more --host-mem or train on one GPU",
            c.ranks()
        )));
    }
    if c.device == Device::Cpu {
        // The CPU backend's device buffers (its compute's transient heap included) are host
        // memory too: planned again with them left out of the window.
        return plan_with(c, cfg, (device_bytes, host_bytes, reserve + p.gpu.total), kernels);
    }
    Ok(p)
}

/// Host bytes a paged store's window leaves to the rest of the run: the process (code, CUDA
/// context, allocator), a checkpoint's pipelined writes (two records of the snapshot file) and
/// the export's one tensor in f32 at a time with its narrowed copy.
fn paged_reserve(c: &TrainConfig, cfg: &ModelConfig) -> u64 {
    let layout = mt_core::ModelLayout::trainable(cfg);
    let record = mt_sched::plan::largest_record(&layout, c.grad_dtype(), c.optim_states);
    let process = match c.device {
        Device::Cuda => PROCESS_OVERHEAD_CUDA,
        Device::Cpu => PROCESS_OVERHEAD_CPU,
    };
    let snapshots = if c.save_every > 0 { 2 * record } else { 0 };
    // The largest tensor of the model (a LoRA run's base included: `--merge` exports it).
    let tensor = mt_core::ModelLayout::new(cfg)
        .all_params()
        .iter()
        .map(|(_, _, t)| t.numel() as u64)
        .max()
        .unwrap_or(0);
    let export = if c.out.is_some() { tensor * (4 + 4) } else { 0 };
    process + snapshots + export
}

/// [`plan_for`]'s planner call: `(device, host, reserved)` bytes.
fn plan_with(
    c: &TrainConfig,
    cfg: &ModelConfig,
    bytes: (u64, u64, u64),
    kernels: DeviceKernels,
) -> Result<Plan> {
    let (device_bytes, host_bytes, host_reserved) = bytes;
    let mut placement = c.placement.for_run(c.device.kind(), c.store.is_some());
    if c.ranks() > 1 {
        // Data parallel keeps every optimizer state in the host store (checks.rs refused an
        // explicit request for these): the planner may not choose them.
        placement = placement.without_device_state();
    }
    plan(&PlanInput {
        cfg: cfg.clone(),
        // Each GPU plans for its share of the batch (the largest, where it does not divide).
        batch: c.batch_size.div_ceil(c.ranks().max(1)),
        seq: c.seq_len,
        weight_dtype: c.precision.dtype(),
        grad_dtype: c.grad_dtype(),
        state_dtype: c.optim_states,
        mode: c.optim_mode,
        gpu_bytes: device_bytes,
        host_bytes,
        ring_depth: Some(c.ring_depth),
        n_chunks: c.chunks,
        rows_per_block: c.rows_per_block,
        fused_kernels: kernels.fused,
        flash_attention: c.attention,
        hopper_attention: kernels.hopper_attention,
        moe_kernels: kernels.moe,
        mlp_rows: c.mlp_rows,
        store_file: c.store.is_some(),
        host_reserved,
        placement,
    })
    .context_with(|| {
        "no memory plan fits this machine (set --chunks, --batch-size, --gpu-mem or --host-mem)".into()
    })
}

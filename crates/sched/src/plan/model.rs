//! The planner's model of a streamed step's speed: the bandwidths it assumes (measured on the
//! H200 machines) and what it derives from them — the forward window that picks the GPU-updated
//! layers, and the backward's room for late state downloads: byte counts over assumed
//! bandwidths. A run prints what it measured beside the plan.

use crate::placement::Placement;

/// Host memory traffic of one parameter's fused AdamW update on the host, in bytes: gradient
/// (`g`), master, m and v read and written (`2·s`, with `s` bytes of them a parameter: 12 with
/// fp32 moments, 8 bf16, 6 8-bit: `mt_core::StateDtype::nominal_state_bytes`), the upload copy
/// written (`e`).
pub fn host_update_bytes(g: u64, e: u64, s: u64) -> u64 {
    g + 2 * s + e
}

/// The exact-mode forward window of a placement's `streamed` layers, of which `p.gpu_updated_layers`
/// are updated on the GPU, `p.late_state_downloads` of those download their state in the
/// backward and `p.early_state_uploads` others upload it in the step before's backward (bytes per
/// parameter of a layer over GB/s: nanoseconds per parameter): the longer of its host memory traffic at `host_gbs` and its
/// uploads at `upload_gbs`. Host memory: a host-updated parameter's [`host_update_bytes`] plus the
/// `e` its upload's DMA reads; a GPU-updated one's state DMA, `s + g` up unless early (master
/// and moments, `s` bytes, up in the step before's backward, the gradient copied on the device)
/// and `s` down unless late. Uploads: `e` per host-updated parameter, `s + g` per GPU-updated one
/// not early. (The forward's compute is not counted: at 4 x 2048 it is a fifth of the window.)
pub fn forward_window(
    streamed: usize,
    p: Placement,
    g: u64,
    e: u64,
    s: u64,
    host_gbs: f64,
    upload_gbs: f64,
) -> f64 {
    let gpu = p.gpu_updated_layers;
    let h = streamed.saturating_sub(gpu) as f64;
    let n = gpu.min(streamed) as f64;
    let l = p.late_state_downloads.min(gpu) as f64;
    let early = (p.early_state_uploads.min(gpu.saturating_sub(p.late_state_downloads))) as f64;
    let host =
        h * (host_update_bytes(g, e, s) + e) as f64 + (n - early) * (s + g) as f64 + (n - l) * s as f64;
    let up = h * e as f64 + (n - early) * (s + g) as f64;
    (host / host_gbs).max(up / upload_gbs)
}

/// How many late state downloads (`state` bytes each: a layer's master and moments) the
/// backward's D2H has time for beside the gradients (`grad_elem` bytes a parameter): the backward computes two thirds of
/// `flops` at [`BACKWARD_TFLOPS`], and its D2H may fill [`BACKWARD_D2H_SHARE`] of that at
/// [`PCIE_GBS`]. Only the part of the backward up to the last held layer counts (`held` of the
/// `streamed` layers' backward positions, with their gradients): a late download goes out no
/// later than its own layer's backward, and held layers are the last ones, the first backward.
pub fn late_download_capacity(
    flops: f64,
    streamed: usize,
    held: usize,
    layer_len: u64,
    grad_elem: u64,
    state: u64,
) -> usize {
    if streamed == 0 {
        return 0;
    }
    let share = held.min(streamed) as f64 / streamed as f64;
    let backward_s = flops * 2.0 / 3.0 / (BACKWARD_TFLOPS * 1e12) * share;
    let grads = (held.min(streamed) as u64 * layer_len * grad_elem) as f64;
    let room = backward_s * PCIE_GBS * 1e9 * BACKWARD_D2H_SHARE - grads;
    (room / state.max(1) as f64).max(0.0) as usize
}

/// How many early uploads (master and moments, `state` bytes each) the backward has room for
/// after `late` late downloads: as many as its H2D fills in [`BACKWARD_D2H_SHARE`] of it at
/// [`PCIE_GBS`], and its host memory at [`HOST_MEMORY_GBS`] beside the gradients' DMA and land
/// (`4 × grad_elem` a parameter: the DMA's write, the land's read, write and the write's read
/// for ownership) and the late downloads. The backward computes two thirds of `flops` at
/// [`BACKWARD_TFLOPS`]. None unless every streamed layer is held: the others' backward re-casts
/// take the backward's H2D.
pub fn early_upload_capacity(
    flops: f64,
    streamed: usize,
    held: usize,
    late: usize,
    layer_len: u64,
    grad_elem: u64,
    state: u64,
) -> usize {
    if streamed == 0 || held < streamed {
        return 0;
    }
    let backward_s = flops * 2.0 / 3.0 / (BACKWARD_TFLOPS * 1e12);
    let each = state.max(1) as f64;
    let h2d = backward_s * PCIE_GBS * 1e9 * BACKWARD_D2H_SHARE / each;
    let busy = (streamed as u64 * layer_len * 4 * grad_elem + late as u64 * state) as f64;
    let host = (backward_s * HOST_MEMORY_GBS * 1e9 - busy) / each;
    h2d.min(host).max(0.0) as usize
}

/// Host memory traffic the forward window sustains, CPU and DMA together, GB/s (the 16-core
/// H200 machine's, with and without state DMA beside the host's pass: docs/decisions/0041).
pub const HOST_MEMORY_GBS: f64 = 165.0;
/// Upload bandwidth of the GPU-updated layers' state beside the host's pass, GB/s: below PCIe's,
/// as the host's pass takes the memory bandwidth the DMA reads through (docs/decisions/0041).
pub const STATE_UPLOAD_GBS: f64 = 40.0;
/// PCIe bandwidth per direction the planner assumes, GB/s (the H200 machine's, PCIe Gen5).
pub const PCIE_GBS: f64 = 50.0;
/// Model TFLOP/s of the backward the planner assumes for a device it does not measure (an H200
/// on the 3.6B at 4 x 2048, every layer held and kept: 7.5 ms a layer, ~490).
pub const BACKWARD_TFLOPS: f64 = 450.0;
/// Share of the backward the late state downloads and the gradients may keep the D2H busy (and
/// the early state uploads the H2D).
pub const BACKWARD_D2H_SHARE: f64 = 0.85;

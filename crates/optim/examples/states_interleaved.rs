//! The host update pass with fp32, bf16 and 8-bit moments timed in interleaved rounds (exact
//! mode's pass: bf16 gradient, bf16 upload copy, as criterion's `adamw_states_64M` group), so that
//! a shared or noisy machine slows all three alike within a round: prints each round's Gparam/s
//! and, per round, bf16's and int8's throughput over fp32's, with their medians.
//!
//! ```text
//! cargo run --release -p mt-optim --example states_interleaved
//! ```
//!
//! Environment: `N` parameters (default 64Mi), `REPS` passes per measurement (2), `ROUNDS` (7),
//! `THREADS` of the rayon pool (default: all cores), `CPU_TIME=1` to divide by the process's
//! on-CPU seconds instead of wall seconds (per core-second: for a single thread on a machine
//! others load), `MEGATRAIN_HOST_SIMD=avx2|scalar` for a narrower instruction set.
#![allow(clippy::print_stdout)]

use std::time::Instant;

use half::bf16;
use mt_core::StateDtype;
use mt_optim::{step_fused, AdamW, Grad, Moments, StepArgs, Upload};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Seconds the process's threads have been on a CPU (`/proc/self/task/*/schedstat`).
fn on_cpu() -> f64 {
    let tasks = std::fs::read_dir("/proc/self/task").into_iter().flatten().flatten();
    let ns = tasks.filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok());
    ns.filter_map(|s| s.split_whitespace().next()?.parse::<f64>().ok()).sum::<f64>() * 1e-9
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    x[x.len() / 2]
}

/// One precision's buffers: master, moments (as 4-byte words) and its throughputs so far.
struct State {
    dtype: StateDtype,
    master: Vec<f32>,
    m: Vec<u32>,
    v: Vec<u32>,
    gparams: Vec<f64>,
}

fn main() {
    let (n, reps, rounds) = (env("N", 64 << 20), env("REPS", 2), env("ROUNDS", 7).max(1));
    let cpu_time = env("CPU_TIME", 0) == 1;
    if let Some(t) = std::env::var("THREADS").ok().and_then(|s| s.parse().ok()) {
        rayon::ThreadPoolBuilder::new().num_threads(t).build_global().expect("the rayon pool is built once");
    }
    println!(
        "{n} parameters, {reps} passes a measurement, {rounds} rounds, {} threads, vector kernels: {}, per {}",
        rayon::current_num_threads(),
        mt_optim::simd_name(),
        if cpu_time { "on-CPU second" } else { "wall second" }
    );
    // Deterministic, normal-range values (as the criterion bench's).
    let pattern = |scale: f32| (0..n).map(move |i| ((i % 1021) as f32 / 1021.0 - 0.5) * scale);
    let grad: Vec<bf16> = pattern(2e-2).map(bf16::from_f32).collect();
    let mut upload = vec![bf16::ZERO; n];
    let (h, a) = (AdamW::default(), StepArgs { step: 100, lr: 1e-4, grad_scale: 0.5 });
    let mut states: Vec<State> = StateDtype::ALL
        .into_iter()
        .map(|dtype| {
            let words = dtype.moment_bytes(n) / 4;
            State {
                dtype,
                master: pattern(2.0).collect(),
                m: vec![0; words],
                v: vec![0; words],
                gparams: vec![],
            }
        })
        .collect();
    // Round 0 warms the moments and the pages; it is not counted.
    for round in 0..=rounds {
        for s in &mut states {
            let (t0, c0) = (Instant::now(), on_cpu());
            for _ in 0..reps {
                let (m, v) = (bytemuck::cast_slice_mut(&mut s.m), bytemuck::cast_slice_mut(&mut s.v));
                let mom = Moments::from_bytes(s.dtype, n, m, v, 1).expect("the moments' buffers fit n");
                step_fused(&h, &a, Grad::Bf16(&grad), &mut s.master, mom, Upload::Bf16(&mut upload))
                    .expect("a valid step");
            }
            let secs = if cpu_time { on_cpu() - c0 } else { t0.elapsed().as_secs_f64() };
            if round > 0 {
                s.gparams.push((reps * n) as f64 / secs / 1e9);
            }
        }
    }
    for s in &states {
        let all: Vec<String> = s.gparams.iter().map(|g| format!("{g:.3}")).collect();
        println!(
            "{:5} median {:.3} Gparam/s, rounds [{}]",
            s.dtype.name(),
            median(s.gparams.clone()),
            all.join(", ")
        );
    }
    for s in &states[1..] {
        let r: Vec<f64> = s.gparams.iter().zip(&states[0].gparams).map(|(x, f)| x / f).collect();
        let all: Vec<String> = r.iter().map(|x| format!("{x:.3}")).collect();
        println!("{}/fp32 median {:.3}, rounds [{}]", s.dtype.name(), median(r.clone()), all.join(", "));
    }
}

#!/usr/bin/env python3
"""results.json of this folder from the runs' --metrics files (nothing typed by hand).

Steady state = the mean of the steps after the first. Both systems count model FLOPs by the one
formula over every parameter (6*N*T + 6*L*S*H*T), which over-counts a LoRA step's GEMM work (no
weight gradient of the base): compare tokens/s.
"""

import json
from pathlib import Path

here = Path(__file__).resolve().parent


def load(name):
    recs = [json.loads(l) for l in (here / f"{name}.jsonl").read_text().splitlines() if l.strip()]
    run = next(r for r in recs if r.get("type") == "run")
    steps = [r for r in recs if r.get("type") == "step"]
    later = steps[1:]
    mean = lambda k: sum(s[k] for s in later) / len(later)
    out = {
        "run": name,
        "steps": len(steps),
        "step_s": mean("step_ms") / 1e3,
        "tokens_per_s": mean("tokens_per_s"),
        "model_tflops": mean("model_tflops"),
        "gpu_peak_bytes": max(s["gpu_peak_bytes"] for s in steps),
        "losses": [s["loss"] for s in steps],
    }
    for k in ("compute_busy_frac", "host_busy_frac", "h2d_bytes"):
        if k in later[0]:
            out[k] = mean(k)
    if "rss_bytes" in later[0]:
        out["rss_bytes"] = max(s["rss_bytes"] for s in steps)
    out["batch_size"] = run.get("batch_size") or run["options"]["batch_size"]
    return out


runs = {n: load(n) for n in ("lora-16", "peft-16", "lora-4", "peft-4", "lora-16-streamed")}
ratios = {
    "16x2048 ours (base resident) / peft": runs["lora-16"]["tokens_per_s"] / runs["peft-16"]["tokens_per_s"],
    "4x2048 ours (base resident) / peft": runs["lora-4"]["tokens_per_s"] / runs["peft-4"]["tokens_per_s"],
    "16x2048 ours (base streamed, --gpu-mem 12) / peft (resident)":
        runs["lora-16-streamed"]["tokens_per_s"] / runs["peft-16"]["tokens_per_s"],
}
result = {
    "schema_version": 1,
    "suite": "LoRA speed (issue 35), by hand: ../2026-11-28-512k-two-steps-h200/job.sh",
    "commit": "f6cae5f",
    "machine": "one NVIDIA H200 (143771 MiB), 16-core Xeon, 128 GiB; driver 580.159.04, CUDA 13.0",
    "date": "2026-11-28",
    "config": "bench-harness/configs/llama3-8b.json (random bf16 base from the config), LoRA r 16 alpha 16 on "
              "the seven linear layers, seq 2048, 6 steps; ours: megatrain train --device cuda --precision bf16 "
              "--data synthetic --lora-rank 16; peer: scripts/baselines/peft_lora.py (transformers 5.17, peft "
              "0.21.2, torch 2.11, bf16 base resident, fp32 adapters, SDPA, gradient checkpointing, fused AdamW)",
    "runs": runs,
    "ratios_tokens_per_s": ratios,
}
(here / "results.json").write_text(json.dumps(result, indent=1) + "\n")
for n, r in runs.items():
    print(f"{n}: {r['step_s']:.3f} s/step, {r['tokens_per_s']:.0f} tokens/s, GPU peak {r['gpu_peak_bytes'] / 1e9:.1f} GB")
for k, v in ratios.items():
    print(f"{k}: {v:.2f}x")

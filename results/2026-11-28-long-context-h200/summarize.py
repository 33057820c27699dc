#!/usr/bin/env python3
"""results.json of this folder, from its metrics files and attention.json (nothing typed by hand).

Usage: summarize.py (in this folder). For each 7B run: steady step time (steps after the first),
model TFLOP/s by our causal formula (6*N*T + 6*L*s*hidden*T) and by MegaTrain's non-causal one
(6*N*T + 12*L*s*hidden*T), losses, GPU peak and host RSS against the plan (from the log's end lines).
For the kernel benchmark: fwd / bwd / fwd+bwd TFLOP/s and the ratios to cuDNN in the same process.
"""

import json
import re
from pathlib import Path

here = Path(__file__).resolve().parent
PUBLISHED_GH200_S = {262144: 236.0, 524288: 871.0}
TARGET_S = {131072: 50.0, 262144: 236.0, 524288: 871.0}


def run_summary(metrics, log):
    recs = [json.loads(l) for l in (here / metrics).read_text().splitlines() if l.strip()]
    run = next(r for r in recs if r.get("type") == "run")
    steps = [r for r in recs if "loss" in r]
    m = run["model"]
    n, t = run["n_params"], run["tokens_per_step"]
    s = run["options"]["seq_len"]
    attn_causal = 6 * m["num_hidden_layers"] * s * m["hidden_size"] * t
    steady = steps[1:] or steps
    step_s = sum(x["step_ms"] for x in steady) / len(steady) / 1e3
    text = (here / log).read_text()
    gpu = re.search(r"in use (\d+\.\d+)%, held (\d+\.\d+)% of it", text)
    rss = re.search(r"RSS is (\d+\.\d+)% of it", text)
    return {
        "seq_len": s,
        "steps": len(steps),
        "losses": [x["loss"] for x in steps],
        "step_s_each": [x["step_ms"] / 1e3 for x in steps],
        "steady_step_s": step_s,
        "target_s": TARGET_S.get(s),
        "published_gh200_s": PUBLISHED_GH200_S.get(s),
        "model_tflops_causal": (6 * n * t + attn_causal) / step_s / 1e12,
        "model_tflops_megatrain_noncausal": (6 * n * t + 2 * attn_causal) / step_s / 1e12,
        "gpu_peak_bytes": max(x["gpu_peak_bytes"] for x in steps),
        "gpu_in_use_pct_of_plan": float(gpu.group(1)),
        "gpu_held_pct_of_plan": float(gpu.group(2)),
        "host_rss_bytes": max(x["rss_bytes"] for x in steps),
        "host_rss_pct_of_plan": float(rss.group(1)),
        "optimizer": "fp32 master weights and fp32 AdamW moments (--optim-mode lean --grad-dtype none)",
    }


def kernel_summary():
    a = json.loads((here / "attention.json").read_text())
    out = []
    for b in a["bench"]:
        row = {k: b[k] for k in ("seq_len", "heads", "kv_heads", "head_dim")}
        sy = b["systems"]
        keys = ("fwd_tflops", "bwd_tflops", "fwd_bwd_tflops")
        for impl in ("hopper", "hopper_nondet", "cudnn"):
            row[impl] = {k: sy[impl][k] for k in keys}
        row["hopper_over_cudnn"] = {k: sy["hopper"][k] / sy["cudnn"][k] for k in keys}
        out.append(row)
    return {"machine": a["machine"], "date": a["date"], "checks": a["checks"], "bench": out}


result = {
    "schema_version": 1,
    "suite": "long-context (issue 32), by hand: job.sh",
    "commit": "22c832b",
    "machine": "one NVIDIA H200 (143771 MiB), 16-core Xeon, 128 GiB; driver 580.159.04, CUDA 13.0",
    "date": "2026-11-28",
    "config": "bench-harness/configs/qwen2.5-7b.json, --precision bf16 --data synthetic --batch-size 1 --optim-mode lean --grad-dtype none --lr 1e-4",
    "runs": [run_summary("m-7b-128k.jsonl", "7b-128k.log"), run_summary("m-7b-256k.jsonl", "7b-256k.log")],
    "kernel": kernel_summary(),
}
(here / "results.json").write_text(json.dumps(result, indent=1) + "\n")
for r in result["runs"]:
    print(f"{r['seq_len']}: {r['steady_step_s']:.1f} s/step (target {r['target_s']}), "
          f"{r['model_tflops_causal']:.1f} / {r['model_tflops_megatrain_noncausal']:.1f} TFLOP/s, "
          f"losses {[round(x, 4) for x in r['losses']]}, GPU {r['gpu_in_use_pct_of_plan']}% RSS {r['host_rss_pct_of_plan']}%")
for b in result["kernel"]["bench"]:
    h = b["hopper_over_cudnn"]
    print(b["seq_len"], b["heads"], b["kv_heads"], b["head_dim"], {k: round(v, 3) for k, v in h.items()})

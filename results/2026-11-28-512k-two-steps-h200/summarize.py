#!/usr/bin/env python3
"""results.json of this folder, from m-7b-512k.jsonl, 7b-512k.log and smi.csv (nothing typed by hand).

Per step (two steps, one run): step time, model TFLOP/s by our causal formula (6*N*T + 6*L*s*hidden*T) and by MegaTrain's
non-causal one (6*N*T + 12*L*s*hidden*T), the loss, the GPU pool's peak against the plan's total
and host RSS against the plan's host total (both from the log's placement lines).
"""

import json
import re
from pathlib import Path

here = Path(__file__).resolve().parent
GIB = 1024**3
recs = [json.loads(l) for l in (here / "m-7b-512k.jsonl").read_text().splitlines() if l.strip()]
run = next(r for r in recs if r.get("type") == "run")
steps = [r for r in recs if r.get("type") == "step"]
m = run["model"]
n, t, s = run["n_params"], run["tokens_per_step"], run["options"]["seq_len"]
attn = 6 * m["num_hidden_layers"] * s * m["hidden_size"] * t
log = (here / "7b-512k.log").read_text()
gpu_plan = float(re.search(r"GPU memory: .* total (\d+\.\d+) GiB of", log).group(1)) * GIB
host_plan = float(re.search(r"host memory: .* total (\d+\.\d+) GiB", log).group(1)) * GIB
smi = [l.split(", ") for l in (here / "smi.csv").read_text().splitlines()[1:]]
busy = [l for l in smi if len(l) == 4 and l[2].strip() == "100 %"]
runs = []
for x in steps:
    sec = x["step_ms"] / 1e3
    runs.append({
        "step": x["step"],
        "step_s": sec,
        "target_s": 871.0,
        "published_gh200_s": 871.0,
        "loss": x["loss"],
        "model_tflops_causal": (6 * n * t + attn) / sec / 1e12,
        "model_tflops_megatrain_noncausal": (6 * n * t + 2 * attn) / sec / 1e12,
        "compute_busy_frac": x["compute_busy_frac"],
        "gpu_peak_bytes": x["gpu_peak_bytes"],
        "gpu_peak_pct_of_plan": 100 * x["gpu_peak_bytes"] / gpu_plan,
        "host_rss_bytes": x["rss_bytes"],
        "host_rss_pct_of_plan": 100 * x["rss_bytes"] / host_plan,
    })
result = {
    "schema_version": 1,
    "suite": "long-context (issue 32), by hand: job.sh",
    "commit": "f6cae5f",
    "machine": "one NVIDIA H200 (143771 MiB), 16-core Xeon, 128 GiB; driver 580.159.04, CUDA 13.0",
    "date": "2026-11-28",
    "config": "bench-harness/configs/qwen2.5-7b.json, --seq-len 524288 --precision bf16 --data synthetic "
              "--batch-size 1 --optim-mode lean --grad-dtype none --lr 1e-4",
    "optimizer": "fp32 master weights and fp32 AdamW moments",
    "note": "both steps of one run of a release build of f6cae5f (the run of results/2026-11-28-512k-h200/ was cut after step 1); the job ran other things before and after it, one at a time (job.sh)",
    "store_bytes": run["store_bytes"],
    "gpu_util_100pct_samples": f"{len(busy)} of {len(smi)} (5 s apart, the whole job, other runs included)",
    "steps": runs,
}
(here / "results.json").write_text(json.dumps(result, indent=1) + "\n")
for r in runs:
    print(f"step {r['step']}: {r['step_s']:.1f} s (target {r['target_s']}), "
          f"{r['model_tflops_causal']:.1f} / {r['model_tflops_megatrain_noncausal']:.1f} TFLOP/s, "
          f"loss {r['loss']:.4f}, GPU peak {r['gpu_peak_pct_of_plan']:.1f}% RSS {r['host_rss_pct_of_plan']:.1f}% of plan")

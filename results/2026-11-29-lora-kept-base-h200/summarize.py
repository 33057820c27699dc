#!/usr/bin/env python3
"""results.json of this folder: steady state (mean of steps 2 on) of each run's --metrics log."""
import json, pathlib, statistics
here = pathlib.Path(__file__).parent
def steps(name):
    return [r for r in map(json.loads, (here / f"{name}.jsonl").read_text().splitlines()) if r.get("step") and r.get("type", "step") == "step"]
runs = {}
for name in ["lora-4", "peft-4", "lora-16", "peft-16", "lora-4-streamed", "l70-int8-4"]:
    st = [r for r in steps(name) if r["step"] >= 2]
    e = {"steps": len(st), "step_s": statistics.mean(r["step_ms"] for r in st) / 1e3,
         "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in st),
         "losses": [r["loss"] for r in steps(name)]}
    for k in ["compute_busy_frac", "host_busy_frac", "h2d_bytes", "gpu_peak_bytes"]:
        if k in st[-1]:
            e[k] = st[-1][k]
    runs[name] = e
ratios = {b: runs[f"lora-{b}"]["tokens_per_s"] / runs[f"peft-{b}"]["tokens_per_s"] for b in ["4", "16"]}
doc = {"machine": "one H200 (nvidia-h200), 16 cores, 128 GiB", "commit": "b678cc0", "date": "2026-11-29",
       "config": "bench-harness/configs/llama3-8b.json (70b for l70-*), LoRA r 16, bf16, synthetic, seq 2048",
       "runs": runs, "ours_over_peft": ratios}
(here / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
for n, e in runs.items():
    print(f"{n:16} {e['step_s']:.3f} s  {e['tokens_per_s']:.0f} tok/s  compute {e.get('compute_busy_frac', float('nan')):.2f}")
print("ours / peft:", {k: round(v, 2) for k, v in ratios.items()})

"""Writes results.json from the runs' metrics logs (first and last loss, the largest gradient norm)."""
import glob
import json

runs = []
for path in sorted(glob.glob("lr*.jsonl")):
    recs = [json.loads(l) for l in open(path)]
    run = next(r for r in recs if r["type"] == "run")
    steps = [r for r in recs if r["type"] == "step"]
    runs.append({
        "lr": run["options"]["lr"],
        "metrics_file": path,
        "steps": len(steps),
        "loss_first": steps[0]["loss"],
        "loss_last": steps[-1]["loss"],
        "loss_max": max(s["loss"] for s in steps),
        "grad_norm_max": max(s["grad_norm"] for s in steps),
    })
runs.sort(key=lambda r: -r["lr"])
json.dump({
    "schema_version": 1,
    "what": "learning rate at the 3.6B shape's width (hidden 3072), 2 layers, vocab 8192, CPU",
    "commit": "0df5f68",
    "machine": {"cpus": 2, "gpu": None},
    "config": {"model_config": "config.json", "data": "synthetic", "batch_size": 2, "seq_len": 256,
               "warmup": 5, "schedule": "cosine", "clip": 1.0},
    "runs": runs,
}, open("results.json", "w"), indent=1)

#!/usr/bin/env python3
"""The planner's edge sweep: for each model and batch size, the sequence length doubles from
--start until the first refusal; every accepted plan trains one step, and every refusal must name
the bytes that are missing. Then (--longest) the longest length the planner accepts for one
sequence, found by bisection over multiples of --granule with `megatrain estimate` on this
machine's GPU and host memory, and trained.

One row per (model, batch, length): accepted and trained (step seconds, model TFLOP/s, loss, GPU
peak and host RSS against the plan), accepted but failed (a bug: an accepted plan must run), or
refused (the refusal sentence, and whether it names a byte count). Rows already in --out are
kept and not run again, so an interrupted sweep resumes where it stopped.

  python3 scripts/edge_sweep.py --megatrain target/release/megatrain \\
      --models bench-harness/configs/llama3-3.6b.json,bench-harness/configs/qwen2.5-7b.json \\
      --batches 1,2,3,4 --out edge.json --logs logs/ [--longest] [--max-seconds 3000]

Every run: `megatrain train --config C --device cuda --precision bf16 --data synthetic
--batch-size B --seq-len S --steps 1 --optim-mode lean --grad-dtype none --lr 1e-4`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path

BYTES = re.compile(r"\d+(\.\d+)?\s*(GiB|MiB|KiB|GB|MB|bytes|B)\b")


def run_train(a, cfg: str, batch: int, seq: int, logs: Path) -> dict:
    name = f"{Path(cfg).stem}-{batch}x{seq}"
    metrics = logs / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [a.megatrain, "train", "--config", cfg, "--device", "cuda", "--precision", "bf16",
           "--data", "synthetic", "--batch-size", str(batch), "--seq-len", str(seq), "--steps", "1",
           "--optim-mode", "lean", "--grad-dtype", "none", "--lr", "1e-4", "--metrics", str(metrics)]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    (logs / f"{name}.log").write_text(out)
    row = {"model": Path(cfg).stem, "batch": batch, "seq_len": seq, "wall_s": round(time.time() - t0, 1),
           "command": " ".join(cmd)}
    refusal = next((l for l in out.splitlines() if "no memory plan fits" in l or "refus" in l.lower()
                    or "max_position_embeddings" in l), None)
    steps = []
    if metrics.exists():
        steps = [r for r in map(json.loads, filter(str.strip, metrics.read_text().splitlines()))
                 if r.get("type") == "step"]
    if rc == 0 and steps:
        s = steps[-1]
        gpu = re.search(r"in use (\d+\.\d+)%, held (\d+\.\d+)% of it", out)
        rss = re.search(r"RSS is (\d+\.\d+)% of it", out)
        row.update(status="trained", step_s=s["step_ms"] / 1e3, model_tflops=s.get("model_tflops"),
                   loss=s["loss"], gpu_in_use_pct_of_plan=float(gpu.group(1)) if gpu else None,
                   gpu_held_pct_of_plan=float(gpu.group(2)) if gpu else None,
                   host_rss_pct_of_plan=float(rss.group(1)) if rss else None)
    elif refusal and rc != 0:
        row.update(status="refused", reason=refusal.strip(), names_bytes=bool(BYTES.search(refusal)),
                   by_positions="max_position_embeddings" in refusal)
    else:
        tail = [l for l in out.splitlines() if l.strip()][-3:]
        row.update(status="failed after acceptance", rc=rc, tail=tail)
    return row


def estimate_accepts(a, cfg: str, seq: int) -> bool:
    cmd = [a.megatrain, "estimate", "--config", cfg, "--device", "cuda", "--precision", "bf16",
           "--batch-size", "1", "--seq-len", str(seq), "--optim-mode", "lean", "--grad-dtype", "none",
           "--gpu-mem", str(a.gpu_mem_gib)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.returncode == 0 and "no memory plan fits" not in p.stdout + p.stderr


def gpu_mem_gib() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.split()
    return float(out[0]) / 1024 if out else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatrain", default="target/release/megatrain")
    ap.add_argument("--models", required=True, help="comma-separated config.json paths")
    ap.add_argument("--batches", default="1,2,3,4")
    ap.add_argument("--start", type=int, default=8192)
    ap.add_argument("--max-seq", type=int, default=1 << 21, help="stop doubling here even if accepted")
    ap.add_argument("--longest", action="store_true", help="also bisect and train the longest 1-sequence length")
    ap.add_argument("--granule", type=int, default=8192)
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per run")
    ap.add_argument("--max-seconds", type=float, default=1e9, help="stop starting runs after this long")
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", default="edge-logs")
    a = ap.parse_args()
    a.gpu_mem_gib = gpu_mem_gib()
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    out = Path(a.out)
    doc = json.loads(out.read_text()) if out.exists() else {
        "schema_version": 1, "suite": "edge sweep (issue 32), scripts/edge_sweep.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip(),
        "config": "--device cuda --precision bf16 --data synthetic --steps 1 --optim-mode lean --grad-dtype none",
        "rows": []}
    done = {(r["model"], r["batch"], r["seq_len"]) for r in doc["rows"]}
    t0 = time.time()

    def record(row):
        doc["rows"].append(row)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(row), flush=True)

    for cfg in a.models.split(","):
        for batch in map(int, a.batches.split(",")):
            seq = a.start
            while seq <= a.max_seq:
                key = (Path(cfg).stem, batch, seq)
                prior = next((r for r in doc["rows"] if (r["model"], r["batch"], r["seq_len"]) == key), None)
                if prior is None:
                    if time.time() - t0 > a.max_seconds:
                        print("time budget spent; rerun to resume", flush=True)
                        return 0
                    prior = run_train(a, cfg, batch, seq, logs)
                    record(prior)
                if prior["status"] != "trained":
                    break
                seq *= 2
        if a.longest:
            lo, hi = a.granule, a.granule
            while hi <= a.max_seq and estimate_accepts(a, cfg, hi):
                lo, hi = hi, hi * 2
            while hi - lo > a.granule:
                mid = (lo + hi) // 2 // a.granule * a.granule
                lo, hi = (mid, hi) if estimate_accepts(a, cfg, mid) else (lo, mid)
            key = (Path(cfg).stem, 1, lo)
            if key not in done and not any((r["model"], r["batch"], r["seq_len"]) == key for r in doc["rows"]):
                row = run_train(a, cfg, 1, lo, logs)
                row["longest_accepted"] = True
                record(row)
    bad = [r for r in doc["rows"] if r["status"] == "failed after acceptance"
           or (r["status"] == "refused" and not r["names_bytes"] and not r.get("by_positions"))]
    print(f"{len(doc['rows'])} rows; accepted plans that failed or refusals without bytes: {len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

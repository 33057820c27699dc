#!/usr/bin/env python3
"""Turns `megatrain train` logs (stderr + stdout of a run, `<name>.log`) of one GPU-machine run
directory into one results JSON: per run the plan (placement line, GPU and host bytes), every
step's loss and tokens/s, the steady state (steps after the first; the one step where only one
ran), model TFLOP/s with the plan's FLOPs per step and formula, host RSS and the GPU memory
high-water mark against the plan. Every number comes from the logs; nothing is typed in.

    scripts/collect_train_logs.py DIR --commit SHA --machine nvidia-h200 [--args NAME=ARGS ...] > out.json
"""
import argparse
import glob
import json
import os
import re


def num(s):
    return float(s.replace(",", ""))


def parse(text):
    r = {}
    m = re.search(r"^step: (.*)$", text, re.M)
    r["plan"] = m.group(1) if m else None
    for key, pat in (("gpu_plan_gib", r"^GPU \(GiB\)\s+(.*)$"), ("host_plan_gib", r"^host \(GiB\)\s+(.*)$")):
        m = re.search(pat, text, re.M)
        r[key] = m.group(1).strip() if m else None
    m = re.search(r"model FLOPs per step: ([\d.e+]+) \(([^)]*)\)", text)
    r["model_flops_per_step"], r["flops_formula"] = (num(m.group(1)), m.group(2)) if m else (None, None)
    m = re.search(r"^step: (\d+) x (\d+) tokens", text, re.M)
    tokens = int(m.group(1)) * int(m.group(2)) if m else None
    r["tokens_per_step"] = tokens
    steps = [
        {"step": int(a), "loss": num(b), "tokens_per_s": num(c)}
        for a, b, c in re.findall(r"^step\s+(\d+)\s+loss ([\d.]+)\s.*?\s([\d.]+) tok/s", text, re.M)
    ]
    r["steps"] = steps
    m = re.search(r"steady state \(steps after the first\): ([\d.]+) ms/step, ([\d.]+) tokens/s, ([\d.]+) model TFLOP/s", text)
    if m:
        r["steady"] = {"step_s": num(m.group(1)) / 1e3, "tokens_per_s": num(m.group(2)),
                       "model_tflops": num(m.group(3)), "steps": len(steps) - 1}
    elif steps and tokens and r["model_flops_per_step"]:
        # One step only: its own time (tokens / its tokens per second).
        s = tokens / steps[-1]["tokens_per_s"]
        r["steady"] = {"step_s": s, "tokens_per_s": steps[-1]["tokens_per_s"],
                       "model_tflops": r["model_flops_per_step"] / s / 1e12, "steps": 1,
                       "note": "the only step measured (step 1, which includes first-use work)"}
    m = re.search(r"loss: first ([\d.]+) last ([\d.]+)", text)
    if m:
        r["loss_first"], r["loss_last"] = num(m.group(1)), num(m.group(2))
    m = re.search(r"host RSS at end: ([\d.]+) MB = ([\d.]+) bytes/param.*?counted ([\d.]+) MB", text)
    if m:
        r["host_rss_mb"], r["host_rss_bytes_per_param"], r["host_plan_mb"] = map(num, m.groups())
    m = re.search(r"GPU memory in use at most: ([\d.]+) MB, held by the memory pool at most: ([\d.]+) MB.*?the plan counted ([\d.]+) MB", text, re.S)
    if m:
        used, held, planned = map(num, m.groups())
        r["gpu_peak"] = {"in_use_mb": used, "held_mb": held, "planned_mb": planned,
                         "in_use_of_plan": used / planned, "held_of_plan": held / planned}
    m = re.search(r"^error: (.*)$", text, re.M)
    r["status"] = "failed: " + m.group(1) if m else ("ok" if steps else "no step")
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--args", nargs="*", default=[], help="NAME=command-line arguments of run NAME")
    a = ap.parse_args()
    env_path = os.path.join(a.dir, "env.txt")
    env = open(env_path).read().splitlines() if os.path.exists(env_path) else []
    args = dict(x.split("=", 1) for x in a.args)
    runs = {}
    for log in sorted(glob.glob(os.path.join(a.dir, "*.log"))):
        name = os.path.basename(log)[:-4]
        text = open(log, errors="replace").read()
        if "megatrain" not in text and "step:" not in text:
            continue
        runs[name] = dict(parse(text), args=args.get(name))
    # Runs known only by their `--metrics` JSON Lines (m-NAME.jsonl): the steady state of the
    # steps after the first, as megatrain's own summary computes it (time-weighted).
    for path in sorted(glob.glob(os.path.join(a.dir, "m-*.jsonl"))):
        name = os.path.basename(path)[2:-6]
        recs = [json.loads(l) for l in open(path) if l.strip()]
        run = next((r for r in recs if r["type"] == "run"), None)
        steps = [r for r in recs if r["type"] == "step"]
        later = steps[1:] or steps
        if run is None or not later:
            continue
        secs = sum(r["step_ms"] for r in later) / 1e3
        r = runs.setdefault(name, {"args": args.get(name)})
        r["metrics"] = {
            "options": run["options"], "n_params": run["n_params"], "model_flops_per_step": run["model_flops_per_step"],
            "flops_formula": run["flops_formula"], "steps_measured": len(later),
            "step_s": secs / len(later),
            "tokens_per_s": sum(x["tokens"] for x in later) / secs,
            "model_tflops": run["model_flops_per_step"] * len(later) / secs / 1e12,
            "loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"],
            "gpu_peak_bytes": max((x.get("gpu_peak_bytes") or 0) for x in steps) or None,
            "rss_bytes_max": max((x.get("rss_bytes") or 0) for x in steps) or None,
        }
    print(json.dumps({"schema": "megatrain-train-logs/1", "machine": {"kind": a.machine, "env": env},
                      "commit": a.commit, "date": env[0] if env else None, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()

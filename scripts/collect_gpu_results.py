#!/usr/bin/env python3
"""Turns one GPU-machine run directory (megatrain `--metrics` jsonl files m-<name>.jsonl, their
logs <name>.log, env.txt, gpu-test.log) into one results JSON: per run the configuration, the
steady-state figures (steps after the first), stream busy fractions, PCIe bytes and host RSS, and
the GPU-test SUMMARY lines. Every number comes from the files; nothing is typed in.

    scripts/collect_gpu_results.py DIR --commit SHA --machine nvidia-h200 > out.json
"""
import argparse, glob, json, os, re, statistics

def load(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--machine", required=True)
    a = ap.parse_args()
    env = open(os.path.join(a.dir, "env.txt")).read().splitlines()
    gpu_line = next((l for l in env if "NVIDIA" in l), "")
    gpu, driver, mem = [x.strip() for x in (gpu_line.split(",") + ["", "", ""])[:3]]
    runs = {}
    for m in sorted(glob.glob(os.path.join(a.dir, "m-*.jsonl"))):
        name = os.path.basename(m)[2:-6]
        recs = load(m)
        run = next(r for r in recs if r["type"] == "run")
        steps = [r for r in recs if r["type"] == "step"]
        later = steps[1:] or steps
        step_s = statistics.mean(r["step_ms"] for r in later) / 1e3
        log = open(os.path.join(a.dir, name + ".log")).read()
        rss = re.search(r"host RSS at end: ([\d.]+) MB = ([\d.]+) bytes/param", log)
        o = run["options"]
        runs[name] = {
            "config": {k: o[k] for k in ("batch_size", "seq_len", "precision", "optim_mode", "grad_dtype",
                                         "ring_depth", "optimizer_overlap", "rows_per_block", "chunks")},
            "model": run["model"]["source"], "n_params": run["n_params"],
            "steps_measured": len(later), "warmup_steps_excluded": len(steps) - len(later),
            "step_s": step_s,
            "tokens_per_s": run["tokens_per_step"] / step_s,
            "model_tflops": run["model_flops_per_step"] / step_s / 1e12,
            "flops_formula": run["flops_formula"],
            "busy_frac": {s: statistics.mean(r[s + "_busy_frac"] for r in later) for s in ("host", "h2d", "compute", "d2h")},
            "compute_max_gap_ms": max(r["compute_max_gap_ms"] for r in later),
            "h2d_bytes_per_step": later[-1]["h2d_bytes"], "d2h_bytes_per_step": later[-1]["d2h_bytes"],
            "host_store_bytes_per_param": run["store_bytes_per_param"],
            "host_rss_mb_at_end": float(rss.group(1)) if rss else None,
            "host_rss_bytes_per_param": float(rss.group(2)) if rss else None,
        }
    base = runs.get("b4-r2")
    ablation = None
    if base:
        ablation = {n: {"tokens_per_s_ratio_to_ring2": r["tokens_per_s"] / base["tokens_per_s"]}
                    for n, r in runs.items() if n.startswith("b4-")}
    tests = [l.split("SUMMARY ", 1)[1].strip() for l in open(os.path.join(a.dir, "gpu-test.log")) if "SUMMARY" in l]
    out = {
        "schema": "megatrain-gpu-run/1",
        "machine": {"kind": a.machine, "gpu": gpu, "driver": driver, "gpu_memory": mem, "env": env},
        "commit": a.commit, "date": env[0] if env else None,
        "runs": runs, "ablation_4x2048": ablation, "gpu_tests": tests,
        "raw": os.path.basename(os.path.normpath(a.dir)) + "/",
    }
    print(json.dumps(out, indent=1, sort_keys=True))

if __name__ == "__main__":
    main()

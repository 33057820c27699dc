#!/usr/bin/env python3
"""A results folder's `results.json` from `scripts/attention_bench.py`'s JSON files and the GPU job's
environment file (`nvidia-smi`, `lscpu`, `free -g`, then the commit on the last line): per shape and
system fwd / bwd / fwd+bwd TFLOP/s, each system's fwd+bwd and forward over cuDNN's in the same
process, each variant's over the default Hopper kernels'; the checks' worst errors, finiteness and
bitwise repeatability. Prints one line per shape.

  python3 scripts/attention_summary.py results/DIR/results.json --env results/DIR/env.txt \\
      --suite "attention (issue 32): ..." final=results/DIR/attention.json [name=FILE ...]
"""

import argparse
import json
import math
import re
import sys
from pathlib import Path


def machine(path: Path):
    t = path.read_text()
    return {
        "file": path.name,
        "date": t.splitlines()[0],
        "gpu": re.search(r"\|\s+\d+\s+(NVIDIA \S+)\s", t).group(1),
        "gpu_memory_mib": int(re.search(r"MiB /\s*(\d+)MiB", t).group(1)),
        "driver": re.search(r"Driver Version: (\S+)", t).group(1),
        "cuda": re.search(r"CUDA Version: (\S+)", t).group(1),
        "cpu": re.search(r"Model name:\s+(.+)", t).group(1).strip(),
        "cpus": int(re.search(r"^CPU\(s\):\s+(\d+)", t, re.M).group(1)),
        "ram_gib_free_g": int(re.search(r"^Mem:\s+(\d+)", t, re.M).group(1)),
        "commit": t.strip().splitlines()[-1],
    }


def bench(path: Path):
    a = json.loads(path.read_text())
    out = []
    for b in a["bench"]:
        sy = b["systems"]
        ok = {s: v for s, v in sy.items() if v.get("status") == "ok"}
        row = {k: b[k] for k in ("seq_len", "heads", "kv_heads", "head_dim")}
        row["systems"] = {s: {k: v[k] for k in ("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "fwd_bwd_tflops")}
                          for s, v in ok.items()}
        if "cudnn" in ok:
            ref = ok["cudnn"]
            row["fwd_bwd_over_cudnn"] = {s: v["fwd_bwd_tflops"] / ref["fwd_bwd_tflops"]
                                         for s, v in ok.items() if s != "cudnn"}
            row["fwd_over_cudnn"] = {s: v["fwd_tflops"] / ref["fwd_tflops"] for s, v in ok.items() if s != "cudnn"}
        if "hopper" in ok:
            ref = ok["hopper"]
            row["over_default_hopper"] = {
                s: {k: v[k] / ref[k] for k in ("fwd_tflops", "bwd_tflops", "fwd_bwd_tflops")}
                for s, v in ok.items() if s not in ("hopper", "cudnn")}
        out.append(row)
    checks = a.get("checks", [])
    worst = {}
    for c in checks:
        for g in ("o", "dq", "dk", "dv"):
            if g in c:
                for k in ("rel_l2", "max_abs_over_max_ref"):
                    # A NaN error stays NaN (max() would drop it).
                    v, w = c[g][k], worst.get(f"{g}_{k}", 0.0)
                    worst[f"{g}_{k}"] = w if math.isnan(w) else v if math.isnan(v) or v > w else w
    return {
        "file": path.name,
        "json_commit": a.get("commit"),
        "json_date": a.get("date"),
        "timing": a.get("timing"),
        "ptxas_warnings": a.get("ptxas_warnings"),
        "ptxas_spills": a.get("ptxas_spills"),
        "checks": len(checks),
        "checks_failed": sum(1 for c in checks if "error" in c),
        "checks_all_finite": all(c[g]["finite"] for c in checks if "error" not in c for g in ("o", "dq", "dk", "dv"))
        if checks else None,
        "checks_all_repeatable": all(c.get("backward_bitwise_repeatable") for c in checks) if checks else None,
        "checks_worst": worst,
        "bench": out,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--env", required=True)
    p.add_argument("--suite", required=True)
    p.add_argument("--note", default="")
    p.add_argument("files", nargs="+", metavar="NAME=FILE")
    a = p.parse_args()
    env = machine(Path(a.env))
    doc = {"schema_version": 1, "suite": a.suite, "commit": env["commit"], "date": env["date"], "machine": env}
    if a.note:
        doc["note"] = a.note
    doc["attention"] = {}
    for item in a.files:
        name, f = item.split("=", 1)
        doc["attention"][name] = r = bench(Path(f))
        print(f"{name} ({r['file']}): {r['checks']} checks, {r['checks_failed']} failed, "
              f"repeatable {r['checks_all_repeatable']}")
        for b in r["bench"]:
            line = f"  {b['seq_len']} {b['heads']}/{b['kv_heads']} d{b['head_dim']}:"
            for n, v in b["systems"].items():
                ratio = b.get("fwd_bwd_over_cudnn", {}).get(n)
                line += f" {n} {v['fwd_tflops']:.0f}/{v['bwd_tflops']:.0f}/{v['fwd_bwd_tflops']:.0f}"
                line += f" ({ratio:.3f}x);" if ratio else ";"
            print(line)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

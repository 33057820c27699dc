#!/usr/bin/env python3
"""results.json of this folder, from attention.json, attention16k-2.json, the kt-probe logs and the
env files (nothing typed by hand but the command lines' provenance).

Kernel bench: per shape and system fwd / bwd / fwd+bwd TFLOP/s (causal FLOPs, the bench's) and each
system's fwd+bwd over cuDNN's in the same process; the checks' worst errors and repeatability. Probe
test: passed or failed per process, and whether NVRTC returned no ptxas report (the warning line).
"""

import json
import re
from pathlib import Path

here = Path(__file__).resolve().parent


def machine(name):
    t = (here / name).read_text()
    return {
        "file": name,
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


def bench(name):
    a = json.loads((here / name).read_text())
    out = []
    for b in a["bench"]:
        sy = b["systems"]
        row = {k: b[k] for k in ("seq_len", "heads", "kv_heads", "head_dim")}
        row["systems"] = {
            s: {k: v[k] for k in ("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "fwd_bwd_tflops")}
            for s, v in sy.items() if v.get("status") == "ok"
        }
        row["fwd_bwd_over_cudnn"] = {
            s: v["fwd_bwd_tflops"] / sy["cudnn"]["fwd_bwd_tflops"] for s, v in row["systems"].items() if s != "cudnn"
        }
        row["over_default_hopper"] = {
            s: {k: v[k] / sy["hopper"][k] for k in ("fwd_tflops", "bwd_tflops", "fwd_bwd_tflops")}
            for s, v in row["systems"].items() if s not in ("hopper", "cudnn")
        }
        row["fwd_over_cudnn"] = {
            s: v["fwd_tflops"] / sy["cudnn"]["fwd_tflops"] for s, v in row["systems"].items() if s != "cudnn"
        }
        out.append(row)
    checks = a.get("checks", [])
    worst = {}
    for c in checks:
        for g in ("o", "dq", "dk", "dv"):
            for k in ("rel_l2", "max_abs_over_max_ref"):
                worst[f"{g}_{k}"] = max(worst.get(f"{g}_{k}", 0.0), c[g][k])
    return {
        "file": name,
        "json_commit": a["commit"],
        "json_date": a["date"],
        "ptxas_warnings": a["ptxas_warnings"],
        "ptxas_spills": a["ptxas_spills"],
        "checks": len(checks),
        "checks_all_finite": all(c[g]["finite"] for c in checks for g in ("o", "dq", "dk", "dv")) if checks else None,
        "checks_all_repeatable": all(c["backward_bitwise_repeatable"] for c in checks) if checks else None,
        "checks_worst": worst,
        "bench": out,
    }


def probe(name):
    t = (here / name).read_text()
    res = re.search(r"test result: (\w+)\. (\d+) passed; (\d+) failed", t)
    return {
        "file": name,
        "result": res.group(1),
        "passed": int(res.group(2)),
        "failed": int(res.group(3)),
        "no_ptxas_report_warning": "without ptxas's report" in t,
    }


probes = [probe(p.name) for p in sorted(here.glob("kt-probe-*.log"))]
result = {
    "schema_version": 1,
    "suite": "attention (issue 32): the early dQ release variant; the NVRTC probe test",
    "commit": "c6904bd",
    "date": "2026-11-29",
    "note": "release build and kernels of c6904bd (the env files' last line); the GPU machine has no git, so the "
            "bench JSON says commit null. Machine A ran attention.json and went back; machine B ran "
            "attention16k-2.json and the probe tests",
    "machines": {"A": machine("env-a.txt"), "B": machine("env-b.txt")},
    "config": {
        "attention.json (machine A, job.sh)":
            "python3 scripts/attention_bench.py --out attention.json --ours hopper --sdpa cudnn "
            "--hopper-variants early:MT_HFA_DQ_RELEASE_EARLY,outer:MT_HFA_BWD_HEAD_OUTER "
            "--seqs 16384,65536 --check-seqs 4096 --reps 5",
        "attention16k-2.json (machine B, a later call)":
            "python3 scripts/attention_bench.py --out attention16k-2.json --ours hopper --sdpa cudnn "
            "--seqs 16384 --check-seqs '' --reps 10",
        "kt-probe-cc80-1..3 (machine B, job-b.sh)":
            "MEGATRAIN_NVRTC_CC=80 kt --test-threads 1 --nocapture compile_cubin",
        "kt-probe-cc80-4, kt-probe-default (machine B, later calls)":
            "the same, the second without MEGATRAIN_NVRTC_CC",
    },
    "attention_a": bench("attention.json"),
    "attention_b": bench("attention16k-2.json"),
    "probe_test": probes,
}
(here / "results.json").write_text(json.dumps(result, indent=1) + "\n")

for key in ("attention_a", "attention_b"):
    r = result[key]
    print(f"{r['file']}: {r['checks']} checks, repeatable {r['checks_all_repeatable']}")
    for b in r["bench"]:
        s = b["systems"]
        line = f"  {b['seq_len']} {b['heads']}/{b['kv_heads']} d{b['head_dim']}:"
        for n, v in s.items():
            ratio = b["fwd_bwd_over_cudnn"].get(n)
            line += f" {n} {v['fwd_tflops']:.0f}/{v['bwd_tflops']:.0f}/{v['fwd_bwd_tflops']:.0f}"
            line += f" ({ratio:.3f}x);" if ratio else ";"
        print(line)
for p in probes:
    print(f"{p['file']}: {p['result']} ({p['passed']} passed), no ptxas report: {p['no_ptxas_report_warning']}")

#!/usr/bin/env python3
"""Summarises scripts/disk-tier-run.sh's runs into OUTDIR/results.json and prints a table.

Usage: disk_tier_report.py OUTDIR LIMIT_BYTES WRITE_BPS READ_BPS CGROUP_KIND TOKENS...

Per token count: the steady-state step time (steps after the first) with the store in RAM and
paged from its file inside the memory cgroup, the cgroup's peak memory against its limit, the
pager's bytes per steady step, and the disk bound: the whole store read once and written once
per step at the measured sequential bandwidths (serial: read + write; overlapped: the larger).
"""
import json
import subprocess
import sys
from pathlib import Path


def steps(path):
    recs = [json.loads(line) for line in open(path) if line.strip()]
    run = next(r for r in recs if r["type"] == "run")
    return run, [r for r in recs if r["type"] == "step"]


def steady(recs, key):
    """Median over the steps after the first (this 2-core machine's step times vary by 30%)."""
    later = sorted(r[key] for r in (recs[1:] or recs))
    mid = len(later) // 2
    return later[mid] if len(later) % 2 else (later[mid - 1] + later[mid]) / 2


def main():
    out, limit, write_bps, read_bps, kind = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    tokens = [int(t) for t in sys.argv[6:]]
    out = Path(out)
    rows = []
    for t in tokens:
        run, ram = steps(out / f"ram-1x{t}.jsonl")
        run, paged = steps(out / f"paged-1x{t}.jsonl")
        store = run["store_bytes"]
        per_step = lambda key: (paged[-1][key] - paged[0][key]) / max(len(paged) - 1, 1)
        peak = int((out / f"paged-1x{t}.peak").read_text().split()[0])
        oom = (out / f"paged-1x{t}.oom").read_text().strip() if (out / f"paged-1x{t}.oom").exists() else ""
        bound_serial = store / read_bps + store / write_bps
        bound_overlap = max(store / read_bps, store / write_bps)
        row = {
            "tokens": f"1x{t}",
            "store_bytes": store,
            "store_over_limit": store / limit,
            "ram_step_ms": steady(ram, "step_ms"),
            "paged_step_ms": steady(paged, "step_ms"),
            "paged_over_ram": steady(paged, "step_ms") / steady(ram, "step_ms"),
            "paged_losses_equal_ram": [r["loss"] for r in paged] == [r["loss"] for r in ram],
            "cgroup_peak_bytes": peak,
            "cgroup_limit_bytes": limit,
            "cgroup_oom": oom,
            "paged_rss_bytes_last": paged[-1]["rss_bytes"],
            "read_ahead_bytes_per_step": per_step("store_read_ahead_bytes"),
            "evicted_bytes_per_step": per_step("store_evicted_bytes"),
            "disk_read_bytes_per_step": per_step("io_read_bytes"),
            "disk_write_bytes_per_step": per_step("io_write_bytes"),
            "disk_bound_serial_ms": bound_serial * 1e3,
            "disk_bound_overlapped_ms": bound_overlap * 1e3,
            "paged_over_serial_bound": steady(paged, "step_ms") / (bound_serial * 1e3),
            "steps": len(paged),
        }
        rows.append(row)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "what": "disk tier: a --store file >= 1.5x the memory cgroup's limit, paged through a RAM window",
        "machine": run["machine"],
        "commit": commit,
        "date": subprocess.run(["date", "-u", "+%Y-%m-%dT%H:%M:%SZ"], capture_output=True, text=True).stdout.strip(),
        "config": {"model": run["model"], "n_params": run["n_params"], "options": run["options"], "cgroup": kind},
        "disk": {"write_bytes_per_s": write_bps, "read_bytes_per_s": read_bps, "how": "dd 4 GiB, 16 MiB blocks, O_DIRECT"},
        "runs": rows,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"disk: write {write_bps / 1e9:.2f} GB/s, read {read_bps / 1e9:.2f} GB/s; cgroup limit {limit / 2**30:.2f} GiB")
    print("tokens | store/limit | in RAM ms | paged ms | paged/RAM | bound (serial) ms | paged/bound | cgroup peak | disk read + written per step")
    for r in rows:
        print(
            f"{r['tokens']} | {r['store_over_limit']:.2f}x | {r['ram_step_ms']:.0f} | {r['paged_step_ms']:.0f} | "
            f"{r['paged_over_ram']:.2f} | {r['disk_bound_serial_ms']:.0f} | {r['paged_over_serial_bound']:.2f} | "
            f"{r['cgroup_peak_bytes'] / 2**30:.2f} GiB | {r['disk_read_bytes_per_step'] / 1e9:.2f} + "
            f"{r['disk_write_bytes_per_step'] / 1e9:.2f} GB | losses equal: {r['paged_losses_equal_ram']}"
        )


if __name__ == "__main__":
    main()

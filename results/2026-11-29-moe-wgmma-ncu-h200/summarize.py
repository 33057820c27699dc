#!/usr/bin/env python3
"""results.json of this folder, from moe-ncu-details.csv (ncu's details page), moe-ncu.json,
moe-ncu.log and env.txt (nothing typed by hand).

Per profiled kernel: name, grid and block, duration, the Speed Of Light throughputs, the tensor
pipe's share (ncu's HighPipeUtilization rule), scheduler and warp-state figures, occupancy,
registers, shared memory, and the rules' top stall reason. The kernels are matched to the GEMM kinds
by launch order (moe_bench.py, wgmma variant, --check-tokens '' --reps 1: gemm_calls' forward
launches gate_up then down; then each kind's warm-up and timed call: gate_up, gate_up, down, down,
down_bwd, down_bwd; ncu -c 8 stops there), and each one's TFLOP/s is that kind's FLOPs (moe-ncu.json)
over ncu's duration.
"""

import csv
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


def num(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return v


ORDER = ["gate_up", "down", "gate_up", "gate_up", "down", "down", "down_bwd", "down_bwd"]
METRICS = {
    "duration_ms": ("GPU Speed Of Light Throughput", "Duration"),
    "sm_frequency_ghz": ("GPU Speed Of Light Throughput", "SM Frequency"),
    "compute_sm_throughput_pct": ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    "memory_throughput_pct": ("GPU Speed Of Light Throughput", "Memory Throughput"),
    "dram_throughput_pct": ("GPU Speed Of Light Throughput", "DRAM Throughput"),
    "l1tex_throughput_pct": ("GPU Speed Of Light Throughput", "L1/TEX Cache Throughput"),
    "l2_throughput_pct": ("GPU Speed Of Light Throughput", "L2 Cache Throughput"),
    "memory_gbytes_per_s": ("Memory Workload Analysis", "Memory Throughput"),
    "l2_hit_rate_pct": ("Memory Workload Analysis", "L2 Hit Rate"),
    "issue_slots_busy_pct": ("Compute Workload Analysis", "Issue Slots Busy"),
    "executed_ipc_active": ("Compute Workload Analysis", "Executed Ipc Active"),
    "no_eligible_pct": ("Scheduler Statistics", "No Eligible"),
    "active_warps_per_scheduler": ("Scheduler Statistics", "Active Warps Per Scheduler"),
    "eligible_warps_per_scheduler": ("Scheduler Statistics", "Eligible Warps Per Scheduler"),
    "warp_cycles_per_issued_instruction": ("Warp State Statistics", "Warp Cycles Per Issued Instruction"),
    "theoretical_occupancy_pct": ("Occupancy", "Theoretical Occupancy"),
    "achieved_occupancy_pct": ("Occupancy", "Achieved Occupancy"),
    "block_limit_registers": ("Occupancy", "Block Limit Registers"),
    "block_limit_shared_mem": ("Occupancy", "Block Limit Shared Mem"),
    "registers_per_thread": ("Launch Statistics", "Registers Per Thread"),
    "dynamic_shared_kbyte_per_block": ("Launch Statistics", "Dynamic Shared Memory Per Block"),
    "waves_per_sm": ("Launch Statistics", "Waves Per SM"),
}

rows = list(csv.DictReader((here / "moe-ncu-details.csv").open()))
bench = json.loads((here / "moe-ncu.json").read_text())
variant = bench["variants"][0]
kind_flops = {k: v["flops"] for k, v in variant["gemms"][0]["kinds"].items()}
kernels = []
for i in sorted({int(r["ID"]) for r in rows}):
    rs = [r for r in rows if int(r["ID"]) == i]
    by = {(r["Section Name"], r["Metric Name"]): r["Metric Value"] for r in rs if r["Metric Name"]}
    k = {"id": i, "kernel": rs[0]["Kernel Name"], "grid": rs[0]["Grid Size"], "block": rs[0]["Block Size"],
         "gemm_kind": ORDER[i] if i < len(ORDER) else None}
    k.update({name: num(by[key]) for name, key in METRICS.items() if key in by})
    rules = [r["Rule Description"] for r in rs if not r["Metric Name"]]
    pipe = next((re.search(r"^(\w+) is the highest-utilized pipeline \(([\d.]+)%\)", d) for d in rules
                 if "highest-utilized pipeline" in d), None)
    k["highest_pipe"] = pipe.group(1) if pipe else None
    k["highest_pipe_pct"] = float(pipe.group(2)) if pipe else None
    stall = next((re.search(r"spends ([\d.]+) cycles being stalled (waiting for [^.]+?) operation", d) for d in rules
                  if "cycles being stalled" in d), None)
    k["top_stall"] = (f"{stall.group(1)} cycles {stall.group(2)}" if stall else None)
    k["top_stall_cycles"] = float(stall.group(1)) if stall else None
    issue = next((re.search(r"issues an instruction every ([\d.]+) cycles", d) for d in rules
                  if "issues an instruction every" in d), None)
    k["cycles_between_issues_per_scheduler"] = float(issue.group(1)) if issue else None
    k["rules"] = sorted({r["Rule Name"] + " (" + r["Rule Type"] + ")" for r in rs if not r["Metric Name"]})
    if k["gemm_kind"]:
        k["tflops_from_duration"] = kind_flops[k["gemm_kind"]] / (k["duration_ms"] / 1e3) / 1e12
    kernels.append(k)

log = (here / "moe-ncu.log").read_text()
sy = bench["bench"][0]["systems"]
result = {
    "schema_version": 1,
    "suite": "moe (issue 34): ncu of the wgmma MoE GEMMs, OLMoE-1B-7B shape, 32768 tokens",
    "commit": "c6904bd",
    "date": "2026-11-29",
    "note": "kernels of c6904bd (env.txt's last line; moe-ncu.json says commit null: the GPU machine has no git), "
            "machine B of the session. ncu ran with --clock-control none. The bench line's ours_grouped is "
            "moe_bench.py's default Moe() (moe.cu's mma.sync kernels, not profiled: the filter is mt_moe_hgemm); "
            "the wgmma variant's gate_up / down / down_bwd timings in moe-ncu.json include ncu's 20 replay passes "
            "of the profiled kernels; its dx and weight-gradient GEMMs and its whole pipeline ran after ncu's 8",
    "machine": machine("env.txt"),
    "config": "ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats "
              "--section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section "
              "ComputeWorkloadAnalysis -k regex:mt_moe_hgemm -c 8 -o moe-ncu python3 scripts/moe_bench.py "
              "--out moe-ncu.json --tokens 32768 --reps 1 --skip-loop --check-tokens '' --variants wgmma; "
              "ncu -i moe-ncu.ncu-rep --page details --csv > moe-ncu-details.csv",
    "model": bench["config"],
    "bench_line": re.search(r"^bench t=.*$", log, re.M).group(0),
    "ours_grouped_mma_sync": {k: sy["ours_grouped"][k] for k in ("fwd_tflops", "bwd_tflops", "fwd_bwd_tflops")},
    "torch_dense_matmul": {k: sy["torch_dense_matmul"][k] for k in ("fwd_tflops", "bwd_tflops", "fwd_bwd_tflops")},
    "wgmma_variant": {
        "geometry": variant["geometry"],
        "registers": variant["registers"],
        "gemm_tflops_timed_after_ncu": {k: v["tflops"] for k, v in variant["gemms"][0]["kinds"].items()
                                        if k in ("dx", "wgrad_down", "wgrad_gate_up")},
        "pipeline": {k: variant["pipeline"][0][k] for k in ("fwd_tflops", "bwd_tflops", "fwd_bwd_tflops")},
    },
    "torch_grouped_mm_tflops": {k: v["tflops"] for k, v in bench["peer_grouped_mm"]["kinds"].items()},
    "kernels": kernels,
}
(here / "results.json").write_text(json.dumps(result, indent=1) + "\n")
print(result["bench_line"])
print("wgmma pipeline", {k: round(v, 1) for k, v in result["wgmma_variant"]["pipeline"].items()},
      {k: round(v, 1) for k, v in result["wgmma_variant"]["gemm_tflops_timed_after_ncu"].items()})
for k in kernels:
    print(f"{k['id']} {k['kernel']:22} {k['gemm_kind']:9} {k['grid']} {k['duration_ms']} ms "
          f"{k['tflops_from_duration']:.0f} TF | SM {k['compute_sm_throughput_pct']}% {k['highest_pipe']} "
          f"{k['highest_pipe_pct']}% | mem {k['memory_throughput_pct']}% dram {k['dram_throughput_pct']}% "
          f"L2 hit {k['l2_hit_rate_pct']}% | occ {k['achieved_occupancy_pct']}/{k['theoretical_occupancy_pct']} "
          f"| regs {k['registers_per_thread']:.0f} smem {k['dynamic_shared_kbyte_per_block']} | "
          f"issue 1/{k['cycles_between_issues_per_scheduler']} cyc, CPI {k['warp_cycles_per_issued_instruction']}, "
          f"elig {k['eligible_warps_per_scheduler']} | {k['top_stall']}")

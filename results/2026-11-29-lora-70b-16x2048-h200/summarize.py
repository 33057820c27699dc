#!/usr/bin/env python3
"""results.json of this folder, from the 70B runs' logs and metrics, the estimates, smi.csv, the
SmolLM2 runs' logs and the peft check (nothing typed by hand).

70B runs: each step's time, the steady step (mean of steps 2-3), model TFLOP/s and the compute
stream's busy fraction (the log's lines), host RSS and GPU memory against the plan (the log's end
lines), `megatrain estimate`'s step time against the steady step, and the time before step 1: the
run's wall time (from the start of the trainer's setup) less its steps' times.
"""

import json
import re
import statistics
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


def f(pattern, text, cast=float):
    return cast(re.search(pattern, text, re.M).group(1))


def run70(name, est):
    text = (here / f"{name}.log").read_text()
    e = (here / est).read_text()
    recs = [json.loads(l) for l in (here / f"{name}.jsonl").read_text().splitlines() if l.strip()]
    run = next(r for r in recs if r.get("type") == "run")
    steps = [r for r in recs if r.get("type") == "step"]
    steady = statistics.mean(r["step_ms"] for r in steps[1:]) / 1e3
    wall = f(r"^trained \d+ steps .* in ([\d.]+) s$", text)
    est_s = f(r"^step time: ([\d.]+) s", e)
    return {
        "base_dtype": run["base_dtype"],
        "step_s_each": [r["step_ms"] / 1e3 for r in steps],
        "losses": [r["loss"] for r in steps],
        "steady_step_s": steady,
        "steady_model_tflops_log": f(r"steady state .*?, ([\d.]+) model TFLOP/s", text),
        "steady_tokens_per_s_log": f(r"steady state .*?, (\d+) tokens/s", text),
        "compute_busy_pct_log_mean_of_steps": f(r"compute busy ([\d.]+)%", text),
        "compute_busy_frac_each": [r["compute_busy_frac"] for r in steps],
        "host_rss_gb_log": f(r"host RSS at end: ([\d.]+) GB", text),
        "host_plan_gb_log": f(r"counted ([\d.]+) GB: RSS", text),
        "host_rss_pct_of_plan": f(r"RSS is ([\d.]+)% of it", text),
        "gpu_in_use_gb_log": f(r"GPU memory in use at most: ([\d.]+) GB", text),
        "gpu_plan_gb_log": f(r"the plan counted ([\d.]+) GB: in use", text),
        "gpu_in_use_pct_of_plan": f(r"in use ([\d.]+)%, held", text),
        "gpu_held_pct_of_plan": f(r"held ([\d.]+)% of it", text),
        "frozen_base_bytes": run["frozen_base_bytes"],
        "host_plan_gib_estimate": f(r"^host RAM: ([\d.]+) GiB", e),
        "estimate_step_s": est_s,
        "estimate_tflops": f(r"tokens/s, (\d+) model TFLOP/s", e),
        "estimate_over_measured": est_s / steady,
        "wall_s": wall,
        "before_step_1_s": wall - sum(r["step_ms"] for r in steps) / 1e3,
        "ptxas_report_missing_warning": "without ptxas's report" in text,
    }


int8 = run70("l70-int8-16", "est-70b-int8-16.txt")
nf4 = run70("l70-nf4-16", "est-70b-nf4-16.txt")
# The estimate of the day before (53f5ef0, before e759fbb priced the adapters' memory passes).
old = (here.parent / "2026-11-29-lora-real-finetune-h200/est-70b-int8-16.txt").read_text()
old_s = f(r"^step time: ([\d.]+) s", old)

# smi.csv (machine B, every 5 s): the first sample with the int8 run's memory pool, the first at 100%.
smi = [l.split(", ") for l in (here / "smi.csv").read_text().splitlines()[1:]]
first_pool = next(s[0] for s in smi if int(s[1].split()[0]) > 10000)
first_busy = next(s[0] for s in smi if s[2].strip() == "100 %")

peft = (here / "smol-peft-check.log").read_text()
lora = (here / "smol-lora.log").read_text()
result = {
    "schema_version": 1,
    "suite": "LoRA (issue 35): Llama-3-70B shape r 16 at 16 x 2048 on int8 and NF4 bases; peft check of the merge fix",
    "commit": "c6904bd",
    "date": "2026-11-29",
    "note": "release build of c6904bd (env.txt's last line), machine B of the session (job.sh = job-b.sh of "
            "../2026-11-29-hopper-early-release-h200/)",
    "machine": machine("env.txt"),
    "config": {
        "70b": "megatrain train --config bench-harness/configs/llama3-70b.json --device cuda --precision bf16 "
               "--data synthetic --seq-len 2048 --log-every 1 --lora-rank 16 --steps 3 --batch-size 16 "
               "--base-dtype int8|nf4 --metrics l70-int8-16.jsonl|l70-nf4-16.jsonl",
        "estimate": "megatrain estimate --config bench-harness/configs/llama3-70b.json --device cuda --precision bf16 "
                    "--seq-len 2048 --lora-rank 16 --base-dtype int8|nf4 --batch-size 16",
        "smol": "megatrain train --model smol --data chat/train.jsonl --steps 50 --batch-size 8 --seq-len 256 "
                "--warmup 10 --device cuda --precision bf16 --lr 1e-3 --lora-rank 16 --out smol-lora "
                "(and --out smol-lora-merged --merge); python3 scripts/check_lora_export.py smol smol-lora smol-lora-merged",
    },
    "llama3_70b_16x2048": {
        "int8": int8,
        "nf4": nf4,
        "int8_estimate_53f5ef0_s": old_s,
        "int8_estimate_53f5ef0_over_measured": old_s / int8["steady_step_s"],
        "smi_first_sample_with_pool": first_pool,
        "smi_first_sample_at_100pct": first_busy,
    },
    "smol_peft_check": {
        "adapter_vs_file_max_abs_diff": f(r"vs the file: max abs diff (\S+)", peft),
        "logits_rel_err": f(r"rel err (\S+) \(tol", peft),
        "tolerance": f(r"\(tol (\S+)\)", peft),
        "lora_b_trained": re.search(r"\(trained\): (\d+ of \d+)", peft).group(1),
        "before_fix_rel_err": f(r"rel err (\S+) \(tol",
                                (here.parent / "2026-11-29-lora-real-finetune-h200/smol-peft-check.log").read_text()),
        "lora_loss_first_last": [f(r"loss: first ([\d.]+)", lora), f(r"loss: first [\d.]+ last ([\d.]+)", lora)],
        "gguf_xz_sha256": (here / "smol-sha.txt").read_text().split()[0],
        "gguf_sha_matches_expected": len(set(l.split()[0] for l in (here / "smol-sha.txt").read_text().splitlines())) == 1,
    },
}
(here / "results.json").write_text(json.dumps(result, indent=1) + "\n")
for n, r in (("int8", int8), ("nf4", nf4)):
    print(f"{n}: steps {[round(x, 2) for x in r['step_s_each']]} s, steady {r['steady_step_s']:.2f} s, "
          f"{r['steady_model_tflops_log']} TFLOP/s, compute {r['compute_busy_pct_log_mean_of_steps']}%, "
          f"RSS {r['host_rss_pct_of_plan']}%, GPU {r['gpu_in_use_pct_of_plan']}%, estimate {r['estimate_step_s']} s "
          f"({r['estimate_over_measured']:.4f}), before step 1 {r['before_step_1_s']:.1f} s of {r['wall_s']} s")
print(f"int8 estimate at 53f5ef0 {old_s} s ({old_s / int8['steady_step_s']:.4f}); smi pool {first_pool}, busy {first_busy}")
print(result["smol_peft_check"])

#!/usr/bin/env python3
"""results.json of this folder, from the two MT_PROFILE=1 logs, their metrics and the env files
(nothing typed by hand; the 512k step and the dense-matmul rate are read from their folders).

The 3-step run (machine B): every profile section's total / 3 (a step), its share of the mean step,
the sections grouped, the GEMM sections' TFLOP/s from their FLOPs, and the step extrapolated to
1 x 524288 (attention x 16: s^2 per sequence, 4x the length; everything else x 4: linear in tokens)
against the 512k step measured in ../2026-11-28-512k-two-steps-h200/. The 2-step run (machine A):
what its first step cost beyond the second.

FLOPs (T tokens, H hidden, I intermediate, L layers, nh/nkv heads of d): the recompute runs each
layer's forward again in the backward, but the MLP's down projection only in the first forward
(mlp.rs: `want_out` is false in the recompute; the section is still marked, so its count doubles).
gate/up fwd 2*T*H*2I per layer, twice a step; down fwd 2*T*I*H once; each backward 2x its forward.
qkv fwd 2*T*H*(nh + 2*nkv)*d and o 2*T*H*H per layer, twice a step (both needed by the recompute).
LM head (the loss section, cross-entropy included) 6*T*H*V, once a step.
Attention forward 2*nh*T^2*d (causal, the bench's formula), backward 2.5x that.
"""

import json
import re
from pathlib import Path

here = Path(__file__).resolve().parent
results = here.parent

GROUPS = {
    "attention fwd+bwd": ["fwd 4 attention", "bwd 4 attention"],
    "MLP GEMMs": ["fwd 7 gate/up proj (GEMM)", "bwd 7 gate/up proj (4 GEMMs + accumulate)",
                  "fwd 9 down proj (GEMM) + residual", "bwd 9 down proj (2 GEMMs + accumulate)"],
    "attention projection GEMMs": ["fwd 2 qkv proj (GEMM)", "bwd 2 qkv proj (6 GEMMs + accumulate)",
                                   "fwd 5 o proj (GEMM) + residual", "bwd 5 o proj (2 GEMMs + accumulate)"],
    "loss (LM head GEMMs + CE)": ["loss (LM head GEMMs + cross-entropy)"],
    "elementwise (norms, silu * up, qk norm + rope)": [
        "fwd 1 input norm", "bwd 1 input norm", "fwd 6 post norm", "bwd 6 post norm",
        "fwd 8 silu * up", "bwd 8 silu * up", "fwd 3 qk norm + rope", "bwd 3 qk norm + rope"],
}


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


def run(log, metrics):
    text = (here / log).read_text()
    recs = [json.loads(l) for l in (here / metrics).read_text().splitlines() if l.strip()]
    r = next(x for x in recs if x.get("type") == "run")
    steps = [x for x in recs if x.get("type") == "step"]
    prof = {m.group(1).strip(): (int(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^profile (.+?)\s+(\d+) calls\s+([\d.]+) ms", text, re.M)}
    return r, steps, prof, text


r3, steps3, prof3, text3 = run("prof-7b-128k-3steps.log", "prof-7b-128k-3steps.jsonl")
r2, steps2, prof2, text2 = run("prof-7b-128k.log", "prof-7b-128k.jsonl")
m = r3["model"]
T, H, I, L = r3["tokens_per_step"], m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
nh, nkv, d = m["num_attention_heads"], m["num_key_value_heads"], m["head_dim"]
n3 = len(steps3)
step_ms = sum(x["step_ms"] for x in steps3) / n3

sections = {k: {"calls": c, "total_ms": ms, "per_step_ms": ms / n3, "pct_of_step": 100 * ms / n3 / step_ms}
            for k, (c, ms) in prof3.items()}
groups = {}
for g, names in GROUPS.items():
    per = sum(prof3[n][1] for n in names) / n3
    groups[g] = {"per_step_ms": per, "pct_of_step": 100 * per / step_ms}
assert sum(len(v) for v in GROUPS.values()) == len(prof3), "a profile section is in no group"
sections_ms = sum(ms for _, ms in prof3.values()) / n3

# GEMM FLOPs per step and the sections' rates.
gu = 2 * T * H * 2 * I * L      # gate/up forward, one pass over the layers
dn = 2 * T * I * H * L          # down forward
qkv = 2 * T * H * (nh + 2 * nkv) * d * L
o = 2 * T * H * H * L
flops = {
    "fwd 7 gate/up proj (GEMM)": 2 * gu,
    "fwd 9 down proj (GEMM) + residual": dn,
    "bwd 7 gate/up proj (4 GEMMs + accumulate)": 2 * gu,
    "bwd 9 down proj (2 GEMMs + accumulate)": 2 * dn,
    "fwd 2 qkv proj (GEMM)": 2 * qkv,
    "bwd 2 qkv proj (6 GEMMs + accumulate)": 2 * qkv,
    "fwd 5 o proj (GEMM) + residual": 2 * o,
    "bwd 5 o proj (2 GEMMs + accumulate)": 2 * o,
    "loss (LM head GEMMs + cross-entropy)": 6 * T * H * m["vocab_size"],
}
attn_fwd_call = 2 * nh * T * T * d
rates = {k: {"flops_per_step": f, "tflops": f / (sections[k]["per_step_ms"] / 1e3) / 1e12} for k, f in flops.items()}
rates["fwd 4 attention"] = {"flops_per_call": attn_fwd_call,
                            "tflops": attn_fwd_call / (prof3["fwd 4 attention"][1] / prof3["fwd 4 attention"][0] / 1e3) / 1e12}
rates["bwd 4 attention"] = {"flops_per_call": 2.5 * attn_fwd_call,
                            "tflops": 2.5 * attn_fwd_call / (prof3["bwd 4 attention"][1] / prof3["bwd 4 attention"][0] / 1e3) / 1e12}
mlp_flops = sum(flops[k] for k in GROUPS["MLP GEMMs"])
mlp_tflops = mlp_flops / (groups["MLP GEMMs"]["per_step_ms"] / 1e3) / 1e12
dense = json.loads((results / "2026-11-29-moe-wgmma-ncu-h200/moe-ncu.json").read_text())
dense_tflops = dense["bench"][0]["systems"]["torch_dense_matmul"]["fwd_bwd_tflops"]

# Extrapolation to 1 x 524288.
big = json.loads((results / "2026-11-28-512k-two-steps-h200/results.json").read_text())
measured_512k_s = big["steps"][-1]["step_s"]
scale = 524288 // T
attn_s = groups["attention fwd+bwd"]["per_step_ms"] * scale ** 2 / 1e3
other = {g: v["per_step_ms"] * scale / 1e3 for g, v in groups.items() if g != "attention fwd+bwd"}
pred_s = attn_s + sum(other.values())
elementwise = {n: sections[n]["per_step_ms"] * scale / 1e3 for n in GROUPS["elementwise (norms, silu * up, qk norm + rope)"]}
mlp_512k_s = other["MLP GEMMs"]
extrap = {
    "scale_tokens": scale,
    "attention_s (x16)": attn_s,
    "other_groups_s (x4)": other,
    "sections_sum_s": pred_s,
    "measured_512k_step_s": measured_512k_s,
    "measured_from": "../2026-11-28-512k-two-steps-h200/results.json, step 2 (release build of f6cae5f)",
    "sections_sum_over_measured": pred_s / measured_512k_s,
    "attention_pct_of_measured": 100 * attn_s / measured_512k_s,
    "non_attention_pct_of_measured": 100 * sum(other.values()) / measured_512k_s,
    "elementwise_sections_s": elementwise,
    "largest_elementwise_section_pct_of_measured": 100 * max(elementwise.values()) / measured_512k_s,
    "elementwise_group_pct_of_measured": 100 * other["elementwise (norms, silu * up, qk norm + rope)"] / measured_512k_s,
    "loss_pct_of_measured": 100 * other["loss (LM head GEMMs + CE)"] / measured_512k_s,
    "mlp_gemms_pct_of_measured": 100 * mlp_512k_s / measured_512k_s,
    "mlp_saving_at_dense_matmul_rate_s": mlp_512k_s * (1 - mlp_tflops / dense_tflops),
}

# The 2-step run: its first step's excess over the second, and where (against 2 x the 3-step run's step).
first_excess = {k: prof2[k][1] - 2 * sections[k]["per_step_ms"] for k in prof2}
result = {
    "schema_version": 1,
    "suite": "long-context (issue 32): where a long step's device time goes (MT_PROFILE=1)",
    "commit": "c6904bd",
    "date": "2026-11-29",
    "note": "release build of c6904bd. MT_PROFILE=1 synchronises the device at every section boundary: the totals "
            "say where device time goes, not how fast a step is. prof-7b-128k (2 steps) ran on machine A, "
            "prof-7b-128k-3steps (3 steps) on machine B",
    "machines": {"A": machine("env-a.txt"), "B": machine("env-b.txt")},
    "config": {
        "prof-7b-128k (machine A, job.sh)":
            "MT_PROFILE=1 megatrain train --config bench-harness/configs/qwen2.5-7b.json --device cuda --precision bf16 "
            "--data synthetic --batch-size 1 --optim-mode lean --grad-dtype none --lr 1e-4 --log-every 1 "
            "--seq-len 131072 --steps 2 --metrics prof-7b-128k.jsonl",
        "prof-7b-128k-3steps (machine B, a later call)": "the same with --steps 3 --metrics prof-7b-128k-3steps.jsonl",
    },
    "model": {"hidden": H, "intermediate": I, "layers": L, "heads": nh, "kv_heads": nkv, "head_dim": d,
              "vocab": m["vocab_size"], "tokens_per_step": T},
    "three_steps": {
        "step_s_each": [x["step_ms"] / 1e3 for x in steps3],
        "mean_step_ms": step_ms,
        "losses": [x["loss"] for x in steps3],
        "compute_busy_frac": [x["compute_busy_frac"] for x in steps3],
        "sections_per_step_ms": sections_ms,
        "unprofiled_per_step_ms": step_ms - sections_ms,
        "sections": sections,
        "groups": groups,
        "gemm_and_attention_tflops": rates,
        "mlp_gemm_flops_per_step": mlp_flops,
        "mlp_gemm_tflops": mlp_tflops,
        "torch_dense_matmul_fwd_bwd_tflops_machine_b": dense_tflops,
        "mlp_over_dense_matmul": mlp_tflops / dense_tflops,
    },
    "extrapolated_to_524288": extrap,
    "two_steps": {
        "step_s_each": [x["step_ms"] / 1e3 for x in steps2],
        "first_step_excess_s": (steps2[0]["step_ms"] - steps2[1]["step_ms"]) / 1e3,
        "sections_total_ms": {k: ms for k, (_, ms) in prof2.items()},
        "section_excess_over_2x_three_step_ms": {k: v for k, v in sorted(first_excess.items(), key=lambda kv: -kv[1])},
    },
}
(here / "results.json").write_text(json.dumps(result, indent=1) + "\n")

print(f"3 steps: {[round(x['step_ms'] / 1e3, 2) for x in steps3]} s, mean {step_ms:.1f} ms; "
      f"sections {sections_ms:.1f} ms/step, unprofiled {step_ms - sections_ms:.1f}")
for k, v in sections.items():
    rate = rates.get(k, {}).get("tflops")
    print(f"  {k:45} {v['per_step_ms']:9.1f} ms {v['pct_of_step']:5.1f}%" + (f"  {rate:.0f} TFLOP/s" if rate else ""))
for g, v in groups.items():
    print(f"  [{g}] {v['per_step_ms']:.1f} ms {v['pct_of_step']:.1f}%")
print(f"MLP GEMMs {mlp_flops:.4e} FLOPs/step, {mlp_tflops:.1f} TFLOP/s ({mlp_tflops / dense_tflops:.3f}x torch dense {dense_tflops:.1f})")
print(f"512k: attention {attn_s:.1f} s + others {sum(other.values()):.1f} s = {pred_s:.1f} s vs measured "
      f"{measured_512k_s:.1f} ({pred_s / measured_512k_s:.3f}); largest elementwise "
      f"{extrap['largest_elementwise_section_pct_of_measured']:.2f}%, all elementwise "
      f"{extrap['elementwise_group_pct_of_measured']:.2f}%, loss {extrap['loss_pct_of_measured']:.2f}%, "
      f"MLP {extrap['mlp_gemms_pct_of_measured']:.2f}%, MLP saving at dense rate {extrap['mlp_saving_at_dense_matmul_rate_s']:.1f} s")
for k, v in extrap["other_groups_s (x4)"].items():
    print(f"  512k {k}: {v:.2f} s")
print(f"2 steps: {[round(x['step_ms'] / 1e3, 2) for x in steps2]} s, first-step excess "
      f"{result['two_steps']['first_step_excess_s']:.1f} s; by section:",
      {k: round(v) for k, v in list(result['two_steps']['section_excess_over_2x_three_step_ms'].items())[:4]})

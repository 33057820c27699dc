#!/usr/bin/env python3
"""Summarises state_codes.txt (crates/optim/examples/state_codes.rs) over the four golden models:
per format, the range of each quantisation-error figure over the models and snapshots (steps 10,
100, 300 of the fp32-moment run, round to nearest), and the worst relative loss difference from
the fp32-moment run in each regime. Usage: summarize.py state_codes.txt > summary.txt"""
import collections
import re
import sys

txt = open(sys.argv[1]).read()
model = regime = None
step = None
stat = collections.defaultdict(list)
train = collections.defaultdict(dict)
for line in txt.splitlines():
    m = re.match(r"## (\S+), (.*?):", line)
    if m:
        model, regime, step = m.group(1), m.group(2), None
        continue
    m = re.match(r"### states after step (\d+)", line)
    if m:
        step = int(m.group(1))
        continue
    if line.startswith("### training"):
        step = None
        continue
    if step is not None and "zeroed" in line:
        nums = re.findall(r"\d+\.\d+e[-+]?\d+|\d+\.\d+(?=%)", line)
        stat[line[:28].strip()].append([float(x) for x in nums])
        continue
    m = re.match(r"(.{28}) max\s+(\S+)\s+last20\s+(\S+)", line)
    if m:
        train[(regime, m.group(1).strip())][model] = float(m.group(2))

cols = ["v>0 decoded 0 (%)", "sqrt(v) rel err p50", "p99", "max", "update m/(sqrt v + eps) rel L2"]
print("## Quantisation error of the fp32-moment run's states (4 models x 3 snapshots): min - max")
print(f"{'format':28s} " + " | ".join(cols))
for name, rows in stat.items():
    rng = [f"{min(r[i] for r in rows):.2e} - {max(r[i] for r in rows):.2e}" for i in range(5)]
    print(f"{name:28s} " + " | ".join(rng))
print()
print("## Training: worst |loss - fp32 loss| / fp32 loss over 300 steps, per model and the worst")
for (reg, name), d in train.items():
    per = " ".join(f"{k} {v:.1e}" for k, v in d.items())
    print(f"{reg:13s} {name:28s} worst {max(d.values()):.2e}   {per}")

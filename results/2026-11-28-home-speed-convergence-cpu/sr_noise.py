#!/usr/bin/env python3
"""How much noise stochastic rounding puts into AdamW's second moment at beta2 = 0.999: a model of
the stored formats (crates/optim/src/moments/mod.rs), not the shipped code.

Each simulated parameter sees i.i.d. gradients g ~ N(0, 1) and keeps v = beta2·v + (1 − beta2)·g²
twice: in f64 (the reference) and stored after every step in a coded format with an unbiased
stochastic rounding, as the optimizer does. After STEPS steps (past v's memory of ~1/(1 − beta2)
steps, so the spread is at its steady state) it prints, over the parameters, the coded v's relative
error against the reference and the step-size factor sqrt(v_ref / v_coded) (the coded run's update
over the reference's, for the same m): its mean (the bias) and its spread.

Formats: bf16 (8 significant bits, the stored v's rounding); the 8-bit fourth-root code
c⁴·s with s = max/255⁴, for an element whose v sits at a fixed fraction of its block's largest
(the block's largest held fixed: a simplification; in the optimizer it moves with the block).
Usage: sr_noise.py [STEPS] [PARAMS] (defaults 3000, 400). Pure Python, seeded: the same output every run.
"""

import math
import random
import struct
import sys

BETA2 = 0.999
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
PARAMS = int(sys.argv[2]) if len(sys.argv) > 2 else 400


def bf16_sr(x, rng):
    """x rounded to bf16 with a uniform 16-bit draw added to the dropped half (as `bf16_sr`)."""
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    b = ((b + rng.getrandbits(16)) >> 16) << 16
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def q8v_sr(x, top, rng):
    """x in the fourth-root code of a block whose largest v is `top`, rounded stochastically between
    its two neighbouring codes, unbiased in value (as `code_v`)."""
    s = top / 255.0**4
    y = x / s
    lo = min(math.floor(y ** 0.25), 254)
    t_lo, t_hi = lo**4, (lo + 1) ** 4
    c = lo + 1 if rng.random() * (t_hi - t_lo) < y - t_lo else lo
    return c**4 * s


def simulate(code, rng):
    rel, factor = [], []
    for _ in range(PARAMS):
        v_ref = v_code = 1.0
        for _ in range(STEPS):
            g2 = rng.gauss(0.0, 1.0) ** 2
            v_ref = BETA2 * v_ref + (1.0 - BETA2) * g2
            v_code = code(BETA2 * v_code + (1.0 - BETA2) * g2, rng)
        rel.append(v_code / v_ref - 1.0)
        factor.append(math.sqrt(v_ref / v_code) if v_code > 0 else float("inf"))
    n = len(rel)
    rms = math.sqrt(sum(r * r for r in rel) / n)
    mean_f = sum(factor) / n
    sd_f = math.sqrt(sum((f - mean_f) ** 2 for f in factor) / n)
    return rms, mean_f, sd_f, min(factor), max(factor)


def main():
    print(f"beta2 {BETA2}, {STEPS} steps, {PARAMS} parameters, g ~ N(0, 1) (E v = 1)")
    print("| format | v / block's largest | v rel. error, RMS | step-size factor mean | its std | min-max |")
    print("|---|---|---|---|---|---|")
    cases = [("bf16", None, lambda x, r: bf16_sr(x, r))]
    for frac in [1.0 / 4, 1e-2, 1e-4, 1e-6]:
        # The block's largest is 1 / frac times this element's expected v (1.0).
        cases.append(("int8 ∜", frac, lambda x, r, top=1.0 / frac: q8v_sr(x, top, r)))
    for name, frac, code in cases:
        rms, mean_f, sd_f, lo, hi = simulate(code, random.Random(1))
        where = "-" if frac is None else f"{frac:g}"
        print(f"| {name} | {where} | {rms:.3f} | {mean_f:.4f} | {sd_f:.3f} | {lo:.3f}-{hi:.3f} |")


if __name__ == "__main__":
    main()

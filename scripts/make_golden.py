#!/usr/bin/env python3
"""Golden fixtures from PyTorch + Hugging Face transformers for the engine's numerics tests.

Run (from the repository root; versions pinned in scripts/requirements-golden.txt):

    /opt/golden-venv/bin/python scripts/make_golden.py [--out DIR]

The code is the package scripts/golden/ (one module per concern; its __init__ lists them);
this file is the entry point and the specification.

DIR defaults to crates/testkit/fixtures/golden. For each tiny model NAME below the script writes
NAME.config.json (the HF config, as `config.to_json_file` writes it) and NAME.safetensors.

Models (all: vocab 128, hidden 64, intermediate 96, 2 layers, 4 query heads, SiLU, eager attention):
  llama_gqa     LlamaConfig, 2 KV heads, untied, rope_theta 1e4, Llama-3 rope scaling (factor 8,
                low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 32). The
                small original context puts the 8 frequencies of head_dim 16 into all three
                llama3 bands (wavelength < 32/4: kept; 32/4..32/1: smoothed; > 32: divided by 8);
                the script checks that each band is hit. (With 8 instead of 32 no frequency is
                kept unchanged, leaving that branch untested.)
  llama_tied    LlamaConfig, 4 KV heads, tie_word_embeddings=True (no lm_head.weight parameter;
                the embedding gradient includes the head's contribution), no rope scaling.
  qwen2_bias    Qwen2Config, 2 KV heads, untied, bias on q/k/v.
  qwen3_qknorm  Qwen3Config, 2 KV heads, head_dim 32 (!= hidden/heads = 16), untied, q_norm/k_norm.

Mixture-of-experts models (smaller, to keep the fixtures a few hundred KB: vocab 64, hidden 32,
2 layers, 4 query heads, 2 KV heads, experts of width 16, top-2 routing):
  qwen3_moe     Qwen3MoeConfig, 8 experts, head_dim 16 (!= hidden/heads = 8), norm_topk_prob,
                output_router_logits with router_aux_loss_coef 0.1 (the load-balancing loss added).
  mixtral       MixtralConfig, 4 experts (top-k always renormalised), output_router_logits with
                router_aux_loss_coef 0.05, rope_theta 1e6.
  olmoe         OlmoeConfig, 8 experts, q/k norm over the whole projections, no norm_topk_prob,
                no load-balancing loss. Layer 0's router is set so that expert 0 receives no token
                at step 0: its row is zero and rows 2 and 4 are minus rows 1 and 3, so every token
                has a logit >= 0 among experts {1, 2} and another among {3, 4}, and top-2 never
                picks expert 0 (logit 0); its gate_up/down gradients are exactly zero.
  The router weights are transformers' init times 10 (sharper routing). The router softmax, the
  top-k weights and the load-balancing loss's sums are float32 islands of transformers' code too
  (kept). Every row's k-th and (k+1)-th router probabilities must differ by more than 1e-5
  relative at every step (checked), so that float32 rounding cannot change which experts a
  token reaches.

GPT-OSS (vocab 64, hidden 32, 2 layers, 4 query heads, 2 KV heads, head_dim 16, 8 experts of
width 16, top-4):
  gpt_oss       GptOssConfig with every feature the released models have: q/k/v/o biases, a sink
                logit per head (set to randn, std 1, so that the sinks take a visible share of
                each row), layer 0 a sliding window of 4 keys (shorter than T = 16), layer 1 full,
                YaRN RoPE (theta 150000, factor 32, beta_fast 32, beta_slow 1, original context
                4096, truncate false: at head_dim 16 the eight frequencies are 3 kept, 2 blended,
                3 interpolated, checked), a biased router (weights x 10) whose top-4 logits are
                softmaxed, biased experts with the clamped GLU at swiglu_limit 0.1 (small, so that
                the clamps bind: every step, some routed gate values lie above it and some up
                values outside +-0.1, checked, and none within 1e-6 relative of a bound, so that
                float32 rounding cannot flip a clamp), the load-balancing loss (coef 0.1,
                transformers 5's: over the router logits) in the loss. Its attention softmax and
                router run in float64 (no float32 island); its RMSNorm normalises in float32 and
                multiplies the weight in float64.
  `--only gpt_oss` writes just this fixture (the others stay as committed).

Initialisation (deterministic, seeded per model): `torch.manual_seed(seed)`, then the model is
built in float32 by transformers' own init (normal(0, 0.02) for Linear/Embedding, ones for norms,
zeros for biases). Then, from a generator seeded with `seed + 1`, in named_parameters() order,
every RMSNorm weight is set to 1 + 0.1*randn and every bias to 0.02*randn, so that every
parameter gets a non-trivial gradient. These float32 values are saved as `param.*`; then the
model is converted to float64 (`model.double()`) and all further computation is float64.
Known float32 islands inside transformers' code, kept as transformers has them: rotary cos/sin
are computed in float32, RMSNorm normalises in float32 (x.to(float32) ... .to(input dtype)), and
eager attention takes its softmax in float32. Each is a single float32 rounding (relative error
~6e-8) of an otherwise float64 computation, so the oracle is still far more accurate than a
float32 engine; `--precision-report` measures their effect against fully float64 versions.

Batch (B=4, T=16, generator seeded with `seed + 2`): input_ids uniform in [0, vocab).
targets[b, t] = input_ids[b, t+1] for t < T-1 and -100 at t = T-1 (the next-token target
aligned to position t; -100 = ignored). Also ignored (-100): the last 6 positions of sequence 1
(simulated padding) and the positions (0, 5), (2, 0), (3, 9). Position ids are 0..T-1 for every
sequence; causal attention, no attention mask. The model is called without labels (HF would
shift them); the loss is computed here:

    loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1),
                           ignore_index=-100, reduction="mean")

i.e. the mean over the non-ignored targets of the whole batch.

Training: three steps k = 0, 1, 2 on the same batch, each: zero grads, forward, loss, backward,
grad_norms[k] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) (the pre-clip global L2
norm; the call also clips to 1.0), then one step of
torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
(one default parameter group: weight decay applies to every parameter, biases and norms included).

NAME.safetensors keys (all tensors float32 except the ids; parameter names are HF
named_parameters() names, e.g. model.layers.0.self_attn.q_proj.weight):
  input_ids   I64 [B, T]       targets     I64 [B, T]
  logits      F32 [B, T, V]    logits of step 0 (before any update)
  loss        F32 []           loss of step 0
  losses      F32 [3]          loss of steps 0, 1, 2 (each before its update)
  grad_norms  F32 [3]          pre-clip global gradient norm of steps 0, 1, 2
  param.NAME  F32              initial values
  grad.NAME   F32              step-0 gradients, before clipping
  step3.NAME  F32              values after the three updates
The header metadata (strings) records the versions, seed and these definitions.

Determinism: fixed seeds, one CPU thread, deterministic algorithms, no timestamps, and the
header metadata keys sorted (the safetensors writer orders them randomly); two runs on the same
machine give byte-identical files (`--check` verifies this by running twice).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from golden.fixture import make_one, sha256
from golden.precision import f32_control, precision_report
from golden.specs import MAX_NORM, SPECS


def main() -> int:
    repo = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=repo / "crates/testkit/fixtures/golden")
    ap.add_argument("--check", action="store_true", help="run twice and compare sha256")
    ap.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="write only this fixture (repeatable); the others are left as they are",
    )
    ap.add_argument(
        "--precision-report",
        action="store_true",
        help="also measure the effect of transformers' float32 islands (writes nothing extra)",
    )
    ap.add_argument(
        "--f32-control",
        action="store_true",
        help="only compare a float32 PyTorch run against the committed fixtures (writes nothing)",
    )
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    args.out.mkdir(parents=True, exist_ok=True)

    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    specs = [s for s in SPECS if not args.only or s.name in args.only]
    if args.only and len(specs) != len(set(args.only)):
        print(f"error: --only names {args.only}; models: {[s.name for s in SPECS]}", file=sys.stderr)
        return 1
    if args.f32_control:
        for spec in specs:
            f32_control(spec, args.out)
        return 0
    results = [make_one(spec, args.out, verbose=True) for spec in specs]
    total = 0
    for r in results:
        size = r["path"].stat().st_size
        total += size
        losses = ", ".join(f"{x:.6f}" for x in r["losses"])
        norms = ", ".join(f"{x:.6f}" for x in r["grad_norms"])
        print(
            f"{r['name']:13s} params {r['n_params']:6d}  targets {r['n_targets']}  "
            f"losses [{losses}]  grad_norms [{norms}]  {size} bytes  {sha256(r['path'])[:16]}"
        )
    print(f"total {total} bytes in {len(results)} safetensors files")
    if not any(r["grad_norms"][0] > MAX_NORM for r in results):
        print("error: no model has a step-0 grad norm above the clip threshold", file=sys.stderr)
        return 1

    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            again = [make_one(spec, Path(tmp), verbose=False) for spec in specs]
            for r, s in zip(results, again):
                for ext in (".safetensors", ".config.json"):
                    a = r["path"].with_name(r["name"] + ext)
                    b = s["path"].with_name(s["name"] + ext)
                    if sha256(a) != sha256(b):
                        print(f"error: {a.name} differs between two runs", file=sys.stderr)
                        return 1
        print("check: a second run produced byte-identical files")

    if args.precision_report:
        for spec in specs:
            if not spec.is_moe():  # its float64 patches cover the dense families only
                precision_report(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())

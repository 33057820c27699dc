#!/usr/bin/env python3
"""Golden fixtures from PyTorch + Hugging Face transformers for the engine's numerics tests.

Run (from the repository root; versions pinned in scripts/requirements-golden.txt):

    /opt/golden-venv/bin/python scripts/make_golden.py [--out DIR]

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
import hashlib
import json
import math
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from transformers import (
    AutoModelForCausalLM,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

FORMAT = "megatrain-golden-v1"
B, T = 4, 16
IGNORE = -100
PAD_TAIL = 6  # ignored positions at the end of sequence 1
SCATTERED_IGNORED = [(0, 5), (2, 0), (3, 9)]
STEPS = 3
MAX_NORM = 1.0
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
NORM_JITTER, BIAS_STD = 0.1, 0.02

TARGETS_DEF = (
    f"targets[b,t] = input_ids[b,t+1] for t < T-1, -100 at t = T-1; also -100 at the last "
    f"{PAD_TAIL} positions of sequence 1 and at (b,t) in {SCATTERED_IGNORED}"
)
LOSS_DEF = (
    "F.cross_entropy(logits.reshape(-1,V), targets.reshape(-1), ignore_index=-100, "
    "reduction='mean') on model(input_ids, position_ids=0..T-1).logits, no labels passed"
)
OPTIM_DEF = (
    f"per step: grad_norm = clip_grad_norm_(params, {MAX_NORM}) (pre-clip norm; clips), then "
    "AdamW(lr=1e-3, betas=(0.9,0.999), eps=1e-8, weight_decay=0.1), one param group"
)

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    hidden_act="silu",
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)


MOE_COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)


GPT_OSS_COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    num_experts_per_tok=4,
    tie_word_embeddings=False,
)
SINK_STD = 1.0  # GPT-OSS's sink logits: randn times this (transformers' init is 0.02)
MIN_CLAMP_MARGIN = 1e-6


@dataclass
class Spec:
    """One tiny model: its config and seed."""

    name: str
    config_cls: type
    seed: int
    kwargs: dict = field(default_factory=dict)
    common: dict = field(default_factory=lambda: COMMON)

    def config(self):
        return self.config_cls(**self.common, **self.kwargs)

    def is_moe(self) -> bool:
        return self.common is MOE_COMMON or self.common is GPT_OSS_COMMON

    def is_gpt_oss(self) -> bool:
        return self.common is GPT_OSS_COMMON


SPECS = [
    Spec(
        "llama_gqa",
        LlamaConfig,
        1001,
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    Spec(
        "llama_tied",
        LlamaConfig,
        1002,
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    Spec(
        "qwen2_bias",
        Qwen2Config,
        1003,
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    Spec(
        "qwen3_qknorm",
        Qwen3Config,
        1004,
        dict(
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    Spec(
        "qwen3_moe",
        Qwen3MoeConfig,
        1005,
        dict(
            head_dim=16,
            moe_intermediate_size=16,
            num_experts=8,
            norm_topk_prob=True,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        MOE_COMMON,
    ),
    Spec(
        "mixtral",
        MixtralConfig,
        1006,
        dict(
            num_local_experts=4,
            output_router_logits=True,
            router_aux_loss_coef=0.05,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        MOE_COMMON,
    ),
    Spec(
        "olmoe",
        OlmoeConfig,
        1007,
        dict(
            num_experts=8,
            norm_topk_prob=False,
            output_router_logits=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        MOE_COMMON,
    ),
    Spec(
        "gpt_oss",
        GptOssConfig,
        1008,
        dict(
            num_local_experts=8,
            attention_bias=True,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            swiglu_limit=0.1,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=4096,
            ),
        ),
        GPT_OSS_COMMON,
    ),
]
IDLE_EXPERT = {"olmoe": (0, 0)}  # (layer, expert) that receives no token at step 0
MIN_ROUTING_MARGIN = 1e-5
ROUTER_SCALE = 10.0  # router weights: transformers' normal(0, 0.02) init times this


def check_saved_config(spec: Spec, path: Path, verbose: bool) -> None:
    """Asserts that the written config.json carries every value the engine's parser reads."""
    saved = json.loads(path.read_text())
    if verbose:
        print(f"--- {path.name}\n{json.dumps(saved, indent=2, sort_keys=True)}")
    expected = {**spec.common, **spec.kwargs}
    expected.pop("rope_parameters")
    expected.pop("use_sliding_window", None)
    if "num_experts" in expected and spec.name == "qwen3_moe":
        # transformers 5 writes qwen3_moe's expert count as num_local_experts.
        expected["num_local_experts"] = expected.pop("num_experts")
    for key, value in expected.items():
        if key == "tie_word_embeddings" and not value:
            assert saved.get(key, False) is False, (path, key)
            continue
        assert saved.get(key) == value, f"{path}: {key} = {saved.get(key)!r}, expected {value!r}"
    assert saved.get("use_sliding_window", False) is False, path
    assert saved.get("attention_bias", False) is spec.is_gpt_oss(), path
    assert saved.get("mlp_bias", False) is False, path
    rope = saved["rope_parameters"]
    want = spec.kwargs["rope_parameters"]
    for key, value in want.items():
        assert rope.get(key) == value, f"{path}: rope_parameters.{key} = {rope.get(key)!r}"
    assert saved.get("rope_theta", rope["rope_theta"]) == rope["rope_theta"], path


def build_model(spec: Spec):
    """The float32 model from transformers' init, with norms and biases perturbed."""
    torch.manual_seed(spec.seed)
    # MoE: the "eager" experts loop (the per-expert Python loop of the modelling file); the
    # default grouped GEMM has no float64 kernel.
    extra = dict(experts_implementation="eager") if spec.is_moe() else {}
    model = AutoModelForCausalLM.from_config(
        spec.config(), attn_implementation="eager", dtype=torch.float32, **extra
    )
    assert model.config._attn_implementation == "eager"
    if spec.is_moe():
        assert model.config._experts_implementation == "eager"
    assert model.config.attention_dropout == 0.0
    gen = torch.Generator().manual_seed(spec.seed + 1)
    norm_weights = {
        f"{mod_name}.weight"
        for mod_name, mod in model.named_modules()
        if type(mod).__name__.endswith("RMSNorm")
    }
    with torch.no_grad():
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32, name
            if name in norm_weights:
                p.copy_(1.0 + NORM_JITTER * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(BIAS_STD * torch.randn(p.shape, generator=gen))
        if spec.is_moe():
            # Sharper routing (router logits of order 1 rather than 0.1): wider routing margins.
            for layer in model.model.layers:
                router = layer.mlp.router if spec.is_gpt_oss() else layer.mlp.gate
                router.weight.mul_(ROUTER_SCALE)
        if spec.is_gpt_oss():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(SINK_STD * torch.randn(layer.self_attn.sinks.shape, generator=gen))
        if spec.name in IDLE_EXPERT:
            layer, expert = IDLE_EXPERT[spec.name]
            assert expert == 0
            w = model.model.layers[layer].mlp.gate.weight
            w[0].zero_()
            w[2].copy_(-w[1])
            w[4].copy_(-w[3])
    names = [n for n, _ in model.named_parameters()]
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in names, names
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert "lm_head.weight" in names, names
    return model


def check_rope(spec: Spec, model) -> None:
    """Asserts that llama3 scaling hits all three of its frequency bands at these sizes."""
    cfg = model.config
    rope = cfg.rope_parameters
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    used = model.model.rotary_emb.inv_freq.float()
    if rope["rope_type"] == "yarn":
        # Kept (extrapolated), blended by the ramp, and interpolated (divided by the factor).
        ratio = used / plain
        kept = int(torch.isclose(ratio, torch.tensor(1.0), rtol=1e-6).sum())
        divided = int(torch.isclose(ratio, torch.tensor(1.0 / rope["factor"]), rtol=1e-6).sum())
        blended = dim // 2 - kept - divided
        assert kept > 0 and divided > 0 and blended > 0, (spec.name, ratio)
        print(f"{spec.name}: yarn rope: of {dim // 2} frequencies {kept} kept, {blended} blended, {divided} interpolated")
        return
    if rope["rope_type"] != "llama3":
        assert torch.equal(used, plain), f"{spec.name}: unexpected rope scaling"
        return
    ratio = used / plain
    kept = int(torch.isclose(ratio, torch.tensor(1.0), rtol=1e-6).sum())
    divided = int(torch.isclose(ratio, torch.tensor(1.0 / rope["factor"]), rtol=1e-6).sum())
    smoothed = dim // 2 - kept - divided
    assert kept > 0 and divided > 0 and smoothed > 0, (spec.name, ratio)
    print(
        f"{spec.name}: llama3 rope: of {dim // 2} inverse frequencies {kept} kept, "
        f"{smoothed} smoothed, {divided} divided by {rope['factor']}"
    )


def make_batch(spec: Spec, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed + 2)
    input_ids = torch.randint(0, vocab, (B, T), generator=gen, dtype=torch.int64)
    targets = torch.full((B, T), IGNORE, dtype=torch.int64)
    targets[:, : T - 1] = input_ids[:, 1:]
    targets[1, T - PAD_TAIL :] = IGNORE
    for b, t in SCATTERED_IGNORED:
        targets[b, t] = IGNORE
    return input_ids, targets


def forward_loss(model, input_ids, targets):
    """Logits, loss and (MoE) each layer's router logits. A MoE model's loss adds
    router_aux_loss_coef * aux_loss when its config says output_router_logits, as transformers
    does when it is given labels (here, as for the dense models, the loss is computed outside)."""
    position_ids = torch.arange(T, dtype=torch.int64).expand(B, T)
    moe = hasattr(model.config, "router_aux_loss_coef")
    extra = dict(output_router_logits=True) if moe else {}
    clamp_inputs = []
    hooks = []
    if model.config.model_type == "gpt_oss":
        for layer in model.model.layers:
            hooks.append(layer.mlp.register_forward_hook(lambda m, args, out: clamp_inputs.append(args[0])))
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
    for h in hooks:
        h.remove()
    logits = out.logits
    vocab = logits.shape[-1]
    loss = F.cross_entropy(
        logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=IGNORE, reduction="mean"
    )
    router = None
    if moe:
        router = [r.detach().clone() for r in out.router_logits]
        check_routing(model, router)
        if clamp_inputs:
            check_clamps(model, clamp_inputs, router)
        if model.config.output_router_logits:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return logits, loss, router


def check_routing(model, router_logits) -> None:
    """Asserts every row's k-th and (k+1)-th router probabilities are far apart (see above)."""
    k = model.config.num_experts_per_tok
    for r in router_logits:
        p = torch.softmax(r.double(), dim=-1).sort(dim=-1, descending=True).values
        margin = float(((p[:, k - 1] - p[:, k]) / p[:, k - 1]).min())
        assert margin > MIN_ROUTING_MARGIN, f"routing margin {margin:.2e}: pick another seed"


def check_clamps(model, mlp_inputs, router_logits) -> None:
    """GPT-OSS: for every routed (token, expert), the clamped GLU's bounds bind on some gate and
    up values and leave others free, and no value lies within MIN_CLAMP_MARGIN (relative) of a
    bound, so that float32 rounding cannot change which values are clamped."""
    k, limit = model.config.num_experts_per_tok, model.config.swiglu_limit
    above = outside = inside = 0
    for layer, x, r in zip(model.model.layers, mlp_inputs, router_logits):
        ex = layer.mlp.experts
        x = x.detach().reshape(-1, x.shape[-1])
        picked = torch.topk(r, k, dim=-1).indices
        for e in range(ex.num_experts):
            rows = (picked == e).any(dim=-1)
            gu = x[rows] @ ex.gate_up_proj[e].detach() + ex.gate_up_proj_bias[e].detach()
            gate, up = gu[:, ::2], gu[:, 1::2]
            margin = min(
                float((gate - limit).abs().min() / limit) if gate.numel() else math.inf,
                float((up.abs() - limit).abs().min() / limit) if up.numel() else math.inf,
            )
            assert margin > MIN_CLAMP_MARGIN, f"clamp margin {margin:.2e}: pick another seed"
            above += int((gate > limit).sum())
            outside += int((up.abs() > limit).sum())
            inside += int((up.abs() < limit).sum())
    assert above > 0 and outside > 0 and inside > 0, (above, outside, inside)


def train(model, input_ids, targets) -> dict[str, torch.Tensor]:
    """Runs the three steps on a float64 model; returns the tensors to save (not yet float32)."""
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **ADAMW)
    out: dict[str, torch.Tensor] = {}
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        logits, loss, router = forward_loss(model, input_ids, targets)
        loss.backward()
        if step == 0:
            out["logits"] = logits.detach().clone()
            out["loss"] = loss.detach().clone()
            for name, p in params.items():
                assert p.grad is not None and bool(p.grad.abs().max() > 0), f"no gradient: {name}"
                out[f"grad.{name}"] = p.grad.detach().clone()
            for layer, r in enumerate(router or []):
                out[f"router_logits.{layer}"] = r
            check_idle_expert(model, router)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        losses.append(loss.detach())
        norms.append(norm.detach())
        opt.step()
    out["losses"] = torch.stack(losses)
    out["grad_norms"] = torch.stack(norms)
    for name, p in params.items():
        out[f"step3.{name}"] = p.detach().clone()
    return out


def check_idle_expert(model, router) -> None:
    """The IDLE_EXPERT of the model (if any) is in nobody's top-k and has zero gradients."""
    name = model.config.model_type
    if name not in IDLE_EXPERT:
        return
    layer, expert = IDLE_EXPERT[name]
    k = model.config.num_experts_per_tok
    picked = torch.topk(router[layer], k, dim=-1).indices
    assert not bool((picked == expert).any()), "the idle expert was routed a token"
    experts = model.model.layers[layer].mlp.experts
    for p in (experts.gate_up_proj, experts.down_proj):
        assert bool((p.grad[expert] == 0).all()), "the idle expert has a gradient"


def metadata(spec: Spec) -> dict[str, str]:
    return {
        "format": FORMAT,
        "model": spec.name,
        "seed": str(spec.seed),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "safetensors_version": safetensors.__version__,
        "numpy_version": numpy.__version__,
        "batch": f"B={B}, T={T}, position_ids 0..T-1, causal, no attention mask",
        "targets": TARGETS_DEF,
        "loss": LOSS_DEF,
        "optimizer": OPTIM_DEF,
        "compute_dtype": "float64 (rotary cos/sin, RMSNorm and softmax internally float32)",
        "init": (
            f"transformers init in float32 after torch.manual_seed(seed); then RMSNorm weights "
            f"1+{NORM_JITTER}*randn and biases {BIAS_STD}*randn from Generator(seed+1)"
        ),
        "script": "scripts/make_golden.py",
    }


def make_one(spec: Spec, out_dir: Path, verbose: bool) -> dict:
    cfg_path = out_dir / f"{spec.name}.config.json"
    spec.config().to_json_file(cfg_path)
    check_saved_config(spec, cfg_path, verbose)

    model = build_model(spec)
    check_rope(spec, model)
    tensors: dict[str, torch.Tensor] = {}
    input_ids, targets = make_batch(spec, model.config.vocab_size)
    tensors["input_ids"] = input_ids
    tensors["targets"] = targets
    for name, p in model.named_parameters():
        tensors[f"param.{name}"] = p.detach().clone()
    n_params = sum(p.numel() for p in model.parameters())

    model.double()
    model.train()
    for name, t in train(model, input_ids, targets).items():
        tensors[name] = t.to(torch.float32).contiguous()
    path = out_dir / f"{spec.name}.safetensors"
    blob = safetensors.torch.save(tensors, metadata=metadata(spec))
    path.write_bytes(canonical_header(blob))
    return dict(
        name=spec.name,
        n_params=n_params,
        n_targets=int((targets != IGNORE).sum()),
        losses=[float(x) for x in tensors["losses"]],
        grad_norms=[float(x) for x in tensors["grad_norms"]],
        path=path,
    )


def canonical_header(blob: bytes) -> bytes:
    """Rewrites a safetensors file's JSON header with the metadata keys sorted.

    The safetensors writer keeps `__metadata__` in a Rust HashMap, whose order changes from run
    to run; sorting it makes the file bytes reproducible. Tensor entries keep their order (data
    offsets are relative to the end of the header, so its length may change freely).
    """
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob[8 + n :]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
    # The float32 control and the precision report live in golden_precision.py (imported here:
    # it imports this module's model, batch and training functions).
    from golden_precision import f32_control, precision_report

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

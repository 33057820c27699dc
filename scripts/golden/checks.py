"""The checks that keep the mixture-of-experts fixtures robust to float32 rounding: routing
margins, GPT-OSS's clamp margins, OLMoE's idle expert."""

from __future__ import annotations

import math

import torch

from golden.specs import IDLE_EXPERT

MIN_CLAMP_MARGIN = 1e-6
MIN_ROUTING_MARGIN = 1e-5


def check_routing(model, router_logits) -> None:
    """Asserts every row's k-th and (k+1)-th router probabilities are far apart (see make_golden.py)."""
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



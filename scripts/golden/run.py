"""The batch and the three training steps that produce a fixture's tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from golden.checks import check_clamps, check_idle_expert, check_routing
from golden.specs import ADAMW, IGNORE, MAX_NORM, PAD_TAIL, SCATTERED_IGNORED, STEPS, Spec, B, T


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



#!/usr/bin/env python3
"""Baseline: LoRA with transformers + peft, the whole model resident on the GPU.

An HF transformers causal LM built from a config.json with random init directly on the device in
bf16 (the frozen base), peft's LoRA (`get_peft_model`, rank `--lora-rank`, alpha `--lora-alpha`,
no dropout) on every linear layer of the decoder as `megatrain train --lora-rank R` puts them by
default (q, k, v, o, gate, up and down projections; the attention's four on a mixture of experts),
the adapters in fp32 (peft's `autocast_adapter_dtype`), bf16 autocast compute, SDPA attention,
activation checkpointing (non-reentrant, the inputs' gradient enabled as peft needs),
torch.optim.AdamW(fused=True) over the adapters only, synthetic seeded token ids. Writes the JSON
Lines metrics described in common.py (system "peft_lora"); a CUDA out-of-memory anywhere, model
build included, writes an `error` record and exits with status 3.

    python3 scripts/baselines/peft_lora.py --config bench-harness/configs/llama3-8b.json \
        --batch-size 4 --seq-len 2048 --steps 10 --lora-rank 16 --metrics results/tmp/peft.jsonl

Model FLOPs are the project's one formula (6·N·T + 6·L·S·H·T over every parameter, as megatrain's
log counts a LoRA run's): compare the systems by tokens/s.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

SYSTEM = "peft_lora"

# megatrain's default LoRA targets (`LoraConfig::for_model`): every linear layer of a dense
# decoder, the attention's on a mixture of experts.
ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]


def lora_targets(cfg: dict, given: str | None) -> list[str]:
    """The modules the adapters go on: `given` (comma-separated) or megatrain's default for
    `cfg` (a MoE config has `num_experts` or `num_local_experts`)."""
    if given:
        return [t.strip() for t in given.split(",") if t.strip()]
    moe = any(k in cfg for k in ("num_experts", "num_local_experts"))
    return ATTENTION_TARGETS if moe else ATTENTION_TARGETS + MLP_TARGETS


def main(argv=None) -> None:
    extra = [
        ("--lora-rank", dict(type=int, default=16, help="adapter rank r")),
        ("--lora-alpha", dict(type=float, default=None, help="adapter alpha (default: r)")),
        ("--lora-targets", dict(default=None, help="comma-separated modules (default: megatrain's)")),
    ]
    args = common.parse_args(__doc__.splitlines()[1], argv, extra)
    if args.lora_rank < 1:
        raise SystemExit("--lora-rank must be >= 1")
    common.run_guarded(SYSTEM, args.metrics, lambda w: train(args, w))


def train(args, writer) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg_dict = common.read_config(args.config)
    dims = common.model_dims(cfg_dict)
    device = torch.device(args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch sees no GPU")

    torch.manual_seed(args.seed)
    timer = common.Timer()
    # The frozen base in bf16, built on the device (initialising billions of parameters on the
    # CPU takes minutes).
    with device:
        base = AutoModelForCausalLM.from_config(
            common.hf_config(cfg_dict), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    n_params = sum(p.numel() for p in base.parameters())
    targets = lora_targets(cfg_dict, args.lora_targets)
    alpha = args.lora_alpha if args.lora_alpha is not None else float(args.lora_rank)
    lora = LoraConfig(
        r=args.lora_rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
    )
    model = get_peft_model(base, lora, autocast_adapter_dtype=True)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, fused=True)
    common.sync(args.device)
    init_s = timer.s()

    flops = common.model_flops_per_step(
        common.active_params(cfg_dict, n_params),
        args.batch_size,
        args.seq_len,
        dims["num_hidden_layers"],
        dims["hidden_size"],
    )
    writer.write(
        common.run_record(
            SYSTEM,
            args,
            cfg_dict,
            n_params,
            **common.versions(),
            peft_version=_peft_version(),
            gpu=common.gpu_name(args.device),
            device=args.device,
            init_s=init_s,
            precision="bf16 frozen base, fp32 adapters, bf16 autocast",
            optimizer="torch.optim.AdamW(fused=True) over the adapters",
            lora={"rank": args.lora_rank, "alpha": alpha, "targets": targets, "trainable_params": n_trainable},
            attn_implementation=base.config._attn_implementation,
            gradient_checkpointing=not args.no_checkpointing,
        )
    )

    train_step = common.autocast_step(model, optimizer, device, args.grad_accum)
    common.train_loop(args, writer, dims["vocab_size"], flops, train_step)


def _peft_version() -> str | None:
    try:
        import peft

        return peft.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()

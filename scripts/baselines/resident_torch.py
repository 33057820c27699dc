#!/usr/bin/env python3
"""Baseline: resident PyTorch training (everything on the GPU).

An HF transformers causal LM built from a config.json with random init directly on the device
(fp32 master weights), SDPA attention, bf16 autocast compute, activation checkpointing
(non-reentrant), torch.optim.AdamW(fused=True), synthetic seeded token ids. Writes the JSON Lines
metrics described in common.py (system "torch_resident"); a CUDA out-of-memory anywhere, model
build included, writes an `error` record and exits with status 3.

    python3 scripts/baselines/resident_torch.py --config bench-harness/configs/llama3-3.6b.json \
        --batch-size 4 --seq-len 2048 --steps 10 --metrics results/tmp/resident.jsonl
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

SYSTEM = "torch_resident"


def main(argv=None) -> None:
    args = common.parse_args(__doc__.splitlines()[1], argv)
    common.run_guarded(SYSTEM, args.metrics, lambda w: train(args, w))


def train(args, writer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    cfg_dict = common.read_config(args.config)
    dims = common.model_dims(cfg_dict)
    device = torch.device(args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch sees no GPU")

    torch.manual_seed(args.seed)
    timer = common.Timer()
    # Built under the device context: parameters are allocated and initialised on the GPU
    # (initialising 3-14B parameters on the CPU takes minutes).
    with device:
        model = AutoModelForCausalLM.from_config(
            common.hf_config(cfg_dict), dtype=torch.float32, attn_implementation="sdpa"
        )
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    common.sync(args.device)
    init_s = timer.s()

    flops = common.model_flops_per_step(common.active_params(cfg_dict, n_params), args.batch_size, args.seq_len, dims["num_hidden_layers"], dims["hidden_size"])
    writer.write(
        common.run_record(
            SYSTEM,
            args,
            cfg_dict,
            n_params,
            **common.versions(),
            gpu=common.gpu_name(args.device),
            device=args.device,
            init_s=init_s,
            precision="fp32 master weights, bf16 autocast",
            optimizer="torch.optim.AdamW(fused=True)",
            attn_implementation=model.config._attn_implementation,
            gradient_checkpointing=bool(model.is_gradient_checkpointing),
        )
    )

    train_step = common.autocast_step(model, optimizer, device, args.grad_accum)
    common.train_loop(args, writer, dims["vocab_size"], flops, train_step)


if __name__ == "__main__":
    main()

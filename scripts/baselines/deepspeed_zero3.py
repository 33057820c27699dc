#!/usr/bin/env python3
"""Baseline: DeepSpeed ZeRO-3 with parameters and optimizer states offloaded to the CPU.

One process, one GPU. The HF transformers causal LM is built from a config.json (random init)
under deepspeed.zero.Init, so its bf16 parameter partitions land in pinned host memory as they
are created; the fp32 master weights and AdamW moments live in host memory and are updated by
DeepSpeedCPUAdam (the "optimizer" section, type AdamW, with offload_optimizer on the CPU). bf16
compute, activation checkpointing (non-reentrant). Same CLI and JSON Lines contract as
resident_torch.py (system "deepspeed_zero3_offload"); the run record adds deepspeed_version, the
DeepSpeed config, and init_s = model_init_s (construction + partitioning + weight init) +
cpu_adam_load_s (JIT compile of DeepSpeedCPUAdam's extension on a fresh machine, ~1 min; a load
from the cache after that) + engine_init_s (deepspeed.initialize: fp32 master copy, pinned
optimizer states).

    python3 scripts/baselines/deepspeed_zero3.py --config bench-harness/configs/llama3-3.6b.json \
        --batch-size 4 --seq-len 2048 --steps 10 --metrics results/tmp/ds.jsonl

Config keys: DeepSpeed's docs (https://www.deepspeed.ai/docs/config-json/, "ZeRO optimizations
for FP16 training" and "Parameter offloading" / "Optimizer offloading") and its pydantic model
deepspeed/runtime/zero/config.py + offload_config.py of 0.19.8. The bucket sizes are the ones
transformers' HfTrainerDeepSpeedConfig fills in for "auto" (integrations/deepspeed.py):
reduce_bucket_size = H*H, stage3_prefetch_bucket_size = 0.9*H*H,
stage3_param_persistence_threshold = 10*H.
"""

from __future__ import annotations

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

SYSTEM = "deepspeed_zero3_offload"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_env() -> None:
    """Single-process distributed environment, set before torch/deepspeed are imported. NVLink
    multicast stays off (a rule of the GPU machines; NCCL reads NCCL_NVLS_ENABLE at init)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    # The wheel is built without torch (DS_BUILD_OPS=0), so pin the accelerator instead of relying
    # on detection.
    os.environ.setdefault("DS_ACCELERATOR", "cuda")


def ds_config(args, hidden: int) -> dict:
    return {
        "train_batch_size": args.batch_size,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 0.0,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": True},
        "optimizer": {
            # With offload_optimizer on the CPU the engine builds DeepSpeedCPUAdam (adamw_mode=True,
            # fp32 moments) for type AdamW; same hyper-parameters as torch.optim.AdamW's defaults.
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
            "stage3_max_live_parameters": int(1e9),
            "stage3_max_reuse_distance": int(1e9),
            "sub_group_size": int(1e9),
            "stage3_gather_16bit_weights_on_model_save": False,
        },
    }


def main(argv=None) -> None:
    args = common.parse_args(__doc__.splitlines()[1], argv)
    if args.device != "cuda":
        sys.exit("deepspeed_zero3.py runs on a GPU only (--device cuda)")
    setup_env()
    common.run_guarded(SYSTEM, args.metrics, lambda w: train(args, w))


def train(args, writer) -> None:
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    cfg_dict = common.read_config(args.config)
    dims = common.model_dims(cfg_dict)
    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no GPU")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl")

    config = ds_config(args, dims["hidden_size"])
    torch.manual_seed(args.seed)
    timer = common.Timer()
    # transformers keeps a weak reference to this object: while it lives, from_config sees ZeRO-3
    # and builds the model under its own deepspeed.zero.Init (nested in the one below, which
    # DeepSpeed merges into one context: the outer one's settings apply) with init suppressed, then
    # initialises the weights module by module with their parameters gathered
    # (initialize_weights_zero3). remote_device/pin_memory are explicit here; zero.Init would read
    # the same values from offload_param. The run record reports where the partitions landed.
    hf_ds = HfDeepSpeedConfig(config)  # noqa: F841
    with deepspeed.zero.Init(remote_device="cpu", pin_memory=True, config_dict_or_path=config):
        model = AutoModelForCausalLM.from_config(
            common.hf_config(cfg_dict), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model_init_s = timer.s()
    params = list(model.parameters())
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    first = params[0].ds_tensor if hasattr(params[0], "ds_tensor") else params[0]
    partition = {"param_partition_device": str(first.device), "param_partition_pinned": bool(first.is_pinned())}

    # DeepSpeedCPUAdam JIT-compiles its extension on a fresh machine (about a minute; cached under
    # TORCH_EXTENSIONS_DIR afterwards): load it first so that engine_init_s measures DeepSpeed only.
    timer = common.Timer()
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load()
    cpu_adam_load_s = timer.s()

    timer = common.Timer()
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in params if p.requires_grad], config=config
    )
    common.sync("cuda")
    engine_init_s = timer.s()

    flops = common.model_flops_per_step(common.active_params(cfg_dict, n_params), args.batch_size, args.seq_len, dims["num_hidden_layers"], dims["hidden_size"])
    writer.write(
        common.run_record(
            SYSTEM,
            args,
            cfg_dict,
            n_params,
            **common.versions(),
            deepspeed_version=deepspeed.__version__,
            gpu=common.gpu_name("cuda"),
            device="cuda",
            init_s=model_init_s + cpu_adam_load_s + engine_init_s,
            model_init_s=model_init_s,
            cpu_adam_load_s=cpu_adam_load_s,
            engine_init_s=engine_init_s,
            precision="bf16 params and compute, fp32 master weights (ZeRO-3)",
            optimizer=type(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).__name__,
            attn_implementation=model.config._attn_implementation,
            gradient_checkpointing=bool(model.is_gradient_checkpointing),
            ds_config=config,
            **partition,
        )
    )

    k = args.grad_accum

    def train_step(micro):
        total = torch.zeros((), device="cuda", dtype=torch.float32)
        for ids in micro:
            ids = ids.to("cuda", non_blocking=True)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself
            engine.step()  # updates at the accumulation boundary only
            total += loss.detach().float()
        return (total / k).item()

    common.train_loop(args, writer, dims["vocab_size"], flops, train_step)
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()

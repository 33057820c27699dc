"""The tiny models of the golden fixtures and the batch and training recipe they share
(`make_golden.py`'s docstring specifies each one)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import (
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

B, T = 4, 16
IGNORE = -100
PAD_TAIL = 6  # ignored positions at the end of sequence 1
SCATTERED_IGNORED = [(0, 5), (2, 0), (3, 9)]
STEPS = 3
MAX_NORM = 1.0
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
NORM_JITTER, BIAS_STD = 0.1, 0.02

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
ROUTER_SCALE = 10.0  # router weights: transformers' normal(0, 0.02) init times this

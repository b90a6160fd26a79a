"""Small ``GPTArch`` variants covering every layout feature (no files, no vLLM head-size limits)."""

from __future__ import annotations

import dataclasses

import torch

from asyncflow.bridge.hf_layout import hf_param_shapes
from asyncflow.models.megatron import GPTArch

_BASE = dict(
    vocab_size=50,
    hidden_size=16,
    num_layers=3,
    num_attention_heads=8,
    num_query_groups=2,
    head_dim=4,
    ffn_hidden_size=24,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    qkv_bias=False,
    qk_layernorm=False,
    tie_word_embeddings=False,
)

ARCHS = {
    "qwen2_gqa": GPTArch(model_type="qwen2", **{**_BASE, "qkv_bias": True}),
    "llama_mqa_tied": GPTArch(
        model_type="llama", **{**_BASE, "num_query_groups": 1, "tie_word_embeddings": True}
    ),
    "qwen3_mha": GPTArch(model_type="qwen3", **{**_BASE, "num_query_groups": 8, "qk_layernorm": True}),
    "qwen3_moe": GPTArch(
        model_type="qwen3_moe",
        **{**_BASE, "qk_layernorm": True},
        num_experts=4,
        moe_ffn_hidden_size=8,
        moe_router_topk=2,
    ),
    "qwen2_moe_shared": GPTArch(
        model_type="qwen2_moe",
        **{**_BASE, "qkv_bias": True},
        num_experts=4,
        moe_ffn_hidden_size=8,
        moe_router_topk=2,
        moe_norm_topk_prob=False,
        shared_expert_ffn_hidden_size=12,
    ),
}


def random_hf_state(arch: GPTArch, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random full Hugging Face tensors of ``arch`` (distinct values, so any misplacement shows)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in hf_param_shapes(arch).items()}


def with_layers(arch: GPTArch, n: int) -> GPTArch:
    """``arch`` with ``n`` layers."""
    return dataclasses.replace(arch, num_layers=n)

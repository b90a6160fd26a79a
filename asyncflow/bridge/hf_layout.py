"""Megatron-core GPTModel <-> Hugging Face parameter names and layouts (Llama / Qwen2 / Qwen3), full tensors.

This is the unsharded core of the weight bridge: it converts one whole (TP=1) tensor at a time. The
weight-bridge issue builds tensor/pipeline/expert-parallel shard plans and vLLM's fused layouts on top
of these functions; they stay the single source of truth for names and layouts.

Layouts that are easy to get wrong, and what this file does about them:
- Megatron fuses q, k and v into ``linear_qkv`` interleaved *per query group*: for each of the
  ``num_query_groups`` groups, its ``heads_per_group`` query heads, then its key head, then its value
  head (rows of ``head_dim`` each). Biases use the same order.
- Megatron fuses SwiGLU's gate and up projections into ``linear_fc1`` as ``[gate; up]`` (at TP=1).
- Megatron pads the vocabulary (``padded_vocab_size``); export drops the padded rows, import zero-pads.
- Two Megatron namings exist: the local spec (``input_layernorm``, ``pre_mlp_layernorm``) and the
  Transformer Engine spec, which fuses those norms into ``linear_qkv.layer_norm_weight`` and
  ``linear_fc1.layer_norm_weight``. ``canonical_name`` maps the TE naming onto the local one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch

from asyncflow.engines.megatron.model import GPTArch

_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Per-layer Megatron suffix -> Hugging Face suffix for tensors that map one to one.
_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_QKV = {"self_attention.linear_qkv.weight": "weight", "self_attention.linear_qkv.bias": "bias"}
_FC1 = "mlp.linear_fc1.weight"


def canonical_name(name: str) -> str:
    """Map a Transformer Engine spec parameter name onto the local-spec name (others unchanged)."""
    for te, local in _TE_TO_LOCAL.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def is_extra_state(name: str) -> bool:
    """Megatron/TE bookkeeping entries (``_extra_state``) that carry no weights."""
    return name.endswith("_extra_state")


def split_qkv(arch: GPTArch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's group-interleaved ``linear_qkv`` (weight or bias) -> Hugging Face q, k, v."""
    groups, hd = arch.num_query_groups, arch.head_dim
    per_group = arch.num_attention_heads // groups
    grouped = qkv.reshape(groups, (per_group + 2) * hd, *qkv.shape[1:])
    q = grouped[:, : per_group * hd].reshape(groups * per_group * hd, *qkv.shape[1:])
    k = grouped[:, per_group * hd : (per_group + 1) * hd].reshape(groups * hd, *qkv.shape[1:])
    v = grouped[:, (per_group + 1) * hd :].reshape(groups * hd, *qkv.shape[1:])
    return q, k, v


def merge_qkv(arch: GPTArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Hugging Face q, k, v (weights or biases) -> Megatron's group-interleaved ``linear_qkv``."""
    groups, hd = arch.num_query_groups, arch.head_dim
    per_group = arch.num_attention_heads // groups
    rest = q.shape[1:]
    parts = (
        q.reshape(groups, per_group * hd, *rest),
        k.reshape(groups, hd, *rest),
        v.reshape(groups, hd, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def mcore_to_hf(
    arch: GPTArch, name: str, tensor: torch.Tensor, layer_offset: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """Convert one full Megatron tensor into its Hugging Face tensor(s); ``[]`` for bookkeeping entries.

    ``layer_offset`` turns a pipeline stage's local layer index into the global one.
    """
    if is_extra_state(name):
        return []
    name = canonical_name(name)
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor[: arch.vocab_size])]
    if name == "output_layer.weight":
        if arch.tie_word_embeddings:
            return []
        return [("lm_head.weight", tensor[: arch.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    match = _LAYER_RE.match(name)
    if not match:
        raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r}")
    layer, suffix = int(match.group(1)) + layer_offset, match.group(2)
    prefix = f"model.layers.{layer}."
    if suffix in _DIRECT:
        return [(prefix + _DIRECT[suffix], tensor)]
    if suffix in _QKV:
        kind = _QKV[suffix]
        q, k, v = split_qkv(arch, tensor)
        return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v))]
    if suffix == _FC1:
        gate, up = tensor.chunk(2, dim=0)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r}")


def export_hf(
    arch: GPTArch, mcore_state: Mapping[str, torch.Tensor], layer_offset: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream a full (TP=1) Megatron state dict as Hugging Face ``(name, tensor)`` pairs."""
    for name, tensor in mcore_state.items():
        yield from mcore_to_hf(arch, name, tensor, layer_offset)


def _pad_vocab(tensor: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    if tensor.shape[0] == padded_vocab:
        return tensor
    pad = tensor.new_zeros(padded_vocab - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, pad], dim=0)


def hf_to_mcore_name_sources(arch: GPTArch, mcore_name: str, layer_offset: int = 0) -> list[str]:
    """The Hugging Face tensor names that a (local-spec) Megatron parameter is built from."""
    name = canonical_name(mcore_name)
    if name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if name == "output_layer.weight":
        return ["model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"]
    if name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    match = _LAYER_RE.match(name)
    if not match:
        raise KeyError(f"no Hugging Face mapping for Megatron parameter {mcore_name!r}")
    prefix = f"model.layers.{int(match.group(1)) + layer_offset}."
    suffix = match.group(2)
    if suffix in _DIRECT:
        return [prefix + _DIRECT[suffix]]
    if suffix in _QKV:
        return [f"{prefix}self_attn.{p}_proj.{_QKV[suffix]}" for p in "qkv"]
    if suffix == _FC1:
        return [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
    raise KeyError(f"no Hugging Face mapping for Megatron parameter {mcore_name!r}")


def hf_to_mcore(
    arch: GPTArch,
    mcore_name: str,
    hf_state: Mapping[str, torch.Tensor],
    padded_vocab: int,
    layer_offset: int = 0,
) -> torch.Tensor:
    """Build one full Megatron tensor from the Hugging Face tensors it comes from."""
    sources = hf_to_mcore_name_sources(arch, mcore_name, layer_offset)
    missing = [s for s in sources if s not in hf_state]
    if missing:
        raise KeyError(f"Hugging Face checkpoint lacks {missing} needed for {mcore_name!r}")
    tensors = [hf_state[s] for s in sources]
    name = canonical_name(mcore_name)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return _pad_vocab(tensors[0], padded_vocab)
    if len(tensors) == 3:
        return merge_qkv(arch, *tensors)
    if len(tensors) == 2:
        return torch.cat(tensors, dim=0)
    return tensors[0]

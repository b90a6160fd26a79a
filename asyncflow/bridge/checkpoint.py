"""Checkpoint conversion: Hugging Face <-> Megatron distributed checkpoint, any TP/PP/EP, streamed.

``hf_to_mcore`` starts ``tp * pp * ep`` gloo processes; each builds its Megatron model chunk, reads only
its own slices of the Hugging Face safetensors (``bridge.mcore.load_hf_into``) and the group saves one
``megatron.core.dist_checkpointing`` checkpoint, which Megatron can load at any parallel layout.

``mcore_to_hf`` needs no model and no parallel group larger than one process: it reads the checkpoint
metadata, then loads one layer of one parameter at a time (a ``ShardedTensor`` request for that slice),
converts it with ``hf_layout`` and appends it to size-capped safetensors files with an index.

Both write into a temporary sibling directory and rename it at the end, so a failure (bad input,
unsupported architecture, TP not dividing the heads) leaves no half-written output behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from asyncflow.bridge.shards import ParallelLayout
from asyncflow.models.arch import GPTArch

META_FILE = "asyncflow_bridge.json"
HF_FILES = "hf_config"  # config.json + tokenizer files kept beside the Megatron checkpoint
# The files of a Hugging Face directory that describe the model without holding its weights. Anything else
# (safetensors, .bin, .pt, their index files) must never be copied next to converted weights: it would
# overwrite them with the base model's.
_CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".npz")


def is_config_or_tokenizer_file(name: str) -> bool:
    """Whether a file of a Hugging Face model directory is config or tokenizer, never weights or their index."""
    if name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json"):
        return False
    return name in _CONFIG_FILES or name.startswith("tokenizer")


class ConversionError(RuntimeError):
    """A conversion input is wrong or unsupported; the message is one line for the user."""


def _say(progress: Callable[[str], None] | None, text: str) -> None:
    if progress is not None:
        progress(text)


class _AtomicDir:
    """Write into ``<out>.tmp-*`` and rename to ``out`` only on success."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        if self.out.exists() and any(self.out.iterdir()):
            raise ConversionError(f"output directory {self.out} exists and is not empty")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=self.out.name + ".tmp-", dir=self.out.parent))

    def __enter__(self) -> Path:
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if self.out.exists():
                self.out.rmdir()
            os.replace(self.tmp, self.out)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def read_arch(hf_dir: str | Path) -> GPTArch:
    """``GPTArch`` of a Hugging Face directory, as a ``ConversionError`` when it is not one we support."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ConversionError(f"{hf_dir} is not a Hugging Face checkpoint (no config.json)")
    if not list(hf_dir.glob("*.safetensors")):
        raise ConversionError(f"{hf_dir} has no *.safetensors weights")
    try:
        return GPTArch.from_pretrained(hf_dir)
    except (ValueError, KeyError) as exc:
        raise ConversionError(f"unsupported architecture in {hf_dir / 'config.json'}: {exc}") from exc


# ------------------------------------------------------------------------------------------ HF -> mcore
def _hf_to_mcore_rank(
    rank: int, world: int, port: int, layout: ParallelLayout, hf_dir: str, out: str
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from megatron.core import dist_checkpointing

    from asyncflow.bridge.mcore import HFReader, init_parallel, load_hf_into, model_rank
    from asyncflow.models.megatron import build_gpt_model, transformer_config
    from asyncflow.models.parallel import destroy_megatron

    arch = GPTArch.from_pretrained(hf_dir)
    init_parallel(layout.tp, layout.pp, layout.ep)
    config = transformer_config(
        arch,
        tensor_parallel=layout.tp,
        pipeline_parallel=layout.pp,
        expert_parallel=layout.ep,
        **_stage_overrides(layout),
    )
    model = build_gpt_model(arch, config, make_vocab_size_divisible_by=layout.make_vocab_size_divisible_by)
    load_hf_into(model, arch, layout, model_rank()[0], HFReader(hf_dir))
    dist_checkpointing.save(model.sharded_state_dict(), out)
    destroy_megatron()


def _stage_overrides(layout: ParallelLayout) -> dict:
    """TransformerConfig arguments for uneven pipeline stages (first/last stage sizes)."""
    if layout.layers_per_stage is None:
        return {}
    sizes = layout.layers_per_stage
    if len(set(sizes[1:-1])) > 1:
        raise ConversionError(f"Megatron supports uneven first/last stages only, got {list(sizes)}")
    return dict(num_layers_in_first_pipeline_stage=sizes[0], num_layers_in_last_pipeline_stage=sizes[-1])


def hf_to_mcore(
    hf_dir: str | Path,
    out: str | Path,
    layout: ParallelLayout,
    progress: Callable[[str], None] | None = print,
) -> Path:
    """Convert a Hugging Face checkpoint into a Megatron distributed checkpoint written at ``layout``."""
    import torch.multiprocessing as mp

    from asyncflow.ports import free_port

    arch = read_arch(hf_dir)
    try:
        layout.validate(arch)
    except ValueError as exc:
        raise ConversionError(str(exc)) from exc
    world = layout.tp * layout.pp * layout.ep
    with _AtomicDir(out) as tmp:
        _say(
            progress,
            f"converting {hf_dir} ({arch.model_type}, {arch.num_layers} layers) with "
            f"tp={layout.tp} pp={layout.pp} ep={layout.ep} on {world} processes",
        )
        try:
            mp.start_processes(
                _hf_to_mcore_rank,
                args=(world, free_port(), layout, str(hf_dir), str(tmp)),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as exc:
            last = [line for line in str(exc).strip().splitlines() if line.strip()][-1]
            raise ConversionError(f"a conversion rank failed: {last}") from exc
        _copy_hf_files(Path(hf_dir), tmp / HF_FILES)
        meta = dict(
            format="asyncflow-mcore",
            tp=layout.tp,
            pp=layout.pp,
            ep=layout.ep,
            make_vocab_size_divisible_by=layout.make_vocab_size_divisible_by,
            layers_per_stage=list(layout.layers_per_stage) if layout.layers_per_stage else None,
        )
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        _say(progress, f"wrote Megatron distributed checkpoint {out}")
    return Path(out)


def _copy_hf_files(src: Path, dst: Path) -> None:
    """Copy the config and tokenizer files of ``src`` (never weights) into ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and is_config_or_tokenizer_file(f.name):
            shutil.copy2(f, dst / f.name)


# ------------------------------------------------------------------------------------------ mcore -> HF
_EXPERT_KEYS = {
    "decoder.layers.mlp.experts.experts.linear_fc1.weight": "linear_fc1",
    "decoder.layers.mlp.experts.experts.linear_fc2.weight": "linear_fc2",
}


def _box_planner(boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]):
    """A torch.distributed.checkpoint load planner that reads only ``boxes`` (fqn -> (offsets, sizes)).

    Megatron's own ``dist_checkpointing.load`` (and torch's ShardedTensor) insist that the requests of all
    ranks cover each tensor, so reading one layer from a process of one goes through DCP directly.
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class BoxPlanner(DefaultLoadPlanner):
        def create_local_plan(self):
            items = []
            for fqn, (offsets, sizes) in boxes.items():
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                items += create_read_items_for_chunk_list(
                    fqn, self.metadata.state_dict_metadata[fqn], [chunk]
                )
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]  # the buffer is the box itself (read offsets are box-relative)

    return BoxPlanner()


class McoreReader:
    """Reads boxes of the tensors of a Megatron ``torch_dist`` checkpoint; no process group needed."""

    def __init__(self, mcore_dir: str | Path):
        import torch.distributed.checkpoint as dcp

        self.dir = str(mcore_dir)
        self.meta = {
            k: v
            for k, v in dcp.FileSystemReader(self.dir).read_metadata().state_dict_metadata.items()
            if hasattr(v, "chunks")
        }

    def read(self, key: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """``key`` with its leading dimensions fixed at ``index`` (e.g. one layer, one expert)."""
        import torch.distributed.checkpoint as dcp

        shape = tuple(self.meta[key].size)
        sizes = (1,) * len(index) + shape[len(index) :]
        offsets = tuple(index) + (0,) * (len(shape) - len(index))
        buf = torch.empty(sizes, dtype=self.meta[key].properties.dtype)
        dcp.load(
            {key: buf},
            storage_reader=dcp.FileSystemReader(self.dir),
            planner=_box_planner({key: (offsets, sizes)}),
            no_dist=True,
        )
        return buf.reshape(shape[len(index) :])


def iter_mcore_checkpoint(mcore_dir: str | Path, arch: GPTArch):
    """Yield ``(global Megatron name, full tensor)`` from a distributed checkpoint, one layer (and expert) at
    a time, in model order. Layer-stacked keys (``decoder.layers.X``, global shape [layers, ...]) are
    Megatron's checkpoint format; routed experts are stacked as [layers, experts, ...]."""
    reader = McoreReader(mcore_dir)
    layered = [k for k in reader.meta if k.startswith("decoder.layers.")]
    for key in ("embedding.word_embeddings.weight",):
        if key in reader.meta:
            yield key, reader.read(key)
    for layer in range(arch.num_layers):
        for key in layered:
            if key in _EXPERT_KEYS:
                for j in range(reader.meta[key].size[1]):
                    name = f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.{_EXPERT_KEYS[key]}.weight"
                    yield name, reader.read(key, (layer, j))
            else:
                yield (
                    f"decoder.layers.{layer}.{key.removeprefix('decoder.layers.')}",
                    reader.read(key, (layer,)),
                )
    for key in ("decoder.final_layernorm.weight", "output_layer.weight"):
        if key in reader.meta:
            yield key, reader.read(key)


def mcore_to_hf(
    mcore_dir: str | Path,
    out: str | Path,
    hf_config_dir: str | Path | None = None,
    max_shard_bytes: int = 5 * 2**30,
    progress: Callable[[str], None] | None = print,
) -> Path:
    """Convert a Megatron distributed checkpoint into Hugging Face safetensors (+ index).

    The config and tokenizer files come from ``hf_config_dir`` (default: the copy ``hf_to_mcore`` kept in the
    checkpoint); its weight files are never copied, so a trained checkpoint exports its own weights.
    """
    from safetensors.torch import save_file

    from asyncflow.bridge import hf_layout

    mcore_dir = Path(mcore_dir)
    if not (mcore_dir / "metadata.json").is_file():
        raise ConversionError(f"{mcore_dir} is not a Megatron distributed checkpoint (no metadata.json)")
    hf_files = Path(hf_config_dir) if hf_config_dir else mcore_dir / HF_FILES
    if not (hf_files / "config.json").is_file():
        raise ConversionError(f"no Hugging Face config.json in {hf_files}; pass --hf-config DIR")
    try:
        arch = GPTArch.from_pretrained(hf_files)
    except (ValueError, KeyError) as exc:
        raise ConversionError(f"unsupported architecture in {hf_files / 'config.json'}: {exc}") from exc
    with _AtomicDir(out) as tmp:
        files, current, size, weight_map, total = [], {}, 0, {}, 0

        def flush():
            nonlocal current, size
            if current:
                files.append(tmp / f"part-{len(files):05d}.safetensors")
                save_file(current, str(files[-1]), metadata={"format": "pt"})
                current, size = {}, 0

        for name, tensor in iter_mcore_checkpoint(mcore_dir, arch):
            for hf_name, hf_tensor in hf_layout.mcore_to_hf(arch, name, tensor):
                nbytes = hf_tensor.numel() * hf_tensor.element_size()
                if current and size + nbytes > max_shard_bytes:
                    flush()
                current[hf_name] = hf_tensor.contiguous().clone()
                weight_map[hf_name] = len(files)
                size, total = size + nbytes, total + nbytes
            if name.startswith("decoder.layers.") and name.endswith("linear_proj.weight"):
                _say(progress, f"  layer {name.split('.')[2]} / {arch.num_layers}")
        flush()
        expected = set(hf_layout.hf_param_shapes(arch))
        if set(weight_map) != expected:
            missing = sorted(expected - set(weight_map))[:4]
            raise ConversionError(f"checkpoint {mcore_dir} does not hold the whole model (missing {missing})")
        names = (
            ["model.safetensors"]
            if len(files) == 1
            else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
        )
        for src, dst in zip(files, names):
            src.rename(tmp / dst)
        if len(files) > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {k: names[v] for k, v in weight_map.items()},
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        _copy_hf_files(hf_files, tmp)
        _say(
            progress,
            f"wrote {len(weight_map)} tensors ({total / 2**20:.1f} MiB) in {len(files)} file(s) to {out}",
        )
    return Path(out)

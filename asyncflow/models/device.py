"""Where an engine computes: the one device decision, and moving tensors across the engine boundary.

The workflow builds every batch on the CPU (TransferQueue rows -> ``asyncflow.workflow.batching``) and
keeps what comes back on the CPU; the Megatron trainer moves each micro-batch to ``engine_device()``
once, where it enters Megatron, and moves results back with ``to_device(..., CPU)`` where they leave.
Collectives take tensors on ``engine_device()`` as well: NCCL rejects CPU tensors.

Checked on CPU only (``tests/engines/megatron/test_device_discipline.py``): with the engine device
set to ``cuda:0`` and Megatron's CPU patches mapping it back to the CPU, every tensor that enters the
model, the loss or a collective is shown to have been created on, or moved to, that device, and every
result to have been moved back. Only a GPU run proves the rest: CUDA/NCCL kernels, streams and
synchronisation, memory, and Megatron's own device choices (the CPU patches rewrite those).
"""

from __future__ import annotations

import torch

CPU = torch.device("cpu")


def engine_device() -> torch.device:
    """``cuda:<current device>`` where CUDA is available, else ``cpu``.

    The current device is what the launcher selected for this process (``init_megatron`` sets it from
    ``LOCAL_RANK`` under torchrun; a Ray worker sees one device, index 0).
    """
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return CPU


def to_device(tensors: dict, device: torch.device) -> dict:
    """A copy of the dict ``tensors`` with every tensor value on ``device`` (others unchanged)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}

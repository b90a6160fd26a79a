"""Patch: Megatron's CUDA RNG tracker -> the CPU generator.

Target: ``megatron.core.tensor_parallel.random._get_cuda_rng_state``, ``_set_cuda_rng_state`` and
``CudaRNGStatesTracker.add``.
Reason: the tracker saves and restores CUDA RNG states around every tensor-parallel region even with
dropout 0 (``torch.cuda.get_rng_state()`` fails without CUDA). Routing the states to the CPU default
generator keeps Megatron's semantics (separate data-parallel / tensor-parallel / expert streams,
forked and restored) so ``tensor_parallel.model_parallel_cuda_manual_seed(seed)`` is called as usual.
Megatron versions checked: 0.16.1.
"""

from __future__ import annotations

import torch

from ._util import replace

TARGETS = [
    "megatron.core.tensor_parallel.random._get_cuda_rng_state",
    "megatron.core.tensor_parallel.random._set_cuda_rng_state",
    "megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add",
    "megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork",
    "megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed",
]


def _get_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _tracker_add(self, name: str, seed: int) -> None:
    """CPU twin of ``CudaRNGStatesTracker.add``: same checks, state taken from the CPU generator."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


def apply() -> None:
    """Route the tracker to the CPU generator (idempotent)."""
    if getattr(apply, "_done", False):
        return
    from megatron.core.tensor_parallel import random as mrandom

    replace("megatron.core.tensor_parallel.random._get_cuda_rng_state", _get_state)
    replace("megatron.core.tensor_parallel.random._set_cuda_rng_state", _set_state)
    mrandom.CudaRNGStatesTracker.add = _tracker_add
    apply._done = True

"""Patch: the causal mask that activation recomputation rebuilds inside the backward pass.

Target: ``megatron.core.fusions.fused_softmax.get_default_causal_mask`` (imported there from
``megatron.core.transformer.utils``, patched in both places).
Reason: with ``recompute_granularity`` ``selective`` or ``full`` Megatron re-runs core attention (or whole
layers) inside the backward pass. ``torch.autograd.backward`` is itself a torch function, and a
``TorchFunctionMode`` is suspended while it handles a call, so ``megatron_patches.device`` does not see the
ops run by the backward pass. On the recomputed path of the local layer spec the only ``device="cuda"`` is
the default causal mask (``torch.ones(sq, sq, device="cuda")``, rebuilt on every call); this builds the
same mask on the CPU. Checked with recompute ``selective`` and ``full`` (``tests/test_plan.py``).
Megatron versions checked: 0.16.1.
"""

from __future__ import annotations

import torch

from ._util import replace

TARGETS = [
    "megatron.core.fusions.fused_softmax.get_default_causal_mask",
    "megatron.core.transformer.utils.get_default_causal_mask",
]


def get_default_causal_mask(sq: int) -> torch.Tensor:
    """Megatron's causal upper-triangular mask [sq, sq] (True = masked), built on the CPU."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply() -> None:
    """Install the CPU mask in both modules that reference it (idempotent)."""
    if getattr(apply, "_done", False):
        return
    for target in TARGETS:
        replace(target, get_default_causal_mask)
    apply._done = True

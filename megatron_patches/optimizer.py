"""Patch: Megatron's gradient clipping on CPU.

Target: ``megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (and the reference that
``megatron.core.optimizer.optimizer`` imported from it).
Reason: it asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` and scales through apex's
multi-tensor applier; neither holds on CPU. The replacement scales the same gradients by the same
coefficient with ``torch._foreach_mul_``. The ``device='cuda'`` tensors elsewhere in the optimizer and
DDP code are handled by ``megatron_patches.device``.
Megatron versions checked: 0.16.1.
"""

from __future__ import annotations

import torch

TARGETS = [
    "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
    "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32",
    "megatron.core.optimizer.clip_grads.get_grad_norm_fp32",
]


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
    """Scale gradients so that their total norm is at most ``max_norm`` (Megatron's signature)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def apply() -> None:
    """Install the CPU clip function in both modules that reference it (idempotent)."""
    if getattr(apply, "_done", False):
        return
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mopt

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    mopt.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    apply._done = True

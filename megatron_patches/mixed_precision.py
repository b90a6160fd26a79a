"""Patch: Megatron's mixed-precision and distributed optimizers accept CPU parameters.

Target: ``megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__`` and
``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__`` (which also runs
``_build_model_and_main_param_groups``).
Reason: both sort parameters into 16-bit (given fp32 main copies) and fp32 by comparing ``param.type()``
with ``'torch.cuda.HalfTensor'``, ``'torch.cuda.BFloat16Tensor'`` and ``'torch.cuda.FloatTensor'``, and raise
"Wrapped parameters must be one of torch.cuda.FloatTensor, ..." for anything else, so a bf16 or fp16
model, or any model under the distributed optimizer, cannot be built on the CPU. While these two
constructors run, ``Tensor.type()`` with no argument reports a CPU tensor under its CUDA name (a
``TorchFunctionMode`` entered only for the call), so Megatron sorts the parameters exactly as it does on a
GPU; outside them ``type()`` is untouched. The rest of the optimizers' CUDA assumptions (``device='cuda'``
buffers, ``Tensor.cuda()``, clip-grad's type assertion) are ``megatron_patches.device`` and ``optimizer``.
Megatron versions checked: 0.16.1.
"""

from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode

from ._util import resolve

TARGETS = [
    "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups",
]

_WRAPPED = TARGETS[:2]


class CudaTypeNamesMode(TorchFunctionMode):
    """``Tensor.type()`` (the type-name query, not the conversion) answers ``torch.cuda.*`` for CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return result.replace("torch.", "torch.cuda.", 1)
        return result


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with CudaTypeNamesMode():
            return fn(*args, **kwargs)

    wrapper._asyncflow_cuda_type_names = True
    return wrapper


def apply() -> None:
    """Wrap both constructors (idempotent)."""
    for target in _WRAPPED:
        owner_path, attr = target.rsplit(".", 1)
        owner = resolve(owner_path)
        original = getattr(owner, attr)
        if not getattr(original, "_asyncflow_cuda_type_names", False):
            setattr(owner, attr, _with_cuda_type_names(original))

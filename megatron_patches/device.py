"""Patch: CUDA devices -> CPU.

Target: ``torch.cuda.current_device``, ``torch.cuda.synchronize``, ``torch.cuda.empty_cache`` and every
``device="cuda"`` / ``Tensor.cuda()`` that Megatron-core evaluates (optimizer, grad buffers, pipeline
schedules, clip-grad).
Reason: Megatron-core uses ``torch.cuda.current_device()`` as *the* device and hard-codes ``"cuda"`` in
dozens of places (``torch.zeros(..., device="cuda")`` in the schedules, ``device='cuda'`` in the
optimizer and clip-grad code, ``param.data.cuda()``). Rewriting each call site would mean forking
Megatron; one ``TorchFunctionMode`` that maps the device "cuda" to "cpu" covers all of them (measured
cost: about 2 ms per step on a 126k-parameter model).
Megatron versions checked: 0.16.1.
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

from ._util import replace

TARGETS = [
    "torch.cuda.current_device",
    "torch.cuda.synchronize",
    "torch.cuda.empty_cache",
    "torch.Tensor.cuda",
    "megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining",
    "megatron.core.optimizer.optimizer.MegatronOptimizer",
    "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer",
]

_CUDA_NAMES = ("cuda", "cuda:0")


def _to_cpu(device):
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a CUDA ordinal such as torch.cuda.current_device() on a GPU build
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device=`` keyword arguments and ``Tensor.to("cuda")`` so that they land on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)):
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


_local = threading.local()


def _tensor_cuda(self, *args, **kwargs):
    return self


def apply() -> None:
    """Install the CPU device redirection (module functions once, the mode once per thread)."""
    if not getattr(apply, "_functions_done", False):
        replace("torch.cuda.current_device", lambda: "cpu")
        replace("torch.cuda.synchronize", lambda *a, **k: None)
        replace("torch.cuda.empty_cache", lambda: None)
        replace("torch.Tensor.cuda", _tensor_cuda)
        apply._functions_done = True
    # TorchFunctionMode stacks are thread-local: Ray may run actor methods on a different thread than
    # the one that imported Megatron, so the mode is entered once per thread that calls apply().
    if not getattr(_local, "mode", None):
        _local.mode = CudaToCpuMode()
        _local.mode.__enter__()

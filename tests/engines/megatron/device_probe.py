"""Track on a CPU machine which tensors would sit on the host and which on the engine's GPU.

On CPU every tensor is a CPU tensor, so device checks prove nothing by themselves. The probe keeps a
shadow device per tensor instead: the engine believes its device is ``cuda:0`` (Megatron's CPU patches
map that back to the CPU), and a ``TorchFunctionMode`` marks a tensor *host* when

* it is created by code outside torch, Megatron and ``megatron_patches`` (AsyncFlow, the test) without
  ``device=`` naming a CUDA device, or by ``.cpu()`` / ``.to("cpu")``;
* every tensor an op read was host (``.to(cuda)`` and CUDA factories give engine tensors).

Torch and Megatron internals are trusted: on a GPU they pick CUDA themselves. An op that mixes a host
tensor with an engine tensor fails on CUDA (a 0-dim host tensor is the one exception CUDA allows), so
the probe records it, as it records host tensors that enter the model, the loss or a collective.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

_TRUSTED = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, __import__("megatron.core").core,
                                                                    __import__("megatron_patches")))
_NO_MIX_CHECK = {"copy_", "__setitem__", "__getitem__", "set_", "__set__", "__get__", "to", "cpu"}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "reduce", "send", "recv", "isend", "irecv", "all_to_all_single", "_all_gather_base",
               "_reduce_scatter_base")


def is_host(t) -> bool:
    """True for a tensor the probe saw made on (or moved to) the host."""
    return isinstance(t, torch.Tensor) and getattr(t, "_probe_host", False)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _is_cuda(device) -> bool:
    return (isinstance(device, torch.device) and device.type == "cuda") or (
        isinstance(device, str) and device.startswith("cuda")) or (type(device) is int)


def _where() -> str:
    """The innermost caller outside this file, torch and Megatron (the line that handed the tensor over)."""
    frame = sys._getframe(1)
    while frame.f_back and (frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(_TRUSTED)):
        frame = frame.f_back
    return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}"


class DeviceProbe(TorchFunctionMode):
    """Enter after ``megatron_patches.apply()`` (so it sees ``device="cuda"`` before the patch rewrites it)."""

    def __init__(self):
        super().__init__()
        self.violations: list[str] = []
        self.collectives: list[tuple[str, str]] = []  # (function, caller) of every collective call
        self.entries: dict[str, int] = {}

    # ------------------------------------------------------------------ shadow devices
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = func(*args, **kwargs)
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        # Torch and Megatron choose their own devices (the CPU patches make current_device() "cpu").
        trusted = sys._getframe(1).f_code.co_filename.startswith(_TRUSTED)
        if name == "cpu":
            host = True
        elif name == "to":
            host = self._to_host(args, kwargs, trusted)
        elif not inputs or kwargs.get("device") is not None:  # a factory: where would it live on a GPU?
            host = not trusted and not _is_cuda(kwargs.get("device"))
        elif name == "__getitem__":  # CUDA accepts host index tensors
            host = is_host(args[0])
        else:
            host = all(is_host(t) for t in inputs)
            if name not in _NO_MIX_CHECK and not host and any(is_host(t) and t.dim() for t in inputs):
                self.violations.append(f"{name} mixes host and engine tensors at {_where()}")
        if name in ("to", "cpu") and out is args[0] and is_host(out) != host:
            out = out.clone()  # on a GPU these are copies; keep the source's shadow device as it was
        for t in _tensors(out if isinstance(out, (tuple, list)) else [out]):
            t._probe_host = host
        return out

    @staticmethod
    def _to_host(args, kwargs, trusted: bool) -> bool:
        """The shadow device of ``Tensor.to(...)``'s result: host unless it targets CUDA (or torch or
        Megatron move it: ``all_gather_object`` moves to the backend's device, which reads "cpu" here)."""
        target = kwargs.get("device", kwargs.get("other"))
        for a in args[1:]:
            if target is None and (isinstance(a, (str, torch.device, torch.Tensor)) or type(a) is int):
                target = a
        if target is None:  # a dtype conversion stays where it was
            return is_host(args[0])
        if trusted and not isinstance(target, torch.Tensor):
            return False
        return is_host(target) if isinstance(target, torch.Tensor) else not _is_cuda(target)

    def __enter__(self):
        self._param_new = torch.nn.Parameter.__dict__["__new__"]
        original = self._param_new.__func__

        def param_new(cls, data=None, requires_grad=True):  # Parameter() is invisible to the mode
            p = original(cls, data, requires_grad)
            p._probe_host = is_host(data)
            return p

        torch.nn.Parameter.__new__ = staticmethod(param_new)
        self._collectives = {n: getattr(torch.distributed, n) for n in COLLECTIVES if hasattr(torch.distributed, n)}
        for n, fn in self._collectives.items():
            setattr(torch.distributed, n, self._shim(n, fn))
        return super().__enter__()

    def __exit__(self, *exc):
        torch.nn.Parameter.__new__ = self._param_new
        for n, fn in self._collectives.items():
            setattr(torch.distributed, n, fn)
        return super().__exit__(*exc)

    # ------------------------------------------------------------------ checks
    def _shim(self, name, fn):
        def collective(*args, **kwargs):
            self.collectives.append((name, _where()))
            self.check(f"torch.distributed.{name}", args, kwargs)
            return fn(*args, **kwargs)
        return collective

    def check(self, what: str, *objs) -> None:
        """Record a violation for every host tensor in ``objs`` (``what`` names the entry point)."""
        self.entries[what] = self.entries.get(what, 0) + 1
        for t in _tensors(list(objs)):
            if is_host(t):
                self.violations.append(f"host tensor {tuple(t.shape)} enters {what} at {_where()}")

    def watch_model(self, module: torch.nn.Module, what: str) -> None:
        """Check every tensor argument of ``module``'s forward."""
        module.register_forward_pre_hook(lambda m, args, kwargs: self.check(what, args, kwargs),
                                         with_kwargs=True)

    def checked_loss(self, loss_fn, what: str):
        """``loss_fn`` with its inputs (outputs, micro-batch) checked; keeps its attributes."""
        def wrapped(out, mb):
            self.check(what, out, mb)
            return loss_fn(out, mb)

        wrapped.__dict__.update(loss_fn.__dict__)
        return wrapped

    def expect_host(self, what: str, *objs) -> None:
        """Record a violation for every tensor in ``objs`` that is still on the engine device."""
        for t in _tensors(list(objs)):
            if not is_host(t):
                self.violations.append(f"{what} returns an engine tensor {tuple(t.shape)} (not moved to CPU)")

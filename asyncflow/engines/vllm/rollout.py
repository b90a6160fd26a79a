"""A vLLM rollout engine: generation with per-token logprobs and versioned in-place weight updates."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from asyncflow.config import VllmConfig
from asyncflow.engines.vllm.worker_extension import EXTENSION


@dataclasses.dataclass
class Rollout:
    """One generated response: the prompt, the response tokens and vLLM's logprob of each."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    weight_version: int
    finish_reason: str | None = None


def _environment(cfg: VllmConfig) -> None:
    # vLLM reads these at import / engine start; set them only where the user has not.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
    if cfg.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cfg.tensor_parallel > 1 and not torch.cuda.is_available():
        # One core per CPU worker; without it start-up fails with "Not enough allowed NUMA nodes".
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(cfg.tensor_parallel)))


class VllmRollout:
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

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
    ) -> list[Rollout]:
        """``n`` sampled responses per prompt (token-id prompts), each with its per-token logprobs."""
        from vllm import SamplingParams

        params = SamplingParams(
            n=n,
            temperature=self.cfg.temperature if temperature is None else temperature,
            max_tokens=max_new_tokens or self.cfg.max_new_tokens,
            logprobs=0,  # the sampled token's logprob only
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False
        )
        rollouts = []
        for out in outputs:
            for comp in out.outputs:
                ids = list(comp.token_ids)
                lps = [step[tok].logprob for step, tok in zip(comp.logprobs, ids)]
                rollouts.append(Rollout(list(out.prompt_token_ids), ids, lps, self.version, comp.finish_reason))
        return rollouts

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

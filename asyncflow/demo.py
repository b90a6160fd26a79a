"""``asyncflow demo``: the smallest honest slice of the AsyncFlow pipeline, on the real stack.

    tiny HF model ──load──► Megatron trainer (Ray actor) ──train N steps──► stage its shards (shm)
                                                                                   │ weights v=N
    prompts ──► vLLM rollout (Ray actor) ◄──── read its boxes, reload by bucket ───┘
                      │ responses + vLLM logprobs
                      └──► Megatron recomputes logprobs ──► max |vLLM - Megatron|

The weights take the same path as in ``asyncflow train`` (``asyncflow.bridge.staging``); the full RL
loop (TransferQueue, staleness-bounded delayed updates, GRPO) is ``asyncflow train``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from asyncflow.config import AsyncFlowConfig, MegatronConfig, VllmConfig


class _TrainerWorker:
    """Ray actor around ``MegatronTrainer`` (Megatron's world of one lives in this process)."""

    def __init__(self, cfg: MegatronConfig, model_dir: str):
        import megatron_patches
        from asyncflow.engines.megatron.trainer import MegatronTrainer

        megatron_patches.apply()
        torch.set_num_threads(1)
        self.trainer = MegatronTrainer(cfg, model_dir)
        self.trainer.load_hf(model_dir)

    def train_step(self, tokens: torch.Tensor, mask: torch.Tensor) -> dict:
        import megatron_patches

        megatron_patches.apply()  # Ray may run this method on another thread than __init__
        return self.trainer.train_step(tokens, mask)

    def stage_weights(self, bucket_mb: float) -> tuple[dict, int]:
        """Stage the current weights (the loop's path); returns the staging description and the version."""
        from asyncflow.bridge.staging import source_key

        if not hasattr(self, "stager"):
            self.stager, self.plan = self.trainer.weight_stager(bucket_mb, "demo")
        self.stager.stage(self.trainer.version)
        staging = {"plan": self.plan, "segments": {source_key(self.stager.rank): self.stager.segment}}
        return staging, self.trainer.version

    def close(self) -> None:
        """Remove the staging segment."""
        if hasattr(self, "stager"):
            self.stager.close()

    def logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        import megatron_patches

        megatron_patches.apply()
        return self.trainer.logprobs(tokens)


class _RolloutWorker:
    """Ray actor around ``VllmRollout`` (in-process vLLM engine inside this actor)."""

    def __init__(self, cfg: VllmConfig, model_dir: str):
        from asyncflow.engines.vllm.rollout import VllmRollout

        self.rollout = VllmRollout(cfg, model_dir)

    def generate(self, prompts, n: int = 1, temperature: float | None = None):
        return self.rollout.generate(prompts, n=n, temperature=temperature)

    def apply_staged(self, staging: dict, version: int) -> tuple[list[int], dict]:
        stats = self.rollout.apply_staged(staging, version)
        return self.rollout.served_versions(), stats


def _say(step: int, total: int, text: str, t0: float) -> None:
    print(f"[{step}/{total}] {text}  (+{time.time() - t0:.1f}s)", flush=True)


def _sft_batch(task, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = task.prompts(size, gen)
    tokens = torch.tensor([p + task.answer(p) for p in prompts])
    mask = torch.zeros(tokens.shape[0], tokens.shape[1] - 1)
    mask[:, len(prompts[0]) - 1 :] = 1.0  # train only the answer tokens
    return tokens, mask


def _score(task, rollouts) -> float:
    return sum(task.reward(r.prompt_ids, r.response_ids) for r in rollouts) / max(len(rollouts), 1)


def run_demo(cfg: AsyncFlowConfig) -> dict:
    """Run the demo; print each step; return (and write) a summary with the logprob agreement."""
    import ray
    from transformers import AutoTokenizer

    from asyncflow.data.synthetic import Add1Task
    from asyncflow.tiny_model import make_tiny_model

    t0, total = time.time(), 6
    model_dir = Path(cfg.model.path)
    if not (model_dir / "config.json").is_file():
        if not cfg.model.make_tiny_if_missing:
            raise FileNotFoundError(f"model.path {model_dir} has no config.json (model.make_tiny_if_missing=true "
                                    "creates a random tiny model there)")
        make_tiny_model(model_dir, family=cfg.model.tiny_family, charset=cfg.model.tiny_charset)
        _say(1, total, f"created a tiny {cfg.model.tiny_family} model at {model_dir}", t0)
    else:
        _say(1, total, f"using the model at {model_dir}", t0)
    task = Add1Task(AutoTokenizer.from_pretrained(model_dir))
    gen = torch.Generator().manual_seed(cfg.trainer.seed)

    from asyncflow.workflow.pipeline import connect_ray

    connect_ray(cfg)
    try:
        trainer = ray.remote(num_cpus=1)(_TrainerWorker).remote(cfg.trainer, str(model_dir))
        rollout = ray.remote(num_cpus=1)(_RolloutWorker).remote(cfg.rollout, str(model_dir))
        eval_prompts = task.prompts(cfg.demo.num_prompts, gen)
        before = ray.get(rollout.generate.remote(eval_prompts, temperature=0.0))
        _say(2, total, f"Ray up; Megatron trainer and vLLM rollout actors ready; greedy reward before "
             f"training {_score(task, before):.2f}", t0)

        losses = []
        for step in range(cfg.demo.train_steps):
            tokens, mask = _sft_batch(task, cfg.demo.batch_size, gen)
            stats = ray.get(trainer.train_step.remote(tokens, mask))
            losses.append(stats["loss"])
            print(f"      train step {step + 1}/{cfg.demo.train_steps}: loss {stats['loss']:.4f} "
                  f"grad_norm {stats['grad_norm']:.3f}", flush=True)
        _say(3, total, f"Megatron trained {cfg.demo.train_steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}",
             t0)

        t_move = time.time()
        staging, version = ray.get(trainer.stage_weights.remote(cfg.weight_sync.bucket_mb))
        served, stats = ray.get(rollout.apply_staged.remote(staging, version))
        move_ms = (time.time() - t_move) * 1e3
        _say(4, total, f"moved weights v{version} Megatron -> vLLM through shared memory "
             f"({max(stats['bytes_per_rank']) / 2**20:.2f} MiB in {stats['buckets']} bucket(s), {move_ms:.0f} ms); "
             f"vLLM ranks serve versions {served}", t0)

        rollouts = ray.get(rollout.generate.remote(eval_prompts, n=4))
        greedy = ray.get(rollout.generate.remote(eval_prompts, temperature=0.0))
        _say(5, total, f"vLLM generated {len(rollouts)} sampled responses; greedy reward after training "
             f"{_score(task, greedy):.2f}", t0)

        max_diff = _compare_logprobs(ray, trainer, rollouts, task.tokenizer.pad_token_id)
        _say(6, total, f"Megatron recomputed the logprobs of every generated token: "
             f"max |vLLM logprob - Megatron logprob| = {max_diff:.3e}", t0)
    finally:
        try:
            ray.get(trainer.close.remote(), timeout=30)
        except Exception:  # the trainer never started or died: nothing of it is left to close
            pass
        ray.shutdown()
    summary = {
        "train_losses": losses,
        "greedy_reward_before": _score(task, before),
        "greedy_reward_after": _score(task, greedy),
        "weight_version": version,
        "weight_move_ms": move_ms,
        "max_abs_logprob_diff": max_diff,
        "wall_s": time.time() - t0,
    }
    out = Path(cfg.demo.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"max |vLLM logprob - Megatron logprob| after the weight move: {max_diff:.3e} "
          f"({'OK' if max_diff < 1e-5 else 'ABOVE 1e-5'}); summary in {out / 'summary.json'}", flush=True)
    return summary


def _compare_logprobs(ray, trainer, rollouts, pad_id: int) -> float:
    """Largest |vLLM - Megatron| logprob over all generated tokens."""
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    tokens = torch.full((len(rollouts), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rollouts):
        seq = r.prompt_ids + r.response_ids
        tokens[i, : len(seq)] = torch.tensor(seq)
    mcore = ray.get(trainer.logprobs.remote(tokens))
    diffs = []
    for i, r in enumerate(rollouts):
        start = len(r.prompt_ids) - 1  # position t predicts token t+1
        ours = mcore[i, start : start + len(r.response_ids)]
        diffs.append((ours - torch.tensor(r.response_logprobs)).abs().max().item())
    return max(diffs)

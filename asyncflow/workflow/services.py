"""RL task services. Each pulls the fields it needs from the TransferQueue and puts back what it makes.

| service    | reads                                        | writes                                  |
|------------|----------------------------------------------|-----------------------------------------|
| rollout    | prompt_ids                                   | response_ids, behaviour_logprobs, version |
| reward     | prompt_ids, response_ids                     | rewards                                 |
| reference  | prompt_ids, response_ids                     | ref_logprobs                            |
| advantage  | rewards (whole GRPO groups)                  | advantages                              |
| actor      | prompts, responses, logprobs, advantages     | new weights (version board)             |

``run_step(step)`` processes one partition (one global step) as its rows become ready; ``run(steps)``
loops over steps and posts each step's report to the version board. The same ``run_step`` serves
the async mode (every service loops on its own) and the sync mode (the driver calls them in turn).
Each service runs in its own Ray actor; it receives only the config sections it needs.
"""

from __future__ import annotations

import os
import time

import torch

from asyncflow.config import AlgorithmConfig, MegatronConfig, TransferQueueConfig, VllmConfig
from asyncflow.workflow.batching import ACTOR_FIELDS, fit_seq_len, pack_tokens, response_slices, to_micro_batch


def partition_name(step: int) -> str:
    """The TransferQueue partition that holds the samples of global step ``step``."""
    return f"step-{step:06d}"


class TaskService:
    """Common plumbing: a TransferQueue client, a timeline, the board, and the step loop."""

    name = "task"

    def __init__(self, tq_address: str, tq_cfg: TransferQueueConfig, board, threads: int, worker: int = 0,
                 timeout_s: float = 600.0, cpus: list[int] | None = None):
        from asyncflow.observability import Timeline
        from asyncflow.transfer_queue import TransferQueueClient

        if cpus:  # Ray reserves CPUs but does not pin; pinning keeps side-by-side workers off each other's cores
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
        self.tq = TransferQueueClient(tq_address, tq_cfg)
        self.board = board
        self.worker = worker
        self.timeout_s = timeout_s
        self.timeline = Timeline()

    def stream(self, step: int, fields: list[str], batch_size: int, **kwargs):
        """Micro-batches of this task's unread rows of ``step`` until the partition is exhausted."""
        return self.tq.iter_batches(partition_name(step), self.name, fields, batch_size,
                                    timeout=self.timeout_s, **kwargs)

    def run_step(self, step: int) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def report(self, step: int, metrics: dict, **extra) -> dict:
        """A step's metrics plus the spans recorded since the last report (and ``extra`` records)."""
        return {"step": step, "service": self.name, "worker": self.worker, "metrics": metrics,
                "spans": self.timeline.export_spans(clear=True), **extra}

    def run(self, first: int, last: int) -> int:
        """Process steps ``first .. last-1`` in order, posting each report to the board."""
        import ray

        for step in range(first, last):
            ray.get(self.board.report.remote(self.run_step(step)))
        return last

    def ping(self) -> str:
        """Liveness check used at start-up."""
        return self.name


class RolloutService(TaskService):
    """vLLM generation under the staleness rule; finished responses stream into the TransferQueue."""

    name = "rollout"

    def __init__(self, vllm_cfg: VllmConfig, model_dir: str, max_staleness: int, chunk: int, budgets: bool = False,
                 **kw):
        cpus = kw.get("cpus") or list(range(kw.get("threads", 1)))
        # vLLM's CPU worker binds its OpenMP threads to these cores (it would claim every core otherwise).
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
        super().__init__(**kw)
        from asyncflow.engines.base import make_rollout_engine

        self.engine = make_rollout_engine("vllm", vllm_cfg, model_dir)
        self.max_staleness = max_staleness
        self.chunk = chunk
        self.fields = ["prompt_ids"] + (["max_new_tokens"] if budgets else [])

    def _admit(self, step: int) -> int:
        """Wait until weights recent enough for ``step`` exist, load the newest; return its version."""
        import ray

        from asyncflow.workflow.board import admitted_version

        with self.timeline.span(self.name, "wait_weights", self.worker):
            version, weights = ray.get(self.board.wait_for_version.remote(
                admitted_version(step, self.max_staleness), self.timeout_s))
        if version > self.engine.weight_version:
            with self.timeline.span(self.name, "load_weights", self.worker, version=version):
                self.engine.apply_blob(ray.get(weights[0]), version)
        return self.engine.weight_version

    def run_step(self, step: int) -> dict:
        version = self._admit(step)
        part, pending, rows, tokens = partition_name(step), [], 0, 0

        def flush():
            if pending:
                self.tq.put(part, {
                    "response_ids": [torch.tensor(s.response_ids, dtype=torch.long) for _, s in pending],
                    "behaviour_logprobs": [torch.tensor(s.response_logprobs) for _, s in pending],
                }, indexes=[i for i, _ in pending], versions=[s.weight_version for _, s in pending])
                pending.clear()

        for batch in self.stream(step, self.fields, self.chunk):
            with self.timeline.span(self.name, "generate", self.worker, rows=len(batch)):
                prompts = [p.tolist() for p in batch["prompt_ids"]]
                budgets = batch["max_new_tokens"].tolist() if "max_new_tokens" in batch else None

                def on_sample(i, sample, indexes=batch.indexes):
                    pending.append((indexes[i], sample))
                    if len(pending) >= 16:  # stream out as they finish, a few rows per put
                        flush()

                samples = self.engine.generate(prompts, n=1, on_sample=on_sample, max_new_tokens=budgets,
                                               ignore_eos=budgets is not None)
                flush()
            rows += len(samples)
            tokens += sum(len(s.response_ids) for s in samples)
        return self.report(step, {"rollout/rows": rows, "rollout/tokens": tokens, "rollout/version": version})


class RewardService(TaskService):
    """Verifiable rewards (registry ``REWARD_FUNCTIONS``)."""

    name = "reward"

    def __init__(self, reward: str, model_dir: str, chunk: int, **kw):
        super().__init__(**kw)
        from transformers import AutoTokenizer

        from asyncflow.rewards import make_reward_fn

        self.reward_fn = make_reward_fn(reward, AutoTokenizer.from_pretrained(model_dir))
        self.chunk = chunk

    def run_step(self, step: int) -> dict:
        for batch in self.stream(step, ["prompt_ids", "response_ids"], self.chunk):
            with self.timeline.span(self.name, "score", self.worker, rows=len(batch)):
                rewards = [float(self.reward_fn(p.tolist(), r.tolist()))
                           for p, r in zip(batch["prompt_ids"], batch["response_ids"])]
                self.tq.put(partition_name(step), {"rewards": torch.tensor(rewards)}, indexes=batch.indexes)
        return self.report(step, {})


class ReferenceService(TaskService):
    """Log-probabilities of the frozen reference policy (Megatron, forward only)."""

    name = "reference"

    def __init__(self, megatron_cfg: MegatronConfig, model_dir: str, seq_len: int, chunk: int, **kw):
        super().__init__(**kw)
        from asyncflow.engines.base import make_train_engine

        self.engine = make_train_engine("megatron", megatron_cfg, model_dir)
        self.seq_len, self.chunk = seq_len, chunk
        self.pad_id = 0
        self.fixed_shape = megatron_cfg.pipeline_parallel > 1

    def run_step(self, step: int) -> dict:
        for batch in self.stream(step, ["prompt_ids", "response_ids"], self.chunk):
            with self.timeline.span(self.name, "ref_logprobs", self.worker, rows=len(batch)):
                prompts, responses = batch["prompt_ids"], batch["response_ids"]
                seq_len = self.seq_len if self.fixed_shape else fit_seq_len(prompts, responses, self.seq_len)
                tokens, _ = pack_tokens(prompts, responses, seq_len, self.pad_id)
                logprobs = self.engine.compute_logprobs(tokens)
                self.tq.put(partition_name(step), {"ref_logprobs": response_slices(logprobs, prompts, responses)},
                            indexes=batch.indexes)
        return self.report(step, {})


class AdvantageService(TaskService):
    """Group-relative advantages; receives whole GRPO groups only (the group sampler)."""

    name = "advantage"

    def __init__(self, algo: AlgorithmConfig, group_size: int, chunk: int, **kw):
        super().__init__(**kw)
        self.algo, self.group_size = algo, group_size
        self.chunk = max(chunk // group_size, 1) * group_size
        self.kl_in_reward = algo.kl_coef > 0 and algo.kl_mode == "reward"

    def run_step(self, step: int) -> dict:
        from asyncflow.algorithms import compute_advantages, kl_penalty

        fields = ["rewards"] + (["behaviour_logprobs", "ref_logprobs"] if self.kl_in_reward else [])
        all_rewards = []
        for batch in self.stream(step, fields, self.chunk, sampler="group",
                                 sampler_args={"group_size": self.group_size}):
            with self.timeline.span(self.name, "advantages", self.worker, rows=len(batch)):
                rewards = torch.as_tensor(batch["rewards"]).float().reshape(-1)
                all_rewards.append(rewards)
                if self.kl_in_reward:
                    kl = torch.stack([kl_penalty(self.algo.kl_estimator, b, r).sum()
                                      for b, r in zip(batch["behaviour_logprobs"], batch["ref_logprobs"])])
                    rewards = rewards - self.algo.kl_coef * kl
                adv = compute_advantages(self.algo.advantage, rewards, batch.meta.group_ids,
                                         **_advantage_kwargs(self.algo))
                self.tq.put(partition_name(step), {"advantages": adv}, indexes=batch.indexes)
        rewards = torch.cat(all_rewards) if all_rewards else torch.zeros(0)
        return self.report(step, {"reward/mean": rewards.mean().item() if len(rewards) else float("nan"),
                                  "reward/max": rewards.max().item() if len(rewards) else float("nan")})


def _advantage_kwargs(algo: AlgorithmConfig) -> dict:
    if algo.advantage == "grpo":
        return {"eps": algo.adv_eps, "norm_by_std": algo.norm_adv_by_std}
    return {}


class ActorService(TaskService):
    """Megatron policy update; the first pass streams micro-batches straight from the TransferQueue."""

    name = "actor"

    def __init__(self, megatron_cfg: MegatronConfig, algo: AlgorithmConfig, model_dir: str, seq_len: int,
                 rows_per_step: int, max_new_tokens: int, **kw):
        super().__init__(**kw)
        from asyncflow.algorithms.objective import make_objective
        from asyncflow.engines.base import make_train_engine

        self.engine = make_train_engine("megatron", megatron_cfg, model_dir)
        self.algo, self.seq_len, self.pad_id = algo, seq_len, 0
        self.fixed_shape = megatron_cfg.pipeline_parallel > 1
        self.mbs = megatron_cfg.micro_batch_size
        if rows_per_step % self.mbs:
            raise ValueError(f"rows per step {rows_per_step} must be a multiple of trainer.micro_batch_size {self.mbs}")
        self.num_micro = rows_per_step // self.mbs
        self.loss_fn = make_objective(algo, max_new_tokens)
        self.fields = ACTOR_FIELDS + (["ref_logprobs"] if algo.kl_coef > 0 and algo.kl_mode == "loss" else [])
        self.publish()  # version 0: the weights rollout starts from

    def publish(self) -> None:
        """Export the current weights and make them the board's newest version."""
        import ray
        from safetensors.torch import save

        with self.timeline.span(self.name, "publish_weights", self.worker, version=self.engine.version):
            blob = save({name: t.contiguous() for name, t in self.engine.export_weights()})
            ray.get(self.board.publish.remote(self.engine.version, [ray.put(blob)]))

    def run_step(self, step: int) -> dict:
        cache: list[dict] = []
        groups: list[int] = []
        version = self.engine.version

        def first_pass():
            for batch in self.stream(step, self.fields, self.mbs):
                groups.extend(batch.meta.group_ids)
                mb = to_micro_batch(batch, self.seq_len, self.pad_id, version, self.fixed_shape)
                cache.append(mb)
                yield mb

        t0 = time.time()
        with self.timeline.span(self.name, "train", self.worker, step=step):
            results = [self.engine.train_step(first_pass(), self.num_micro, self.loss_fn)]
            for mb, out in zip(cache, results[0]["micro"]):
                mb["old_logprobs"] = out["old_logprobs"]  # the proximal policy of this step
            for _ in range(self.algo.ppo_epochs - 1):
                results.append(self.engine.train_step(iter(cache), self.num_micro, self.loss_fn))
        self.engine.version += 1
        self.publish()
        # The GRPO group of every trained row: lets the driver prove each prompt was trained exactly once.
        return self.report(step, _actor_metrics(results, cache, time.time() - t0), trained_groups=sorted(groups))


def _actor_metrics(results: list[dict], cache: list[dict], seconds: float) -> dict:
    first = results[0]["micro"]
    tokens = sum(float(o["tokens"]) for o in first)
    lags = torch.cat([mb["lag"] for mb in cache]).float()
    gaps = [float(o["fresh_logprob_gap_max"]) for o in first if not torch.isnan(o["fresh_logprob_gap_max"])]
    metrics = {
        "actor/pg_loss": sum(float(o["pg_sum"]) for o in first) / max(tokens, 1),
        "actor/grad_norm": results[-1]["grad_norm"],
        "actor/tokens": tokens,
        "actor/rows": float(lags.numel()),
        "actor/train_s": seconds,
        "staleness/version_lag_mean": lags.mean().item(),
        "staleness/version_lag_max": lags.max().item(),
    }
    if "kl_sum" in first[0]:
        metrics["actor/kl"] = sum(float(o["kl_sum"]) for o in first) / max(tokens, 1)
    if "clip_sum" in first[0]:
        metrics["actor/clip_frac"] = sum(float(o["clip_sum"]) for o in results[-1]["micro"]) / max(tokens, 1)
    if gaps:
        metrics["check/fresh_logprob_gap_max"] = max(gaps)
    return metrics

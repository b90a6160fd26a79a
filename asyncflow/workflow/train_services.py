"""The Megatron services: reference logprobs and the actor update, one Ray actor per Megatron rank.

A worker group of ``TP x PP x DP`` ranks forms one torch.distributed world. Every rank streams from the
TransferQueue with its data-parallel rank and its model-parallel rank, so all TP/PP ranks of one
data-parallel replica receive the same rows and different replicas receive different rows. Only the
last pipeline stage's first tensor-parallel rank of each replica writes results back; only the last
stage's first rank of replica 0 reports metrics.
"""

from __future__ import annotations

import os
import time

import torch

from asyncflow.config import AlgorithmConfig, MegatronConfig
from asyncflow.workflow.batching import ACTOR_FIELDS, fit_seq_len, pack_tokens, response_slices, to_micro_batch
from asyncflow.workflow.services import TaskService, partition_name


class MegatronService(TaskService):
    """A rank of a Megatron worker group: joins the group's process group, knows its DP/MP position."""

    def __init__(self, megatron_cfg: MegatronConfig, model_dir: str, seq_len: int, rank: int = 0,
                 world_size: int = 1, master_port: int = 0, **kw):
        if world_size > 1:  # torch.distributed rendezvous of the worker group (127.0.0.1: one node here)
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(master_port))
        super().__init__(worker=rank, **kw)
        from megatron.core import parallel_state as ps

        from asyncflow.engines.base import make_train_engine

        self.engine = make_train_engine(megatron_cfg.engine, megatron_cfg, model_dir)
        self.seq_len, self.pad_id = seq_len, 0
        self.fixed_shape = megatron_cfg.pipeline_parallel > 1  # stages exchange fixed shapes
        tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.tp_rank, self.pp_rank = tp, pp
        self.mp_rank = tp + ps.get_tensor_model_parallel_world_size() * pp
        self.mp_size = ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
        self.writer = ps.is_pipeline_last_stage() and tp == 0  # holds the logprobs of its replica
        self.reporter = self.writer and self.dp_rank == 0

    def stream(self, step: int, fields: list[str], batch_size: int, **kwargs):
        """This rank's share: the same rows for every TP/PP rank of a replica, distinct across replicas."""
        return super().stream(step, fields, batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size,
                              mp_rank=self.mp_rank, mp_size=self.mp_size, **kwargs)

    def seq_len_for(self, prompts, responses) -> int:
        """Micro-batch width: fixed under pipeline parallelism, the longest row otherwise."""
        return self.seq_len if self.fixed_shape else fit_seq_len(prompts, responses, self.seq_len)


class ReferenceService(MegatronService):
    """Log-probabilities of the frozen reference policy (forward only)."""

    name = "reference"

    def __init__(self, chunk: int, **kw):
        super().__init__(**kw)
        self.chunk = chunk

    def run_step(self, step: int) -> dict | None:
        for batch in self.stream(step, ["prompt_ids", "response_ids"], self.chunk):
            with self.timeline.span(self.name, "ref_logprobs", self.worker, rows=len(batch)):
                prompts, responses = batch["prompt_ids"], batch["response_ids"]
                tokens, _ = pack_tokens(prompts, responses, self.seq_len_for(prompts, responses), self.pad_id)
                logprobs = self.engine.compute_logprobs(tokens)
                if self.writer:
                    self.tq.put(partition_name(step), {"ref_logprobs": response_slices(logprobs, prompts, responses)},
                                indexes=batch.indexes)
        return self.report(step, {}) if self.reporter else None


class ActorService(MegatronService):
    """Policy update; the first pass streams micro-batches straight from the TransferQueue."""

    name = "actor"

    def __init__(self, algo: AlgorithmConfig, rows_per_step: int, max_new_tokens: int, **kw):
        super().__init__(**kw)
        from asyncflow.algorithms.objective import make_objective

        self.algo = algo
        self.mbs = self.engine.trainer.cfg.micro_batch_size
        if rows_per_step % (self.mbs * self.dp_size):
            raise ValueError(f"rows per step {rows_per_step} must be a multiple of trainer.micro_batch_size "
                             f"{self.mbs} x data-parallel size {self.dp_size}")
        self.num_micro = rows_per_step // (self.mbs * self.dp_size)
        self.loss_fn = make_objective(algo, max_new_tokens)
        self.fields = ACTOR_FIELDS + (["ref_logprobs"] if algo.kl_coef > 0 and algo.kl_mode == "loss" else [])
        self.publish()  # version 0: the weights rollout starts from

    def publish(self) -> None:
        """Export the current weights; each pipeline stage of replica 0 posts its part to the board.

        The export is collective over the tensor-parallel group; the board makes a version visible once
        every stage's part has arrived, so rollout never loads half a model.
        """
        import ray
        from megatron.core import parallel_state as ps
        from safetensors.torch import save

        if self.dp_rank != 0:
            return
        with self.timeline.span(self.name, "publish_weights", self.worker, version=self.engine.version):
            tensors = {name: t.contiguous() for name, t in self.engine.export_weights()}
            if self.tp_rank == 0:
                ref = ray.put(save(tensors))
                ray.get(self.board.publish.remote(self.engine.version, [ref], part=self.pp_rank,
                                                  num_parts=ps.get_pipeline_model_parallel_world_size()))

    def run_step(self, step: int) -> dict | None:
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
        all_groups = _gather_over_data_parallel(groups)
        if not self.reporter:
            return None
        # The GRPO group of every trained row: lets the driver prove each prompt was trained exactly once.
        metrics = _actor_metrics(results, cache, time.time() - t0)
        metrics["actor/rows"] = float(len(all_groups))  # every replica's rows, not only this one's
        return self.report(step, metrics, trained_groups=sorted(all_groups))


def _gather_over_data_parallel(items: list[int]) -> list[int]:
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_world_size() == 1:
        return items
    gathered: list = [None] * ps.get_data_parallel_world_size()
    torch.distributed.all_gather_object(gathered, items, group=ps.get_data_parallel_group(with_context_parallel=False))
    return [x for part in gathered for x in part]


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

"""Start and stop everything the loop needs: Ray, the TransferQueue, the version board, the services.

Worker groups are Ray actors in one placement group. ``async`` (task-separated) gives rollout and
training a bundle each and pins them to different cores; ``sync`` (colocated) puts every worker in one
bundle and lets the heavy ones use all its cores, taking turns.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from asyncflow.config import AsyncFlowConfig
from asyncflow.workflow import services
from asyncflow.workflow.board import VersionBoard
from asyncflow.workflow.services import partition_name


@dataclasses.dataclass
class Pipeline:
    """Handles of a running pipeline; ``close()`` stops every actor and server it started."""

    cfg: AsyncFlowConfig
    tq: object
    client: object
    board: object
    rollouts: list
    reward: object
    reference: object | None
    advantage: object
    actor: object
    placement_group: object
    seq_len: int
    tasks: list[str]

    @property
    def services(self) -> list:
        """Every service actor, in pipeline order."""
        extra = [self.reference] if self.reference is not None else []
        return [*self.rollouts, self.reward, *extra, self.advantage, self.actor]

    def create_partitions(self, steps: int, rows_per_step: int) -> None:
        """Create every step's (empty) partition up front.

        Services run ahead on their own and ask for a step's rows before the prompts exist; the
        TransferQueue treats an unknown partition as an error, while an empty one makes them wait.
        Empty partitions cost a few bytes of metadata; rows are freed as soon as every task read them.
        """
        for step in range(steps):
            self.client.create_partition(partition_name(step), consumers=self.tasks, expected_rows=rows_per_step,
                                         auto_clear=True)

    def feed(self, step: int, prompts: list[list[int]], group_size: int, budgets: list[int] | None = None) -> None:
        """Put the prompts of ``step``, each repeated ``group_size`` times (one GRPO group per prompt),
        with optional per-sample generation ``budgets`` (field ``max_new_tokens``)."""
        import torch

        rows = [torch.tensor(p, dtype=torch.long) for p in prompts for _ in range(group_size)]
        groups = [step * len(prompts) + i for i in range(len(prompts)) for _ in range(group_size)]
        data = {"prompt_ids": rows}
        if budgets is not None:
            data["max_new_tokens"] = torch.tensor(budgets, dtype=torch.long)
        self.client.put(partition_name(step), data, group_ids=groups)

    def close(self) -> None:
        """Kill the actors, stop the TransferQueue, shut Ray down (safe to call twice)."""
        import ray

        for handle in [*self.services, self.board]:
            try:
                ray.kill(handle)
            except Exception:  # already dead: nothing to stop
                pass
        try:
            self.client.close()
        finally:
            self.tq.shutdown()
            ray.shutdown()


def start_pipeline(cfg: AsyncFlowConfig, model_dir: Path, max_prompt_len: int, budgets: bool = False) -> Pipeline:
    """Bring up Ray, the TransferQueue and every service for ``cfg.workflow.mode``.

    ``budgets``: rows carry per-sample generation budgets (``max_new_tokens``), used to the end.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from asyncflow import transfer_queue

    wf, algo = cfg.workflow, cfg.algorithm
    colocated = wf.mode == "sync"
    ray.init(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, namespace=cfg.ray.namespace,
             include_dashboard=False, log_to_driver=False)
    tq = transfer_queue.start(cfg.transfer_queue)
    client = tq.client()
    cores = 2 if cfg.ray.num_cpus is None else max(int(cfg.ray.num_cpus), 1)
    bundles = [{"CPU": cores}] if colocated else [{"CPU": 1}, {"CPU": max(cores - 1, 1)}]
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready(), timeout=120)

    def place(cls, bundle: int, num_cpus: float, **kwargs):
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
        return ray.remote(cls).options(num_cpus=num_cpus, scheduling_strategy=strategy).remote(**kwargs)

    threads = wf.sync_worker_threads if colocated else wf.worker_threads
    train_bundle = 0 if colocated else 1
    # Async: rollout on core 0, trainer-side workers on the rest; sync: everyone may use every core.
    rollout_cpus = list(range(cores)) if colocated else [0]
    train_cpus = list(range(cores)) if colocated else list(range(1, cores))
    board = ray.remote(VersionBoard).options(num_cpus=0).remote()
    common = dict(tq_address=tq.address, tq_cfg=cfg.transfer_queue, board=board, timeout_s=wf.step_timeout_s)
    seq_len = max_prompt_len + cfg.rollout.max_new_tokens
    rows_per_step = wf.prompts_per_step * wf.samples_per_prompt
    use_ref = algo.kl_coef > 0

    rollouts = [
        place(services.RolloutService, 0, 1 if i == 0 else 0, vllm_cfg=cfg.rollout, model_dir=str(model_dir),
              max_staleness=0 if colocated else wf.max_staleness, chunk=wf.rollout_chunk, threads=threads,
              budgets=budgets,
              worker=i, cpus=rollout_cpus, **common)
        for i in range(wf.rollout_instances)
    ]
    actor = place(services.ActorService, train_bundle, 1, megatron_cfg=cfg.trainer, algo=algo,
                  model_dir=str(model_dir), seq_len=seq_len, rows_per_step=rows_per_step,
                  max_new_tokens=cfg.rollout.max_new_tokens, threads=threads, cpus=train_cpus, **common)
    reference = None
    if use_ref:
        reference = place(services.ReferenceService, train_bundle, 0, megatron_cfg=cfg.trainer,
                          model_dir=str(model_dir), seq_len=seq_len, chunk=wf.score_chunk, threads=threads,
                          cpus=train_cpus, **common)
    reward = place(services.RewardService, train_bundle, 0, reward=algo.reward, model_dir=str(model_dir),
                   chunk=wf.score_chunk, threads=1, **common)
    advantage = place(services.AdvantageService, train_bundle, 0, algo=algo, group_size=wf.samples_per_prompt,
                      chunk=wf.score_chunk, threads=1, **common)
    tasks = ["rollout", "reward", "advantage", "actor"] + (["reference"] if use_ref else [])
    pipeline = Pipeline(cfg, tq, client, board, rollouts, reward, reference, advantage, actor, pg, seq_len, tasks)
    try:
        ray.get([s.ping.remote() for s in pipeline.services], timeout=600)
    except BaseException:
        pipeline.close()
        raise
    return pipeline

"""Start and stop everything the loop needs: Ray, the TransferQueue, the version board, the services.

Worker groups are Ray actors in one placement group. ``async`` (task-separated) gives rollout and
training a bundle each and pins them to different cores; ``sync`` (colocated) puts every worker in one
bundle and lets the heavy ones use all its cores, taking turns.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from asyncflow.config import AsyncFlowConfig
from asyncflow.workflow import services, train_services
from asyncflow.workflow.board import VersionBoard
from asyncflow.workflow.services import partition_name


@dataclasses.dataclass
class Pipeline:
    """Handles of a running pipeline; ``close()`` stops every actor and server it started."""

    cfg: AsyncFlowConfig
    tq: object
    client: object
    board: object
    groups: dict[str, list]
    """Worker groups in pipeline order: service name -> its Ray actors (one per instance or rank)."""
    placement_group: object
    seq_len: int
    tasks: list[str]
    """TransferQueue consumer tasks (a group may run several, e.g. the critic's ``values`` and ``critic``)."""
    stages: list[tuple[str, str | None]]
    """Sync mode's lock-step order within a step: (group, phase) pairs, phase None = the whole step."""

    @property
    def services(self) -> list:
        """Every service actor, in pipeline order."""
        return [handle for group in self.groups.values() for handle in group]

    def create_partitions(self, steps: int, rows_per_step: int, first: int = 0) -> None:
        """Create every step's (empty) partition up front.

        Services run ahead on their own and ask for a step's rows before the prompts exist; the
        TransferQueue treats an unknown partition as an error, while an empty one makes them wait.
        Empty partitions cost a few bytes of metadata; rows are freed as soon as every task read them.
        """
        # Dynamic sampling grows a step in rounds; the driver seals it once enough groups are kept.
        expected = None if self.cfg.algorithm.dynamic_sampling else rows_per_step
        for step in range(first, steps):
            self.client.create_partition(partition_name(step), consumers=self.tasks, expected_rows=expected,
                                         auto_clear=True)

    def feed(self, step: int, prompts: list[list[int]], group_size: int, budgets: list[int] | None = None,
             answers: list | None = None, first_group: int | None = None) -> None:
        """Put the prompts of ``step``, each repeated ``group_size`` times (one GRPO group per prompt),
        with optional per-sample generation ``budgets`` (field ``max_new_tokens``) and per-prompt
        reference ``answers`` (field ``ground_truth``, read by the reward task). Group ids start at
        ``first_group`` (default ``step x len(prompts)``)."""
        import torch

        rows = [torch.tensor(p, dtype=torch.long) for p in prompts for _ in range(group_size)]
        base = step * len(prompts) if first_group is None else first_group
        groups = [base + i for i in range(len(prompts)) for _ in range(group_size)]
        data = {"prompt_ids": rows}
        if budgets is not None:
            data["max_new_tokens"] = torch.tensor(budgets, dtype=torch.long)
        if answers is not None:
            data["ground_truth"] = [a for a in answers for _ in range(group_size)]
        self.client.put(partition_name(step), data, group_ids=groups)

    def seal(self, step: int) -> None:
        """No more rows for ``step`` (dynamic sampling): its tasks finish once they have read what is there."""
        self.client.seal(partition_name(step))

    def close(self) -> None:
        """Kill the actors, stop the TransferQueue, shut Ray down (safe to call twice)."""
        import ray

        try:  # graceful first: a killed rollout actor would orphan vLLM's worker processes
            ray.get([s.shutdown.remote() for s in self.services], timeout=60)
        except Exception:  # a dead or stuck service: killing it below is all that is left
            pass
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


def check_algorithm(cfg: AsyncFlowConfig) -> None:
    """Reject algorithm settings that cannot work together, naming the keys (before anything starts)."""
    from asyncflow.algorithms.advantages import estimator_scope
    from asyncflow.config import ConfigError

    algo = cfg.algorithm
    scope = estimator_scope(algo.advantage)
    if algo.dynamic_sampling:
        if scope != "group":
            raise ConfigError(f"algorithm.dynamic_sampling needs a group estimator (grpo, rloo); "
                              f"algorithm.advantage={algo.advantage!r} is {scope}-scoped")
        if algo.kl_coef > 0 and algo.kl_mode == "reward":
            raise ConfigError("algorithm.dynamic_sampling with algorithm.kl_mode=reward is not supported: the "
                              "reference would have to score groups before they are kept; use kl_mode=loss "
                              "or kl_coef=0")


def start_pipeline(cfg: AsyncFlowConfig, model_dir: Path, max_prompt_len: int, budgets: bool = False,
                   answers: bool = False, resume_dir: Path | None = None, start_step: int = 0) -> Pipeline:
    """Bring up Ray, the TransferQueue and every service for ``cfg.workflow.mode``.

    ``budgets``: rows carry per-sample generation budgets (``max_new_tokens``), used to the end.
    ``answers``: rows carry reference answers (``ground_truth``) for the reward function.
    ``resume_dir``: a committed run checkpoint the actor (and critic) load; training continues at ``start_step``.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from asyncflow import transfer_queue
    from asyncflow.algorithms.advantages import estimator_scope
    from asyncflow.workflow.resume import checkpoint_root

    wf, algo = cfg.workflow, cfg.algorithm
    check_algorithm(cfg)
    colocated = wf.mode == "sync"
    critic = estimator_scope(algo.advantage) == "critic"
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
    common = dict(tq_address=tq.address, tq_cfg=cfg.transfer_queue, board=board, timeout_s=wf.step_timeout_s,
                  partial_batches=algo.dynamic_sampling)
    seq_len = max_prompt_len + cfg.rollout.max_new_tokens
    persist = dict(checkpoint={"root": str(checkpoint_root(cfg)), "interval": cfg.checkpoint.interval,
                               "steps": wf.steps},
                   resume_dir=None if resume_dir is None else str(resume_dir), start_version=start_step)
    rows_per_step = wf.prompts_per_step * wf.samples_per_prompt

    groups: dict[str, list] = {"rollout": [
        place(services.RolloutService, 0, 1 if i == 0 else 0, vllm_cfg=cfg.rollout, model_dir=str(model_dir),
              max_staleness=0 if colocated else wf.max_staleness, chunk=wf.rollout_chunk, threads=threads,
              budgets=budgets, worker=i, cpus=rollout_cpus, **common)
        for i in range(wf.rollout_instances)
    ]}
    groups["reward"] = [place(services.RewardService, train_bundle, 0, reward=algo.reward, model_dir=str(model_dir),
                              chunk=wf.score_chunk, reward_on_error=algo.reward_on_error, with_answers=answers,
                              threads=1, **common)]
    megatron = dict(megatron_cfg=cfg.trainer, model_dir=str(model_dir), seq_len=seq_len, threads=threads, **common)
    if algo.kl_coef > 0:
        # The reference forward shares rollout's cores: the actor update is the longer task, and the
        # rollout side idles whenever it waits for weights (measured: it balances the two cores).
        groups["reference"] = megatron_group(place, train_services.ReferenceService, 0, cfg.trainer, 0,
                                             chunk=wf.score_chunk, after_advantage=algo.dynamic_sampling,
                                             cpus=rollout_cpus, **megatron)
    groups["advantage"] = [place(services.AdvantageService, train_bundle, 0, algo=algo,
                                 group_size=wf.samples_per_prompt, chunk=wf.score_chunk, rows_per_step=rows_per_step,
                                 threads=1, **common)]
    groups["actor"] = megatron_group(place, train_services.ActorService, train_bundle, cfg.trainer, 1, algo=algo,
                                     rows_per_step=rows_per_step, max_new_tokens=cfg.rollout.max_new_tokens,
                                     cpus=train_cpus, **persist, **megatron)
    stages = [(name, None) for name in groups]
    if algo.dynamic_sampling and "reference" in groups:  # it scores only the kept rows: after advantage
        stages.remove(("reference", None))
        stages.insert([name for name, _ in stages].index("actor"), ("reference", None))
    if critic:
        # The critic shares the trainer's cores: its values pass is short and its update runs while the
        # actor waits for the next step's rows.
        groups["critic"] = megatron_group(place, train_services.CriticService, train_bundle, cfg.critic, 0,
                                          algo=algo, rows_per_step=rows_per_step, chunk=wf.score_chunk,
                                          cpus=train_cpus, **persist, **{**megatron, "megatron_cfg": cfg.critic})
        at = [name for name, _ in stages].index("advantage")
        stages[at:at] = [("critic", "values")]  # GAE needs the values; the critic update follows the actor
        stages.append(("critic", "critic"))
    multi_task = {"critic": train_services.CriticService.tasks}
    tasks = [task for name in groups for task in multi_task.get(name, (name,))]
    pipeline = Pipeline(cfg, tq, client, board, groups, pg, seq_len, tasks, stages)
    try:
        ray.get([s.ping.remote() for s in pipeline.services], timeout=600)
    except BaseException:
        pipeline.close()
        raise
    return pipeline


def megatron_group(place, cls, bundle: int, mcfg, num_cpus: float, **kwargs) -> list:
    """``TP x PP x DP`` Ray actors of ``cls`` forming one torch.distributed world.

    Only rank 0 reserves ``num_cpus``: all ranks of a group must be scheduled together (they rendezvous
    in their constructors), and on a small machine reserving a CPU per rank could leave one unplaced.
    """
    from asyncflow.engines.megatron.parallel import free_port

    world = mcfg.tensor_parallel * mcfg.pipeline_parallel * mcfg.data_parallel
    port = free_port()
    return [place(cls, bundle, num_cpus if rank == 0 else 0, rank=rank, world_size=world, master_port=port,
                  **kwargs) for rank in range(world)]

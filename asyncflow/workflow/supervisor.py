"""Restarts of the stateless services (rollout instances, reward, advantage) when their process dies.

    worker dies ─► Ray restarts its actor (``max_restarts``; same bundle, same arguments: a rollout engine starts
         │         from the initial weights and applies the newest version at its next step)
         ▼
    driver: the service's ``run`` fails ─► wait until the actor answers ─► give its rows back ─► ``run`` again
            from the first step it had not reported (``Supervisor.recover``)

Exactly once: a restartable service reads its rows without acking them and acks a batch only after it has put
what it made of it (``TaskService.stream`` with ``redo``), so a worker that dies leaves its unfinished rows in
flight; the supervisor releases them and they are handed out again, first. A row whose output the dead worker had
already put (it died between its put and its ack) is skipped by the next put (``RedoClient``: fields are
write-once, the first write stands). Releasing a task's in-flight rows also releases those of its live instances
(the TransferQueue does not know which consumer holds them): they are made twice and put once.

Not restarted: the trainer groups (actor, reference, critic), a rollout on the continuous stream (it acks rows as
it admits them into its engine), the advantage task under dynamic sampling (its judgements are counted on the
board as they happen), and any service in ``sync`` and ``stream`` modes. A death there stops the run as before.
"""

from __future__ import annotations

import time

from asyncflow.config import AsyncFlowConfig
from asyncflow.transfer_queue import AlreadyWrittenError, TransferQueueClient, WritePendingError
from asyncflow.workflow.errors import WorkerDiedError


def restartable(cfg: AsyncFlowConfig) -> set[str]:
    """The worker groups of ``cfg``'s run that are restarted when a worker dies (empty when
    ``workflow.max_service_restarts`` is 0)."""
    wf, rollout = cfg.workflow, cfg.rollout
    if wf.mode != "async" or wf.max_service_restarts <= 0:
        return set()
    groups = {"reward"}
    if not (rollout.continuous or rollout.partial or cfg.agent.loop):
        groups.add("rollout")
    if not cfg.algorithm.dynamic_sampling:
        groups.add("advantage")
    return groups


class RedoClient(TransferQueueClient):
    """A TransferQueue client whose indexed puts skip the rows already written: a restarted worker makes again
    the rows its predecessor held, and the predecessor may have put some of them before it died."""

    skipped = 0
    """Rows whose output was already written (by this worker's predecessor, or by another instance that held the
    same rows) and were not written again."""

    def put(self, partition: str, data: dict, *, indexes=None, versions=None, group_ids=None, lengths=None,
            **kwargs):
        try:
            return super().put(partition, data, indexes=indexes, versions=versions, group_ids=group_ids,
                               lengths=lengths, **kwargs)
        except (AlreadyWrittenError, WritePendingError):
            if indexes is None:
                raise
        # Row by row: the rows already written are skipped, the others are put.
        for i, index in enumerate(list(indexes)):
            one = {name: value[i:i + 1] for name, value in data.items()}
            meta = {key: None if value is None else value[i:i + 1]
                    for key, value in (("versions", versions), ("group_ids", group_ids), ("lengths", lengths))}
            self._put_row(partition, one, int(index), meta, kwargs)

    def _put_row(self, partition: str, data: dict, index: int, meta: dict, kwargs: dict) -> None:
        # A put of the dead worker that was prepared and never committed holds the row until it rolls back.
        deadline = time.monotonic() + self.config.put_lease_s + 30.0
        while True:
            try:
                super().put(partition, data, indexes=[index], **meta, **kwargs)
                return
            except AlreadyWrittenError:
                type(self).skipped += 1
                return
            except WritePendingError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)


class Supervisor:
    """The driver's side of restarts: which service loop runs on which actor, and what to do when one fails."""

    def __init__(self, cfg: AsyncFlowConfig, pipe, reporter):
        self.cfg, self.pipe, self.reporter = cfg, pipe, reporter
        self.groups = restartable(cfg)
        self.limit = cfg.workflow.max_service_restarts
        self.runs: dict = {}  # Ray object ref of a service loop -> (group name, index, actor handle)
        self.restarts: dict[str, int] = {}
        self.events: list[dict] = []
        """One record per restart (``summary.json``'s ``service_restarts``)."""

    def start(self, first: int, last: int) -> list:
        """Start every service's loop over steps ``first .. last-1``; returns their refs (``Feeder.wait``)."""
        self.last = last
        for name, handles in self.pipe.groups.items():
            for i, handle in enumerate(handles):
                self.runs[handle.run.remote(first, last)] = (name, i, handle)
        return list(self.runs)

    def recover(self, ref, exc: BaseException):
        """The ref of the restarted loop of the service whose loop ``ref`` failed with ``exc``; raises ``exc`` (or a
        ``WorkerDiedError`` past ``workflow.max_service_restarts``) when the failure is not one it restarts. None
        when a rollout instance past the bound is left out and the others go on."""
        import ray

        name, i, handle = self.runs.pop(ref, (None, None, None))
        if name not in self.groups or not isinstance(exc, ray.exceptions.RayActorError):
            raise exc
        detected = time.time()
        what = f"{name} instance {i}" if name == "rollout" else f"{name} worker {i}"
        count = self.restarts.get(name, 0) + 1
        self.restarts[name] = count
        if count > self.limit:
            if name == "rollout" and self._running("rollout"):
                return self._drop(handle, i, what, count, detected)
            raise WorkerDiedError(f"{what} died; {name} workers died {count} times, more than "
                                  f"workflow.max_service_restarts={self.limit}") from exc
        self._wait_up(handle, what, exc)
        released = self._release(name)
        self.reporter.collect()  # the reports it posted before it died say where it got to
        start = max(self.reporter.reported.get((name, i), -1) + 1, self.reporter.trained_steps)
        new = handle.run.remote(start, self.last)
        self.runs[new] = (name, i, handle)
        event = {"service": name, "worker": i, "restart": count, "error": f"{type(exc).__name__}",
                 "detected_at": detected, "recovered_at": time.time(), "released_rows": released,
                 "resumed_at_step": start}
        self.events.append(event)
        self.reporter.collect([{"step": self.reporter.trained_steps, "service": "supervisor", "worker": 0,
                                "metrics": {"supervisor/restarts": 1.0}, "spans": []}])
        print(f"{what} died; restarted ({count} of at most {self.limit}), {released} of its rows handed out again, "
              f"going on from step {start}", flush=True)
        return new

    def _running(self, name: str) -> int:
        """How many workers of group ``name`` have a loop running."""
        return sum(1 for group, _, _ in self.runs.values() if group == name)

    def _drop(self, handle, i: int, what: str, count: int, detected: float) -> None:
        """Past the bound, a rollout instance is not started again while others run: the run goes on with them,
        and they generate its rows."""
        import ray

        try:  # Ray may be starting it again still (its own bound is per instance)
            ray.kill(handle)
        except Exception:  # already gone for good
            pass
        released = self._release("rollout")
        self.events.append({"service": "rollout", "worker": i, "restart": None, "error": "dropped",
                            "detected_at": detected, "recovered_at": time.time(), "released_rows": released,
                            "resumed_at_step": None})
        print(f"{what} died; rollout workers died {count} times, more than workflow.max_service_restarts="
              f"{self.limit}: the run goes on with the other {self._running('rollout')} instance(s)", flush=True)

    def _wait_up(self, handle, what: str, exc: BaseException) -> None:
        """Return once Ray has started the actor again in its bundle (it answers a ping)."""
        import ray

        deadline = time.monotonic() + self.cfg.workflow.step_timeout_s
        while True:
            try:
                ray.get(handle.ping.remote(), timeout=max(deadline - time.monotonic(), 1.0))
                return
            except ray.exceptions.ActorUnavailableError:  # still restarting
                if time.monotonic() > deadline:
                    raise WorkerDiedError(f"{what} died and did not start again within "
                                          "workflow.step_timeout_s") from exc
                time.sleep(0.2)
            except Exception as err:  # out of Ray's restarts, or it cannot start again: the run cannot go on
                raise WorkerDiedError(f"{what} died and could not be started again: {err}") from exc

    def _release(self, task: str) -> int:
        """Give every row ``task`` holds in flight back to it (in every partition); returns how many."""
        from asyncflow.transfer_queue import BadRequestError

        released = 0
        for partition in self.pipe.client.status()["partitions"]:
            try:
                released += self.pipe.client.release(partition, task)
            except BadRequestError:  # cleared meanwhile, or not read by this task: nothing of it is held
                continue
        return released

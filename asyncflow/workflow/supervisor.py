"""Restarts of the stateless services (rollout instances, reward, advantage, the reference) when their process dies.

    worker dies ─► Ray restarts its actor (``max_restarts``; same bundle, same arguments: a rollout engine starts
         │         from the initial weights and applies the newest version at its next step)
         ▼
    driver: the service's ``run`` fails ─► give its rows back (``Supervisor.recover``) ─► once the actor answers,
            ``run`` again from the first step it had not reported (``Supervisor.poll``); the driver goes on meanwhile

Exactly once: a restartable service reads its rows without acking them and acks a batch only after it has put
what it made of it (``TaskService.stream`` with ``redo``), so a worker that dies leaves its unfinished rows in
flight; the supervisor releases them and they are handed out again, first. A row whose output the dead worker had
already put (it died between its put and its ack) is skipped by the next put (``RedoClient``: fields are
write-once, the first write stands). Releasing a task's in-flight rows also releases those of its live instances
(the TransferQueue does not know which consumer holds them): they are made twice and put once. Before the release,
the dead worker's gets still waiting in the controller are dropped (``cancel_reads`` of its client's tag,
``writer_of``): nothing would read their answer, and the rows handed to them would stay leased for
``transfer_queue.row_lease_s``. A put it had prepared and not committed is rolled back at once (``roll_back_puts``
of the same tag), so that its successor's put of those rows does not wait for that put's lease
(``transfer_queue.put_lease_s``). Its rows are handed back once, at its death; its successor's loop starts as soon as
its process answers.

Rollout instances are restarted under chunked, continuous and partial rollout and agent loops alike: on the
continuous stream an instance acks a row once its response is put, not when it admits it into its engine, so the
rows of one that dies (a response partly generated, a multi-turn trajectory between turns) are generated again from
their prompts (``redo_rows.RedoRows``).

In ``stream`` mode (``sample_stream``) a rollout instance holds prompts, reservations and claims on the board's
ledger: its death has the board forget them (``_release_stream``, ``StreamLedger.forget``), its prompts return to the
stream and the steps it claimed wait for their copies; its restarted process takes prompts like any instance.

Warm spares (``workflow.rollout_spares``): rollout instances built with the run and left idle (no loop, no rows,
no weights). A rollout instance that dies within the bound is not started again: the dead actor is killed for good,
its rows are handed back as above, and a spare takes its slot (``_promote``: its index, its TransferQueue tag, its
holder name on the stream's ledger), applies the newest weights at its first step and runs its loop from the step a
restart would resume at; once it has reported that step, a new spare is started in the background to refill the
pool (``poll`` notes when it answers). With no spare left on the dead instance's node, the dead instance is
started again as above.

Not restarted: the advantage task under dynamic sampling (its judgements are counted on the board as they
happen), rollout in ``stream`` mode under dynamic sampling (a step takes any number of groups: no fixed slots), and
any service in ``sync`` mode. A death there stops the run as before.
Nor the trained groups, here: an actor or critic death restarts the whole run from its newest checkpoint
(``workflow.loop.train``). The frozen reference is restarted here when each of its ranks is a group of its own
(trainer world size 1: a new process joins no torch.distributed group of live peers); otherwise, and past
``workflow.max_service_restarts``, its death restarts the run from its newest checkpoint as an actor rank's does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from asyncflow.config import AsyncFlowConfig
from asyncflow.transfer_queue import AlreadyWrittenError, RowsClearedError, TransferQueueClient, WritePendingError
from asyncflow.workflow.errors import ServiceLostError, TrainerDiedError
from asyncflow.workflow.placement import world_size

SCALE_FILE = "scale.json"
"""A request to the running driver, in its output directory: ``{"rollout": N}`` (``request_scale``)."""


def request_scale(output_dir: str | Path, rollout: int) -> Path:
    """Ask the run writing to ``output_dir`` for ``rollout`` rollout instances; the driver applies it within a
    second (``Supervisor.scale``: it prints what it did, and records it in ``restarts.jsonl``). Returns the file."""
    out = Path(output_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"{out} is not a run's output directory (observability.output_dir)")
    tmp = out / f".{SCALE_FILE}.tmp"
    tmp.write_text(json.dumps({"rollout": int(rollout)}))
    return tmp.replace(out / SCALE_FILE)


def writer_of(name: str, worker: int) -> str:
    """The TransferQueue tag of worker ``worker`` of group ``name`` (its puts' writer and its gets' reader); a
    restarted worker keeps it."""
    return f"{name}/{worker}"


def restartable(cfg: AsyncFlowConfig) -> set[str]:
    """The worker groups of ``cfg``'s run that are restarted when a worker dies (empty when
    ``workflow.max_service_restarts`` is 0)."""
    wf = cfg.workflow
    if wf.mode == "stream" and wf.max_service_restarts > 0:
        # The sample stream: the board's ledger knows what each rollout instance holds (``sample_stream``). Under
        # dynamic sampling a step takes any number of groups (no fixed slots), and the advantage task's judgements
        # are counted as they happen.
        return {"reward"} if cfg.algorithm.dynamic_sampling else {"reward", "rollout", "advantage"}
    if wf.mode != "async" or wf.max_service_restarts <= 0:
        return set()
    # Rollout on every stream: chunked, continuous, partial, agent loops (``redo_rows.RedoRows``).
    groups = {"reward", "rollout"}
    if not cfg.algorithm.dynamic_sampling:
        groups.add("advantage")
    if world_size(cfg.trainer) == 1:
        # The frozen reference is a stateless service with a model: a new process loads the same initial weights.
        # A rank of a larger group would have to join a torch.distributed group of live peers; its death restarts
        # the run from its checkpoint instead (``workflow.loop.train``).
        groups.add("reference")
    return groups


class RedoClient(TransferQueueClient):
    """A TransferQueue client whose indexed puts skip the rows already written: a restarted worker makes again
    the rows its predecessor held, and the predecessor may have put some of them before it died. A row already
    cleared counts as written: the workflow's partitions clear a row once every consumer task read it, which it
    could only do once the row's fields were written (by that predecessor, whose put committed and whose rows
    were trained before its successor's copy was done)."""

    skipped = 0
    """Rows whose output was already written (by this worker's predecessor, or by another instance that held the
    same rows) and were not written again."""

    last_skipped: list[int] = []
    """The rows the last ``put`` of this client skipped (their responses are not the ones trained)."""

    def put(self, partition: str, data: dict, *, indexes=None, versions=None, group_ids=None, lengths=None,
            **kwargs):
        self.last_skipped = []
        try:
            return super().put(partition, data, indexes=indexes, versions=versions, group_ids=group_ids,
                               lengths=lengths, **kwargs)
        except (AlreadyWrittenError, WritePendingError, RowsClearedError):
            if indexes is None:
                raise
        # Row by row: the rows already written are skipped, the others are put.
        for i, index in enumerate(list(indexes)):
            one = {name: value[i:i + 1] for name, value in data.items()}
            meta = {key: None if value is None else value[i:i + 1]
                    for key, value in (("versions", versions), ("group_ids", group_ids), ("lengths", lengths))}
            self._put_row(partition, one, int(index), meta, kwargs)

    def _put_row(self, partition: str, data: dict, index: int, meta: dict, kwargs: dict) -> None:
        # The supervisor rolled back the dead worker's pending puts before this worker's loop started; a pending put
        # here is a live instance's that holds the same row, and commits or rolls back within its lease.
        deadline = time.monotonic() + self.config.put_lease_s + 30.0
        while True:
            try:
                super().put(partition, data, indexes=[index], **meta, **kwargs)
                return
            except (AlreadyWrittenError, RowsClearedError):
                type(self).skipped += 1
                self.last_skipped.append(index)
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
        self.removed: dict[tuple[str, int], dict] = {}  # workers stopped on request -> their record
        self.starting: dict = {}  # ping ref of a worker Ray is starting again -> (its name, its restart record)
        self.warming: dict = {}  # ping ref of a spare started to refill the pool -> (its handle, its record)
        self.promoted: set = set()  # the first ping of each promoted spare, while it waits (``pending``)
        self.refilled: set[int] = set()  # ids of the promotion events whose refill spare was started (``_refill``)
        self.refill_due: list[dict] = []  # promotions whose spare answered, refilled once it reported (``_refill``)
        self.request = Path(cfg.observability.output_dir) / SCALE_FILE
        self.events: list[dict] = []
        """One record per restart (``summary.json``'s ``service_restarts``, and a line of ``restarts.jsonl``)."""

    def start(self, first: int, last: int) -> list:
        """Start every service's loop over steps ``first .. last-1``; returns their refs (``Feeder.wait``)."""
        self.last = last
        for name, handles in self.pipe.groups.items():
            for i, handle in enumerate(handles):
                self.runs[handle.run.remote(first, last)] = (name, i, handle)
        return list(self.runs)

    def recover(self, ref, exc: BaseException):
        """After the loop ``ref`` of a service failed with ``exc``: give its rows back and have Ray start it again
        (its loop runs again once it answers, ``poll``); returns None. Raises ``exc`` (or a ``ServiceLostError``
        past ``workflow.max_service_restarts``) when the failure is not one it restarts; past the bound a rollout
        instance is left out instead while others run."""
        import ray

        name, i, handle = self.runs.pop(ref, (None, None, None))
        if (name, i) in self.removed:  # stopped on request (``scale``): its rows go to the others
            event = self.removed[(name, i)]
            event["rolled_back_puts"], event["released_rows"] = self._hand_back(name, i)
            event["recovered_at"] = time.time()
            return None
        if name not in self.groups or not isinstance(exc, ray.exceptions.RayActorError):
            raise exc
        self._died(name, i, handle, exc)
        return None

    def _died(self, name: str, i: int, handle, exc: BaseException, down_since: float | None = None) -> None:
        """Worker ``i`` of ``name`` died (``exc``): count it, then leave it out, stop the run, or start it again.
        ``down_since``: when it first died, where it died again before it answered (the bounds on its restart count
        from there)."""
        detected = time.time()
        what = {"rollout": f"rollout instance {i}", "reference": f"reference rank {i}"}.get(name, f"{name} worker {i}")
        count = self.restarts.get(name, 0) + 1
        self.restarts[name] = count
        if count > self.limit:
            if name == "rollout" and self._running("rollout"):
                self._drop(handle, i, what, count, detected)
                return
            if name == "reference":  # as any reference death that is not restarted in place: from the checkpoint
                raise TrainerDiedError(f"reference rank {i} died; reference ranks died {count} times, more than "
                                       f"workflow.max_service_restarts={self.limit}", name, i) from exc
            # Past the bound in place: with checkpoints on, the run restarts from its newest one (``loop.train``).
            raise ServiceLostError(f"{what} died; {name} workers died {count} times, more than "
                                   f"workflow.max_service_restarts={self.limit}", name, i) from exc
        spare = self._spare_for(handle) if name == "rollout" else None
        if spare is not None:
            self._promote(handle, spare, i, what, count, detected, exc)
            return
        # Its process is dead: nothing can read or ack the rows it held, so they go back now, and the others (or
        # its next incarnation) take them while Ray starts it again; its loop runs again once it answers (``poll``).
        rolled_back, released = self._hand_back(name, i)
        self.reporter.collect()  # the reports it posted before it died say where it got to
        start = max(self.reporter.reported.get((name, i), -1) + 1, self.reporter.trained_steps)
        event = {"service": name, "worker": i, "restart": count, "error": type(exc).__name__, "detected_at": detected,
                 "recovered_at": None, "released_rows": released, "rolled_back_puts": rolled_back,
                 "resumed_at_step": start, "how": "process restarted", "down_since": down_since or detected}
        self.starting[handle.ping.remote()] = (name, i, handle, what, event)
        print(f"{what} died; starting it again ({count} of at most {self.limit}), {released} of its rows handed out "
              f"again, going on from step {start}", flush=True)

    def poll(self) -> list:
        """Called while the driver waits: start the loops of the restarted workers that answer again, and apply a
        request to scale rollout (``scale``); returns the loops it started."""
        import ray

        started = []
        self._warmed()
        self._refill_when_recovered()
        if self.starting:
            up, _ = ray.wait(list(self.starting), num_returns=len(self.starting), timeout=0)
            for ref in up:
                name, i, handle, what, event = self.starting.pop(ref)
                self.promoted.discard(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.ActorUnavailableError:  # Ray is still starting it: ask again
                    if time.time() - event.get("down_since", event["detected_at"]) > self.cfg.workflow.step_timeout_s:
                        raise ServiceLostError(f"{what} died and did not start again within "
                                               "workflow.step_timeout_s", name, i) from None
                    self.starting[handle.ping.remote()] = (name, i, handle, what, event)
                    continue
                except ray.exceptions.RayActorError as err:  # it died again before it answered (e.g. Ray placed
                    # it on a lost host's node before it marked that node dead): still down since its first death
                    self._refill(event)
                    self._died(name, i, handle, err, down_since=event.get("down_since"))
                    continue
                event["recovered_at"] = time.time()
                if name == "rollout":  # a promoted spare's process Ray started again is built as a spare: no slot
                    handle.take_slot.remote(i, self.pipe.workers.evaluation(i))
                ref = handle.run.remote(event["resumed_at_step"], self.last)
                self.runs[ref] = (name, i, handle)
                started.append(ref)
                self._record(event)
                self.reporter.collect([{"step": self.reporter.trained_steps, "service": "supervisor", "worker": 0,
                                        "metrics": {"supervisor/restarts": 1.0}, "spans": []}])
                print(f"{what} is {'replaced by a spare' if event['how'] == 'spare promoted' else 'up again'} "
                      f"({event['recovered_at'] - event['detected_at']:.1f} s after its death)", flush=True)
                if event.get("how") == "spare promoted":
                    self.refill_due.append(event)
            self._overdue()
        return started + self.scale()

    def _overdue(self) -> None:
        """Give up on the workers Ray has not started again within ``workflow.restart_timeout_s`` of their death
        (Ray waits without bound for what it cannot place, e.g. the devices of a host lost with the worker): a
        rollout instance is left out while others run, any other worker is lost (``ServiceLostError``)."""
        import ray

        bound = self.cfg.workflow.restart_timeout_s
        bound = self.cfg.workflow.step_timeout_s if bound is None else bound
        for ref, (name, i, handle, what, event) in list(self.starting.items()):
            if time.time() - event.get("down_since", event["detected_at"]) <= bound:
                continue
            self.starting.pop(ref)
            if name != "rollout" or not self._running("rollout"):
                raise ServiceLostError(f"{what} died and was not started again within "
                                       f"workflow.restart_timeout_s={bound:g} s", name, i)
            try:  # stop Ray's attempts: a later placement would bring back an instance the run left out
                ray.kill(handle)
            except Exception:  # already gone for good
                pass
            # Its rows were handed back at its death (``_died``); the others have been generating them since.
            self._record({**event, "restart": None, "error": "dropped", "recovered_at": time.time(),
                          "how": "not started again in time"})
            print(f"{what} was not started again within workflow.restart_timeout_s={bound:g} s (Ray could not "
                  f"place it): the run goes on with the other {self._running('rollout')} instance(s)", flush=True)

    def scale(self) -> list:
        """Apply a request to change the number of rollout instances (``request_scale``), if one came; returns the
        loops of the instances it started. Added instances start at the first step not trained yet and take rows
        as the others do; removed ones (the newest first) are stopped and their rows generated by the others."""
        import ray

        if not self.request.exists():
            return []
        try:
            wanted = int(json.loads(self.request.read_text())["rollout"])
        except (ValueError, KeyError, TypeError):  # half written: read it at the next poll
            return []
        self.request.unlink(missing_ok=True)
        # An instance Ray is starting again after a death counts as running: it takes rows once it answers.
        restarting = {i: ref for ref, (name, i, *_) in self.starting.items() if name == "rollout"}
        running = sorted({i for name, i, _ in self.runs.values() if name == "rollout"} | set(restarting))
        refused = self._refuse_scale(wanted, len(running))
        if refused:
            print(f"scale: {refused}", flush=True)
            return []
        added = []
        rollout = self.pipe.groups["rollout"]
        for _ in range(wanted - len(running)):
            i = len(rollout)
            handle = self.pipe.workers.rollout_instance(i)
            rollout.append(handle)
            ref = handle.run.remote(self.reporter.trained_steps, self.last)
            self.runs[ref] = ("rollout", i, handle)
            added.append(ref)
            self._record({"service": "rollout", "worker": i, "restart": None, "error": "added",
                          "detected_at": time.time(), "recovered_at": None, "released_rows": 0,
                          "resumed_at_step": self.reporter.trained_steps})
        for i in running[wanted:]:
            # Recorded when asked, not when its loop is seen to end: a run may end before that. The rows it held
            # are handed out again once its loop has ended (``recover``); the summary has their number.
            self.removed[("rollout", i)] = {"service": "rollout", "worker": i, "restart": None, "error": "removed",
                                            "detected_at": time.time(), "recovered_at": None, "released_rows": None,
                                            "resumed_at_step": None}
            self._record(self.removed[("rollout", i)])
            if i in restarting:  # no loop of it will end: its rows were handed out again at its death
                self.starting.pop(restarting[i])
                self.removed[("rollout", i)].update(recovered_at=time.time(), released_rows=0)
            ray.kill(rollout[i])
        print(f"scale: rollout instances {len(running)} -> {wanted}", flush=True)
        return added

    def _refuse_scale(self, wanted: int, running: int) -> str | None:
        """Why a request for ``wanted`` rollout instances cannot be met (None: it can)."""
        if wanted < 1:
            return f"rollout={wanted} refused: a run needs at least 1 rollout instance"
        if "rollout" not in self.groups:
            return ("rollout instances are added or removed only in async and stream modes with "
                    "workflow.max_service_restarts > 0")
        if wanted > running and self.cfg.ray.accelerator is not None:
            return "adding rollout instances needs free devices in the run's placement group, which has none"
        return None

    def finish(self) -> list[dict]:
        """At the end of the run: record the deaths whose worker was still being started again (a restart that
        outlasted the rest of the run leaves a record too, with ``recovered_at`` None); returns every record."""
        for _name, _i, _handle, _what, event in self.starting.values():
            self._record({**event, "how": f"{event['how']}; not up again when the run ended"})
        self.starting.clear()
        return self.events

    def _record(self, event: dict) -> None:
        """Keep ``event`` for the summary and append it to ``restarts.jsonl`` in the output directory at once (a
        run that fails later keeps the record)."""
        self.events.append(event)
        out = Path(self.cfg.observability.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "restarts.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")

    def _running(self, name: str) -> int:
        """How many workers of group ``name`` have a loop running or are being started again."""
        return sum(1 for group, *_ in [*self.runs.values(), *self.starting.values()] if group == name)

    def _drop(self, handle, i: int, what: str, count: int, detected: float) -> None:
        """Past the bound, a rollout instance is not started again while others run: the run goes on with them,
        and they generate its rows."""
        import ray

        try:  # Ray may be starting it again still (its own bound is per instance)
            ray.kill(handle)
        except Exception:  # already gone for good
            pass
        rolled_back, released = self._hand_back("rollout", i)
        self._record({"service": "rollout", "worker": i, "restart": None, "error": "dropped",
                      "detected_at": detected, "recovered_at": time.time(), "released_rows": released,
                      "rolled_back_puts": rolled_back, "resumed_at_step": None})
        print(f"{what} died; rollout workers died {count} times, more than workflow.max_service_restarts="
              f"{self.limit}: the run goes on with the other {self._running('rollout')} instance(s)", flush=True)

    def _spare_for(self, dead):
        """The spare to take dead rollout instance ``dead``'s slot: one on its node (a slot's weight route, shared
        memory or its host's relay mirror, is its host's), an answering one before one still starting. None: no
        spare there, and Ray starts the dead one again instead."""
        node = self.pipe.workers.rollout_node(dead)
        there = [h for h in self.pipe.spares if self.pipe.workers.rollout_node(h) == node]
        ready = [h for h in there if all(h is not w for w, _ in self.warming.values())]
        return (ready or there or [None])[0]

    def _promote(self, dead, spare, i: int, what: str, count: int, detected: float, exc: BaseException) -> None:
        """Rollout instance ``i`` died and a spare is at hand: kill the dead actor for good (Ray would start it
        again), hand its rows back, put the spare in its slot (``RolloutService.take_slot``: the dead one's tag,
        which ``_hand_back`` fenced, is the spare's from now on) and start its loop once it answers (``poll``: at
        once when it is up), from the step a restart would resume at. A new spare is started to refill the pool;
        nothing waits for it."""
        import ray

        try:
            ray.kill(dead)
        except Exception:  # already gone for good
            pass
        self.pipe.workers.release(dead)  # its devices hold the spare that refills the pool (``_refill``)
        rolled_back, released = self._hand_back("rollout", i)
        self.reporter.collect()  # the reports it posted before it died say where it got to
        start = max(self.reporter.reported.get(("rollout", i), -1) + 1, self.reporter.trained_steps)
        self.pipe.spares.remove(spare)
        self.warming = {ref: (h, rec) for ref, (h, rec) in self.warming.items() if h is not spare}
        self.pipe.groups["rollout"][i] = spare
        spare.take_slot.remote(i, self.pipe.workers.evaluation(i))
        event = {"service": "rollout", "worker": i, "restart": count, "error": type(exc).__name__,
                 "detected_at": detected, "recovered_at": None, "released_rows": released,
                 "rolled_back_puts": rolled_back, "resumed_at_step": start, "how": "spare promoted"}
        ping = spare.ping.remote()
        self.starting[ping] = ("rollout", i, spare, what, event)
        self.promoted.add(ping)
        print(f"{what} died; a spare takes its place ({count} of at most {self.limit}), {released} of its rows "
              f"handed out again, going on from step {start}", flush=True)

    def _refill_when_recovered(self) -> None:
        """Refill the pool for each promoted spare that has reported its first step: by then the rows its
        predecessor held were made again (``_refill``)."""
        for event in list(self.refill_due):
            if id(event) in self.refilled:  # it died again meanwhile and was refilled then
                self.refill_due.remove(event)
                continue
            reported = self.reporter.reported.get(("rollout", event["worker"]), -1)
            if reported >= event["resumed_at_step"]:
                self.refill_due.remove(event)
                self._refill(event, reported)

    def _refill(self, event: dict, reported: int | None = None) -> None:
        """Start a new spare for the one ``event`` promoted, once that one reported its first step
        (``_refill_when_recovered``) or died: a process start (Python, Ray, an import of torch: seconds of CPU)
        while the spare makes again its predecessor's rows would slow that recovery where they share a host's
        cores (measured on 2 cores: about 0.2 s more per death, as much as the rows' regeneration). Nothing waits
        for the new spare (``_warmed`` notes when it answers); it starts in the CPU's background
        (``asyncflow.workflow.priority``): where it shares cores it takes only what the run leaves idle.
        ``reported``: the last step the promoted spare had reported then (None: it died), in the record."""
        if event.get("how") != "spare promoted" or id(event) in self.refilled:
            return
        self.refilled.add(id(event))
        refill = self.pipe.workers.spares(1, background=True)[0]
        self.pipe.spares.append(refill)
        self.warming[refill.ping.remote()] = (refill, {"service": "rollout spare", "worker": None, "restart": None,
                                                       "error": "spare started", "detected_at": time.time(),
                                                       "recovered_at": None, "released_rows": 0,
                                                       "resumed_at_step": None, "replaces": event["worker"],
                                                       "after_step_reported": reported})
        print("a new spare rollout instance is starting", flush=True)

    def pending(self) -> list:
        """The answers the driver's wait wakes for besides the service loops (``Feeder.wait``): the first ping of
        each promoted spare, so its loop starts as soon as it answers. Not the pings of processes Ray starts again:
        those answer at once with ``ActorUnavailableError`` until it is up, and are asked again at the wait's pace."""
        return [ref for ref in self.starting if ref in self.promoted]

    def _warmed(self) -> None:
        """Note the refilling spares that answer (``restarts.jsonl``: ``spare started``, with the time it took);
        one that died before it answered is left out of the pool."""
        import ray

        if not self.warming:
            return
        up, _ = ray.wait(list(self.warming), num_returns=len(self.warming), timeout=0)
        for ref in up:
            handle, record = self.warming.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.ActorUnavailableError:  # Ray is starting it again: ask again
                self.warming[handle.ping.remote()] = (handle, record)
                continue
            except ray.exceptions.RayActorError as err:
                self.pipe.spares.remove(handle)
                print(f"a spare rollout instance died while it started ({type(err).__name__}); the pool has "
                      f"{len(self.pipe.spares)} spare(s)", flush=True)
                continue
            record["recovered_at"] = time.time()
            self._record(record)

    def _hand_back(self, name: str, i: int) -> tuple[int, int]:
        """Worker ``i`` of ``name`` is dead: drop its gets still waiting in the controller (their rows would be
        leased to nobody), roll back the puts it prepared and never committed (the rows they held are free for the
        next writer at once), then give every row ``name`` holds in flight back to it, for the live readers and its
        successor; returns (puts rolled back, rows released)."""
        self.pipe.client.cancel_reads(writer_of(name, i))
        rolled_back = self.pipe.client.roll_back_puts(writer_of(name, i))
        return rolled_back, self._release(name)

    def _release(self, task: str) -> int:
        """Give every row ``task`` holds in flight back to it (in every partition); returns how many."""
        if task == "rollout" and self.cfg.workflow.mode == "stream":
            return self._release_stream()
        from asyncflow.transfer_queue import BadRequestError

        released = 0
        for partition in self.pipe.client.status()["partitions"]:
            try:
                released += self.pipe.client.release(partition, task)
            except BadRequestError:  # cleared meanwhile, or not read by this task: nothing of it is held
                continue
        return released

    def _release_stream(self) -> int:
        """The sample stream: what the rollout instances whose loops are not running (dead, left out, removed) held
        goes back, their reservations and unconfirmed claims on the board (``StreamLedger.forget``) and their
        prompts to the stream; returns how many prompt rows were handed out again."""
        import ray

        from asyncflow.workflow.partitions import STREAM_PARTITION

        running = {i for name, i, _ in self.runs.values() if name == "rollout"}
        rows = []
        for i in range(len(self.pipe.groups["rollout"])):
            if i not in running:
                rows += ray.get(self.pipe.board.stream_forget.remote(i))
        return self.pipe.client.release(STREAM_PARTITION, "rollout", rows) if rows else 0

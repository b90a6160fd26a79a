"""The version board: where the trainer announces staged weight versions and rollout waits for admission.

A small asyncio Ray actor that carries metadata only: the weights themselves are staged by each exporting
trainer rank in its shared-memory segment (``asyncflow.bridge.staging``) and never pass through Ray. A
version becomes visible once every exporting rank announced it, so rollout never loads half a model.

The staleness rule lives in ``admitted_version``: rollout may start generating the samples of step ``s``
once weights of version ``s - k`` exist, so every sample of step ``s`` comes from a version ``v >= s - k``
and is trained at step ``s <= v + k``. Rollout instances report which version they are applying and which
they serve (for failure messages and metrics). Workers also drop their per-step metrics and timeline spans
here for the driver to collect.
"""

from __future__ import annotations

import asyncio

from asyncflow.observability.keys import EVAL_VERSION


def admitted_version(step: int, max_staleness: int) -> int:
    """The oldest weight version allowed to generate the samples of ``step``."""
    return max(step - max_staleness, 0)


class VersionBoard:
    """Newest complete staged version per staging domain, rollout states, and a mailbox of worker reports.

    A domain is where a version is readable: one per rollout host (``asyncflow.bridge.routes``), holding the
    segments of the exporting ranks on that host and the host's relay mirrors of the others
    (``asyncflow.bridge.relay``); ``"local"`` when everything runs on one host.
    """

    def __init__(self, checkpoints: tuple[int, int, float] = (0, 0, 0.0)):
        """``checkpoints``: ``(checkpoint.interval, workflow.steps, checkpoint.every_minutes)`` of the run, for
        ``checkpoint_due``."""
        from asyncflow.workflow.resume import CheckpointSchedule

        self._checkpoints = CheckpointSchedule(*checkpoints)  # its clock starts here, with the run
        self._domains: dict[str, dict] = {}  # domain -> {"version", "segments", "parts"}
        self._plan: dict | None = None  # the SyncPlan as plain data, and the exporting ranks
        self._cond: asyncio.Condition | None = None
        self._reports: list[dict] = []
        self._evaluated = -1  # the newest version whose evaluation was reported (``evaluated``)
        self._sampling: dict[int, tuple[int, int]] = {}  # step -> (kept rows, judged rows), dynamic sampling
        self._rollout: dict[int, dict] = {}  # rollout instance -> {"serving": v, "applying": v | None}
        self._aborted: str | None = None
        self._stream = None  # the sample stream's ledger (workflow.mode=stream)
        self._begun = -1  # the highest step a trainer rank has begun (``trainer_begin``)
        self._stop: dict | None = None  # {"at": step, "save": bool} once the driver asked the run to stop
        self._stopped = 0  # trainer ranks that stopped there (and saved their parts)

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # created lazily: it must belong to the actor's event loop
            self._cond = asyncio.Condition()
        return self._cond

    def _domain(self, name: str) -> dict:
        return self._domains.setdefault(name, {"version": -1, "segments": {}, "via": {}, "parts": {}})

    async def set_plan(self, plan: dict, sources: list[str], hosts: dict[str, str] | None = None) -> None:
        """The trainer's ``SyncPlan`` (plain data) and its exporting ranks (``"tp.pp.ep"``); each exporting
        rank adds ``{its source: its host key}`` (``asyncflow.bridge.routes``)."""
        cond = self._condition()
        async with cond:
            known = {} if self._plan is None else self._plan["hosts"]
            self._plan = {"plan": plan, "sources": sorted(sources), "hosts": {**known, **(hosts or {})}}
            cond.notify_all()

    async def wait_for_plan(self, timeout_s: float, hosts: bool = False) -> dict:
        """``{"plan": ..., "sources": [...], "hosts": {source: host}}`` once the trainer has set it (``hosts``:
        and once every exporting rank has said where it runs)."""
        cond = self._condition()

        def ready() -> bool:
            return self._plan is not None and (not hosts or set(self._plan["sources"]) <= set(self._plan["hosts"]))

        async with cond:
            await asyncio.wait_for(cond.wait_for(lambda: ready() or self._aborted), timeout_s)
            if not ready():
                raise RuntimeError(f"run aborted before the trainer described its weights: {self._aborted}")
            return self._plan

    async def publish(self, version: int, source: str, segment: str, domain: str = "local", via: str = "shm") -> None:
        """Exporting rank ``source`` (``"tp.pp.ep"``) staged ``version`` in ``segment``, readable in ``domain``;
        ``via`` says what the segment is: the rank's own staging segment (``shm``) or a relay mirror (``relay``).
        The version becomes the domain's newest once every exporting rank staged it there."""
        cond = self._condition()
        async with cond:
            if self._plan is None:
                raise ValueError("publish before set_plan")
            state = self._domain(domain)
            if version <= state["version"]:
                raise ValueError(f"version {version} staged in {domain} after {state['version']}: versions must "
                                 f"increase")
            state["segments"][source] = segment
            state["via"][source] = via
            parts = state["parts"].setdefault(version, set())
            parts.add(source)
            if len(parts) < len(self._plan["sources"]):
                return
            state["parts"] = {v: p for v, p in state["parts"].items() if v > version}
            state["version"] = version
            cond.notify_all()

    async def wait_for_version(self, min_version: int, timeout_s: float, domain: str = "local") -> tuple[int, dict]:
        """Block until a version >= ``min_version`` is staged in ``domain``; return the newest
        ``(version, staging)``."""
        cond = self._condition()
        async with cond:
            state = self._domain(domain)
            try:
                await asyncio.wait_for(cond.wait_for(lambda: state["version"] >= min_version or self._aborted),
                                       timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"rollout waited {timeout_s:.0f} s for weight version {min_version}; newest is "
                    f"{state['version']} (is the trainer alive?)"
                ) from None
            if self._aborted and state["version"] < min_version:
                raise RuntimeError(f"run aborted while waiting for weight version {min_version}: {self._aborted}")
            return state["version"], {"plan": self._plan["plan"], "segments": dict(state["segments"]),
                                      "via": dict(state["via"])}

    async def rollout_state(self, instance: int, serving: int, applying: int | None = None) -> None:
        """Rollout ``instance`` serves version ``serving`` (-1: none complete) and is applying ``applying``."""
        self._rollout[instance] = {"serving": serving, "applying": applying}

    async def rollout_states(self) -> dict[int, dict]:
        """Every rollout instance's last reported state."""
        return dict(self._rollout)

    async def abort(self, reason: str) -> None:
        """Fail every present and future wait for a version not published yet (the run has failed)."""
        cond = self._condition()
        async with cond:
            self._aborted = reason
            cond.notify_all()

    async def request_stop(self, first: int, save: bool) -> int:
        """The run stops on a signal (``workflow.signals``): at the step boundary after the highest step a trainer
        rank has begun (``first`` when none has), so that every rank of every trainer group finishes the steps any
        of its peers began and none begins a later one. ``save``: the ranks save their checkpoint parts there.
        Returns that boundary (the number of trained steps at the stop)."""
        if self._stop is None:
            self._stop = {"at": max(self._begun + 1, first), "save": save}
        return self._stop["at"]

    async def trainer_begin(self, step: int) -> dict | None:
        """A trainer rank is about to begin ``step``: None to go on, or ``{"at": step, "save": bool}`` when the run
        stops at this step's boundary."""
        if self._stop is not None and step >= self._stop["at"]:
            return self._stop
        self._begun = max(self._begun, step)
        return None

    async def checkpoint_due(self, trained: int) -> bool:
        """Whether the boundary after ``trained`` steps gets a checkpoint (``CheckpointSchedule.due``): the first
        caller decides, every trainer rank and the driver get the same answer."""
        return self._checkpoints.due(trained)

    async def trainer_stopped(self) -> None:
        """A trainer rank stopped at the boundary (its checkpoint part, if any, is written)."""
        self._stopped += 1

    async def trainers_stopped(self) -> int:
        """How many trainer ranks stopped at the boundary."""
        return self._stopped

    async def version(self, domain: str = "local") -> int:
        """The newest complete version in ``domain`` (-1: none yet)."""
        return self._domain(domain)["version"]

    async def report(self, item: dict) -> None:
        """A worker's per-step metrics and timeline spans."""
        self._reports.append(item)
        version = item.get("metrics", {}).get(EVAL_VERSION)
        if version is not None:
            self._evaluated = max(self._evaluated, int(version))

    async def evaluated(self) -> int:
        """The newest version whose evaluation a rollout instance reported (-1: none): a new incarnation of
        instance 0 does not evaluate it again."""
        return self._evaluated

    async def take_reports(self) -> list[dict]:
        """Every report since the last call."""
        items, self._reports = self._reports, []
        return items

    async def sampling_progress(self, step: int, kept: int, judged: int) -> None:
        """Dynamic sampling: of the rows of ``step`` judged so far, ``kept`` were kept (cumulative)."""
        self._sampling[step] = (kept, judged)
        if self._stream is not None:  # a dropped group leaves room in its step for the next one to finish
            self._stream.judged(step, kept, judged)

    # ------------------------------------------------------------------ the sample stream (workflow.mode=stream)
    async def stream_setup(self, first: int, last: int, groups_per_step: int, group_size: int,
                           max_staleness: int, spare: int) -> None:
        """Start the stream's ledger (``asyncflow.workflow.stream_ledger``) for steps ``first .. last-1``."""
        from asyncflow.workflow.stream_ledger import StreamLedger

        self._stream = StreamLedger(first, last, groups_per_step, group_size, max_staleness, spare)

    async def stream_reserve(self, groups: int, version: int, holder: str | None = None) -> int:
        """How many of ``groups`` an engine serving ``version`` may admit now (``StreamLedger.reserve``; ``holder``:
        the rollout loop asking, ``StreamRollout.holder``)."""
        return self._stream.reserve(groups, version, holder)

    async def stream_release(self, groups: int, holder: str | None = None) -> None:
        """Reservations given back unused."""
        self._stream.release(groups, holder)

    async def stream_claims(self, claims: list[tuple], reserve: int = 0, version: int = -1,
                            holder: str | None = None) -> tuple[list[tuple[str, int, int]], int, int]:
        """The step each group an engine finished together goes to, or why none (``StreamLedger.claim`` for each
        ``(oldest_version, reserved[, group id])``, in order), then ``stream_reserve(reserve, version)`` for the
        slots they freed, in one round trip: their ``(verdict, step, slot)`` (slot -1 without a group id), the open
        step after them, and the reservations granted."""
        verdicts = []
        for oldest, reserved, *gid in claims:
            gid = gid[0] if gid else None
            verdict, step, _ = self._stream.claim(oldest, reserved, gid, holder)
            verdicts.append((verdict, step, self._stream.bound[gid][1] if gid in self._stream.bound else -1))
        granted = self._stream.reserve(reserve, version, holder) if reserve > 0 else 0
        return verdicts, self._stream.state()["open"], granted

    async def stream_admitted(self, holder: str, rows: dict[int, list[int]]) -> None:
        """``holder`` admitted these groups into its engine: group id -> its prompt-stream rows, read and not acked
        (``StreamLedger.admitted``)."""
        self._stream.admitted(holder, rows)

    async def stream_done(self, holder: str, gids: list[int]) -> None:
        """``holder`` put, re-fed or dropped these groups and acks their prompt rows next (``StreamLedger.done``)."""
        self._stream.done(holder, gids)

    async def stream_forget(self, instance: int) -> list[int]:
        """Rollout instance ``instance`` died or was removed: what its loops held goes back (``StreamLedger.forget``);
        returns the prompt-stream rows to hand out again (the supervisor releases them)."""
        if self._stream is None:
            return []
        return self._stream.forget(str(instance))

    async def stream_poll(self, domain: str = "local") -> tuple[int, int]:
        """What a stream rollout loop polls for, in one round trip: the newest version in ``domain`` and the
        stream's open step."""
        return self._domain(domain)["version"], self._stream.state()["open"]

    async def stream_state(self) -> dict:
        """The stream's open step, claims and stale groups (``StreamLedger.state``)."""
        return self._stream.state()

    async def take_sampling(self) -> dict[int, tuple[int, int]]:
        """The latest progress of every step with news since the last call."""
        items, self._sampling = self._sampling, {}
        return items

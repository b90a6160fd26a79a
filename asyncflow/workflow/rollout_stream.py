"""Continuous rollout: one engine step loop across steps, with no chunk barrier (``rollout.continuous``).

    TQ[step s]   ──poll──► admit while a slot is free ─┐        finished ─► TQ[step s] (a few rows per put)
    TQ[step s+1] ──poll──► (once weights >= s+1-k)   ──┴─► vLLM step loop (≤ max_num_seqs in flight)
    version board ──► newer weights: partial=true  → swap at a token boundary (prefix recomputed, or
                                                      its KV kept: rollout.partial_kv)
                                     partial=false → applied once the engine has drained

Prompts of step s+1 are admitted while step s's tail is still generating, as soon as the engine serves a
version v >= s+1-k (``admitted_version``). Without partial rollout the engine may only change weights when
it is empty, so a step that needs a newer version waits for the tail to drain first; with partial rollout
the tail carries on under the new version. Either way a response's oldest token comes from a version that
admitted its step, so workflow.max_staleness bounds every token (the row's version is its oldest token's).
A step's report is posted once every one of its rows has been generated.

Multi-turn (``agent.loop``): a finished turn leaves the engine and its agent-loop call runs in a worker
(``asyncflow.agents.calls``) while the engine steps the other sequences; once the call answers, the trajectory
is continued (its observation appended, its next turn admitted) or finished. A trajectory waiting for its call
holds its step open, and counts as work in flight: the engine is not "empty" while a call runs, so weights
change under it only with partial rollout, as for a sequence being generated.

Restarts (``redo``: the driver restarts an instance that dies, ``asyncflow.workflow.supervisor``): rows are read
without acking them and acked once their responses are put (``RedoRows``), so the rows of an instance that dies
stay in flight until the supervisor releases them, and are generated again from their prompts, a partly generated
response or a multi-turn trajectory as a whole. A step is left for the next one once every row of it is handed
out (not acked), so admission still runs across steps; rows handed back to a step left behind are taken again,
and a step is reported only once the TransferQueue says every row of it is acked. Puts go through ``RedoClient``:
a row whose response a dead instance had put is not written again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from asyncflow.workflow.agent_turns import AgentTurns, Ended, TurnStats, model_token_versions, row_fields
from asyncflow.workflow.board import admitted_version
from asyncflow.workflow.partitions import PUT_ROWS, partition_name, row_length
from asyncflow.workflow.redo_rows import RedoRows


@dataclass
class _StepState:
    """What the stream knows about one step's rows."""

    taken: bool = False  # every row of the partition was admitted (or, with ``redo``, handed out)
    done: bool = False  # the TransferQueue says every row of it is generated (acked, with ``redo``)
    in_flight: int = 0
    rows: int = 0
    tokens: int = 0
    token_versions: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)  # vLLM's running set, sampled after each engine step
    swaps: int = 0
    first_version: int = -1
    agent: TurnStats = field(default_factory=TurnStats)  # multi-turn counts of the rows put


class ContinuousRollout:
    """Drives ``service.engine``'s stream over steps ``first .. last-1`` for a ``RolloutService``."""

    poll_weights_s = 0.05  # how often the board is asked for a newer version while generating

    def __init__(self, service, partial: bool, evaluate: bool = False):
        """``evaluate``: run the service's evaluations (instance 0's ``evaluator``) between steps, draining the
        engine for each; off for ``sync`` mode's one-step runs, whose ``run_step`` evaluates before them."""
        self.svc = service
        self.partial = partial
        self.evaluator = service.evaluator if evaluate else None
        self.agent = service.agent  # an ``asyncflow.agents.AgentLoop`` or None (single turn)
        self.stream = service.engine.stream(ignore_eos="max_new_tokens" in service.fields,
                                            turns=self.agent is not None)
        self.turns: AgentTurns | None = None  # the agent loop's calls and waiting trajectories, made in ``run``
        # An agent loop sees the row's reference answer (with data_source/extra_info, asyncflow.data) as metadata.
        self.fields = list(service.fields) + (["ground_truth"] if self.agent is not None and service.answers else [])
        self.steps: dict[int, _StepState] = {}
        self.pending: list[tuple[int, int, Ended]] = []  # (step, row, its ended trajectory) not yet put
        self.busy_since: float | None = None
        self.redo = RedoRows(service, self.poll_weights_s) if service.redo else None
        self._checked = self._reopened = 0.0
        self._newest = -1

    # ------------------------------------------------------------------ weights
    def _newest_version(self) -> int:
        """The newest staged version (asked at most every ``poll_weights_s``)."""
        import ray

        now = time.monotonic()
        if now - self._checked >= self.poll_weights_s:
            self._checked = now
            self._newest = ray.get(self.svc.board.version.remote(self.svc.domain))
        return self._newest

    def _weights(self, step: int) -> None:
        """Bring the engine to a version allowed for ``step``, and to the newest one when that is free."""
        engine, need = self.svc.engine, admitted_version(step, self.svc.max_staleness)
        served = engine.weight_version
        if not self._busy():
            if served < need and self._open_before(step):
                # Not blocked on weights while an earlier step may get rows back (a peer died): that step's
                # training, and so the version awaited here, may wait for them (``_reopen``).
                return
            if served < need or self._newest_version() > served:
                self._idle()
                self.svc._admit(step)  # blocks until a version >= need is staged; applies the newest
            return
        if self.partial and max(self._newest_version(), served) >= need and self._newest > served:
            _, done = self.stream.swap_weights(lambda: self.svc._admit(step), keep_kv=self.svc.partial_kv == "keep")
            for state in self.steps.values():
                if state.in_flight:
                    state.swaps += 1
            self._finished(done)

    def _evaluation(self, step: int, post) -> bool:
        """True while an evaluation is due for the newest staged version and the engine drains for it: no row is
        admitted then, the rows in flight finish (with partial rollout too: an evaluation costs a drain). Once the
        engine is empty, the newest weights allowed for ``step`` are applied and evaluated
        (``RolloutService.evaluate_drained``); the loop then admits rows again."""
        # None staged yet (-1): version 0 is coming, and with eval_before_train it is evaluated before any row.
        if self.evaluator is None or not self.evaluator.due(max(self._newest_version(), 0)):
            return False
        if self._open_before(step) and self.svc.engine.weight_version < admitted_version(step, self.svc.max_staleness):
            return False  # the weights it would wait for may need an earlier step's rows handed back (``_weights``)
        if self._busy():
            return True
        self._idle()
        self.svc.evaluate_drained(step, post)
        return False

    # ------------------------------------------------------------------ rows
    def _admit_rows(self, step: int, block: bool) -> bool:
        """Admit ready rows of ``step`` into free slots; True once the partition is exhausted (with ``redo``: once
        every row of it is handed out, ``RedoRows.handed_out``)."""
        if not self.stream.free:
            return False
        if self.redo is not None:
            batch = self.redo.read(step, self.fields, self.stream.free, block=False)
            if batch is None and self.redo.handed_out(step):
                return True
            if batch is None and block:
                batch = self.redo.read(step, self.fields, self.stream.free, block=True)
        elif block:
            batch = self.svc.tq.get(partition_name(step), self.svc.name, self.fields, self.stream.free,
                                    timeout=self.svc.timeout_s, allow_partial=True)
        else:
            batch = self.svc.tq.poll(partition_name(step), self.svc.name, self.fields, self.stream.free,
                                     allow_partial=True)
        if batch is None:
            return False
        self._add(step, batch)
        return batch.done

    def _add(self, step: int, batch) -> None:
        """Put ``batch``'s rows of ``step`` into the engine (``done``: the step is generated)."""
        state = self.steps[step]
        if batch.done:
            state.done = True
            return
        if state.first_version < 0:
            state.first_version = self.svc.engine.weight_version
        budgets = batch["max_new_tokens"].tolist() if "max_new_tokens" in batch else [None] * len(batch)
        answers = batch["ground_truth"] if "ground_truth" in self.fields else [None] * len(batch)
        rows = range(len(batch)) if self.redo is None else self.redo.take(step, batch)
        for i in rows:
            key = (step, batch.indexes[i])
            if self.turns is not None:
                self.turns.add(key, batch["prompt_ids"][i].tolist(), budgets[i], answers[i])
            else:
                self.stream.add(key, batch["prompt_ids"][i].tolist(), budgets[i])
        state.in_flight += len(rows)
        if self.busy_since is None:
            self.busy_since = time.time()
        return False

    def _busy(self) -> bool:
        """Sequences in the engine, or trajectories waiting for their agent-loop call."""
        return bool(len(self.stream) or (self.turns is not None and len(self.turns)))

    def _answered(self, ended: list[Ended]) -> None:
        """Queue the trajectories whose agent-loop calls ended them (done, failed or timed out)."""
        for trajectory in ended:
            self._end(trajectory)
        self._maybe_flush()

    def _end(self, ended: Ended) -> None:
        """``ended.key``'s response is complete: queue it for the TransferQueue (``_flush`` counts it once put)."""
        step, index = ended.key
        self.steps[step].in_flight -= 1
        self.pending.append((step, index, ended))

    def _count(self, step: int, ended: Ended) -> None:
        """Add a response that was written to its step's report."""
        state, sample = self.steps[step], ended.sample
        state.rows += 1
        state.tokens += len(sample.response_ids)
        state.token_versions += model_token_versions(sample)  # the model's tokens only
        if self.agent is not None:
            state.agent.add(ended)

    def _finished(self, done) -> None:
        for key, sample in done:
            if self.turns is not None:
                self.turns.finished(key, sample)
            else:
                self._end(Ended(key, sample))
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if len(self.pending) >= PUT_ROWS or any(self.steps[s].in_flight == 0 for s, *_ in self.pending):
            self._flush()

    def _flush(self) -> None:
        by_step: dict[int, list[tuple[int, Ended]]] = {}
        for step, index, ended in self.pending:
            by_step.setdefault(step, []).append((index, ended))
        self.pending.clear()
        for step, rows in by_step.items():
            samples = [e.sample for _, e in rows]
            data = {"response_ids": [torch.tensor(s.response_ids, dtype=torch.long) for s in samples],
                    "behaviour_logprobs": [torch.tensor(s.response_logprobs) for s in samples]}
            if self.partial:  # rows span versions: the actor checks its logprobs on the tokens of its own
                data["token_versions"] = [torch.tensor(s.token_versions, dtype=torch.long) for s in samples]
            if self.agent is not None:  # the loss mask travels with the row into the actor's objective
                data.update(row_fields([e for _, e in rows]))
            self.svc.tq.put(partition_name(step), data, indexes=[i for i, _ in rows],
                            versions=[s.weight_version for s in samples], lengths=[row_length(s) for s in samples])
            # A row whose response another instance wrote first (it held the row before it died, or holds it
            # too since a peer's death gave every row back) is not counted: the report describes what is trained.
            skipped = set(getattr(self.svc.tq, "last_skipped", ()))
            for index, ended in rows:
                if index not in skipped:
                    self._count(step, ended)
            if self.redo is not None:  # put: these rows are done, and no longer come back if this instance dies
                self.redo.written(step, [i for i, *_ in rows])

    # ------------------------------------------------------------------ timeline and reports
    def _idle(self) -> None:
        """Close the current ``generate`` span (the engine is about to wait)."""
        if self.busy_since is not None:
            self.svc.timeline.add(self.svc.name, "generate", self.busy_since, time.time(), self.svc.worker)
            self.busy_since = None

    def _report(self, step: int) -> dict:
        state = self.steps.pop(step)
        if self.redo is not None:
            self.redo.forget(step)
        if self.busy_since is not None:  # cut the open span so this step's report carries it
            self._idle()
            self.busy_since = time.time()
        lags = torch.tensor([step - v for v in state.token_versions] or [0], dtype=torch.float)
        running = state.running or [0]
        return self.svc.report(step, {
            "rollout/rows": state.rows, "rollout/tokens": state.tokens, "rollout/version": state.first_version,
            "rollout/weight_buckets": self.svc.apply_stats.get("weights/buckets", 0.0),
            "rollout/in_flight_mean": sum(running) / len(running), "rollout/in_flight_max": float(max(running)),
            "rollout/weight_swaps": float(state.swaps),
            "staleness/token_lag_min": lags.min().item(), "staleness/token_lag_mean": lags.mean().item(),
            "staleness/token_lag_max": lags.max().item(), **self.svc.apply_stats,
            **(state.agent.metrics() if self.agent is not None else {})})

    # ------------------------------------------------------------------ the loop
    def run(self, first: int, last: int, post) -> None:
        """Generate steps ``first .. last-1``; ``post(report)`` each as its last row is put."""
        if self.agent is not None:
            self.turns = AgentTurns(self.svc, self.stream)
        try:
            self._run(first, last, post)
        finally:
            if self.turns is not None:
                self.turns.close()

    def _run(self, first: int, last: int, post) -> None:
        admit, reported = first, first
        while reported < last:
            # Post finished steps first: nothing below may block while a finished step goes unreported.
            while reported < admit and self.steps[reported].done and not self.steps[reported].in_flight:
                self._flush()
                post(self._report(reported))
                reported += 1
            if self.redo is not None and reported < admit:
                self._reopen(reported, admit)
            if admit < last and not self._evaluation(admit, post):
                self.steps.setdefault(admit, _StepState())
                self._weights(admit)
                if self.svc.engine.weight_version >= admitted_version(admit, self.svc.max_staleness):
                    # Block on the queue only when the engine has nothing else to do.
                    if self._admit_rows(admit, block=not self._busy()):
                        self.steps[admit].taken = True
                        admit += 1
                        continue
            if len(self.stream):
                done = self.stream.step()
                running = self.stream.running()
                for state in self.steps.values():
                    if state.in_flight:
                        state.running.append(running)
                self._finished(done)
                if self.turns is not None and len(self.turns):
                    self._answered(self.turns.ready())
            elif self.turns is not None and len(self.turns):  # only agent-loop calls are left: wait a little for one
                self._answered(self.turns.ready(wait_s=self.poll_weights_s))
            elif self.busy_since is not None:
                self._idle()
        self._idle()

    def _open_before(self, step: int) -> bool:
        """A step before ``step`` whose rows are handed out but not all generated yet (``redo``)."""
        return self.redo is not None and any(not s.done for k, s in self.steps.items() if k < step)

    def _reopen(self, first: int, admit: int) -> None:
        """``redo``: take the rows handed back to steps ``first .. admit-1`` (an instance that held them died and
        the supervisor released them) and see which of these steps are generated. The engine serves weights
        allowed for ``admit``, so for these earlier steps too. Blocks briefly when the engine has nothing to do."""
        step = next((k for k in range(first, admit) if not self.steps[k].done), None)
        busy, now = self._busy(), time.monotonic()
        if step is None or not self.stream.free or (busy and now - self._reopened < self.poll_weights_s):
            return
        self._reopened = now
        batch = self.redo.read(step, self.fields, self.stream.free, block=not busy)
        if batch is not None:
            self._add(step, batch)

"""The sample stream's rollout side (``workflow.mode: stream``): whole groups generated continuously from the
prompt stream, each put into the step the board's ledger (``asyncflow.workflow.stream_ledger``) gives it.

    TQ[prompt-stream] ─group sampler─► reserve (board) ─► engine stream (<= max_num_seqs responses in flight)
                                                              │ the group's n responses finished
                                                              ▼
                    claim (its oldest token's version) ─ok────► TQ[step s]: reward, reference, advantage, actor
                                                       └stale─► TQ[prompt-stream]: generated again later

A response never holds a step up: step s trains the first groups to finish while it is open; a group that
finishes after the steps its oldest token allows (s > v + k) is counted and generated again. Newer weights are
applied when the engine is empty, or at once under partial rollout (``rollout.partial``; the swapped response's
oldest token stays the one that bounds it).

Restarts (``asyncflow.workflow.supervisor``): an instance reads its prompts without acking them, tells the ledger
which prompt rows it holds, and acks a group's rows only once the ledger knows the group is done (put into its
step, re-fed or dropped). When its process dies the supervisor has the board forget it (``StreamLedger.forget``):
its reservations go back, the prompts it held return to the stream, and the slots it claimed and did not confirm
wait for those prompts' copies. A restartable instance puts a group into its claim's slot (rows the driver made
ahead, ``StreamFeeder``) with a ``RedoClient``, so a copy's put of a slot its dead predecessor had written is
skipped: the first write stands.

Multi-turn (``agent.loop``): a finished turn leaves the engine and its agent-loop call runs in a worker while the
engine steps the others (``asyncflow.workflow.agent_turns``, shared with the step-tied loop); the trajectory then
re-enters the engine for its next turn or ends (done, failed, or its call past agent.tool_timeout_s). A group is
complete once its n trajectories ended; its oldest token, from its first turn, bounds it as a single-turn group's.
A trajectory waiting for its call is out of the engine but its group is held (its reservation, its unacked prompt
rows: a death hands the prompt back) and counts as work in flight: weights change under it only with partial
rollout.

The engine is the loop's critical path, so the loop never waits on a round trip it can go on without: the board's
answers (a poll, a reservation, a batch of claims) come back while the engine steps and are taken in the order they
were asked (``_settle``), and a finished group's put, the ledger's ``done`` and its prompt rows' ack run in that order
on a thread of their own (``outbox``). Whatever the ledger must know first is still known first: a group's
admission before its claim, its claim before its put, its put before ``done``, ``done`` before the ack.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from asyncflow.workflow.agent_turns import AgentTurns, Ended, TurnStats, model_token_versions, row_fields
from asyncflow.workflow.partitions import STREAM_PARTITION, partition_name, row_length


@dataclass
class _Group:
    """One prompt's group in the engine."""

    prompt: list[int]
    version: int
    """The engine's version when the group was admitted: no token of it is older."""
    answer: object = None
    meta: object = None
    """The hand-out its prompt rows came in (acked once the ledger knows the group is done)."""
    rows: list[int] = field(default_factory=list)
    """Its prompt rows in the prompt stream."""
    doomed: bool = False
    """Its version is too old for the open step: it will go stale, and its reservation was given back."""
    budgets: list = field(default_factory=list)
    ended: dict[int, Ended] = field(default_factory=dict)
    """Its trajectories that ended, by their index in the group."""


@dataclass
class _StepStats:
    """This instance's share of one step: the groups it put there and those that went stale while it was open."""

    rows: int = 0
    tokens: int = 0
    lags: list[int] = field(default_factory=list)
    stale: int = 0
    swaps: int = 0
    running: list[int] = field(default_factory=list)
    """vLLM's running set, sampled after each engine step while this step was open (as the step-tied stream's)."""
    agent: TurnStats = field(default_factory=TurnStats)


class StreamRollout:
    """Drives ``service.engine``'s stream for a ``RolloutService`` until every step ``first .. last-1`` has its
    groups (under dynamic sampling: until the trainer has made version ``last``)."""

    poll_s = 0.05
    """How often the board is asked for newer weights and the open step."""
    retry_s = 0.5
    """A refused reservation is asked again at once when what decides it here changed (the engine's version, the
    open step, a reservation this loop gave back), else after this long: room that others make (a drop by dynamic
    sampling that leaves its step open, another instance giving reservations back) shows no other way. Asking every
    ``poll_s`` instead kept the board busy a tenth of a core while the engine waited for weights."""

    def __init__(self, service, partial: bool, group_size: int, answers: bool):
        self.svc, self.partial, self.n = service, partial, group_size
        self.budgets = "max_new_tokens" in service.fields
        self.answers = answers
        self.fields = list(service.fields) + (["ground_truth"] if answers else [])
        self.agent = service.agent  # an ``asyncflow.agents.AgentLoop`` or None (single turn)
        self.stream = service.engine.stream(ignore_eos=self.budgets, turns=self.agent is not None)
        self.turns: AgentTurns | None = None  # the agent loop's calls and waiting trajectories, made in ``run``
        self.groups: dict[int, _Group] = {}
        self.stats: dict[int, _StepStats] = {}
        self.held = 0  # reservations granted and not used yet
        self.open = 0
        self.newest = -1
        self._polled = self._refused = self._empty = 0.0
        self._refused_at: tuple | None = None  # (engine version, open step) of the last refusal
        self.busy_since: float | None = None
        self.draining = False  # instance 0 empties its engine for an evaluation (``_evaluation``)
        self.holder = f"{service.worker}:{uuid.uuid4().hex[:8]}"
        """Who holds what on the ledger: this loop of this instance (its restarted process is another holder)."""
        self.slots = service.redo  # puts go to their claim's slot (``StreamFeeder`` makes the rows ahead)
        self.posted: set[int] = set()  # steps whose share this loop reported
        self.pending: list[tuple[object, object]] = []
        """Board calls asked and not taken yet, in the order asked: ``(object ref, what takes its answer)``."""
        self.asking = 0  # reservations asked for in ``pending``
        self.claiming = 0  # claims in ``pending``: their groups' shares are not counted yet
        self.polling = False
        self.outbox = ThreadPoolExecutor(1, thread_name_prefix="stream-out")
        """Puts, ``done`` and acks, one at a time in the order given (one thread: a group's steps stay in order)."""
        self.sent: list[Future] = []

    def _call(self, method: str, *args):
        import ray

        return ray.get(getattr(self.svc.board, method).remote(*args))

    def _ask(self, method: str, args: tuple, take) -> None:
        """Ask the board without waiting; ``take(answer)`` runs in ``_settle``, in the order asked."""
        self.pending.append((getattr(self.svc.board, method).remote(*args), take))

    def _settle(self, block: bool = False) -> None:
        """Take the board's answers that are in (``block``: every one asked), oldest first; a later answer waits
        for an earlier one, so the ledger's order is the loop's. Raises what a put of the outbox raised."""
        import ray

        while self.pending:
            ref, take = self.pending[0]
            if not block and not ray.wait([ref], timeout=0)[0]:
                break
            self.pending.pop(0)
            take(ray.get(ref))
        while self.sent and self.sent[0].done():
            self.sent.pop(0).result()

    # ------------------------------------------------------------------ board
    def _poll(self) -> None:
        now = time.monotonic()
        if not self.polling and now - self._polled >= self.poll_s:
            self._polled, self.polling = now, True
            self._ask("stream_poll", (self.svc.domain,), self._polled_answer)

    def _polled_answer(self, answer) -> None:
        self.polling = False
        self.newest, self.open = answer

    def _release_doomed(self) -> None:
        """Give back the reservations of groups that can no longer be trained (admitted at a version older than the
        open step allows): a long response must not keep newer groups out of the window."""
        doomed = [g for g in self.groups.values() if not g.doomed and g.version + self.svc.max_staleness < self.open]
        for group in doomed:
            group.doomed = True
        if doomed:
            self._call("stream_release", len(doomed), self.holder)
            self._refused_at = None  # room this loop made: ask at once

    def _drop_doomed(self) -> None:
        """Every group in the engine can only go stale and newer weights are staged: stop generating them (their
        prompts go back to the stream, as a stale group's do), so the engine takes the newer weights now instead of
        draining responses no step will train."""
        if not self.groups or self.newest <= self.svc.engine.weight_version:
            return
        if not all(group.doomed for group in self.groups.values()):
            return
        self.stream.abort()
        dropped, self.groups = list(self.groups.items()), {}
        if self.turns is not None:  # trajectories waiting for their calls go with their groups
            self.turns.drop([(gid, j) for gid, group in dropped for j in range(len(group.budgets))])
        stats = self.stats.setdefault(self.open, _StepStats()) if self.open not in self.posted else _StepStats()
        stats.stale += len(dropped)
        self.sent.append(self.outbox.submit(self._out, {STREAM_PARTITION: [(gid, group, None, -1)
                                                                           for gid, group in dropped]},
                                            [group for _, group in dropped], [gid for gid, _ in dropped]))

    def _weights(self) -> None:
        """Serve the newest version: at once when the engine is empty, at a token boundary under partial rollout."""
        engine = self.svc.engine
        if self.newest <= engine.weight_version:
            return
        apply = lambda: self.svc._admit(self.newest + self.svc.max_staleness)  # noqa: E731 - waits for nothing
        if not self._busy():
            self._idle()
            apply()
        elif self.partial:
            _, done = self.stream.swap_weights(apply, keep_kv=self.svc.partial_kv == "keep")
            for step in {s for s in self.stats if s >= self.open}:
                self.stats[step].swaps += 1
            self._finished(done)

    def _evaluation(self, last: int, post) -> bool:
        """True while an evaluation is due for the newest staged version and the engine drains for it: no group is
        admitted (the reservations held go back to the ledger, for the other instances) and the weights wait, under
        partial rollout too (an evaluation costs a drain). Once the engine is empty the newest weights are applied
        and evaluated (``RolloutService.evaluate_drained``), and the loop admits again. Only while a step is open:
        weights no group will be generated with are not evaluated."""
        evaluator, newest = self.svc.evaluator, max(self.newest, 0)  # none staged yet: version 0 is coming
        self.draining = False
        if evaluator is None or self.open >= last or not evaluator.due(newest):
            return False
        if self.held:
            self._call("stream_release", self.held, self.holder)
            self.held = 0
        self.draining = self._busy()
        if self.draining:
            return True
        self._idle()
        self.svc.evaluate_drained(newest + self.svc.max_staleness, post, step=self.open)
        return False

    # ------------------------------------------------------------------ prompts in
    def _admit(self) -> bool:
        """Admit whole groups from the prompt stream into free slots, as far as reservations allow."""
        free = self.stream.free // self.n
        now = time.monotonic()
        want = free - self.held - self.asking
        if want > 0 and self._may_ask(now):
            self.asking += want
            self._ask("stream_reserve", (want, self.svc.engine.weight_version, self.holder),
                      lambda granted, want=want, now=now: self._granted(want, granted, now))
        take = min(free, self.held)
        if not take or now - self._empty < self.poll_s / 5:
            return False
        tq = self.svc.tq
        meta = tq.get_meta(STREAM_PARTITION, self.svc.name, self.fields, take * self.n, sampler="group",
                           sampler_args={"group_size": self.n}, allow_partial=True, block=False)
        if not meta.indexes:
            self._empty = now
            return False
        batch = tq.get_data(meta, ack=False)  # acked once the ledger knows each group is done (``_done``)
        budgets = batch["max_new_tokens"].tolist() if self.budgets else [None] * len(batch)
        answers = batch["ground_truth"] if self.answers else [None] * len(batch)
        rows: dict[int, list[int]] = {}
        for gid, index in zip(meta.group_ids, meta.indexes):
            rows.setdefault(gid, []).append(index)
        copies = [gid for gid in rows if gid in self.groups]  # its prompt, handed out again, is in the engine here
        for gid in copies:
            tq.ack(meta, rows.pop(gid))
        if rows:  # taken before any claim of these groups (``_settle`` keeps the order)
            self._ask("stream_admitted", (self.holder, rows), lambda _: None)
        for gid, prompt, budget, answer in zip(meta.group_ids, batch["prompt_ids"], budgets, answers):
            if gid not in rows:
                continue
            group = self.groups.setdefault(gid, _Group(prompt.tolist(), self.svc.engine.weight_version, answer,
                                                       meta, rows[gid]))
            if self.turns is not None:
                self.turns.add((gid, len(group.budgets)), group.prompt, budget, answer)
            else:
                self.stream.add((gid, len(group.budgets)), group.prompt, budget)
            group.budgets.append(budget)
        self.held -= len(rows)
        if self.busy_since is None:
            self.busy_since = time.time()
        return True

    def _may_ask(self, now: float) -> bool:
        """Whether to ask for reservations now (see ``retry_s``)."""
        if self._refused_at != (self.svc.engine.weight_version, self.open):
            return now - self._refused >= self.poll_s
        return now - self._refused >= self.retry_s

    def _granted(self, want: int, granted: int, asked: float | None = None) -> None:
        self.asking -= want
        self.held += granted
        if not granted and asked is not None:
            self._refused, self._refused_at = asked, (self.svc.engine.weight_version, self.open)
        elif granted:
            self._refused_at = None

    # ------------------------------------------------------------------ groups out
    def _busy(self) -> bool:
        """Sequences in the engine, or trajectories waiting for their agent-loop call."""
        return bool(len(self.stream) or (self.turns is not None and len(self.turns)))

    def _finished(self, done) -> None:
        """Turns the engine finished: multi-turn, each goes to its agent-loop call; else its trajectory ended."""
        if self.turns is None:
            self._ended([Ended(key, sample) for key, sample in done])
            return
        for key, sample in done:
            self.turns.finished(key, sample)

    def _ended(self, ended: list[Ended]) -> None:
        """Trajectories that ended; a group whose every trajectory ended is placed."""
        finished = []
        for trajectory in ended:
            gid, j = trajectory.key
            group = self.groups[gid]
            group.ended[j] = trajectory
            if len(group.ended) == self.n:
                finished.append((gid, self.groups.pop(gid)))
        if finished:
            self._place(finished)

    def _place(self, finished: list[tuple[int, _Group]]) -> None:
        """Claim a step for each group the engine finished together, with the reservations for the slots they
        freed, in one board call; its answer is taken while the engine steps on (``_placed``)."""
        samples = {gid: [group.ended[j] for j in range(self.n)] for gid, group in finished}
        # Its oldest token's version: every turn's tokens are at least as new as its first turn's.
        claims = [(min(e.sample.weight_version for e in samples[gid]), not group.doomed, gid)
                  for gid, group in finished]
        want = 0 if self.draining else max(self.stream.free // self.n - self.held - self.asking, 0)  # a drain: none
        self.asking += want
        self.claiming += 1
        self._ask("stream_claims", (claims, want, self.svc.engine.weight_version, self.holder),
                  lambda answer: self._placed(finished, samples, want, answer))

    def _placed(self, finished: list[tuple[int, _Group]], samples: dict, want: int, answer) -> None:
        """Count each claimed group in its step's share and hand the puts (one per partition the groups go to:
        their step, or the prompt stream when they went stale) to the outbox."""
        verdicts, self.open, granted = answer
        self.claiming -= 1
        self._granted(want, granted)
        puts: dict[str, list] = {}  # partition -> its groups, in claim order
        for (gid, group), (verdict, step, slot) in zip(finished, verdicts):
            # "dup": a copy of its prompt has its slot. "full": every step has its groups for now; its prompt goes
            # back into the stream, as a stale one's does (not counted stale): under dynamic sampling a group the
            # advantage task drops later reopens its step, and the driver feeds by prompts fed minus claimed.
            if verdict == "dup":
                continue
            if verdict == "full":
                puts.setdefault(STREAM_PARTITION, []).append((gid, group, None, -1))
                continue
            stats = self.stats.setdefault(step, _StepStats()) if step not in self.posted else _StepStats()
            if verdict == "stale":
                stats.stale += 1
                puts.setdefault(STREAM_PARTITION, []).append((gid, group, None, -1))
                continue
            puts.setdefault(partition_name(step), []).append((gid, group, samples[gid], slot))
            stats.rows += self.n
            for ended in samples[gid]:
                stats.tokens += len(ended.sample.response_ids)
                stats.lags += [step - v for v in model_token_versions(ended.sample)]  # the model's tokens only
                if self.turns is not None:
                    stats.agent.add(ended)
        self.sent.append(self.outbox.submit(self._out, puts, [group for _, group in finished],
                                            [gid for gid, _ in finished]))

    def _out(self, puts: dict[str, list], groups: list[_Group], gids: list[int]) -> None:
        """The outbox's work for one claim: the puts, then ``_done``."""
        for partition, put in puts.items():
            self._put(partition, put)
        self._done(groups, gids)

    def _done(self, groups: list[_Group], gids: list[int]) -> None:
        """Tell the ledger these groups are done (put, re-fed or dropped), then ack their prompt rows: a death
        before the ledger knows leaves them held (``StreamLedger.forget`` hands them out again)."""
        self._call("stream_done", self.holder, gids)
        by_handout: dict[int, tuple] = {}
        for group in groups:
            meta, rows = by_handout.setdefault(id(group.meta), (group.meta, []))
            rows += group.rows
        for meta, rows in by_handout.values():
            self.svc.tq.ack(meta, rows)

    def _put(self, partition: str, groups: list[tuple[int, _Group, list | None, int]]) -> None:
        """Put whole groups into ``partition``: their prompts only when they went stale (``samples`` None, the
        prompt stream), else their rows (into their slots, with ``slots``)."""
        data = {"prompt_ids": [torch.tensor(group.prompt, dtype=torch.long) for _, group, _, _ in groups
                               for _ in range(self.n)]}
        group_ids = [gid for gid, *_ in groups for _ in range(self.n)]
        if self.answers:
            data["ground_truth"] = [group.answer for _, group, _, _ in groups for _ in range(self.n)]
        if partition == STREAM_PARTITION:
            if self.budgets:
                data["max_new_tokens"] = torch.tensor([b for _, group, _, _ in groups for b in group.budgets],
                                                      dtype=torch.long)
            self.svc.tq.put(STREAM_PARTITION, data, group_ids=group_ids)
            return
        ended = [e for _, _, samples, _ in groups for e in samples]
        flat = [e.sample for e in ended]
        data["response_ids"] = [torch.tensor(s.response_ids, dtype=torch.long) for s in flat]
        data["behaviour_logprobs"] = [torch.tensor(s.response_logprobs) for s in flat]
        if self.partial:  # rows span versions: the actor checks its logprobs on the tokens of its own
            data["token_versions"] = [torch.tensor(s.token_versions, dtype=torch.long) for s in flat]
        if self.turns is not None:  # the loss mask travels with the row into the actor's objective
            data.update(row_fields(ended))
        indexes = [slot * self.n + j for *_, slot in groups for j in range(self.n)] if self.slots else None
        self._put_rows(partition, data, indexes=indexes, group_ids=group_ids,
                       versions=[s.weight_version for s in flat], lengths=[row_length(s) for s in flat])

    def _put_rows(self, partition: str, data: dict, **kwargs) -> None:
        """``tq.put``; a slot whose rows the driver has not made yet is waited for (``StreamFeeder``)."""
        from asyncflow.transfer_queue import BadRequestError

        deadline = time.monotonic() + self.svc.timeout_s
        while True:
            try:
                self.svc.tq.put(partition, data, **kwargs)
                return
            except BadRequestError as err:
                if "out of range" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(self.poll_s)

    # ------------------------------------------------------------------ reports
    def _idle(self) -> None:
        if self.busy_since is not None:
            self.svc.timeline.add(self.svc.name, "generate", self.busy_since, time.time(), self.svc.worker)
            self.busy_since = None

    def _post_closed(self, post) -> None:
        """Report every step this instance took part in that has all its groups now (its claims' answers taken
        first: a poll may tell of a closed step before them)."""
        if self.claiming and any(s < self.open for s in self.stats):
            self._settle(block=True)  # once a step: its share is complete only with every claim counted
        for step in sorted(s for s in self.stats if s < self.open):
            if self.busy_since is not None:  # cut the open span so this step's report carries it
                self._idle()
                self.busy_since = time.time()
            stats = self.stats.pop(step)
            self.posted.add(step)
            lags = torch.tensor(stats.lags or [0], dtype=torch.float)
            running = stats.running or [0]
            post(self.svc.report(step, {
                "rollout/rows": stats.rows, "rollout/tokens": stats.tokens,
                "rollout/version": step - lags.max().item(), "rollout/weight_swaps": float(stats.swaps),
                "rollout/weight_buckets": self.svc.apply_stats.get("weights/buckets", 0.0),
                "rollout/in_flight_mean": sum(running) / len(running), "rollout/in_flight_max": float(max(running)),
                "stream/stale_groups": float(stats.stale), "staleness/token_lag_min": lags.min().item(),
                "staleness/token_lag_mean": lags.mean().item(), "staleness/token_lag_max": lags.max().item(),
                **self.svc.apply_stats, **(stats.agent.metrics() if self.turns is not None else {})}))

    # ------------------------------------------------------------------ the loop
    def run(self, first: int, last: int, post) -> None:
        """Generate until every step has its groups; ``post(report)`` each step's share once the step is full."""
        self.open = first
        if self.agent is not None:
            self.turns = AgentTurns(self.svc, self.stream)
        try:
            self._run(last, post)
            self._settle(block=True)  # the last claims' answers, then their puts
            for sent in self.sent:
                sent.result()
        finally:
            self.outbox.shutdown(wait=True)
            if self.turns is not None:
                self.turns.close()
        self._idle()
        self._post_closed(post)

    def _run(self, last: int, post) -> None:
        while True:
            self._settle()
            self._poll()
            self._post_closed(post)
            self._release_doomed()
            self._drop_doomed()
            # Under dynamic sampling a judged group may still leave room in a full step: go on until it trained.
            if self.open >= last and (not self.svc.partial_batches or self.newest >= last):
                break
            draining = self._evaluation(last, post)
            if not draining:
                self._weights()
            admitted = not draining and self._admit()
            if len(self.stream):
                done = self.stream.step()
                if self.open < last and self.open not in self.posted:
                    self.stats.setdefault(self.open, _StepStats()).running.append(self.stream.running())
                self._finished(done)
                if self.turns is not None and len(self.turns):
                    self._ended(self.turns.ready())
            elif self.turns is not None and len(self.turns):  # only agent-loop calls are left: wait a little
                self._ended(self.turns.ready(wait_s=self.poll_s))
            elif not admitted:
                self._idle()
                time.sleep(0.005)

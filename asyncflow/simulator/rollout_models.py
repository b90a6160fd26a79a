"""How a rollout engine turns prompts into finished responses over time (a registry of models).

A model is a function ``serve(pipe, instance, steps)``: a simulator process that serves ``steps`` (a range: one
step per call in sync mode, every step in async) on one rollout instance. It waits for weights the staleness
bound allows (``take_weights``), pulls the steps' prompt rows from the simulated TransferQueue, spends time on
the instance's device and puts each response back when it finishes.

- ``chunked`` is ``RolloutService.run_step``: take ``rollout_chunk`` rows, run them as one engine batch (at most
  ``max_num_seqs`` at once, the rest admitted as slots free), stream each response out as it finishes, then
  take the next chunk; weights change between steps.
- ``continuous`` is ``rollout.continuous`` (``asyncflow.workflow.rollout_stream``): one engine across steps,
  a prompt admitted as soon as a slot frees, the next step's prompts admitted while this step's tail finishes
  once the engine serves a version the staleness bound allows; weights change only on an empty engine, so a
  step that needs a newer version waits for the tail to drain.
- ``partial`` is ``rollout.partial``: as ``continuous``, but a newer version is applied while responses are in
  flight; ``rollout.partial_kv`` ``recompute`` re-prefills every in-flight response's prompt and tokens so far
  (``keep``: no prefill). The real loop looks for a newer version every 0.05 s; the model looks at every finish
  and every ``CHECK_STEPS`` engine steps.

The engine is simulated step by step from ``RolloutCosts`` (``Engine``): a step prefills the sequences admitted
in it and decodes one token for every running sequence; steps in which nothing finishes are merged into one
device job, so a chunk costs a few jobs, not one per token.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Generator

from asyncflow.registry import Registry
from asyncflow.simulator.costs import RolloutCosts
from asyncflow.workflow.board import admitted_version
from asyncflow.workflow.rollout_stream import PUT_ROWS

ROLLOUT_MODELS = Registry("rollout model")
CHECK_STEPS = 16
"""``partial``: engine steps between two looks at the version board when nothing finishes (the real loop looks
every 0.05 s, about 16 steps of the tiny CPU model; at scale 16 steps are well under a second)."""


class Engine:
    """One engine's waiting and running sequences, advanced one finish at a time (``segment``).

    Bookkeeping is incremental, so a segment costs O(log n) in the running sequences, not O(n): an engine step
    counter ``t``; each running sequence's first-token step (``start``) and finishing step in a heap; the attended
    context of the running set is ``n (prompt_len + t) - sum(start)``."""

    def __init__(self, costs: RolloutCosts, prompt_len: int, max_seqs: int):
        self.costs, self.prompt_len, self.max_seqs = costs, prompt_len, max_seqs
        self.waiting: deque = deque()  # keys in arrival order
        self.start: dict = {}  # running key -> the engine step whose prefill gave its first token, minus 1
        self.ends: list = []  # heap of (the step at which it finishes, seq, key)
        self.lengths: dict = {}  # key -> tokens it will generate (waiting and running)
        self.t, self.seq, self.start_sum = 0, 0, 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.start)

    @property
    def free(self) -> int:
        """Slots neither running nor promised to a waiting sequence."""
        return max(self.max_seqs - len(self), 0)

    def add(self, key, length: int) -> None:
        """Queue a sequence that will generate ``length`` tokens."""
        self.waiting.append(key)
        self.lengths[key] = length

    def done(self, key) -> int:
        """Tokens a running sequence has generated."""
        return self.t - self.start[key]

    def segment(self, max_steps: int | None = None) -> tuple[float, list]:
        """``(seconds, finished keys)`` up to the next engine step in which a sequence finishes, or after
        ``max_steps`` engine steps with no finish (``[]``).

        A sequence admitted at a step gets its first token from that step's prefill and finishes ``length - 1``
        decode steps later; sequences wait in arrival order for one of ``max_seqs`` slots. Runs of decode steps
        without an admission are summed in closed form (the attended context grows by one token per running
        sequence per step), so a batch costs one iteration per finish event, not one per token."""
        costs, work, taken = self.costs, 0.0, 0
        while (self.waiting or self.start) and (max_steps is None or taken < max_steps):
            n_admit = min(max(self.max_seqs - len(self.start), 0), len(self.waiting))
            admitted = [self.waiting.popleft() for _ in range(n_admit)]
            running = len(self.start)
            batch = running + n_admit
            ctx = running * (self.prompt_len + self.t) - self.start_sum
            if admitted:  # one engine step: prefill the admitted rows (their first token), decode the others
                steps = 1
                tokens = running + self.prompt_len * n_admit
                work += (costs.fixed_s(tokens) + costs.per_seq_s * batch + costs.per_ctx_token_s * ctx
                         + (costs.prefill_per_token_s * self.prompt_len + costs.per_request_s) * n_admit)
            else:  # decode steps up to the next finish: context ctx, ctx + B, ctx + 2B, ...
                steps = self.ends[0][0] - self.t
                steps = steps if max_steps is None else min(steps, max_steps - taken)
                work += (steps * (costs.fixed_s(batch) + costs.per_seq_s * batch)
                         + costs.per_ctx_token_s * (steps * ctx + batch * steps * (steps - 1) / 2))
            taken += steps
            self.t += steps
            for key in admitted:  # one token after this step
                self.start[key] = self.t - 1
                self.start_sum += self.t - 1
                heapq.heappush(self.ends, (self.t - 1 + self.lengths[key], self.seq, key))
                self.seq += 1
            finished = []
            while self.ends and self.ends[0][0] <= self.t:
                key = heapq.heappop(self.ends)[2]
                self.start_sum -= self.start.pop(key)
                del self.lengths[key]
                finished.append(key)
            if finished:
                return work, finished
        return work, []

    def recompute_s(self) -> float:
        """Prefill of every running sequence's prompt and tokens so far (a partial-rollout swap that drops the
        KV cache: the requests are re-added with their tokens as the prompt)."""
        costs, n = self.costs, len(self.start)
        tokens = n * (self.prompt_len + self.t) - self.start_sum
        return costs.prefill_per_token_s * tokens + costs.per_request_s * n


def engine_batch(lengths: list[int], prompt_len: int, costs: RolloutCosts, max_seqs: int
                 ) -> list[tuple[float, list[int]]]:
    """Segments ``(seconds, finished row positions)`` of one engine batch over ``lengths`` (tokens per row)."""
    engine = Engine(costs, prompt_len, max_seqs)
    for row, length in enumerate(lengths):
        engine.add(row, length)
    segments = []
    while len(engine):
        segments.append(engine.segment())
    return segments


def take_weights(pipe, instance: int, step: int) -> Generator:
    """Wait for a version the staleness bound allows for ``step``, then apply the newest one if it is newer than
    the instance's (``RolloutService._admit``)."""
    start = pipe.sim.now
    yield pipe.board.wait(admitted_version(step, pipe.w.max_staleness))
    if pipe.sim.now > start:
        pipe.span("rollout", "wait_weights", instance, start)
    yield from _apply(pipe, instance)


def _apply(pipe, instance: int, extra_s: float = 0.0) -> Generator:
    newest = pipe.board.version
    if newest != pipe.served[instance]:
        start, ws = pipe.sim.now, pipe.costs.weight_sync
        yield pipe.device("rollout", instance).run(ws.apply_fixed_s + ws.apply_per_byte_s * pipe.costs.apply_bytes
                                                   + extra_s)
        pipe.served[instance] = newest
        pipe.span("rollout", "load_weights", instance, start, version=newest)


def _put(pipe, finished: list, version: dict) -> None:
    """Put finished ``(step, row)`` responses, grouped by step (``version``: each row's oldest token's)."""
    by_step = defaultdict(list)
    for step, row in finished:
        by_step[step].append(row)
    for step, rows in by_step.items():
        for v in sorted({version[(step, r)] for r in rows}):
            pipe.tq.put(step, "response", [r for r in rows if version[(step, r)] == v], version=v)


def _take_rows(pipe, device, step: int, rows: list[int]) -> Generator:
    """The service's work on prompt rows it has taken: the TransferQueue get (8 bytes a prompt token) and its
    overhead per token it will generate (``ServiceCosts.generate_token_s``); returns the rows' lengths."""
    lengths = [pipe.lengths[step][r] for r in rows]
    get = pipe.costs.queue.request(len(rows) * pipe.w.prompt_len * 8)
    yield from pipe.work(device, get, pipe.costs.service.generate_token_s * sum(lengths))
    return lengths


def _put_s(pipe, rows: list) -> float:
    """The TransferQueue puts of finished ``(step, row)`` responses, ``PUT_ROWS`` a put: tokens and logprobs, 12
    bytes a token.

    Per put of up to 16, as the loop puts them, not per engine segment in which a row finished: a long-tailed
    step's rows finish over dozens of segments but take a handful of puts."""
    if not rows:
        return 0.0
    q, tokens = pipe.costs.queue, sum(pipe.lengths[step][row] for step, row in rows)
    return q.per_request_s * -(-len(rows) // PUT_ROWS) + q.per_byte_s * tokens * 12


@ROLLOUT_MODELS.register("chunked")
def chunked(pipe, instance: int, steps: range) -> Generator:
    """``RolloutService.run_step``: one engine batch per ``rollout_chunk`` rows; responses stream out as they
    finish; weights change between steps."""
    w = pipe.w
    device = pipe.device("rollout", instance)
    for step in steps:
        yield from take_weights(pipe, instance, step)
        while rows := (yield pipe.tq.take(step, "rollout", w.rollout_chunk)):
            start = pipe.sim.now
            lengths = yield from _take_rows(pipe, device, step, rows)
            version = {(step, r): pipe.served[instance] for r in rows}
            engine_s, pending = 0.0, []
            for seconds, finished in engine_batch(lengths, w.prompt_len, pipe.costs.rollout, w.max_num_seqs):
                engine_s += seconds
                pending += [(step, rows[i]) for i in finished]
                full = len(pending) // PUT_ROWS * PUT_ROWS  # put as the 16th, 32nd, ... row finishes
                done, pending = pending[:full], pending[full:]
                yield device.run(seconds + _put_s(pipe, done))
                _put(pipe, done, version)
            if pending:  # the call's last rows
                yield device.run(_put_s(pipe, pending))
                _put(pipe, pending, version)
            pipe.span("rollout", "generate", instance, start, rows=len(rows), engine_s=engine_s)


def _stream(pipe, instance: int, steps: range, partial: bool) -> Generator:
    """``continuous`` and ``partial``: one engine across ``steps`` (``ContinuousRollout.run``)."""
    w, sim = pipe.w, pipe.sim
    device = pipe.device("rollout", instance)
    engine = Engine(pipe.costs.rollout, w.prompt_len, w.max_num_seqs)
    version: dict = {}  # (step, row) -> the version of its first token
    admit, busy, pending, engine_s = steps.start, None, [], 0.0
    while admit < steps.stop or len(engine):
        if admit < steps.stop:
            need, served = admitted_version(admit, w.max_staleness), pipe.served[instance]
            if not len(engine) and (served < need or pipe.board.version > served):
                if busy is not None:  # the engine waits: close its generate span
                    pipe.span("rollout", "generate", instance, busy, engine_s=engine_s)
                    busy, engine_s = None, 0.0
                yield from take_weights(pipe, instance, admit)
            elif partial and len(engine) and pipe.board.version > served and pipe.board.version >= need:
                recompute = engine.recompute_s() if w.partial_kv == "recompute" else 0.0
                yield from _apply(pipe, instance, recompute)
            if pipe.served[instance] >= need and engine.free:
                rows = yield pipe.tq.take(admit, "rollout", engine.free)
                if not rows:  # every row of the step is admitted
                    admit += 1
                    continue
                busy = sim.now if busy is None else busy
                lengths = yield from _take_rows(pipe, device, admit, rows)
                for r, length in zip(rows, lengths):
                    engine.add((admit, r), length)
                    version[(admit, r)] = pipe.served[instance]
                continue
        seconds, finished = engine.segment(CHECK_STEPS if partial else None)
        engine_s += seconds
        pending += finished
        # Put once 16 are pending, or a pending row's step has nothing left in the engine (``ContinuousRollout``).
        live = {key[0] for key in engine.lengths} if pending else set()
        if len(pending) >= PUT_ROWS or any(step not in live for step, _ in pending):
            done, pending = pending, []
        else:
            done = []
        yield device.run(seconds + _put_s(pipe, done))
        _put(pipe, done, version)
    if busy is not None:
        pipe.span("rollout", "generate", instance, busy, engine_s=engine_s)


@ROLLOUT_MODELS.register("continuous")
def continuous(pipe, instance: int, steps: range) -> Generator:
    """``rollout.continuous``: one engine across steps; weights change only on an empty engine."""
    yield from _stream(pipe, instance, steps, partial=False)


@ROLLOUT_MODELS.register("partial")
def partial(pipe, instance: int, steps: range) -> Generator:
    """``rollout.partial``: as ``continuous``, with newer weights applied while responses are in flight."""
    yield from _stream(pipe, instance, steps, partial=True)

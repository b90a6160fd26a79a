"""The simulated pipeline: the same tasks, TransferQueue streaming, staleness bound and weight publication as
``asyncflow.workflow.loop``, on simulated devices with measured costs.

    prompts ─► TQ[step s] ─► rollout (admitted once version >= s - k; applies the newest) ─► reward ─► advantage ─┐
                         └──────────────────────────────► reference ──────────────────────────────────────────┤
                                                                                                               ▼
              version v+1 ◄── stage weights ◄── optimizer ◄── ppo_epochs passes ◄── micro-batches as rows are ready

Every task takes rows from the simulated TransferQueue with the real client's rule (a get returns
``batch_size`` rows whose fields exist, or the last partial batch of a complete step; the advantage task
takes whole groups), spends time on its device and puts its field back. ``async``: every service loops
over steps on its own; ``sync``: the driver runs them one after another per step. ``simulate`` returns
step times, samples/s, idle fraction per task and the version lag of every trained row.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Callable

from asyncflow.observability.timeline import Timeline
from asyncflow.simulator import stream
from asyncflow.simulator.costs import CostModel
from asyncflow.simulator.events import Device, Event, Pool, Sim
from asyncflow.simulator.result import SimResult
from asyncflow.simulator.rollout_models import ROLLOUT_MODELS
from asyncflow.simulator.workload import Workload, draw_lengths
from asyncflow.workflow.batching import fit_seq_len

TASK_FIELDS = {"rollout": ("prompt",), "reward": ("response",), "reference": ("response",),
               "advantage": ("reward",), "actor": ("advantage",), "actor+ref": ("advantage", "ref")}
"""The fields each simulated task reads (``services`` and ``train_services`` read the real ones)."""


SHORTEST_TASKS = ("actor", "reference")
"""The tasks that take the shortest ready rows under ``Workload.row_order = "shortest"`` (the Megatron services)."""


class _ByLength:
    """A task's ready rows, handed out shortest first, ties in ready order (the ``shortest`` sampler)."""

    def __init__(self, length: Callable[[int], int]):
        self.length, self.heap, self.seq = length, [], 0

    def append(self, row: int) -> None:
        heapq.heappush(self.heap, (self.length(row), self.seq, row))
        self.seq += 1

    def extend(self, rows) -> None:
        for row in rows:
            self.append(row)

    def __len__(self) -> int:
        return len(self.heap)

    def popleft(self) -> int:
        return heapq.heappop(self.heap)[2]


class SimQueue:
    """The TransferQueue's readiness rules over simulated rows (ids ``0 .. rows_per_step-1`` per step).

    Each task keeps a queue of the rows (or whole groups) ready for it, in the real partition's order
    (``ReadyView``): the view is built at the task's first request of the step from the rows ready by then, in
    index order, and later rows join in the order they become ready. The actor and the reference take the
    shortest ready rows instead (``Workload.row_order``, the ``shortest`` sampler; ``length(step, row)`` gives a
    row's length): so a sync actor, which asks once every row is in, gets micro-batches of like lengths, and
    under ``arrival`` it gets them mixed (padded to their longest); a streaming one gets them roughly by length
    either way, as in the real runs.
    """

    def __init__(self, sim: Sim, w: Workload, tasks: dict[str, tuple[str, ...]],
                 length: Callable[[int, int], int] | None = None):
        self.sim, self.w, self.tasks = sim, w, tasks
        self.have: dict[int, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
        self.versions: dict[int, dict[int, int]] = defaultdict(dict)
        by_length = w.row_order == "shortest" and length is not None

        def new_queue(key):
            step, task = key
            if by_length and task in SHORTEST_TASKS:
                return _ByLength(lambda row: length(step, row))
            return deque()

        self.queues: dict[tuple[int, str], deque | _ByLength] = _KeyedDefault(new_queue)
        self.taken: dict[tuple[int, str], int] = defaultdict(int)
        self.group_ready: dict[tuple[int, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.waiters: dict[tuple[int, str], tuple] = {}
        self.opened: set[tuple[int, str]] = set()  # (step, task) whose ready view exists
        self.on_put: Callable[[str, int], None] | None = None
        """Called with ``(field, rows)`` after every put (``Pipe`` charges the floating processes' work)."""

    def put(self, step: int, field: str, rows: list[int], version: int | None = None) -> None:
        """Rows of ``step`` now hold ``field`` (``version``: the weights that generated them)."""
        have, group = self.have[step], self.w.samples_per_prompt
        if self.on_put is not None:
            self.on_put(field, len(rows))
        for row in rows:
            have[row].add(field)
            if version is not None:
                self.versions[step][row] = version
        for task, fields in self.tasks.items():
            if field not in fields:
                continue
            key, grouped = (step, task), task == "advantage"
            if key not in self.opened:
                continue  # built from ``have`` at the task's first request
            for row in rows:
                if all(f in have[row] for f in fields):
                    if not grouped:
                        self.queues[key].append(row)
                        continue
                    counts = self.group_ready[key]
                    counts[row // group] += 1
                    if counts[row // group] == group:  # the advantage task takes whole groups
                        self.queues[key].extend(range(row // group * group, (row // group + 1) * group))
            if key in self.waiters and self._serve(key, *self.waiters[key]):
                del self.waiters[key]

    def take(self, step: int, task: str, n: int) -> Event:
        """An event with up to ``n`` rows of ``step`` ready for ``task`` that it has not taken (whole groups for
        the advantage task); ``[]`` once every row of the step is taken (the real client's rule: a full batch,
        or the last partial one)."""
        ev = self.sim.event()
        key = (step, task)
        if key not in self.opened:
            self._open(key)
        if task == "advantage":
            n = max(n // self.w.samples_per_prompt, 1) * self.w.samples_per_prompt
        if not self._serve(key, n, ev):
            self.waiters[key] = (n, ev)
        return ev

    def _open(self, key) -> None:
        """The ready view of ``key`` at its first request: every row ready now, by index."""
        step, task = key
        self.opened.add(key)
        fields, have, group = self.tasks[task], self.have[step], self.w.samples_per_prompt
        ready = [row for row in sorted(have) if all(f in have[row] for f in fields)]
        if task != "advantage":
            self.queues[key].extend(ready)
            return
        counts = self.group_ready[key]
        for row in ready:
            counts[row // group] += 1
        for g in sorted(counts):
            if counts[g] == group:
                self.queues[key].extend(range(g * group, (g + 1) * group))

    def _serve(self, key, n: int, ev: Event) -> bool:
        remaining = self.w.rows_per_step - self.taken[key]
        queue = self.queues[key]
        if remaining and len(queue) < n and len(queue) < remaining:
            return False
        rows = [queue.popleft() for _ in range(min(n, len(queue)))]
        self.taken[key] += len(rows)
        ev.succeed(rows)
        return True


class _KeyedDefault(dict):
    """A dict whose missing values are made from their key."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        value = self[key] = self.make(key)
        return value


class SimBoard:
    """The version board: the newest published weight version and the rollouts waiting for one."""

    def __init__(self, sim: Sim):
        self.sim, self.version, self._waiters = sim, 0, []
        self.published_at = {0: 0.0}

    def publish(self, version: int) -> None:
        """Weights ``version`` are staged and complete."""
        self.version = version
        self.published_at[version] = self.sim.now
        ready = [(v, ev) for v, ev in self._waiters if v <= version]
        self._waiters = [(v, ev) for v, ev in self._waiters if v > version]
        for _, ev in ready:
            ev.succeed(version)

    def wait(self, version: int) -> Event:
        """An event once a version >= ``version`` is published."""
        ev = self.sim.event()
        if self.version >= version:
            return ev.succeed(self.version)
        self._waiters.append((version, ev))
        return ev


class Pipe:
    """One simulation: the clock, devices, queue, board, the drawn lengths and the recorded spans."""

    def __init__(self, w: Workload, costs: CostModel, lengths: list[list[int]] | None = None):
        self.w, self.costs, self.sim = w, costs.in_loop(), Sim()
        tasks = {t: TASK_FIELDS[t] for t in ("rollout", "reward", "advantage")}
        tasks["actor"] = TASK_FIELDS["actor+ref" if w.reference else "actor"]
        if w.reference:
            tasks["reference"] = TASK_FIELDS["reference"]
        self.lengths = lengths or draw_lengths(w)
        self.tq = SimQueue(self.sim, w, tasks, length=lambda step, row: self.lengths[step][row])
        self.board = SimBoard(self.sim)
        self.served = [0] * w.rollout_instances  # the version each rollout instance serves
        self.timeline = Timeline(clock=lambda: self.sim.now)
        self.devices: dict[str, Device] = {}
        self.pool: Pool | None = None  # the floating work of the async CPU placement (``device``)
        self.step_end: list[float] = []
        self.lags: list[list[int]] = []
        for step in range(w.steps):
            self.tq.put(step, "prompt", list(range(w.rows_per_step)))
        # The fields a row is put with (response, reward, advantage, ref): what the tasks read, but the prompt.
        self.row_fields = len({f for fields in tasks.values() for f in fields} - {"prompt"})
        if w.placement == "cpu" and w.mode != "sync" and costs.service.async_floating_row_s > 0:
            self.tq.on_put = self._floating_rows

    def _floating_rows(self, field: str, rows: int) -> None:
        """The floating processes' work for ``rows`` rows that got ``field`` (``ServiceCosts.async_floating_row_s``
        per row, spread over the fields a row is put with), served by whichever pinned core is idle (``Pool``)."""
        if field == "prompt":
            return
        self.device("rollout")  # creates the pinned cores and their pool
        self.pool.add(self.costs.service.async_floating_row_s * rows / self.row_fields)

    def device(self, task: str, instance: int = 0) -> Device:
        """The device ``task`` runs on (``Workload.placement``); tasks that share one split its speed."""
        w = self.w
        if task in ("reward", "advantage"):
            name = f"cpu-{task}"  # light tasks: a host core each, never the bottleneck
        elif w.placement == "cpu":
            if w.mode == "sync":
                name = "cores"  # colocated: every worker takes its turn on all cores
            else:  # workflow.placement: rollout and the reference on core 0, the actor on the others
                name = "core0" if task in ("rollout", "reference") else "core1+"
        else:
            name = f"rollout{instance}" if task == "rollout" else "trainer"
        if name not in self.devices:
            self.devices[name] = Device(self.sim, name)
            if name in ("core0", "core1+"):  # the processes that float over both (ServiceCosts.async_floating)
                pinned = [self.devices.setdefault(n, Device(self.sim, n)) for n in ("core0", "core1+")]
                self.pool = Pool(self.sim, pinned)
                for device in pinned:
                    device.spill = self.costs.service.async_floating
        return self.devices[name]

    def work(self, device: Device, seconds: float, overhead_s: float):
        """``seconds`` of engine work on ``device``, then the service's overhead of the call (``ServiceCosts``):
        latency that does not occupy the device."""
        yield device.run(seconds)
        if overhead_s > 0:
            yield self.sim.timeout(overhead_s)

    def span(self, group: str, name: str, worker: int, start: float, **args) -> None:
        """Record ``[start, now]`` of ``group``'s ``worker`` on the timeline."""
        self.timeline.add(group, name, start, self.sim.now, worker, args)

    def padded(self, step: int, rows: list[int]) -> int:
        """Tokens of a micro-batch of ``rows`` as the trainer pads it (``batching.fit_seq_len``; packed: the rows'
        own tokens)."""
        w = self.w
        if w.packing:
            return self.row_tokens(step, rows)
        if w.fixed_shape:
            return len(rows) * w.seq_cap
        prompts = [[0] * w.prompt_len] * len(rows)
        responses = [[0] * self.lengths[step][r] for r in rows]
        return len(rows) * fit_seq_len(prompts, responses, w.seq_cap)

    def attended(self, step: int, rows: list[int], padded: int) -> float:
        """The row length that prices a micro-batch's attention (``TrainCosts``' ``tokens x seq`` terms): its padded
        row, or packed, ``sum(len^2) / sum(len)`` (each row attends only within itself)."""
        if not self.w.packing:
            return padded / len(rows)
        own = [self.w.prompt_len + self.lengths[step][r] for r in rows]
        return sum(x * x for x in own) / sum(own)

    def row_tokens(self, step: int, rows: list[int]) -> int:
        """Tokens the rows hold themselves (prompt and response, no padding): what the TransferQueue moves and
        what a service packs row by row."""
        return sum(self.w.prompt_len + self.lengths[step][r] for r in rows)


# ------------------------------------------------------------------------------------------ tasks
def rollout_step(pipe: Pipe, instance: int, step: int):
    """One step of rollout on ``instance`` (sync mode): the rollout model over that step alone."""
    yield from ROLLOUT_MODELS.resolve(pipe.w.rollout_model)(pipe, instance, range(step, step + 1))


def reward_step(pipe: Pipe, step: int):
    """Rewards of each ``score_chunk`` of responses."""
    q, light = pipe.costs.queue, pipe.costs.light
    while rows := (yield pipe.tq.take(step, "reward", pipe.w.score_chunk)):
        start = pipe.sim.now
        tokens = sum(pipe.lengths[step][r] for r in rows) + len(rows) * pipe.w.prompt_len
        yield pipe.device("reward").run(q.request(tokens * 8) + q.request(len(rows) * 4)
                                        + light.reward_per_row_s * len(rows))
        pipe.tq.put(step, "reward", rows)
        pipe.span("reward", "score", 0, start, rows=len(rows))


class _Replicas:
    """The work of ``n`` data-parallel replicas that run side by side and meet only at the end (the actor's
    gradient all-reduce, or nothing: the reference): each call adds one piece of work per replica, and the
    device is charged what the slowest replica's running total grew by, so a pass costs the slowest replica's
    sum, not the sum of each call's slowest piece (which charged every long row as if all replicas waited for
    it: at DP 32 with one-row micro-batches of long-tailed lengths that doubled the trainer's time)."""

    def __init__(self, n: int):
        self.totals, self.charged = [0.0] * n, 0.0

    def add(self, work: list[float]) -> float:
        """Seconds to charge for ``work`` (one piece per replica, in replica order; fewer at a step's end)."""
        for replica, seconds in enumerate(work):
            self.totals[replica] += seconds
        lead = max(self.totals)
        grown, self.charged = lead - self.charged, lead
        return grown


def _deal(w: Workload, rows: list[int], size: int) -> list[list[int]]:
    """The data-parallel replicas' shares of one request's rows (at most ``size`` each, since callers take at most
    ``size x data_parallel`` rows): dealt in turn under ``row_order = "shortest"`` (the sampler's split: the rows
    come shortest first), else in runs of ``size``."""
    if w.row_order == "shortest" and w.data_parallel > 1:
        return [part for i in range(w.data_parallel) if (part := rows[i::w.data_parallel])]
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def reference_step(pipe: Pipe, step: int):
    """Reference log-probs: each data-parallel replica takes its own ``score_chunk`` of responses (a forward
    pass over the chunk padded to its longest row); replicas run side by side (``_Replicas``)."""
    w, q, tc = pipe.w, pipe.costs.queue, pipe.costs.train
    replicas = _Replicas(w.data_parallel)
    while rows := (yield pipe.tq.take(step, "reference", w.score_chunk * w.data_parallel)):
        start = pipe.sim.now
        chunks = _deal(w, rows, w.score_chunk)
        padded = [pipe.padded(step, c) for c in chunks]
        work = replicas.add([tc.reference_s(p, pipe.attended(step, c, p)) for p, c in zip(padded, chunks)])
        own = max(pipe.row_tokens(step, c) for c in chunks)  # the replicas' calls run side by side
        resp = max(sum(pipe.lengths[step][r] for r in c) for c in chunks)
        service = pipe.costs.service
        yield from pipe.work(pipe.device("reference"), work + q.request(own * 8) + q.request(resp * 4),
                             service.reference_call_s + service.reference_token_s * own)
        pipe.tq.put(step, "ref", rows)
        pipe.span("reference", "ref_logprobs", 0, start, rows=len(rows), tokens=max(padded), row_tokens=own,
                  engine_s=work)


def advantage_step(pipe: Pipe, step: int):
    """Advantages of whole GRPO groups."""
    w, q = pipe.w, pipe.costs.queue
    while rows := (yield pipe.tq.take(step, "advantage", w.score_chunk)):
        start = pipe.sim.now
        yield pipe.device("advantage").run(q.request(len(rows) * 4) * 2 + pipe.costs.light.advantage_per_row_s
                                           * len(rows))
        pipe.tq.put(step, "advantage", rows)
        pipe.span("advantage", "advantages", 0, start, rows=len(rows))


def actor_step(pipe: Pipe, step: int, version: int):
    """Streamed first pass, the other PPO epochs, the optimizer step, then staging version + 1."""
    w, tc, q, service = pipe.w, pipe.costs.train, pipe.costs.queue, pipe.costs.service
    first_tokens, first_own, lags, start, engine_s = 0, 0, [], pipe.sim.now, 0.0
    device, replicas, mbs = pipe.device("actor"), _Replicas(w.data_parallel), w.micro_batch_size
    taken = 0
    while taken < w.rows_per_step:  # packed, the last request may be short: DP need not divide the step's rows
        rows = yield pipe.tq.take(step, "actor", min(mbs * w.data_parallel, w.rows_per_step - taken))
        if not rows:
            break
        taken += len(rows)
        lags += [version - pipe.tq.versions[step][r] for r in rows]
        # Replicas run side by side on distinct rows (one micro-batch each here) and meet at the all-reduce.
        parts = _deal(w, rows, mbs)
        padded = [pipe.padded(step, part) for part in parts]
        work = replicas.add([tc.micro_s(tokens, pipe.attended(step, part, tokens))
                             for tokens, part in zip(padded, parts)])
        own = max(pipe.row_tokens(step, part) for part in parts)
        first_tokens, first_own, engine_s = first_tokens + max(padded), first_own + own, engine_s + work
        # The engine computes on the padded micro-batch (``work``); the service moves and packs the rows' own
        # tokens, so its overhead is charged on those.
        yield from pipe.work(device, work + q.request(own * 24), service.train_micro_s + service.train_token_s * own)
    # The other epochs re-read each replica's cached micro-batches: the slowest replica's pass again.
    per_pass = max(replicas.totals)
    rest = per_pass * (w.ppo_epochs - 1) + tc.optimizer_s * w.ppo_epochs
    yield device.run(rest)
    pipe.span("actor", "train", 0, start, step=step, tokens=first_tokens, row_tokens=first_own,
              engine_s=engine_s + rest)
    start, ws = pipe.sim.now, pipe.costs.weight_sync
    yield device.run(ws.stage_fixed_s + ws.stage_per_byte_s * pipe.costs.weight_bytes)
    pipe.span("actor", "stage_weights", 0, start, version=version + 1)
    pipe.lags.append(lags)
    pipe.step_end.append(pipe.sim.now)
    pipe.board.publish(version + 1)


def _loop(step_fn, steps: int, *args):
    for step in range(steps):
        yield from step_fn(*args, step)


def _actor_loop(pipe: Pipe):
    for step in range(pipe.w.steps):
        yield from actor_step(pipe, step, step)


def _sync_driver(pipe: Pipe):
    """Lock-step: every task (all its instances at once) finishes the step before the next starts."""
    sim, w = pipe.sim, pipe.w
    for step in range(w.steps):
        yield sim.all_of([sim.process(rollout_step(pipe, i, step)) for i in range(w.rollout_instances)])
        yield sim.process(reward_step(pipe, step))
        if w.reference:
            yield sim.process(reference_step(pipe, step))
        yield sim.process(advantage_step(pipe, step))
        yield sim.process(actor_step(pipe, step, step))
        if pipe.costs.service.sync_handoff_s > 0:
            yield sim.timeout(pipe.costs.service.sync_handoff_s)


def simulate(w: Workload, costs: CostModel, lengths: list[list[int]] | None = None) -> SimResult:
    """Run the pipeline of ``w`` on ``costs``; ``lengths`` replaces the drawn response lengths."""
    if w.mode in ("stream", "colocated"):
        return stream.simulate_stream(w, costs) if w.mode == "stream" else stream.colocated(w, costs, lengths)
    if not w.packing and w.rows_per_step % (w.micro_batch_size * w.data_parallel):
        raise ValueError(f"rows per step {w.rows_per_step} must be a multiple of micro_batch_size x data_parallel "
                         "(or the trainer packs)")
    pipe = Pipe(w, costs, lengths)
    sim = pipe.sim
    if w.mode == "sync":
        sim.process(_sync_driver(pipe))
    else:
        model = ROLLOUT_MODELS.resolve(w.rollout_model)
        for i in range(w.rollout_instances):  # every step, admitted under the staleness bound
            sim.process(model(pipe, i, range(w.steps)))
        sim.process(_loop(reward_step, w.steps, pipe))
        if w.reference:
            sim.process(_loop(reference_step, w.steps, pipe))
        sim.process(_loop(advantage_step, w.steps, pipe))
        sim.process(_actor_loop(pipe))
    sim.run()
    if len(pipe.step_end) != w.steps:
        raise RuntimeError(f"simulation stalled after {len(pipe.step_end)} of {w.steps} steps (a deadlock in "
                           f"the workload's settings)")
    ends = pipe.step_end
    first = min(w.warmup_steps, w.steps - 1)
    t0 = ends[first - 1] if first > 0 else 0.0
    steady = (ends[-1] - t0) / (w.steps - first)
    tl = pipe.timeline
    return SimResult(w, ends, w.rows_per_step / steady if steady > 0 else float("inf"), steady,
                     tl.idle_fractions() if len(tl) else {}, pipe.lags, tl,
                     {name: device.busy for name, device in pipe.devices.items()})

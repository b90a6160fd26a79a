"""The sample stream and the colocated baseline, at cluster scale (``Workload.mode`` ``stream`` / ``colocated``).

    prompt stream ─► rollout engines (continuous batching; ``partial``: newer weights under running responses)
                         │ a group is complete when its last sample finishes; its version is its oldest token's
                         ▼
                   completed groups, in finishing order ──► trainer step s: the first B groups of version >= s - k
                         ▲                                    (an older one is dropped and its prompt generated again)
                         └──── admission: at most ``stream_ahead`` steps' worth of groups admitted and not trained

- ``simulate_stream``: rollout instances and the trainer run side by side on their own devices. Each trainer step
  takes its groups mini-batch by mini-batch as they complete (each mini-batch: forward and backward over packed
  rows balanced over the DP replicas, the pipeline bubble, the gradient all-reduce and the optimizer step),
  then stages version s + 1; rollout applies it at once (``partial``, re-prefilling the running responses when
  ``partial_kv`` is ``recompute``) or once its engine is empty (``continuous``, admitting nothing meanwhile).
- ``colocated``: every device generates the step's rows (dealt evenly over the engines, each engine batching
  continuously), then pays ``CostModel.switch`` (offload, sleep and wake, weight reload), then every device
  trains (old log-probs, reference, mini-batches).

Training always packs rows (``trainer_s``): micro-batches are filled to ``TOKEN_BUDGET_ROWS`` max-length rows.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque

from asyncflow.observability.timeline import Timeline
from asyncflow.simulator.costs import CostModel
from asyncflow.simulator.events import Device, Sim
from asyncflow.simulator.result import SimResult
from asyncflow.simulator.rollout_models import CHECK_STEPS, Engine, engine_batch
from asyncflow.simulator.workload import Workload, draw_lengths

TOKEN_BUDGET_ROWS = 2
"""A packed micro-batch's token budget, in rows of ``prompt_len + max_new_tokens`` (verl's fully-async scripts set
``ppo_max_token_len_per_gpu`` to twice the longest row)."""


def balance(rows: list[int], replicas: int) -> list[list[int]]:
    """Rows (token counts) dealt to ``replicas`` data-parallel replicas, longest first to the least loaded (the
    packed trainer's token-balanced split)."""
    heap = [(0, r) for r in range(replicas)]
    out: list[list[int]] = [[] for _ in range(replicas)]
    for row in sorted(rows, reverse=True):
        load, r = heapq.heappop(heap)
        out[r].append(row)
        heapq.heappush(heap, (load + row, r))
    return out


def _pass_s(w: Workload, parts: list[list[int]], per_micro: float, per_token: float, per_seq: float) -> float:
    """One pass over packed rows on every replica side by side: the slowest replica's micro-batches, stretched by
    the pipeline bubble ``(PP - 1) / micro-batches``."""
    budget, worst = TOKEN_BUDGET_ROWS * w.seq_cap, 0.0
    for rows in parts:
        if not rows:
            continue
        tokens = sum(rows)
        micro = max(1, math.ceil(tokens / budget))
        seconds = per_micro * micro + per_token * tokens + per_seq * sum(x * x for x in rows)
        worst = max(worst, seconds * (1 + (w.pipeline_parallel - 1) / micro))
    return worst


def forward_s(w: Workload, costs: CostModel, lengths: list[int]) -> float:
    """One forward-only pass (reference or old log-probs) over responses of ``lengths``, packed and balanced."""
    tc = costs.train
    parts = balance([w.prompt_len + n for n in lengths], w.data_parallel)
    return _pass_s(w, parts, tc.ref_per_call_s, tc.ref_per_token_s, tc.ref_per_token_seq_s)


def trainer_s(w: Workload, costs: CostModel, lengths: list[int]) -> float:
    """One mini-batch: ``ppo_epochs`` forward and backward passes, each with its gradient all-reduce over the DP
    replicas and its optimizer step; the reference forward first when ``w.reference``."""
    tc = costs.train
    parts = balance([w.prompt_len + n for n in lengths], w.data_parallel)
    train = _pass_s(w, parts, tc.per_micro_s, tc.per_token_s, tc.per_token_seq_s)
    ref = forward_s(w, costs, lengths) if w.reference else 0.0
    return ref + w.ppo_epochs * (train + tc.allreduce_s(w.data_parallel) + tc.optimizer_s)


def _stage_s(costs: CostModel) -> float:
    ws = costs.weight_sync
    return ws.stage_fixed_s + ws.stage_per_byte_s * costs.weight_bytes


def _result(w: Workload, ends: list[float], lags: list[list[int]], tl: Timeline, busy: dict[str, float],
            dropped: int = 0) -> SimResult:
    first = min(w.warmup_steps, w.steps - 1)
    t0 = ends[first - 1] if first > 0 else 0.0
    steady = (ends[-1] - t0) / (w.steps - first)
    span = ends[-1] or 1.0
    rollout = [v for k, v in busy.items() if k.startswith("rollout")]
    idle = {"rollout": 1 - sum(rollout) / len(rollout) / span, "actor": 1 - busy.get("trainer", 0.0) / span}
    return SimResult(w, ends, w.rows_per_step / steady if steady > 0 else float("inf"), steady, idle, lags, tl,
                     busy, dropped)


def colocated(w: Workload, costs: CostModel, lengths: list[list[int]] | None = None) -> SimResult:
    """The colocated baseline: per step, every engine generates its even share of the rows (``rollout_instances``
    engines over all devices), the devices switch (``CostModel.switch``), then train on ``data_parallel`` replicas
    (old log-probs when ``w.old_logprob``, then ``mini_batches`` mini-batches)."""
    lengths = lengths or draw_lengths(w)
    tl, t, ends, lags = Timeline(clock=lambda: 0.0), 0.0, [], []
    busy = {"rollout": 0.0, "trainer": 0.0}
    per_mini = w.rows_per_step // w.mini_batches
    for step in range(w.steps):
        rows = lengths[step]
        # Dealt evenly over every engine (verl splits the batch over its rollout DP ranks), not max_num_seqs each.
        shares = [rows[i::w.rollout_instances] for i in range(w.rollout_instances)]
        gen = max(sum(s for s, _ in engine_batch(share, w.prompt_len, costs.rollout, w.max_num_seqs))
                  for share in shares if share)
        tl.add("rollout", "generate", t, t + gen, 0, {"step": step})
        switch = costs.switch.step_s(w.data_parallel * w.devices_per_replica)
        # The trainer's offload apart from the engine's sleep, wake and reload (verl times the first inside
        # update_actor, the others inside gen).
        offload = costs.switch.offload_step_s(w.data_parallel * w.devices_per_replica)
        tl.add("actor", "offload", t + gen, t + gen + offload, 0, {"step": step})
        tl.add("actor", "switch", t + gen + offload, t + gen + switch, 0, {"step": step})
        start = t + gen + switch
        old = forward_s(w, costs, rows) if w.old_logprob else 0.0
        if old:
            tl.add("actor", "old_logprob", start, start + old, 0, {"step": step})
        train = sum(trainer_s(w, costs, rows[i:i + per_mini]) for i in range(0, len(rows), per_mini))
        train += _stage_s(costs)
        tl.add("actor", "train", start + old, start + old + train, 0, {"step": step})
        train += old
        t += gen + switch + train
        busy["rollout"] += gen
        busy["trainer"] += train
        ends.append(t)
        lags.append([0] * len(rows))
    return _result(w, ends, lags, tl, busy)


@dataclasses.dataclass
class _Group:
    prompt: int
    """The prompt's id (a dropped group's prompt is generated again under the same id)."""
    lengths: list[int]
    version: int = 0
    """The weights of its oldest token."""
    left: int = 0
    """Samples still generating."""


class _Stream:
    """One sample-stream simulation: the prompt stream, rollout instances, the completed groups and the trainer."""

    def __init__(self, w: Workload, costs: CostModel):
        self.w, self.costs, self.sim = w, costs, Sim()
        self.fresh: deque[list[int]] = deque()
        self.draws = 0  # batches of lengths drawn so far (each with a seed of its own)
        self.prompts, self.retry = 0, deque()
        self.done: deque[_Group] = deque()
        self.version, self.outstanding, self.running, self.dropped = 0, 0, True, 0
        self.ahead = (w.stream_ahead or w.max_staleness + 1) * w.prompts_per_step
        self.waiters: list = []
        self.ends: list[float] = []
        self.lags: list[list[int]] = []
        self.trained: list[int] = []
        self.trained_lengths: list[int] = []
        self.timeline = Timeline(clock=lambda: self.sim.now)
        self.devices: dict[str, Device] = {}

    def notify(self) -> None:
        """Wake every process waiting for a change (a group done or trained, a version published)."""
        waiters, self.waiters = self.waiters, []
        for ev in waiters:
            ev.succeed()

    def changed(self):
        ev = self.sim.event()
        self.waiters.append(ev)
        return ev

    def draw(self) -> list[int]:
        """The next group's response lengths (drawn in batches of ``2 x steps + 4`` steps' worth as needed)."""
        if not self.fresh:
            w = self.w
            batch = dataclasses.replace(w, steps=2 * w.steps + 4, seed=w.seed + 7919 * self.draws)
            flat = [n for step in draw_lengths(batch) for n in step]
            g = w.samples_per_prompt
            self.fresh.extend(flat[i:i + g] for i in range(0, len(flat) - g + 1, g))
            self.draws += 1
        return self.fresh.popleft()

    def next_group(self, version: int) -> _Group:
        if self.retry:
            group = self.retry.popleft()
            if self.w.regenerated == "redraw":  # a new sample of the policy for the same prompt
                group.lengths = self.draw()
        else:
            group, self.prompts = _Group(self.prompts, self.draw()), self.prompts + 1
        group.version, group.left = version, len(group.lengths)
        self.outstanding += 1
        return group

    def rollout(self, instance: int):
        w, costs, sim = self.w, self.costs, self.sim
        device = self.devices[f"rollout{instance}"] = Device(sim, f"rollout{instance}")
        engine, served, partial = Engine(costs.rollout, w.prompt_len, w.max_num_seqs), 0, w.rollout_model == "partial"
        groups: dict[int, _Group] = {}
        while self.running:
            if self.version > served and (partial or not len(engine)):
                start, ws = sim.now, costs.weight_sync
                recompute = engine.recompute_s() if partial and w.partial_kv == "recompute" else 0.0
                served = self.version
                yield device.run(ws.apply_fixed_s + ws.apply_per_byte_s * costs.apply_bytes + recompute)
                self.timeline.add("rollout", "load_weights", start, sim.now, instance, {"version": served})
            if not (self.version > served and not partial):  # continuous: drain before the swap
                while engine.free > 0 and self.outstanding < self.ahead:
                    group = self.next_group(served)
                    groups[group.prompt] = group
                    for j, n in enumerate(group.lengths):
                        engine.add((group.prompt, j), n)
            if not len(engine):
                if self.version > served:
                    continue  # published during the swap: apply it before admitting (continuous) or waiting
                yield self.changed()
                continue
            seconds, finished = engine.segment(CHECK_STEPS if partial else None)
            yield device.run(seconds)
            for prompt, _ in finished:
                group = groups[prompt]
                group.left -= 1
                if not group.left:
                    del groups[prompt]
                    self.done.append(group)
            if finished:
                self.notify()

    def trainer(self):
        w, sim, k = self.w, self.sim, self.w.max_staleness
        device = self.devices["trainer"] = Device(sim, "trainer")
        per_mini = w.prompts_per_step // w.mini_batches
        for step in range(w.steps):
            lags = []
            for _ in range(w.mini_batches):
                take: list[_Group] = []
                while len(take) < per_mini:
                    while self.done and len(take) < per_mini:
                        group = self.done.popleft()
                        if group.version < step - k:  # out of the bound: never trained, its prompt goes back
                            self.dropped += 1
                            self.outstanding -= 1
                            self.retry.append(group)
                            self.notify()  # a free admission slot: an idle engine may take the prompt again
                        else:
                            take.append(group)
                    if len(take) < per_mini:
                        start = sim.now
                        yield self.changed()
                        self.timeline.add("actor", "wait_samples", start, sim.now, 0, {"step": step})
                self.outstanding -= len(take)
                self.notify()
                self.trained += [g.prompt for g in take]
                self.trained_lengths += [n for g in take for n in g.lengths]
                lags += [step - g.version for g in take for _ in g.lengths]
                start = sim.now
                yield device.run(trainer_s(w, self.costs, [n for g in take for n in g.lengths]))
                self.timeline.add("actor", "train", start, sim.now, 0, {"step": step})
            yield device.run(_stage_s(self.costs))
            self.version = step + 1
            self.lags.append(lags)
            self.ends.append(sim.now)
            self.notify()
        self.running = False
        self.notify()


def simulate_stream(w: Workload, costs: CostModel) -> SimResult:
    """The sample stream of ``w`` on ``costs`` (module docstring); ``SimResult.dropped`` counts the groups that fell
    out of the staleness bound."""
    stream = _Stream(w, costs.in_loop())
    for i in range(w.rollout_instances):
        stream.sim.process(stream.rollout(i))
    stream.sim.process(stream.trainer())
    stream.sim.run()
    if len(stream.ends) != w.steps:
        raise RuntimeError(f"stream simulation stalled after {len(stream.ends)} of {w.steps} steps")
    result = _result(w, stream.ends, stream.lags, stream.timeline,
                     {name: d.busy for name, d in stream.devices.items()}, stream.dropped)
    return dataclasses.replace(result, trained=stream.trained, trained_lengths=stream.trained_lengths)

"""Service calibration on the CPU machine: what the loop's services cost beyond their engine calls.

Used by ``bench/simulator.py`` (the CPU accuracy benchmark); the simulator itself (``asyncflow.simulator``) only
reads the ``ServiceCosts`` this writes into a cost file. A profile without calibration is the engine-only model.

``asyncflow profile`` times engine calls in isolation (vLLM ``generate``, Megatron ``train_step`` and
``compute_logprobs``). The loop's services also move rows through the TransferQueue, pack and slice tensors, run
per-row Python and, in sync mode, wait for the driver's Ray calls between phases; an engine-only model
under-predicts the real spans.

``calibration_run`` runs the loop for real, in sync mode (every phase alone on the machine, so a span is that
task's own time), on one of two *calibration workloads* that none of the benchmark's held-out cases use
(long-tailed lengths clipped at 48 or at 12 tokens); ``calibrate`` subtracts the simulator's engine-only
prediction of the same workload from each task's median span per step, and ``service_costs`` turns what is left
into overheads per generated token (rollout), per call and per token of the rows themselves (the reference, the
actor: least squares over the two workloads) and the sync hand-off time.

Async runs on CPU pin rollout (with the reference) to one core and the actor to the other, while the
TransferQueue, the version board, the driver, the light services and Ray's daemons float over both cores. An
async run of the same workload measures what that costs: a ``CpuSampler`` reads the CPU time of every process
from the OS, ``floating_row_s`` divides the floating ones' by the rows trained
(``ServiceCosts.async_floating_row_s``), and ``fit_async_floating`` finds what else async adds per second of
pinned work (``ServiceCosts.async_floating``) at which the simulator reproduces that run's step time.

``Calibration`` collects these runs as they run (in the rounds of ``calibration_order``) and sets each variant's
``ServiceCosts`` from them; ``engine_speed_line`` reports how fast the engines ran in the loop against the profile.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from asyncflow.simulator.costs import CostModel, ServiceCosts, fit

CALIBRATION_OVERRIDES = [
    "workflow.task=add1_longtail", "workflow.prompts_per_step=16", "workflow.samples_per_prompt=8",
    "workflow.rollout_chunk=128", "workflow.score_chunk=32", "trainer.micro_batch_size=32", "workflow.mode=sync",
    "workflow.max_staleness=0", "rollout.max_new_tokens=48", "rollout.max_model_len=64",
]
"""The calibration workload: long-tailed lengths clipped at 48 tokens (the benchmark's held-out cases clip at
128, or answer the add-one task in 4), sync mode; ``workflow.sync_worker_threads`` is set per variant."""
SHORT_OVERRIDES = ["rollout.max_new_tokens=12", "rollout.max_model_len=32"]
"""The second calibration workload (every other sync calibration run): the same long-tailed budgets clipped at
12 tokens. Rows about 3x shorter than the first workload's tell a service's overhead per call from its
overhead per token (``service_costs``)."""
ASYNC_OVERRIDES = ["workflow.mode=async", "workflow.max_staleness=1"]
"""The async calibration run: the same workload, async at staleness 1 (one thread per pinned worker)."""
CALIBRATION_STEPS = 10
"""Steps of a sync calibration run; the first ``WARMUP`` are left out (fewer steps make the per-call overheads
swing between runs)."""
ASYNC_CALIBRATION_STEPS = 20
"""Steps of the async calibration run: its steps vary from one to the next (which task waits for which changes),
and its mean step time, not a median, is what ``fit_async_floating`` matches."""
WARMUP = 2
QUICK_STEPS = {"sync": WARMUP + 3, "async": 10}
"""Steps of short calibration runs (a first look, and the tests): fits that vary more between runs."""
TASK_SPANS = {"generate": "generate_token_s", "ref_logprobs": "reference_call_s", "train": "train_micro_s"}
"""Span name -> the ``ServiceCosts`` field of its per-call overhead."""
TOKEN_FIELDS = {"ref_logprobs": "reference_token_s", "train": "train_token_s"}
"""Span name -> the ``ServiceCosts`` field of its per-token overhead (fitted with two workloads)."""


def real_spans(timeline: Path, warmup: int = WARMUP, median: bool = False,
               engine: bool = False) -> tuple[dict[str, float], float]:
    """Mean seconds per step of each span name and the mean step time of a run's ``timeline.json``, over the
    steps after ``warmup`` (a step ends when its weights are staged). ``median``: the median over those steps
    instead (a sync run's steps are alike, so one slowed by another job on the shared machine is left out).
    ``engine``: the spans' engine seconds (their ``engine_s``) instead of their lengths, for the span names
    that record them."""
    events = json.loads(Path(timeline).read_text())["traceEvents"]
    events = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    ends = [e["ts"] + e["dur"] for e in events if e["name"] == "stage_weights"]
    # The first stage_weights is version 0's, before step 0; step s ends at ends[s + 1].
    if len(ends) < warmup + 3:
        raise ValueError(f"{timeline}: {len(ends) - 1} steps, need at least {warmup + 2}")
    bounds = ends[warmup:]
    steps = len(bounds) - 1
    per_step: dict[str, list[float]] = defaultdict(lambda: [0.0] * steps)
    for e in events:
        i = bisect.bisect_right(bounds, e["ts"]) - 1
        if 0 <= i < steps and (not engine or "engine_s" in e.get("args", {})):
            per_step[e["name"]][i] += e["args"]["engine_s"] if engine else e["dur"] / 1e6
    durations = [(b - a) / 1e6 for a, b in zip(bounds, bounds[1:])]
    stat = statistics.median if median else statistics.fmean
    return {name: stat(values) for name, values in per_step.items()}, stat(durations)


def predicted_spans(result, engine: bool = False) -> dict[str, float]:
    """Mean seconds per step of each span name of a ``SimResult`` (``engine``: of their engine seconds, as
    ``real_spans``)."""
    return result.spans_per_step(engine)


@dataclasses.dataclass
class Overheads:
    """What one sync calibration run shows beyond the engine-only model, per step."""

    beyond: dict[str, float]
    """Span name -> seconds per step of the real span beyond the engine-only prediction (never below 0: the
    engine calls are part of the spans)."""
    calls: dict[str, float]
    """Span name -> calls per step (``calls_per_step``)."""
    tokens: dict[str, float]
    """Span name -> tokens per step of the rows of its calls, unpadded (reference chunks, first-pass
    micro-batches; ``predicted_tokens``)."""
    handoff: float
    """Seconds of a step outside every span (the sync driver's hand-offs)."""
    step_s: float = 0.0
    """The run's median step time."""
    workload: int = 0
    """Which calibration workload ran (``overrides_for``)."""
    excess: dict[str, float] = dataclasses.field(default_factory=dict)
    """Span name -> seconds per step of the real span beyond the engine-only prediction, not clamped."""
    engine: dict[str, float] = dataclasses.field(default_factory=dict)
    """Span name -> seconds per step of the engine's own time in the real spans (their ``engine_s``; only the
    tasks that record it)."""
    engine_predicted: dict[str, float] = dataclasses.field(default_factory=dict)
    """Span name -> the profile's engine seconds per step for the same calls (the simulated spans' ``engine_s``)."""


def overheads(real: dict[str, float], real_step: float, predicted: dict[str, float], calls: dict[str, float],
              tokens: dict[str, float] | None = None, workload: int = 0, engine: dict[str, float] | None = None,
              engine_predicted: dict[str, float] | None = None) -> Overheads:
    """The ``Overheads`` of a run whose mean spans per step are ``real`` against the engine-only ``predicted``
    (``engine`` and ``engine_predicted``: the engines' own seconds in each, where the spans record them)."""
    excess = {name: real.get(name, 0.0) - predicted.get(name, 0.0) for name in TASK_SPANS}
    beyond = {name: max(value, 0.0) for name, value in excess.items()}
    return Overheads(beyond, calls, tokens or {}, max(real_step - sum(real.values()), 0.0), real_step, workload,
                     excess, dict(engine or {}), dict(engine_predicted or {}))


SCALE_FIELDS = {"generate": "rollout_engine_scale", "ref_logprobs": "reference_engine_scale",
                "train": "train_engine_scale"}
"""Span name -> the ``ServiceCosts`` field of its engine's speed in the loop against the profile."""


def engine_scales(runs: list[Overheads]) -> dict[str, float]:
    """Span name -> the engine's seconds in the real spans over the profile's for the same calls, the median over
    the runs that record both (``ServiceCosts.rollout_engine_scale`` and the like): the median, since one run
    slowed by another job on the shared machine is as likely as one that was not."""
    scales = {}
    for name in SCALE_FIELDS:
        ratios = [r.engine[name] / r.engine_predicted[name] for r in runs
                  if r.engine.get(name, 0.0) > 0 and r.engine_predicted.get(name, 0.0) > 0]
        if ratios:
            scales[name] = statistics.median(ratios)
    return scales


def rescaled(run: Overheads, scales: dict[str, float]) -> Overheads:
    """``run`` with its spans beyond the engine as they are once the profile's engine time is multiplied by
    ``scales`` (span name -> factor): the excess less the engine time the scale adds, clamped at 0."""
    if not scales or not run.excess:
        return run
    excess = {name: value - (scales.get(name, 1.0) - 1.0) * run.engine_predicted.get(name, 0.0)
              for name, value in run.excess.items()}
    return dataclasses.replace(run, excess=excess, beyond={name: max(v, 0.0) for name, v in excess.items()})


def fastest(runs: list, key=lambda run: (run.workload, run.step_s)) -> list:
    """Of several calibration runs of one workload, the one with the shortest step (``key``: ``(workload, step
    seconds)`` of a run); one run per workload, in the order the workloads first ran. On a shared machine the
    fastest run is the one least disturbed (best-of-N); predictions from it lean a few percent optimistic."""
    best: dict = {}
    for run in runs:
        workload, seconds = key(run)
        if workload not in best or seconds < key(best[workload])[1]:
            best[workload] = run
    return list(best.values())


def service_costs(runs: list[Overheads]) -> ServiceCosts:
    """``ServiceCosts`` from one or more calibration runs: each engine's speed in the loop against the profile
    (``engine_scales``), and, beyond the engine time so rescaled, rollout's overhead per generated token; the
    reference's and the actor's per call and per token of the rows, by non-negative least squares over the runs
    when their calls differ in tokens (two workloads), else per call only; the mean sync hand-off."""
    scales = engine_scales(runs)
    runs = [rescaled(r, scales) for r in runs]
    fields = {"sync_handoff_s": statistics.fmean(r.handoff for r in runs)}
    fields.update({SCALE_FIELDS[name]: scale for name, scale in scales.items()})
    gen = [r for r in runs if r.calls.get("generate")]
    if gen:
        fields["generate_token_s"] = sum(r.beyond["generate"] for r in gen) / sum(r.calls["generate"] for r in gen)
    for name, token_field in TOKEN_FIELDS.items():
        obs = [r for r in runs if r.calls.get(name)]
        if not obs:
            continue
        if len({round(r.tokens.get(name, 0.0) / r.calls[name], 3) for r in obs}) > 1:
            per_call, per_token = fit([[r.calls[name], r.tokens[name]] for r in obs], [r.beyond[name] for r in obs],
                                      relative=False)
        else:
            per_call, per_token = statistics.fmean(r.beyond[name] / r.calls[name] for r in obs), 0.0
        fields[TASK_SPANS[name]], fields[token_field] = per_call, per_token
    return ServiceCosts(**fields)


def predicted_tokens(result) -> dict[str, float]:
    """Tokens per step of the rows of the reference's and the actor's first-pass calls in a ``SimResult``, without
    their padding: the engine computes on the padding (the profile prices that), the service moves and packs
    the rows' own tokens (a charge per padded token over-charges long-tailed rows, padded far more than the
    calibration workloads')."""
    sums: dict[str, float] = defaultdict(float)
    steps = len(result.step_end_s)
    for e in result.timeline.to_chrome_trace()["traceEvents"]:
        if e.get("ph") == "X" and e["name"] in TOKEN_FIELDS:
            sums[e["name"]] += e.get("args", {}).get("row_tokens", 0) / steps
    return dict(sums)


def calls_per_step(w, lengths: list[list[int]]) -> dict[str, float]:
    """Calls per step of each task of ``w`` (a ``Workload``) whose steps generate ``lengths`` (tokens per row):
    rollout's generated tokens, reference chunks, micro-batches of the actor's first pass."""
    rows = w.rows_per_step
    return {"generate": sum(map(sum, lengths)) / len(lengths),
            "ref_logprobs": math.ceil(rows / (w.score_chunk * w.data_parallel)),
            "train": rows / (w.micro_batch_size * w.data_parallel)}


def overrides_for(threads: int, mode: str = "sync", workload: int = 0) -> list[str]:
    """The config overrides of calibration workload ``workload`` (0: the first, 1: ``SHORT_OVERRIDES``) at
    ``threads`` torch threads per worker (``mode`` ``async``: the async run, whose workers always run one
    thread on their pinned core)."""
    base = CALIBRATION_OVERRIDES + (SHORT_OVERRIDES if workload % 2 else [])
    if mode == "async":
        return base + ASYNC_OVERRIDES
    return base + [f"workflow.sync_worker_threads={threads}"]


class CpuSampler:
    """The CPU time of a process tree, sampled every ``interval`` seconds by a thread (psutil): per sample, each
    process's user + system seconds and whether it is pinned to a subset of the cores the tree's root may use
    (the async placement's rollout, reference and actor workers) or floats over all of them. Sampling a run's
    20-odd processes costs the sampling process about 1.5% of a core at 0.2 s, 0.6% at the default 0.5 s."""

    def __init__(self, pid: int, interval: float = 0.5):
        import threading

        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, dict[int, tuple[float, bool]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import psutil

        cores = None  # the cores the run may use (a container may allow fewer than the machine has)
        while not self._stop.is_set():
            procs: dict[int, tuple[float, bool]] = {}
            try:
                root = psutil.Process(self.pid)
                cores = cores or set(root.cpu_affinity())
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for proc in tree:
                try:
                    with proc.oneshot():
                        times = proc.cpu_times()
                        procs[proc.pid] = (times.user + times.system, set(proc.cpu_affinity()) < cores)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            self.samples.append((time.time(), procs))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()

    def floating_seconds(self, t0: float, t1: float) -> float:
        """CPU seconds the floating processes (not pinned when last sampled) used between ``t0`` and ``t1``
        (wall-clock times; linear between samples)."""
        if len(self.samples) < 2:
            raise ValueError("fewer than two CPU samples")
        pinned = {pid: p for _, procs in self.samples for pid, (_, p) in procs.items()}  # the last status wins
        floating = [pid for pid, p in pinned.items() if not p]
        times, totals, seen = [t for t, _ in self.samples], [], {}
        for _, procs in self.samples:  # a process that has exited keeps its last CPU time
            seen.update({pid: procs[pid][0] for pid in floating if pid in procs})
            totals.append(sum(seen.values()))

        def at(t: float) -> float:
            i = min(max(bisect.bisect_left(times, t), 1), len(times) - 1)
            (ta, ya), (tb, yb) = (times[i - 1], totals[i - 1]), (times[i], totals[i])
            return ya + (yb - ya) * (t - ta) / (tb - ta) if tb > ta else yb

        return at(t1) - at(t0)


def floating_row_s(sampler: CpuSampler, run_dir: Path, rows_per_step: int, warmup: int = WARMUP) -> float:
    """The floating processes' CPU seconds per row over a finished run's steps after ``warmup``, from the end
    of step ``warmup - 1`` to the end of the last step (when their weights were staged, in ``timeline.json``)."""
    trace = json.loads((run_dir / "timeline.json").read_text())
    t0 = trace["otherData"]["start_unix_time"]
    ends = sorted(t0 + (e["ts"] + e["dur"]) / 1e6 for e in trace["traceEvents"]
                  if e.get("ph") == "X" and e["name"] == "stage_weights")
    # The first stage_weights is version 0's, before step 0; step s ends at ends[s + 1].
    steps = len(ends) - 1 - warmup
    if steps < 2:
        raise ValueError(f"{run_dir}: {len(ends) - 1} steps, need at least {warmup + 2}")
    return sampler.floating_seconds(ends[warmup], ends[-1]) / (rows_per_step * steps)


def calibration_run(recipe: Path, out: Path, model_dir: str, threads: int, steps: int | None = None,
                    mode: str = "sync", sampler: list | None = None, workload: int = 0) -> Path:
    """Run calibration workload ``workload`` for real (``asyncflow train`` in a fresh process, as a user would)
    with ``threads`` torch threads per worker, in ``mode``, for ``steps`` (default ``CALIBRATION_STEPS``, or
    ``ASYNC_CALIBRATION_STEPS`` in async); returns the run's output folder (``sampler``: a list that receives the
    run's ``CpuSampler``)."""
    steps = steps or (ASYNC_CALIBRATION_STEPS if mode == "async" else CALIBRATION_STEPS)
    run_dir = out / f"calibration-{mode}-{threads}"
    overrides = overrides_for(threads, mode, workload) + [
        f"workflow.steps={steps}", f"observability.output_dir={run_dir}", f"model.path={model_dir}",
        "observability.progress_every_s=60"]
    env = dict(os.environ)
    if threads == 1:  # vLLM's OpenMP threads follow this bind list, not torch's thread count
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "train", str(recipe), *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cpu = CpuSampler(proc.pid) if sampler is not None else None
    try:
        stdout, stderr = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    finally:
        if cpu is not None:
            cpu.stop()
            sampler.append(cpu)
    if proc.returncode:
        raise RuntimeError(f"the calibration run failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    return run_dir


def calibrate(model: CostModel, recipe: Path, run_dir: Path, threads: int, workload: int = 0) -> Overheads:
    """The ``Overheads`` of ``model`` shown by the finished sync calibration run of ``workload`` in ``run_dir``
    (``service_costs`` turns one or more into ``ServiceCosts``)."""
    from asyncflow.config import load_config
    from asyncflow.simulator.sim import simulate
    from asyncflow.simulator.workload import draw_lengths, from_config

    engine_only = dataclasses.replace(model, service=ServiceCosts())
    w = from_config(load_config(recipe, overrides_for(threads, "sync", workload) + ["workflow.steps=16"]))
    lengths = draw_lengths(w)
    real, step = real_spans(run_dir / "timeline.json", median=True)
    engine, _ = real_spans(run_dir / "timeline.json", median=True, engine=True)
    result = simulate(w, engine_only, lengths)
    return overheads(real, step, predicted_spans(result), calls_per_step(w, lengths), predicted_tokens(result),
                     workload % 2, engine, predicted_spans(result, engine=True))


FLOATING_CEILING = 4.0
"""The largest ``async_floating`` the fit tries: a run slower than the simulator reaches with it is given it."""
FLOATING_TOLERANCE = 1e-3
"""Where the bisection of ``async_floating`` stops: far below the spread of its fits between runs."""


def fit_async_floating(model: CostModel, recipe: Path, run_dir: Path, row_s: float = 0.0) -> float:
    """With the floating processes' measured ``row_s`` CPU seconds per row, the CPU seconds per second of pinned
    work of whatever else async adds (``ServiceCosts.async_floating``) at which the simulator's steady step
    time of the async calibration workload, as many steps as the real run in ``run_dir``, equals that run's
    (bisection; 0 when the model already predicts a step as slow as measured: never below 0)."""
    from asyncflow.config import load_config
    from asyncflow.simulator.sim import simulate
    from asyncflow.simulator.workload import from_config

    _, real_step = real_spans(run_dir / "timeline.json")
    events = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    steps = sum(1 for e in events if e.get("ph") == "X" and e["name"] == "stage_weights") - 1  # less version 0
    w = dataclasses.replace(from_config(load_config(recipe, overrides_for(1, "async") + [f"workflow.steps={steps}"])),
                            warmup_steps=WARMUP)

    def step_at(factor: float) -> float:
        return simulate(w, dataclasses.replace(model, service=dataclasses.replace(
            model.service, async_floating_row_s=row_s, async_floating=factor))).step_time_s

    lo, hi = 0.0, FLOATING_CEILING
    if step_at(lo) >= real_step:
        return 0.0
    slowest = step_at(hi)
    if slowest < real_step:
        # The pool serves floating work in the pinned cores' idle time and shares them only while both are busy,
        # so the simulated step stops growing once they are always busy: a run the machine slowed beyond that
        # cannot be reproduced.
        print(f"calibration: warning: the async calibration run {run_dir} took {real_step:.3f} s a step, "
              f"slower than the simulator reaches with any floating share ({slowest:.3f} s); async_floating is "
              f"set to its ceiling, {hi:g}", flush=True)
        return hi
    while hi - lo > FLOATING_TOLERANCE:  # the step time grows with the floating work
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step_at(mid) < real_step else (lo, mid)
    return (lo + hi) / 2


def async_terms(rows: list[float], floating: list[float]) -> tuple[float, float]:
    """``(async_floating_row_s, async_floating)`` of several async calibration runs: the median of each run's,
    leaving out the runs at ``FLOATING_CEILING`` unless every run is there.

    A run the shared machine slowed cannot be reproduced by any floating share and fits at the ceiling: it says
    the machine was slow, not what the share is, and one such run would pull a mean far off."""
    fitted = [i for i, share in enumerate(floating) if share < FLOATING_CEILING] or list(range(len(floating)))
    return statistics.median(rows[i] for i in fitted), statistics.median(floating[i] for i in fitted)


def _profile_run(recipe: Path, out: Path, model_dir: str, threads: int, mode: str = "sync",
                 workload: int = 0, steps: int | None = None) -> tuple[Path, float]:
    """One real calibration run of ``workload`` in ``mode`` (``steps``: its default unless given), kept beside the
    cost file ``out``: its folder, and of an async run the floating processes' CPU seconds per row (0 for sync)."""
    import tempfile

    from asyncflow.config import load_config
    from asyncflow.simulator.workload import from_config

    # Kept beside the cost file (metrics, timeline), to lay a calibration run beside its prediction.
    keep = out.parent / f"{out.stem}-calibration"
    keep.mkdir(parents=True, exist_ok=True)
    cpu: list = []
    run_dir = calibration_run(recipe, Path(tempfile.mkdtemp(prefix=f"{mode}-{threads}-{workload}-", dir=keep)),
                              model_dir, threads, steps=steps, mode=mode, sampler=cpu if mode == "async" else None,
                              workload=workload)
    if mode != "async":
        return run_dir, 0.0
    rows = from_config(load_config(recipe, overrides_for(1, mode))).rows_per_step
    return run_dir, floating_row_s(cpu[0], run_dir, rows)


def calibration_order(names: list[str], runs: int) -> list[tuple[str, str, int]]:
    """``(variant, mode, workload)`` of each calibration run, in the order they run: ``runs`` rounds of one sync
    run per variant (workload ``round % 2``: the two calibration workloads alternate) and, if variant ``1`` is
    calibrated, one async run (async places one thread per pinned worker, so variant 1)."""
    order = []
    for run in range(runs):
        order += [(name, "sync", run % 2) for name in names]
        if "1" in names:
            order.append(("1", "async", 0))
    return order


class Calibration:
    """Real calibration runs of the loop, collected as they run, turned into each variant's ``ServiceCosts`` by
    ``apply`` (``bench/simulator.py`` spreads them between its held-out runs, in the rounds of
    ``calibration_order``)."""

    def __init__(self, models: dict[str, CostModel], recipe: Path, out: Path, model_dir: str,
                 steps: dict[str, int] | None = None):
        """``steps``: mode -> steps of its calibration runs (default ``CALIBRATION_STEPS`` and
        ``ASYNC_CALIBRATION_STEPS``; ``QUICK_STEPS`` for a first look)."""
        self.models, self.recipe, self.out, self.model_dir = models, recipe, out, model_dir
        self.steps = steps or {}
        self.sync: dict[str, list] = defaultdict(list)  # variant -> Overheads of its sync runs
        self.asynchronous: list[tuple[float, Path, float]] = []  # (step seconds, run folder, floating CPU per row)

    def run(self, name: str, mode: str, workload: int) -> None:
        """One calibration run of variant ``name`` in ``mode`` (``calibration_order``), kept."""
        run_dir, row_s = _profile_run(self.recipe, self.out, self.model_dir, int(name), mode, workload,
                                      self.steps.get(mode))
        if mode == "sync":
            self.sync[name].append(calibrate(self.models[name], self.recipe, run_dir, int(name), workload))
        else:
            self.asynchronous.append((real_spans(run_dir / "timeline.json", median=True)[1], run_dir, row_s))

    def apply(self, keep: str = "fastest") -> None:
        """Set each calibrated variant's ``ServiceCosts`` from its runs: of each workload and mode the fastest run
        (``keep`` ``fastest``, ``fastest``), or every run (``all``: the fits average them; the async terms are
        the median of each run's, ``async_terms``)."""
        if keep not in ("fastest", "all"):
            raise ValueError(f"keep must be 'fastest' or 'all', not {keep!r}")
        for name, runs in self.sync.items():
            self.models[name].service = service_costs(fastest(runs) if keep == "fastest" else runs)
        if not self.asynchronous:
            return
        runs = fastest(self.asynchronous, key=lambda run: (0, run[0])) if keep == "fastest" else self.asynchronous
        service = self.models["1"].service  # fitted after the sync runs have set the services it adds to
        rows = [row_s for _, _, row_s in runs]
        floating = [fit_async_floating(self.models["1"], self.recipe, run_dir, row_s) for _, run_dir, row_s in runs]
        service.async_floating_row_s, service.async_floating = async_terms(rows, floating)


ENGINE_SCALE_WARNING = (0.67, 1.5)
"""An engine this much faster or slower in the calibration runs than in the profile is flagged: near 1 is the
loop's own cost; beyond these the machine's speed may have changed between the profile and the runs."""


def engine_speed_line(name: str, service: ServiceCosts) -> str:
    """One line on how fast variant ``name``'s engines ran inside the loop against the profile
    (``ServiceCosts.rollout_engine_scale`` and the like), flagged when one is beyond ``ENGINE_SCALE_WARNING``."""
    scales = {"rollout": service.rollout_engine_scale, "reference": service.reference_engine_scale,
              "actor": service.train_engine_scale}
    line = f"calibration: variant {name}: in the loop's calibration runs the engines took " + ", ".join(
        f"{task} {scale:.2f}x" for task, scale in scales.items()) + " the profile's time (the simulator uses these)"
    lo, hi = ENGINE_SCALE_WARNING
    if any(not lo <= scale <= hi for scale in scales.values()):
        line += ("; WARNING: far from the profile: if another job ran during the profile, its engine fits are off "
                 "(the prediction follows the runs)")
    return line

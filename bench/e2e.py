"""End-to-end throughput of the rollout modes on the same long-tailed RL workload.

    python bench/e2e.py [--steps 30] [--repeats 2] [--modes sync,async,continuous,partial] [--out DIR]
                        [section.key=value ...]

Workload: GRPO on the add-one task with long-tailed response lengths (``add1_longtail``: per-sample
budgets from a lognormal, median 24 tokens, clipped to [4, 128], generated to the end), a tiny Qwen2,
Megatron trainer, in-process vLLM, local Ray and the TransferQueue, 16 prompts x 8 samples per step.
Modes (every mode runs ``--repeats`` times in this invocation, on the same machine; start-up of Ray, vLLM
and Megatron is excluded from the wall time):

- ``sync``: colocated lock-step baseline; each heavy worker uses every core while it has the machine;
- ``async``: rollout and training on separate cores, overlapped (max_staleness 1), chunked rollout
  (``workflow.rollout_chunk`` prompts generated to the end before more are taken);
- ``continuous``: async with continuous batching (``rollout.continuous``);
- ``partial``: async with continuous batching and partial rollout (``rollout.partial``), prefixes recomputed
  at each weight swap;
- ``partial_kv``: the same, keeping the in-flight responses' KV cache across the swap (``rollout.partial_kv=keep``);
- ``stream``: the sample stream (``workflow.mode=stream``, max_staleness 1, partial rollout): step s trains the
  first groups to finish within the bound; a group that finishes too late is generated again;
- ``heavy_sync`` / ``heavy_async`` / ``heavy_stream``: a heavy-tailed workload (``add1_heavytail``: median 8
  tokens, sigma 1.5, clipped to [4, 248]; a step's longest response is about 10-12x its mean), in sync, in
  step-tied async (chunked) and in the sample stream, max_staleness 1; ``heavy_continuous`` (step-tied async
  with continuous batching) and ``heavy_stream_cont`` (the stream without partial rollout) drive vLLM's engine
  the same way, so their ratio isolates the stream's own effect from the cost of driving the engine step by step;
- ``rpp_sync`` / ``rpp_stream_group`` / ``rpp_stream``: the heavy-tailed workload under REINFORCE++
  (``algorithm.advantage=reinforce_pp``, an estimator that scores each response alone), every mode packing the
  trainer's rows (``trainer.micro_batch_tokens=2048``): sync, and the sample stream (max_staleness 1, partial
  rollout) moving whole groups (``workflow.stream_unit=group``) or single responses (the default for this
  estimator), so their ratio is what taking samples instead of groups buys;
- ``tool_sync`` / ``tool_partial`` / ``tool_stream``: the multi-turn calculator task
  (``recipes/tiny_cpu/tool_async.yaml``) in sync mode (its own baseline), in the async mode with continuous
  batching and partial rollout, and in the sample stream (max_staleness 1, partial rollout; a group is complete
  once its every trajectory ended).

Every run of a workload trains the same number of samples, so the reward columns compare equal sample
counts. Throughput is given twice: over the whole run (``wall s``, ``samples/s``, ``tokens/s``: from the
first step to the last, warm-up included) and in steady state (``steady samples/s``: samples trained per
second after the first ``WARMUP`` steps, from the steps' own timestamps). The ratio to ``sync`` is taken on
the steady figure: the first steps of every mode include one-off costs (vLLM and torch warming their
kernels, the first Adam step, the async pipeline filling), which a run of hours does not see; in a run
of 20 steps they weigh about 15%, on the async modes more than on sync. A second table gives, per mode, the
ratios to its workload's sync run of the same repeat (runs of a repeat run back to back) and their median.

CPU: a thread samples the machine's busy CPU (``MachineCpu``), and each run reports, over its steady steps, the
cores busy on average and the busy CPU milliseconds per sample trained. The second table adds each mode's CPU per
sample against sync's and its ceiling: the samples/s it would reach with every core busy at its own CPU per sample,
over sync's. On a machine whose cores every mode already keeps busy, a mode is faster than sync only by spending
less CPU per sample, and the ceiling says how far that CPU allows it to go. Reward against samples trained, one
panel per workload, goes to ``reward_by_samples.png``. A third table splits each mode's CPU per sample by process
(``PROCESSES``, medians over its runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BASE = [
    "workflow.task=add1_longtail",
    "workflow.prompts_per_step=16",
    "workflow.samples_per_prompt=8",
    "workflow.rollout_chunk=128",
    "workflow.score_chunk=32",
    "rollout.max_new_tokens=128",
    "rollout.max_model_len=160",
    "trainer.micro_batch_size=32",
]
LONGTAIL = ("grpo_async.yaml", BASE)
HEAVY = ("grpo_async.yaml", [*BASE[1:5], "workflow.task=add1_heavytail", "rollout.max_new_tokens=248",
                             "rollout.max_model_len=256", "trainer.micro_batch_size=32"])
RPP = ("grpo_async.yaml", [*HEAVY[1], "algorithm.advantage=reinforce_pp", "trainer.micro_batch_tokens=2048"])
TOOL = ("tool_async.yaml", ["workflow.prompts_per_step=16"])
MODES = {  # name -> (workload, overrides); a workload's baseline is its sync mode
    "sync": (LONGTAIL, ["workflow.mode=sync", "workflow.max_staleness=0"]),
    "async": (LONGTAIL, ["workflow.mode=async", "workflow.max_staleness=1"]),
    "continuous": (LONGTAIL, ["workflow.mode=async", "workflow.max_staleness=1", "rollout.continuous=true"]),
    "partial": (LONGTAIL, ["workflow.mode=async", "workflow.max_staleness=1", "rollout.partial=true"]),
    "partial_kv": (LONGTAIL, ["workflow.mode=async", "workflow.max_staleness=1", "rollout.partial=true",
                              "rollout.partial_kv=keep", "rollout.enable_prefix_caching=false"]),
    "stream": (LONGTAIL, ["workflow.mode=stream", "workflow.max_staleness=1", "rollout.partial=true"]),
    "heavy_sync": (HEAVY, ["workflow.mode=sync", "workflow.max_staleness=0"]),
    "heavy_async": (HEAVY, ["workflow.mode=async", "workflow.max_staleness=1"]),
    "heavy_stream": (HEAVY, ["workflow.mode=stream", "workflow.max_staleness=1", "rollout.partial=true"]),
    "heavy_continuous": (HEAVY, ["workflow.mode=async", "workflow.max_staleness=1", "rollout.continuous=true"]),
    "heavy_stream_cont": (HEAVY, ["workflow.mode=stream", "workflow.max_staleness=1"]),
    "rpp_sync": (RPP, ["workflow.mode=sync", "workflow.max_staleness=0"]),
    "rpp_stream_group": (RPP, ["workflow.mode=stream", "workflow.max_staleness=1", "rollout.partial=true",
                               "workflow.stream_unit=group"]),
    "rpp_stream": (RPP, ["workflow.mode=stream", "workflow.max_staleness=1", "rollout.partial=true"]),
    "tool_sync": (TOOL, ["workflow.mode=sync", "workflow.max_staleness=0"]),
    "tool_partial": (TOOL, ["workflow.mode=async", "workflow.max_staleness=1", "rollout.partial=true"]),
    "tool_stream": (TOOL, ["workflow.mode=stream", "workflow.max_staleness=1", "rollout.partial=true"]),
}
WORKLOADS = ("tool_", "heavy_", "rpp_")
"""Name prefixes of the workloads other than the long-tailed one; each workload's baseline is its own sync mode."""
IDLE = ["rollout", "actor", "reference"]
WARMUP = 2
"""Steps left out of the steady-state throughput (the simulator's benchmark leaves out as many)."""


def steady_window(metrics: Path, warmup: int = WARMUP) -> tuple[float, float, float]:
    """The steady part of a run: the end of step ``warmup - 1`` and of the last step (``time/elapsed_s`` in
    ``metrics.jsonl``) and the ``actor/rows`` trained between them."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = sorted((r for r in records if "time/elapsed_s" in r), key=lambda r: r["step"])
    if len(steps) <= warmup:
        raise ValueError(f"{metrics}: {len(steps)} steps, need more than the {warmup} warm-up steps")
    rows = sum(r.get("actor/rows", 0.0) for r in steps[warmup:])
    return steps[warmup - 1]["time/elapsed_s"], steps[-1]["time/elapsed_s"], rows


def steady_throughput(metrics: Path, warmup: int = WARMUP) -> float:
    """Samples trained per second after ``warmup`` steps (``steady_window``)."""
    start, end, rows = steady_window(metrics, warmup)
    return rows / (end - start)


PROCESSES = ("RolloutService", "ReferenceService", "ActorService", "VersionBoard", "TransferQueue", "driver")
"""The processes whose CPU per sample the third table gives apart; ``rest`` is the machine's busy CPU less theirs
(the reward and advantage workers, Ray's daemons, the sampler itself, the kernel)."""


def _process_group(proc) -> str | None:
    """Which of ``PROCESSES`` a process is: a Ray worker by the title Ray gives it (``ray::RolloutService.run``),
    a TransferQueue server by its command line, the driver by pid; None for the rest."""
    import os

    if proc.pid == os.getpid():
        return "driver"
    name = proc.info["name"] or ""
    cmdline = proc.info["cmdline"] or []
    title = cmdline[0] if cmdline else name
    if title.startswith("ray::"):
        group = title[5:].split(".")[0].split(" ")[0]
        return group if group in PROCESSES else None
    return "TransferQueue" if "asyncflow.transfer_queue" in " ".join(cmdline) else None


class MachineCpu:
    """The machine's busy CPU seconds (user + nice + system + irq + softirq over every core, ``psutil.cpu_times``),
    and each of ``PROCESSES``'s, sampled every ``interval`` seconds by a thread. Machine-wide on purpose: a run's
    work is spread over Ray's workers and daemons, the TransferQueue and the driver, and all of it is the run's
    cost. Another job on the machine counts too, which the idle machine this benchmark asks for keeps out."""

    def __init__(self, interval: float = 0.5):
        import threading

        import psutil

        self.cores = psutil.cpu_count()
        self.interval, self.samples, self.procs = interval, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import time

        import psutil

        while not self._stop.is_set():
            procs = {}
            for proc in psutil.process_iter(["name", "cmdline", "cpu_times"]):
                group = _process_group(proc)
                if group is not None and proc.info["cpu_times"] is not None:
                    procs[proc.pid] = (group, proc.info["cpu_times"].user + proc.info["cpu_times"].system)
            t = psutil.cpu_times()
            busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
            self.samples.append((time.time(), busy))
            self.procs.append(procs)
            self._stop.wait(self.interval)

    def busy_s(self, start: float, end: float) -> float:
        """Busy CPU seconds between two wall-clock times, read between the samples around each (NaN outside them)."""
        import bisect

        times = [t for t, _ in self.samples]

        def at(when: float) -> float:
            i = bisect.bisect_left(times, when)
            if i == 0 or i >= len(times):
                return float("nan")
            (t0, b0), (t1, b1) = self.samples[i - 1], self.samples[i]
            return b0 + (b1 - b0) * (when - t0) / max(t1 - t0, 1e-9)

        return at(end) - at(start)

    def process_s(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds of each of ``PROCESSES`` between two wall-clock times: over the samples inside them, scaled to
        the whole span. A process is counted from its first sample, so one started in the span counts from 0."""
        inside = [i for i, (t, _) in enumerate(self.samples) if start <= t <= end]
        if len(inside) < 2:
            return {}
        first, last = self.procs[inside[0]], self.procs[inside[-1]]
        scale = (end - start) / (self.samples[inside[-1]][0] - self.samples[inside[0]][0])
        out = dict.fromkeys(PROCESSES, 0.0)
        for pid, (group, cpu) in last.items():
            before = first.get(pid)
            out[group] += scale * (cpu - (before[1] if before and before[0] == group else 0.0))
        return out

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()


def steady_cpu(summary: dict, metrics: Path, cpu: MachineCpu) -> dict:
    """The machine's cores busy on average over a run's steady steps, its busy CPU milliseconds per sample trained
    in them, and each of ``PROCESSES``'s and the rest's (``steady_window``; the run's ``started_unix_s`` puts its
    steps on the wall clock)."""
    start, end, rows = steady_window(metrics)
    start, end = summary["started_unix_s"] + start, summary["started_unix_s"] + end
    busy = cpu.busy_s(start, end)
    procs = cpu.process_s(start, end)
    per = {group: 1e3 * s / rows for group, s in procs.items()}
    if per:
        per["rest"] = 1e3 * busy / rows - sum(per.values())
    return {"cores_busy": busy / (end - start), "cpu_ms_per_sample": 1e3 * busy / rows, "cpu_ms_by_process": per}


def by_process(results: dict[str, dict]) -> str:
    """Per mode, the median over its runs of each process's CPU milliseconds per sample trained (steady steps)."""
    import statistics

    columns = [*PROCESSES, "rest"]
    lines = ["| mode | CPU ms / sample | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for mode in dict.fromkeys(n.split("#")[0] for n in results):
        runs = [s for n, s in results.items() if n.split("#")[0] == mode and s.get("cpu_ms_by_process")]
        if not runs:
            continue
        cells = [statistics.median(s["cpu_ms_by_process"][c] for s in runs) for c in columns]
        total = statistics.median(s["cpu_ms_per_sample"] for s in runs)
        lines.append(f"| {mode} | {total:.2f} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


def run(mode: str, steps: int, out: Path, extra: list[str]) -> dict:
    """One training run in ``mode`` (a key of ``MODES``) writing to ``out``; returns its summary."""
    from asyncflow.config import load_config
    from asyncflow.workflow.loop import train

    (recipe, base), overrides = MODES[mode.split("#")[0]]
    recipe = Path(__file__).resolve().parents[1] / "recipes/tiny_cpu" / recipe
    overrides = base + overrides + [
        f"workflow.steps={steps}", f"observability.output_dir={out}", f"model.path={out.parent / 'model'}",
        "observability.progress_every_s=10"] + extra
    return train(load_config(recipe, overrides))


def _lags(out: Path) -> dict:
    """Sample and token version lag over the run (token lag only where the rollout reports it)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    def mean(key):
        values = [r[key] for r in records if key in r]
        return sum(values) / len(values) if values else float("nan")

    def most(key):
        return max((r[key] for r in records if key in r), default=float("nan"))

    return {"lag_mean": mean("staleness/version_lag_mean"), "lag_max": most("staleness/version_lag_max"),
            "token_lag_mean": mean("staleness/token_lag_mean"), "token_lag_max": most("staleness/token_lag_max"),
            "response_len": mean("response/length_mean")}


def _workload(name: str) -> str:
    return next((w for w in WORKLOADS if name.startswith(w)), "")


def paired(results: dict[str, dict], cores: int) -> str:
    """Per mode, over repeats, the ratio of this mode's steady samples/s in repeat i to its workload's sync mode's
    in repeat i (runs of one repeat ran back to back, so they share the machine's state), with their median; the
    median ratio of its CPU per sample to sync's; and its ceiling: what the mode would reach, against that sync
    run, with every core busy at its own CPU per sample (for sync itself, over its own throughput). A mode beats
    its ceiling only by spending less CPU per sample."""
    import statistics

    lines = ["| mode | paired steady ratios to its sync | median | CPU per sample / sync's (median) | "
             f"ceiling on {cores} busy cores, x sync (median) |", "|---|---|---|---|---|"]
    modes = dict.fromkeys(n.split("#")[0] for n in results)
    for mode in modes:
        sync = _workload(mode) + "sync"
        pairs = [(results[n], results[f"{sync}#{n.split('#')[1]}"]) for n in results
                 if n.split("#")[0] == mode and f"{sync}#{n.split('#')[1]}" in results]
        if not pairs:
            continue
        ratios = [r["steady_samples_per_s"] / b["steady_samples_per_s"] for r, b in pairs]
        cpu = [r["cpu_ms_per_sample"] / b["cpu_ms_per_sample"] for r, b in pairs]
        ceiling = [cores * 1e3 / r["cpu_ms_per_sample"] / b["steady_samples_per_s"] for r, b in pairs]
        shown = "-" if mode == sync else ", ".join(f"{r:.2f}x" for r in ratios)
        lines.append(f"| {mode} | {shown} | {statistics.median(ratios):.2f}x | {statistics.median(cpu):.2f}x | "
                     f"{statistics.median(ceiling):.2f}x |")
    return "\n".join(lines)


def table(results: dict[str, dict]) -> str:
    """A markdown table, one row per run, ratios against the mean samples/s of its workload's sync runs."""
    def baseline(name: str, key: str) -> float:
        runs = [s[key] for n, s in results.items() if n.startswith(_workload(name) + "sync#")]
        return sum(runs) / len(runs) if runs else float("nan")

    header = ("| run | wall s | samples/s | tokens/s | x sync (whole run) | steady samples/s | x sync (steady) | " +
              " | ".join(f"idle {g}" for g in IDLE) +
              " | cores busy | CPU ms / sample | lag mean/max | token lag mean/max | trained response tokens | "
              "reward first -> last10 |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for name, s in results.items():
        idle = " | ".join(f"{s['idle_fraction'].get(g, float('nan')):.0%}" for g in IDLE)
        lag = s["_lags"]
        ratio = s["samples_per_s"] / baseline(name, "samples_per_s")
        steady = s["steady_samples_per_s"] / baseline(name, "steady_samples_per_s")
        lines.append(f"| {name} | {s['wall_s']:.1f} | {s['samples_per_s']:.2f} | {s['tokens_per_s']:.0f} | "
                     f"{ratio:.2f}x | {s['steady_samples_per_s']:.2f} | {steady:.2f}x | {idle} | "
                     f"{s['cores_busy']:.2f} | {s['cpu_ms_per_sample']:.1f} | "
                     f"{lag['lag_mean']:.2f}/{lag['lag_max']:.0f} | "
                     f"{lag['token_lag_mean']:.2f}/{lag['token_lag_max']:.0f} | {lag['response_len']:.1f} | "
                     f"{s['reward_first']:.3f} -> {s['reward_last10_mean']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default="outputs/bench_e2e")
    parser.add_argument("overrides", nargs="*", help="section.key=value applied to every run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; valid: {', '.join(MODES)}")
    results, cpu = {}, MachineCpu()
    for i in range(args.repeats):  # interleaved, so slow drift of the machine hits every mode alike
        for mode in modes:
            name = f"{mode}#{i + 1}"
            results[name] = run(name, args.steps, out / name.replace("#", "-"), args.overrides)
            results[name]["_lags"] = _lags(out / name.replace("#", "-"))
            metrics = out / name.replace("#", "-") / "metrics.jsonl"
            results[name]["steady_samples_per_s"] = steady_throughput(metrics)
            results[name].update(steady_cpu(results[name], metrics, cpu))
    cpu.stop()

    from asyncflow.observability import plot_compare_panels

    # Reward against samples trained, one panel per workload: every run of a workload trains the same samples, so
    # the curves end together and compare equal work.
    panels = {f"reward by samples trained: {(workload or 'longtail_').rstrip('_')} workload":
              {n: out / n.replace("#", "-") / "metrics.jsonl" for n in results if _workload(n) == workload}
              for workload in dict.fromkeys(_workload(n) for n in results)}
    png = plot_compare_panels(panels, out / "reward_by_samples.png", x="samples")
    text = table(results) + "\n\n" + paired(results, cpu.cores) + "\n\n" + by_process(results)
    print(f"\nEnd-to-end RL throughput, same long-tailed workload, baseline = mean of the sync runs; steady = after "
          f"{WARMUP} warm-up steps\n")
    print(text)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({n: {k: v for k, v in s.items() if k != "trained_groups"}
                                                  for n, s in results.items()}, indent=2))
    print(f"\nreward curves: {png}; timelines: {out}/<mode>-<run>/timeline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

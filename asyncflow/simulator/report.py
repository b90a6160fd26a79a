"""``asyncflow simulate RECIPE --costs FILE [section.key=value ...]``: the prediction table, the simulated
Gantt chart (drawn by ``observability.plots.plot_gantt``, like a real run's ``timeline.png``) and, for a
cluster recipe, the device split search under ``asyncflow plan``'s memory limits."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from asyncflow.simulator.costs import CostFile, load_costs
from asyncflow.simulator.sensitivity import Sensitivity, sensitivity
from asyncflow.simulator.sim import SimResult, simulate
from asyncflow.simulator.workload import Workload, from_config

GROUPS = ("rollout", "reference", "actor")


def load(path: str, overrides: list[str]):
    """``(config, recipe or None)`` of a recipe directory (``recipes/<model>``) or a YAML config file."""
    from asyncflow.config import ConfigError, load_config

    if Path(path).is_dir():
        from asyncflow.recipes_check import load_recipe

        recipe, problems = load_recipe(path, overrides)
        if recipe is None:
            raise ConfigError("; ".join(problems))
        return recipe.cfg, recipe
    return load_config(path, overrides), None


def model_for(costs: CostFile, w: Workload, rollout_tp: int = 1):
    """The cost variant a workload runs on (device recipes: per rollout TP, see ``search.costs_for_tp``)."""
    if w.placement == "devices":
        from asyncflow.simulator.search import costs_for_tp

        return costs_for_tp(costs, rollout_tp)[0]
    return costs.variant(w.variant)


def table(rows: list[tuple[str, SimResult]], sensitivities: list[Sensitivity] | None = None) -> str:
    """Markdown table of predictions (idle: the real timeline's definition, 1 - busy spans / run span), with the
    bound side and the change at 10% dearer rollout / training when ``sensitivities`` are given."""
    head = ("| case | step s | samples/s | ratio | " + " | ".join(f"idle {g}" for g in GROUPS) +
            " | lag mean / max |" + (" bound by | rollout / training +10% |" if sensitivities else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    base = rows[0][1].samples_per_s
    for i, (name, r) in enumerate(rows):
        idle = " | ".join(f"{r.idle_fraction[g]:.0%}" if g in r.idle_fraction else "-" for g in GROUPS)
        line = (f"| {name} | {r.step_time_s:.3f} | {r.samples_per_s:.1f} | {r.samples_per_s / base:.2f}x | "
                f"{idle} | {r.lag_mean:.2f} / {r.lag_max} |")
        if sensitivities:
            s = sensitivities[i]
            line += f" {s.bottleneck}{' (tipping)' if s.tipping else ''} | {s.cell()} |"
        lines.append(line)
    return "\n".join(lines)


def tipping_notes(rows: list[tuple[str, SimResult]], sensitivities: list[Sensitivity]) -> list[str]:
    """A line for each case a 10% cost error on one side moves by more than a proportional bottleneck could."""
    notes = []
    for (name, _), s in zip(rows, sensitivities):
        if s.tipping:
            notes.append(f"{name}: near a tipping point: {s.tilt:.0%} dearer rollout / training moves the prediction "
                         f"{s.cell()} ({s.rollout_dearer:.1f} / {s.train_dearer:.1f} samples/s against "
                         f"{s.base:.1f}); the real run may settle on either side (docs/simulator.md)")
    return notes


def variants_of(w: Workload, cfg) -> list[tuple[str, Workload]]:
    """The workload as configured, then sync and async at staleness 0, 1, 2 for comparison."""
    out = [(f"as configured ({w.mode}, k={w.max_staleness})", w)]
    threads = {"sync": str(cfg.workflow.sync_worker_threads), "async": str(cfg.workflow.worker_threads)}
    for mode, k in (("sync", 0), ("async", 0), ("async", 1), ("async", 2)):
        if (mode, k) != (w.mode, w.max_staleness):
            variant = threads[mode] if w.placement == "cpu" else w.variant
            out.append((f"{mode}, k={k}", dataclasses.replace(w, mode=mode, max_staleness=k, variant=variant)))
    return out


def run(args: argparse.Namespace) -> int:
    """The ``simulate`` subcommand: print the table, write the Gantt chart, search the split."""
    cfg, recipe = load(args.recipe, args.overrides)
    costs = load_costs(args.costs)
    w = from_config(cfg, lengths=args.lengths)
    w = dataclasses.replace(w, steps=args.steps or min(w.steps, 50))
    tp = cfg.rollout.tensor_parallel
    rows, sensitivities = [], []
    for name, v in variants_of(w, cfg):
        if v.placement == "cpu" and v.variant not in costs.variants:
            print(f"({name}: skipped, the cost file has no variant {v.variant!r}: threads per worker in that mode)")
            continue
        model = model_for(costs, v, tp)
        rows.append((name, simulate(v, model)))
        sensitivities.append(sensitivity(v, model, rows[-1][1]))
    print(f"predicted from {args.costs} ({costs.hardware.get('host', '?')}), {w.steps} steps, lengths {w.lengths}, "
          f"{w.rows_per_step} rows per step; throughput after {w.warmup_steps} warm-up steps\n")
    print(table(rows, sensitivities))
    for note in tipping_notes(rows, sensitivities):
        print(f"\nwarning: {note}")
    out = Path(args.out)
    result = rows[0][1]
    result.timeline.write_chrome_trace(out / "timeline.json")
    result.timeline.plot(out / "timeline.png", title=f"simulated: {rows[0][0]}, {result.step_time_s:.3f} s per "
                         f"step, {result.samples_per_s:.1f} samples/s")
    print(f"\nsimulated timeline: {out / 'timeline.png'} (and timeline.json for Perfetto)")
    devices = args.devices
    if devices is None and recipe is not None:
        devices = recipe.cluster.nodes * recipe.cluster.devices_per_node
    if devices and w.placement == "devices":
        print_search(w, costs, devices, recipe, cfg)
        if getattr(args, "modes", False):
            print_mode_search(w, costs, devices, recipe, cfg)
    elif devices:
        print("split search: only for device recipes (ray.accelerator set); the CPU layout has one split")
    return 0


def print_search(w: Workload, costs: CostFile, devices: int, recipe, cfg) -> None:
    """Search the split of ``devices`` and print every candidate, best first."""
    from tqdm import tqdm

    from asyncflow.simulator.search import candidate_splits, search

    tr = cfg.trainer
    mp = tr.tensor_parallel * tr.pipeline_parallel * tr.context_parallel
    per_node = recipe.cluster.devices_per_node if recipe is not None else 8
    total = len(candidate_splits(devices, w, mp, per_node))
    with tqdm(total=total, desc="split search", unit="split", leave=False) as bar:
        splits = search(w, costs, devices, recipe, mp, per_node, progress=bar.update)
    print(f"\nsplit search over {devices} devices (trainer TP{tr.tensor_parallel} x PP{tr.pipeline_parallel} "
          f"kept; memory: asyncflow plan's estimate)\n")
    print("| rollout devices | instances x TP | trainer DP | memory (GiB, tightest) | step s | samples/s |")
    print("|---|---|---|---|---|---|")
    for s in splits:
        r = s.result
        perf = f"{r.step_time_s:.2f} | {r.samples_per_s:.1f}" if r else "does not fit | -"
        shape = f"{s.rollout_instances} x {s.rollout_tp}"
        print(f"| {s.rollout_devices} | {shape} | {s.trainer_dp} | {s.memory} | {perf} |")
    best = next((s for s in splits if s.result), None)
    if best:
        print(f"\nbest: {' '.join(best.overrides())} ({best.result.samples_per_s:.1f} samples/s)")


def print_mode_search(w: Workload, costs: CostFile, devices: int, recipe, cfg) -> None:
    """Search the sample stream's rollout share, rollout mode and staleness on ``devices`` and print each candidate
    against the colocated baseline (switching charged), best first."""
    from asyncflow.simulator.search import colocated_baseline, mode_search

    tr, tp = cfg.trainer, cfg.rollout.tensor_parallel
    mp = tr.tensor_parallel * tr.pipeline_parallel * tr.context_parallel
    model = model_for(costs, w, tp)
    base = colocated_baseline(w, model, devices, mp, tp)
    choices = mode_search(w, model, devices, mp, tp, recipe=recipe)
    print(f"\nmode search over {devices} devices: the sample stream (workflow.mode=stream) against the colocated "
          f"baseline, {base.samples_per_s:.1f} samples/s with {model.switch.step_s(devices):.1f} s of switching a "
          "step\n")
    print("| rollout | k | instances x TP | trainer DP | step s | samples/s | vs colocated | bound by | dropped |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in choices:
        r = c.result
        print(f"| {c.rollout_model} | {c.max_staleness} | {c.rollout_instances} x {c.rollout_tp} | {c.trainer_dp} | "
              f"{r.step_time_s:.2f} | {r.samples_per_s:.1f} | {r.samples_per_s / base.samples_per_s:.2f}x | "
              f"{c.bound} | {r.dropped} |")
    if choices:
        print(f"\nbest: {' '.join(choices[0].overrides())} ({choices[0].result.samples_per_s:.1f} samples/s)")

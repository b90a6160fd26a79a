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
from asyncflow.simulator.workload import Workload, draw_lengths, from_config

GROUPS = ("rollout", "reference", "actor")
PUBLISHED_GPUS = ("h100", "h20")
"""``--costs published:<gpu>``: the GPUs ``simulator.published`` has figures for."""


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


def published_costs(spec: str, cfg, recipe) -> CostFile:
    """``--costs published:<gpu>``: a cost file built from the GPU's published figures
    (``simulator.published.gpu_costs``) for the recipe's model, a rollout variant per TP 1-8."""
    from asyncflow.config import ConfigError
    from asyncflow.simulator import published

    gpu = spec.removeprefix("published:").lower()
    if gpu not in PUBLISHED_GPUS:
        raise ConfigError(f"--costs {spec}: published figures exist for {', '.join(PUBLISHED_GPUS)} "
                          f"(published:{PUBLISHED_GPUS[0]})")
    if recipe is None:
        raise ConfigError(f"--costs {spec} needs a recipe directory (recipes/<model>): the costs come from its "
                          "model_arch.json")
    tr = cfg.trainer
    return published.gpu_costs(recipe.arch, tr.tensor_parallel * tr.pipeline_parallel * tr.context_parallel,
                               getattr(published, gpu.upper()))


def lengths_spec(spec: str | None, cfg) -> str | None:
    """``--lengths``: ``heavytail`` is the published runs' heavy tail at the config's ``rollout.max_new_tokens``
    (``published_runs.heavy_tail``); anything else as given."""
    if spec == "heavytail":
        from asyncflow.simulator.published_runs import heavy_tail

        return heavy_tail(cfg.rollout.max_new_tokens)
    return spec


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
    costs = published_costs(args.costs, cfg, recipe) if args.costs.startswith("published:") else load_costs(args.costs)
    w = from_config(cfg, lengths=lengths_spec(args.lengths, cfg), prompt_len=getattr(args, "prompt_len", None))
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
    where = costs.hardware.get("host") or costs.hardware.get("kind", "?")
    print(f"predicted from {args.costs} ({where}), {w.steps} steps, lengths {w.lengths}, prompts of {w.prompt_len} "
          f"tokens, "
          f"{w.rows_per_step} rows per step; throughput after {w.warmup_steps} warm-up steps\n")
    print(table(rows, sensitivities))
    for note in tipping_notes(rows, sensitivities):
        print(f"\nwarning: {note}")
    trained = rows[0][1].trained_lengths
    if trained:  # the sample stream trains what finishes first: say how far that moves the lengths trained
        drawn = [n for step in draw_lengths(w) for n in step]
        unit = "responses" if w.samples_per_prompt == 1 else "groups"
        print(f"\n{rows[0][0]}: trained responses averaged {sum(trained) / len(trained):.1f} tokens against "
              f"{sum(drawn) / len(drawn):.1f} drawn ({rows[0][1].dropped} {unit} fell out of the staleness bound and "
              "were generated again)")
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


def packing_budget(recipe, cfg) -> int:
    """The token budget a recipe's trainer would pack by (``trainer.micro_batch_tokens``): its own, or, at 0,
    ``micro_batch_size`` rows of ``max_prompt_len + max_new_tokens`` (the memory ``asyncflow plan`` already
    counts for a micro-batch) when the trainer's features allow packing; 0 when they do not."""
    tr = cfg.trainer
    if tr.micro_batch_tokens or recipe is None:
        return 0
    from asyncflow.engines.megatron.features import problems

    budget = tr.micro_batch_size * (cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    packed = dataclasses.replace(tr, micro_batch_tokens=budget)
    return 0 if problems(packed, "trainer", is_moe=recipe.arch.is_moe, cuda=True, te=True) else budget


def _tp_fits_heads(recipe, tp: int) -> bool:
    """Rollout TP ``tp`` divides the recipe's attention heads as vLLM needs (True without a recipe)."""
    if recipe is None:
        return True
    from asyncflow.recipes_check import _check_attention

    return not _check_attention(recipe.name, "rollout.tensor_parallel", tp, recipe.arch)


def print_mode_search(w: Workload, costs: CostFile, devices: int, recipe, cfg) -> None:
    """Search the workflow mode (the sample stream, step-tied async), rollout model (chunked, continuous,
    partial), staleness (1, 2), rollout TP and rollout's share of ``devices`` (a quarter to three quarters),
    print each candidate against the colocated baseline (switching charged), best first, then the best one the
    recipe check accepts, as overrides and cluster.env lines."""
    from asyncflow.simulator.search import colocated_baseline, costs_for_tp, mode_search, recipe_best

    tr, tp = cfg.trainer, cfg.rollout.tensor_parallel
    mp = tr.tensor_parallel * tr.pipeline_parallel * tr.context_parallel
    per_node = recipe.cluster.devices_per_node if recipe is not None else 8
    model = model_for(costs, w, tp)
    tps = [t for t in (1, 2, 4, 8) if t <= per_node and t <= devices // 2 and _tp_fits_heads(recipe, t)]
    tp_models = {t: costs_for_tp(costs, t)[0] for t in sorted(set(tps) | {tp})}
    # The baseline at its best rollout TP too, so that the stream's TP choice is not what the ratio measures.
    base, tp = max(((colocated_baseline(w, m, devices, mp, t), t) for t, m in tp_models.items()),
                   key=lambda b: b[0].samples_per_s)
    model = tp_models[tp]
    choices = mode_search(w, model, devices, mp, tp, recipe=recipe, workflow_modes=("stream", "async"),
                          models=("chunked", "continuous", "partial"), tp_models=tp_models,
                          micro_batch_tokens=packing_budget(recipe, cfg))
    print(f"\nmode search over {devices} devices: the sample stream (workflow.mode=stream) and step-tied async "
          f"against the colocated baseline (rollout TP{tp}, every device; {model.switch.step_s(devices):.1f} s of "
          f"switching a step): {base.samples_per_s:.1f} samples/s, {base.step_time_s:.1f} s a step\n")
    print("| mode | rollout | k | instances x TP | trainer DP | step s | samples/s | vs colocated | bound by | "
          "dropped | recipe check |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in choices:
        r = c.result
        check = "ok" if not c.problems else c.problems[0]
        print(f"| {c.workflow_mode} | {c.rollout_model} | {c.max_staleness} | {c.rollout_instances} x "
              f"{c.rollout_tp} | {c.trainer_dp} | {r.step_time_s:.2f} | {r.samples_per_s:.1f} | "
              f"{r.samples_per_s / base.samples_per_s:.2f}x | {c.bound} | {r.dropped} | {check} |")
    if not choices:
        return
    print(f"\nbest: {' '.join(choices[0].overrides())} ({choices[0].result.samples_per_s:.1f} samples/s, "
          f"{choices[0].result.samples_per_s / base.samples_per_s:.2f}x colocated)")
    best = recipe_best(choices)
    if best is None:
        print("no candidate passes the recipe check")
        return
    for mode in ("stream", "async"):
        top = recipe_best([c for c in choices if c.workflow_mode == mode])
        if top is not None:
            print(f"best {mode} the recipe can take: {top.result.samples_per_s:.1f} samples/s, "
                  f"{top.result.samples_per_s / base.samples_per_s:.2f}x colocated")
    print(f"for the recipe: {' '.join(best.overrides())}\n  cluster.env: TRAINER_DEVICES={best.trainer_dp * mp} "
          f"ROLLOUT_DEVICES={best.rollout_devices} ({best.result.samples_per_s:.1f} samples/s, "
          f"{best.result.samples_per_s / base.samples_per_s:.2f}x colocated)")

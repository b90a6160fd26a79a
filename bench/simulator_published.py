"""Predicted against published: the simulator configured as published RL runs (verl fully-async's 7B table,
AReaL's sync / async comparison), one set of constants for every case (``asyncflow.simulator.published``,
``asyncflow.simulator.published_runs``). PREDICTIONS on paper: nothing here ran on a GPU.

    python bench/simulator_published.py [--steps 6] [--out outputs/simulator_published]

Prints each run's published and predicted step time with their ratio, then for each pair (the colocated or sync
baseline and the asynchronous run on the same GPUs) the published and predicted speed-up, then, where the
publication reports them, its per-step columns (``gen``, ``old_log_prob``, ``update_actor``) against the
simulated spans that they time (colocated: generation with vLLM's wake-up and weight reload, old log-probs,
training with the trainer's offload; fully-async: the trainer's wait for samples and its training). The target is 20%.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rows(runs, steps: int) -> list[dict]:
    """Published against predicted, one dict per run."""
    out = []
    for run in runs:
        result = run.predict(steps)
        out.append({"name": run.name, "gpus": run.gpus, "published_s": run.published_step_s,
                    "predicted_s": result.step_time_s, "dropped": result.dropped,
                    "published_columns": list(run.published_columns), "predicted_columns": columns(result),
                    "idle": {k: round(v, 2) for k, v in result.idle_fraction.items()}, "source": run.source})
        print(f"{run.name}: predicted {result.step_time_s:.1f} s, published {run.published_step_s:.1f} s", flush=True)
    return out


COLUMNS = {"gen": ("generate", "wait_samples", "switch"), "old_log_prob": ("old_logprob",),
           "update_actor": ("train", "offload")}
"""The publication's per-step columns and the simulated spans that time the same work (verl's colocated
``update_actor`` loads and offloads the trainer's state, its ``gen`` wakes vLLM and reloads the weights)."""


def columns(result) -> list[float]:
    """Mean seconds per steady step (after the warm-up) of each of ``COLUMNS``' spans."""
    first = min(result.workload.warmup_steps, result.workload.steps - 1)
    sums = dict.fromkeys(COLUMNS, 0.0)
    for e in result.timeline.to_chrome_trace()["traceEvents"]:
        if e.get("ph") != "X" or e.get("args", {}).get("step", -1) < first:
            continue
        for column, spans in COLUMNS.items():
            if e["name"] in spans:
                sums[column] += e["dur"] / 1e6
    return [v / (result.workload.steps - first) for v in sums.values()]


def column_table(results: list[dict]) -> str:
    """Published against predicted per-step columns, for the runs that report them."""
    lines = ["| run | gen s (published / predicted) | old_log_prob s | update_actor s |", "|---|---|---|---|"]
    for r in results:
        if not any(r["published_columns"]):
            continue
        cells = [f"{p:.1f} / {q:.1f}" if p or q else "-" for p, q in zip(r["published_columns"],
                                                                         r["predicted_columns"])]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def hundreds_table(runs, results: list[dict]) -> str:
    """The publication's mean step of each hundred steps (from its total-time columns) against the prediction."""
    lines = ["| run | steps 1-100 | 101-200 | 201-300 | 301-400 | predicted |", "|---|---|---|---|---|---|"]
    for run, r in zip(runs, results):
        if run.published_totals_h:
            lines.append(f"| {run.name} | " + " | ".join(f"{x:.0f}" for x in run.hundreds_s())
                         + f" | {r['predicted_s']:.0f} |")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    """The markdown tables: each run, then each baseline / async pair."""
    lines = ["| run | GPUs | published step s | predicted step s | predicted / published |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['gpus']} | {r['published_s']:.1f} | {r['predicted_s']:.1f} | "
                     f"{r['predicted_s'] / r['published_s']:.2f} |")
    lines += ["", "| baseline / async | published speed-up | predicted speed-up | predicted / published |",
              "|---|---|---|---|"]
    for base, fast in zip(results[::2], results[1::2]):
        pub, pred = base["published_s"] / fast["published_s"], base["predicted_s"] / fast["predicted_s"]
        lines.append(f"| {base['name']} / {fast['name']} | {pub:.2f}x | {pred:.2f}x | {pred / pub:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="simulated steps per run (the first 2 are warm-up)")
    parser.add_argument("--out", default="outputs/simulator_published")
    parser.add_argument("--only", default="verl,areal", help="comma-separated: verl, areal")
    args = parser.parse_args(argv)
    from asyncflow.simulator.published_runs import AREAL, VERL

    runs = {"verl": VERL, "areal": AREAL}
    chosen = [run for name in args.only.split(",") for run in runs[name]]
    results = rows(chosen, args.steps)
    text = table(results)
    if any(any(r["published_columns"]) for r in results):
        text += "\n\n" + column_table(results)
    if any(run.published_totals_h for run in chosen):
        text += "\n\n" + hundreds_table(chosen, results)
    print(f"\nPREDICTED against PUBLISHED (one set of constants, no per-case factor)\n\n{text}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

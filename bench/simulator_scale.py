"""At scale, on paper: the sample stream against the colocated baseline for the cluster recipes, from published
H100 figures (``asyncflow.simulator.published``). PREDICTIONS, not measurements: nothing here ran on a GPU.

    python bench/simulator_scale.py [--gpus 256] [--steps 5] [--recipes qwen2.5-7b,...] [--out outputs/simulator_scale]

Weak scaling: each recipe's global batch grows with the GPU count (rows per GPU as in the recipe); response lengths
are the heavy tail of every published case (``published_runs.heavy_tail``: mean ``max_new_tokens / 18``), prompts
of ``PROMPT_LEN`` tokens. The colocated baseline generates on every GPU (the rows dealt evenly over the engines),
pays its switching (``CostModel.switch``: offload, sleep and wake, weight reload), then trains on every GPU. The
sample stream is searched (``search.mode_search``): rollout shares 1/4 .. 3/4, partial and continuous rollout,
staleness 1 and 2; the best is shown with the side that binds it. Both trainers pack rows (sequence packing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = ["qwen2.5-7b", "qwen2.5-32b", "qwen3-30b-a3b"]


def scenario(name: str, gpus: int, steps: int, staleness=(1, 2), models=("partial", "continuous")) -> dict:
    """The colocated baseline and the best sample stream of recipe ``name`` at ``gpus`` GPUs."""
    from asyncflow.recipes_check import load_recipe
    from asyncflow.simulator.published import h100_costs
    from asyncflow.simulator.published_runs import PROMPT_LEN, heavy_tail
    from asyncflow.simulator.search import colocated_baseline, mode_search
    from asyncflow.simulator.workload import draw_lengths, from_config

    recipe, problems = load_recipe(REPO / "recipes" / name)
    if recipe is None:
        raise RuntimeError(problems)
    cfg = recipe.cfg
    base = recipe.cluster.nodes * recipe.cluster.devices_per_node
    tr, ro = cfg.trainer, cfg.rollout
    mp, rtp = tr.tensor_parallel * tr.pipeline_parallel, ro.tensor_parallel
    model = h100_costs(recipe.arch, mp, rollout_tps=(rtp,)).variant(f"device-tp{rtp}")
    w = from_config(cfg, lengths=heavy_tail(ro.max_new_tokens))
    prompts = cfg.workflow.prompts_per_step * gpus // base
    w = dataclasses.replace(w, steps=steps, warmup_steps=2, prompts_per_step=prompts, prompt_len=PROMPT_LEN,
                            packing=True, fixed_shape=False)
    colocated = colocated_baseline(w, model, gpus, mp, rtp)
    choices = mode_search(w, model, gpus, mp, rtp, recipe=recipe, staleness=staleness, models=models,
                          progress=lambda c: print(f"  {name} {gpus}: {c.rollout_model} k={c.max_staleness} "
                                                   f"{c.rollout_instances}x TP{c.rollout_tp} + DP{c.trainer_dp}: "
                                                   f"{c.result.samples_per_s:.1f} samples/s", flush=True))
    best = choices[0]
    # The stream trains what finishes first, the colocated baseline every response as drawn: their tokens differ.
    trained = best.result.trained_lengths
    drawn = [n for step in draw_lengths(w) for n in step]
    return {"recipe": name, "gpus": gpus, "rows_per_step": w.rows_per_step,
            "colocated": colocated.samples_per_s, "colocated_step_s": colocated.step_time_s,
            "switch_s": model.switch.step_s(gpus),
            "stream": best.result.samples_per_s, "stream_step_s": best.result.step_time_s,
            "split": f"{best.rollout_instances}x TP{best.rollout_tp} rollout + DP{best.trainer_dp} trainer",
            "mode": f"{best.rollout_model}, k={best.max_staleness}", "bound": best.bound,
            "dropped": best.result.dropped, "overrides": best.overrides(),
            "trained_len": sum(trained) / len(trained), "drawn_len": sum(drawn) / len(drawn),
            "idle": {k: round(v, 2) for k, v in best.result.idle_fraction.items()}}


def table(rows: list[dict]) -> str:
    """The markdown table of ``scenario`` rows."""
    lines = ["| recipe | GPUs | rows/step | colocated samples/s (switch s/step) | best stream | split | "
             "stream samples/s | stream / colocated | bound by | response tokens trained / drawn | "
             "stream / colocated in trained tokens |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tokens = r["stream"] * r["trained_len"] / (r["colocated"] * r["drawn_len"])
        lines.append(f"| {r['recipe']} | {r['gpus']} | {r['rows_per_step']} | {r['colocated']:.1f} "
                     f"({r['switch_s']:.1f}) | {r['mode']} | {r['split']} | {r['stream']:.1f} | "
                     f"{r['stream'] / r['colocated']:.2f}x | {r['bound']} | {r['trained_len']:.0f} / "
                     f"{r['drawn_len']:.0f} | {tokens:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/simulator_scale")
    parser.add_argument("--gpus", default="256", help="comma-separated GPU counts")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--models", default="partial,continuous", help="rollout models the search tries")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    models = tuple(args.models.split(","))
    rows = [scenario(name, int(gpus), args.steps, models=models) for name in args.recipes.split(",")
            for gpus in args.gpus.split(",")]
    text = table(rows)
    print(f"\nPREDICTED (published H100 figures; not measured)\n\n{text}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

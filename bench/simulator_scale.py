"""At scale, on paper: predicted throughput and best device split of the cluster recipes at 64, 256 and 1,024
H100s, in sync and async, from published H100 figures (``asyncflow.simulator.published``). PREDICTIONS, not
measurements: nothing here ran on a GPU.

    python bench/simulator_scale.py [--out outputs/simulator_scale] [--mfu 0.47] [--steps 5]

Weak scaling: each recipe's global batch grows with the GPU count (rows per GPU as in the recipe), response
lengths are long-tailed (lognormal, median max_new_tokens / 8, sigma 1). For every scale the split search
tries rollout shares of 3/8 .. 3/4 of the GPUs at the recipe's rollout TP (memory checked by
``asyncflow plan``'s estimate), async at the recipe's staleness; sync is shown twice: this loop's sync
(rollout and trainer on their own GPUs, lock-step, at the async-best split) and the colocated baseline the
AsyncFlow paper compares against (every GPU generates, with every prompt of the step in the engine at once,
then every GPU trains). "async partial" is the async-best
split with partial rollout (``rollout.partial``: one engine across steps, newer weights applied under the
running tail, prefixes recomputed), at the same staleness.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = ["qwen2.5-7b", "qwen2.5-32b", "qwen3-30b-a3b"]
SCALES = [64, 256, 1024]
SHARES = [3 / 8, 1 / 2, 5 / 8, 3 / 4]


def scenario(name: str, gpus: int, mfu: float, steps: int) -> dict:
    """Best async split, this loop's sync at that split, and the colocated sync baseline at ``gpus`` GPUs."""
    from asyncflow.recipes_check import load_recipe
    from asyncflow.simulator.published import h100_costs
    from asyncflow.simulator.search import Split, _memory
    from asyncflow.simulator.sim import simulate
    from asyncflow.simulator.workload import from_config

    recipe, problems = load_recipe(REPO / "recipes" / name)
    if recipe is None:
        raise RuntimeError(problems)
    cfg = recipe.cfg
    base = recipe.cluster.nodes * recipe.cluster.devices_per_node
    tr, ro = cfg.trainer, cfg.rollout
    mp, rtp = tr.tensor_parallel * tr.pipeline_parallel, ro.tensor_parallel
    costs = h100_costs(recipe.arch, mp, train_mfu=mfu)
    model = costs.variant(f"device-tp{rtp}")
    w = from_config(cfg, lengths=f"lognormal:{ro.max_new_tokens // 8}:1")
    prompts = cfg.workflow.prompts_per_step * gpus // base
    w = dataclasses.replace(w, steps=steps, warmup_steps=2, prompts_per_step=prompts)
    best = None
    for share in SHARES:
        instances = max(1, round(gpus * share / rtp))
        dp = (gpus - instances * rtp) // mp
        if dp < 1 or (gpus - instances * rtp) % mp or w.rows_per_step % (w.micro_batch_size * dp):
            continue
        split = Split(instances, rtp, dp, True, "")
        split.fits, split.memory = _memory(recipe, split.overrides())
        if not split.fits:
            continue
        trial = dataclasses.replace(w, rollout_instances=instances, data_parallel=dp)
        split.result = simulate(trial, model)
        if best is None or split.result.samples_per_s > best.result.samples_per_s:
            best = split
    at_best = dataclasses.replace(w, rollout_instances=best.rollout_instances, data_parallel=best.trainer_dp)
    partial = simulate(dataclasses.replace(at_best, rollout_model="partial"), model)
    sync_split = simulate(dataclasses.replace(w, mode="sync", max_staleness=0, rollout_instances=best.rollout_instances,
                                              data_parallel=best.trainer_dp), model)
    # The paper's baseline hands each step's prompts to vLLM at once (continuous batching within the step), not
    # in the recipe's rollout_chunk pieces.
    colocated = simulate(dataclasses.replace(w, mode="sync", max_staleness=0, rollout_instances=gpus // rtp,
                                             data_parallel=gpus // mp, rollout_model="continuous"), model)
    return {"recipe": name, "gpus": gpus, "rows_per_step": w.rows_per_step,
            "best": f"{best.rollout_instances}x TP{rtp} rollout + DP{best.trainer_dp} trainer",
            "async": best.result.samples_per_s, "async_step_s": best.result.step_time_s,
            "async_partial": partial.samples_per_s,
            "sync_split": sync_split.samples_per_s, "sync_colocated": colocated.samples_per_s,
            "idle": {k: round(v, 2) for k, v in best.result.idle_fraction.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/simulator_scale")
    parser.add_argument("--mfu", type=float, default=0.47)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    rows = []
    for name in args.recipes.split(","):
        for gpus in SCALES:
            rows.append(scenario(name, gpus, args.mfu, args.steps))
            r = rows[-1]
            print(f"{name} {gpus} GPUs: async {r['async']:.1f} samples/s ({r['best']}), async partial "
                  f"{r['async_partial']:.1f}, sync {r['sync_split']:.1f}, colocated sync {r['sync_colocated']:.1f}",
                  flush=True)
    lines = ["| recipe | GPUs | rows/step | best split (async) | async samples/s | async partial | sync (this loop) | "
             "sync colocated | async / colocated | partial / colocated | scaling eff. vs 64 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        first = next(x for x in rows if x["recipe"] == r["recipe"])
        eff = r["async"] / first["async"] / (r["gpus"] / first["gpus"])
        lines.append(f"| {r['recipe']} | {r['gpus']} | {r['rows_per_step']} | {r['best']} | {r['async']:.1f} | "
                     f"{r['async_partial']:.1f} | {r['sync_split']:.1f} | {r['sync_colocated']:.1f} | "
                     f"{r['async'] / r['sync_colocated']:.2f}x | {r['async_partial'] / r['sync_colocated']:.2f}x | "
                     f"{eff:.0%} |")
    table = "\n".join(lines)
    print(f"\nPREDICTED (published H100 figures, train MFU {args.mfu:.0%}; not measured)\n\n{table}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"table_mfu{int(args.mfu * 100)}.md").write_text(table + "\n")
    (out / f"results_mfu{int(args.mfu * 100)}.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

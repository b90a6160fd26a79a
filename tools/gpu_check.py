"""`make gpu-check`: prove the GPU path on a machine with at least one CUDA GPU, in under 10 minutes.

Runs the real loop (`asyncflow train`, the same entry point as the recipes) on a tiny Qwen2 made locally:

1. ``async`` in float32: Megatron with the Transformer Engine layer spec on a GPU, vLLM's CUDA engine with CUDA
   graphs at a low ``gpu_memory_utilization``, weights through the loop's staging path;
2. ``async`` in bfloat16 (Megatron's mixed-precision optimizer with fp32 master weights);
3. ``sync``, the colocated baseline: vLLM sleeps while Megatron trains, Megatron offloads while vLLM generates.

Each run trains ``--steps`` GRPO steps on the add-one task and must show the reward rising and the live
vLLM-vs-Megatron logprob gap (the same sample scored by both) within the bounds of its dtype: mean and p99
over every checked token, the statistics and bounds of the training loop itself
(``asyncflow.observability.logprob_gap``: 1e-5 in float32; in bfloat16 bounds derived there from measured bf16
kernels). A table follows; the exit status is 1 on any failed check and 2 where there is no GPU (or no
Transformer Engine). With one GPU (the usual Slurm allocation: ``CUDA_VISIBLE_DEVICES`` lists one), Ray
declares that one device and the async runs put rollout and trainer on it in two half-device bundles
(``ray.device_fraction=0.5``), so Ray gives both processes that device.

``--cpu`` runs the same checks on the CPU stack (the tests use it to keep this script working), with the
one-GPU machine's placement on a device that Ray declares (the colocated run offloads and onloads as on a GPU);
it proves nothing about GPUs.

    python tools/gpu_check.py [--steps 20] [--runs async-fp32,async-bf16,sync-fp32] [--out outputs/gpu_check]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from asyncflow.observability.logprob_gap import gap_bound, gap_problems

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes/tiny_cpu/grpo_async.yaml"
RUNS = {  # name: (mode, dtype)
    "async-fp32": ("async", "float32"),
    "async-bf16": ("async", "bfloat16"),
    "sync-fp32": ("sync", "float32"),
}


def gpu_problem() -> str | None:
    """Why this machine cannot run the GPU check, or None."""
    import torch

    if not torch.cuda.is_available():
        return ("no CUDA GPU is visible (torch.cuda.is_available() is False); run this on a machine with at least "
                "one NVIDIA GPU and the `gpu` extra installed (pip install -e '.[gpu]'), or pass --cpu to check the "
                "script itself on the CPU stack")
    from asyncflow.models.megatron import have_transformer_engine

    if not have_transformer_engine():
        return "Transformer Engine is not installed; pip install -e '.[gpu]' pins the version megatron-core 0.16 needs"
    return None


def device_layout(mode: str, devices: int) -> list[str]:
    """Placement overrides for ``devices`` visible GPUs (``--cpu``: the one-GPU layout on a declared device).

    The sync run is colocated on one device in any case. An async run needs a device for rollout and one for
    the trainer: with two or more, Ray's own detection gives them; with one, Ray must declare exactly that one
    (it refuses to declare more GPUs than ``CUDA_VISIBLE_DEVICES`` lists) and the two bundles take half of it
    each, so Ray sets both processes' ``CUDA_VISIBLE_DEVICES`` to it (vLLM's share capped by
    ``rollout.gpu_memory_utilization``).
    """
    if mode == "sync" or devices < 2:
        return ["ray.local_devices=1"] + (["ray.device_fraction=0.5"] if mode == "async" else [])
    return []


def overrides(name: str, steps: int, out: Path, model: Path, cpu: bool, extra: list[str]) -> tuple[list[str], dict]:
    """Config overrides and environment of one run (``extra``: the user's ``--set`` overrides, applied last)."""
    mode, dtype = RUNS[name]
    args = [f"model.path={model}", f"observability.output_dir={out / name}", f"workflow.mode={mode}",
            f"workflow.steps={steps}", "observability.tensorboard=false", f"trainer.params_dtype={dtype}",
            f"rollout.dtype={dtype}", "ray.accelerator=GPU", "ray.cpus_per_device=1"]
    if cpu:  # Megatron and vLLM compute on the CPU; the placement is the one-GPU machine's
        return args + device_layout(mode, 1) + extra, dict(os.environ)
    import torch

    args += ["rollout.gpu_memory_utilization=0.25", "rollout.enforce_eager=false"]
    return args + device_layout(mode, torch.cuda.device_count()) + extra, dict(os.environ)


CLI = [sys.executable, "-m", "asyncflow.cli"]
"""The command that runs ``asyncflow`` (the tests' CPU runs fork its Ray's workers from a preloaded server)."""


def run_one(name: str, steps: int, out: Path, model: Path, cpu: bool, extra: list[str]) -> dict:
    """Train one run through the CLI; return its row of the table."""
    args, env = overrides(name, steps, out, model, cpu, extra)
    cmd = [*CLI, "train", str(RECIPE), *args]
    print(f"gpu-check: {name}: asyncflow train {' '.join(cmd[len(CLI) + 1:])}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=REPO, text=True, capture_output=True)
    row = {"run": name, "mode": RUNS[name][0], "dtype": RUNS[name][1], "wall_s": time.time() - t0}
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    summary_path = out / name / "summary.json"
    if proc.returncode != 0 or not summary_path.is_file():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        return {**row, "ok": False, "why": f"exit {proc.returncode}: " + " | ".join(tail)}
    summary = json.loads(summary_path.read_text())
    rewards = [r for r in summary["rewards"] if r == r]
    k = max(1, min(5, len(rewards) // 4))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    gap = {stat: summary.get(f"fresh_logprob_gap_{stat}") for stat in ("mean", "p99", "max", "tokens")}
    return {**row, "steps": summary["steps"], "reward_first": first, "reward_last": last,
            "gap": gap if gap["tokens"] else {}}


def judge(row: dict, min_gain: float, steps: int) -> dict:
    """Add ``ok`` and ``why`` to a finished run's row."""
    if "ok" in row:
        return row
    why = []
    if row["steps"] != steps:
        why.append(f"{row['steps']} of {steps} steps")
    if row["reward_last"] - row["reward_first"] < min_gain:
        why.append(f"reward {row['reward_first']:.3f} -> {row['reward_last']:.3f} rose less than {min_gain}")
    why += gap_problems(row["gap"], row["dtype"])
    return {**row, "ok": not why, "why": "; ".join(why)}


def table(rows: list[dict]) -> str:
    """The closing table."""
    head = f"{'run':<11} {'mode':<5} {'dtype':<8} {'steps':>5} {'reward first->last':>19} " \
           f"{'gap mean/p99/max (bound mean/p99)':>45} {'wall s':>7}  verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "reward_first" in r:
            reward = f"{r['reward_first']:.3f} -> {r['reward_last']:.3f}"
            bound = gap_bound(r["dtype"])
            gap = "n/a" if not r["gap"] else f"{r['gap']['mean']:.1e}/{r['gap']['p99']:.1e}/{r['gap']['max']:.1e}"
            gap += f" ({bound.mean:.0e}/{bound.p99:.0e})"
            lines.append(f"{r['run']:<11} {r['mode']:<5} {r['dtype']:<8} {r['steps']:>5} {reward:>19} {gap:>45} "
                         f"{r['wall_s']:>7.0f}  {'ok' if r['ok'] else 'FAILED: ' + r['why']}")
        else:
            lines.append(f"{r['run']:<11} {r['mode']:<5} {r['dtype']:<8} {'-':>5} {'-':>19} {'-':>45} "
                         f"{r['wall_s']:>7.0f}  FAILED: {r['why']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per run (default 20)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    parser.add_argument("--out", type=Path, default=REPO / "outputs/gpu_check", help="logs and run outputs")
    parser.add_argument("--min-reward-gain", type=float, default=0.1,
                        help="the mean reward of the last steps must beat the first steps' by this much")
    parser.add_argument("--cpu", action="store_true", help="run the checks on the CPU stack (tests the script)")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable), e.g. --set workflow.prompts_per_step=16")
    args = parser.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
    if not args.cpu and (problem := gpu_problem()):
        print(f"gpu-check: {problem}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    from asyncflow.tiny_model import make_tiny_model

    model = args.out / "tiny_qwen2"
    if not (model / "config.json").is_file():
        make_tiny_model(model, family="qwen2", seed=0)
    rows = []
    for name in runs:
        row = run_one(name, args.steps, args.out, model, args.cpu, args.extra)
        rows.append(judge(row, args.min_reward_gain, args.steps))
        print(f"gpu-check: {name}: {'ok' if rows[-1]['ok'] else 'FAILED: ' + rows[-1]['why']}", flush=True)
    print(table(rows))
    (args.out / "gpu_check.json").write_text(json.dumps(rows, indent=2))
    failed = [r["run"] for r in rows if not r["ok"]]
    print(f"gpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'} "
          f"(logs in {args.out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

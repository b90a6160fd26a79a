"""Predicted against measured: calibrate the simulator here, then predict real runs it was not fitted on.

    python bench/simulator.py [--costs FILE] [--steps 16] [--repeats 3] [--out outputs/bench_simulator] [--cases a,b]

1. Calibration: ``asyncflow profile`` on this machine (or ``--costs`` from an earlier, calibrated profile) times
   isolated engine calls; then the loop runs on its own two calibration workloads (``bench/calibrate.py``,
   lengths clipped at 48 and at 12 tokens), which no case below uses, so every run below is held out. The
   calibration runs are spread over the invocation (before each round of held-out runs, one sync run of each
   workload per variant and two async runs, ``calibration_order``), since a shared machine's speed drifts over
   the half hour of an invocation; the cost file is completed from all of them (``Calibration.apply``,
   ``keep="all"``) once every run is done, and only then is any case predicted.
2. Each case runs for real (``asyncflow train`` in a fresh process) and is simulated with the cost file;
   throughput is rows trained per second after ``WARMUP`` steps in both (the first steps include vLLM and
   Megatron warm-up, which the cost model leaves out on purpose). A real step ends when its last span ends (its
   weights staged), as a simulated one does. Each case runs ``--repeats`` times, the cases interleaved (all once,
   then all again); the measured figure is the median of the repeats, and the table shows every run.
3. Prints predicted against measured for every case, the error, and the async/sync ratios. A measured ratio is
   the median of its per-round ratios (``paired_ratio``): the rounds drift in speed together, and each async case
   runs next to the sync cases it is compared with.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.e2e import BASE, WARMUP, steady_throughput  # noqa: E402  the long-tailed workload of bench/e2e.py

CASES = {
    # name: (overrides on top of recipes/tiny_cpu/grpo_async.yaml, response-length spec for the simulator)
    "longtail sync": (BASE + ["workflow.mode=sync", "workflow.max_staleness=0"], None),
    # Each async case runs next to the sync cases it is compared with: the machine's speed drifts over minutes
    # and the measured ratio is taken round by round (``paired_ratio``).
    "longtail async k=1": (BASE + ["workflow.mode=async", "workflow.max_staleness=1"], None),
    # Sync with one thread per worker (the workers still take turns on both cores): on a heavily shared machine
    # two OpenMP threads per worker slow down erratically, and the 1-thread profile variant covers this case.
    # vLLM's OpenMP threads follow VLLM_CPU_OMP_THREADS_BIND, not torch's thread count: ``ONE_CORE_ENV`` binds
    # them to one core, as in the profile.
    "longtail sync 1 thread": (BASE + ["workflow.mode=sync", "workflow.max_staleness=0",
                                       "workflow.sync_worker_threads=1"], None),
    # The trainer taking rows in arrival order (``trainer.row_order=arrival``): a sync step's micro-batches mix
    # lengths, padded to their longest; the default batches the shortest ready rows.
    "longtail sync arrival": (BASE + ["workflow.mode=sync", "workflow.max_staleness=0", "trainer.row_order=arrival"],
                              None),
    "longtail async k=0": (BASE + ["workflow.mode=async", "workflow.max_staleness=0"], None),
    "longtail async k=2": (BASE + ["workflow.mode=async", "workflow.max_staleness=2"], None),
    # The other rollout models (``simulator.rollout_models``): one engine across steps, weights changed on an
    # empty engine (continuous) or under the running tail (partial, its prefixes recomputed).
    "longtail continuous k=1": (BASE + ["workflow.mode=async", "workflow.max_staleness=1", "rollout.continuous=true"],
                                None),
    "longtail partial k=1": (BASE + ["workflow.mode=async", "workflow.max_staleness=1", "rollout.partial=true"], None),
    # Another length distribution: the add-one task's short answers (at most 4 tokens, as the demo).
    "short sync": (["workflow.mode=sync", "workflow.max_staleness=0", "trainer.micro_batch_size=32",
                    "workflow.prompts_per_step=16", "workflow.score_chunk=32"], "constant:4"),
    "short async k=1": (["workflow.mode=async", "workflow.max_staleness=1", "trainer.micro_batch_size=32",
                         "workflow.prompts_per_step=16", "workflow.score_chunk=32"], "constant:4"),
    "short sync 1 thread": (["workflow.mode=sync", "workflow.max_staleness=0", "trainer.micro_batch_size=32",
                             "workflow.prompts_per_step=16", "workflow.score_chunk=32",
                             "workflow.sync_worker_threads=1"], "constant:4"),
}
STEP_SCALE = {"short sync": 3, "short async k=1": 3, "short sync 1 thread": 3}
"""Cases whose steps are a few times shorter run that many times ``--steps``, so every case is measured over
seconds, not over a second or two of a noisy machine."""
ONE_CORE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
"""Environment of the 1-thread sync runs (``RolloutService`` keeps a bind list that is already set)."""
RATIOS = [("longtail async k=1", "longtail sync"), ("short async k=1", "short sync"),
          ("longtail async k=1", "longtail sync 1 thread"), ("short async k=1", "short sync 1 thread"),
          ("longtail sync", "longtail sync arrival")]
"""The issue's four async/sync ratios, then what shortest-first micro-batching gains a sync step."""


def predict(overrides: list[str], lengths: str | None, costs, steps: int):
    """The simulator's result for the run ``overrides`` describe, and its workload."""
    from asyncflow.config import load_config
    from asyncflow.simulator.report import model_for
    from asyncflow.simulator.sim import simulate
    from asyncflow.simulator.workload import from_config

    cfg = load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", overrides + [f"workflow.steps={steps}"])
    w = dataclasses.replace(from_config(cfg, lengths=lengths), warmup_steps=WARMUP)
    model = model_for(costs, w)
    return simulate(w, model), w


def measure(name: str, overrides: list[str], steps: int, out: Path, repeat: int = 0) -> Path:
    """Run the case for real in a fresh process (as ``asyncflow train``); returns its metrics.jsonl.

    Ray gives its workers niceness 15 by default; on a machine shared with other jobs at niceness 0 that starved
    them, so set ``RAY_worker_niceness=0`` in the environment to compete on equal terms."""
    import subprocess

    run_dir = out / (name.replace(" ", "_").replace("=", "") + (f"-{repeat}" if repeat else ""))
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"), *overrides,
           f"workflow.steps={steps}", f"observability.output_dir={run_dir}", f"model.path={out / 'model'}",
           "observability.progress_every_s=30"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if "workflow.sync_worker_threads=1" in overrides:
        env.update(ONE_CORE_ENV)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{name}: the real run failed\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return run_dir / "metrics.jsonl"


def paired_ratio(results: dict, a: str, s: str) -> tuple[float, list[float]]:
    """The measured ratio of case ``a`` to case ``s``: the median over rounds of the ratio of their runs in the
    same round (``results[name]["rounds"]``: each run's round; an older results.json without it had no failed
    runs, so its runs are in round order), and the per-round ratios.

    Paired, because a shared machine's speed drifts over minutes, shared by every run of a round: a ratio of the
    two cases' medians can take its two medians from different rounds and keep that drift; a per-round ratio
    cancels it (not each run's own noise). With no round in common, the ratio of the medians."""
    by_round = {}
    for name in (a, s):
        runs = results[name].get("runs", [results[name]["measured"]])
        by_round[name] = dict(zip(results[name].get("rounds", range(len(runs))), runs))
    common = [r for r in by_round[a] if r in by_round[s]]
    per_round = [by_round[a][r] / by_round[s][r] for r in common]
    if not per_round:
        return results[a]["measured"] / results[s]["measured"], []
    return statistics.median(per_round), per_round


def render(results: dict) -> str:
    """Predicted against measured. A ratio's measured figure is ``paired_ratio``; its runs column has the
    per-round ratios and the ratio of the medians."""
    lines = ["| case | predicted samples/s | measured samples/s (median) | runs | error | load avg | "
             "bound by, rollout / training +10% |",
             "|---|---|---|---|---|---|---|"]
    raw = {name: r["predicted"] for name, r in results.items()}
    for name, r in results.items():
        runs = " / ".join(f"{x:.1f}" for x in r.get("runs", [r["measured"]]))
        lines.append(f"| {name} | {raw[name]:.1f} | {r['measured']:.1f} | {runs} | "
                     f"{raw[name] / r['measured'] - 1:+.0%} | {r['load']:.1f} | {r.get('bound', '-')} |")
    for a, s in RATIOS:
        if a in results and s in results:
            pr, (mr, per_round) = raw[a] / raw[s], paired_ratio(results, a, s)
            of_medians = results[a]["measured"] / results[s]["measured"]
            rounds = " / ".join(f"{x:.2f}" for x in per_round) + f" (ratio of the medians {of_medians:.2f})"
            lines.append(f"| ratio {a} / {s} | {pr:.2f} | {mr:.2f} | {rounds} | {pr - mr:+.2f} | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", default=None, help="cost file (default: profile this machine first)")
    parser.add_argument("--steps", type=int, default=16, help="steps of each real run (short cases: STEP_SCALE x)")
    parser.add_argument("--repeats", type=int, default=3, help="real runs per case (interleaved); the median is used")
    parser.add_argument("--out", default="outputs/bench_simulator")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--variants", default=None, help="profile only these variants (e.g. 1)")
    parser.add_argument("--table-from", default=None, help="print the table of an earlier results.json and exit")
    args = parser.parse_args(argv)
    if args.table_from:
        print(render(json.loads(Path(args.table_from).read_text())))
        return 0
    out = Path(args.out).resolve()
    from asyncflow.config import load_config
    from asyncflow.simulator.costs import load_costs
    from asyncflow.simulator.profile import profile
    from asyncflow.simulator.report import model_for
    from asyncflow.simulator.sensitivity import sensitivity
    from bench.calibrate import Calibration, calibration_order, engine_speed_line

    recipe = REPO / "recipes/tiny_cpu/grpo_async.yaml"
    calibration = None
    if args.costs is None:  # the engine grid now; the calibration runs between the held-out rounds (below)
        args.costs = str(out / "costs.json")
        profile(load_config(recipe, BASE + [f"model.path={out / 'model'}"]), args.costs,
                variants=args.variants.split(",") if args.variants else None)
        costs = load_costs(args.costs)
        calibration = Calibration(costs.variants, recipe, Path(args.costs), str(out / "model"))
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    runs, rounds, loads = {}, {}, {}
    for repeat in range(args.repeats):
        if calibration is not None:  # one run of each calibration workload per variant, and two async runs
            for variant, mode, workload in calibration_order([v for v in costs.variants if v != "device"], 2):
                print(f"calibration: variant {variant}, {mode}, workload {workload} (round {repeat + 1}) ...",
                      flush=True)
                calibration.run(variant, mode, workload)
        for name in names:
            overrides, lengths = CASES[name]
            print(f"{name}: running it for real (run {repeat + 1} of {args.repeats}) ...", flush=True)
            steps = args.steps * STEP_SCALE.get(name, 1)
            try:
                metrics = measure(name, overrides, steps, out, repeat)
            except RuntimeError as exc:  # one failed run (e.g. a missed heartbeat on an overloaded machine) is reported
                print(f"{name}: FAILED, left out: {str(exc)[-300:]}", flush=True)
                continue
            runs.setdefault(name, []).append(steady_throughput(metrics, WARMUP))
            rounds.setdefault(name, []).append(repeat)
            loads.setdefault(name, []).append(os.getloadavg()[0])
            print(f"{name}: measured {runs[name][-1]:.1f} samples/s", flush=True)
            (out / "runs.json").write_text(json.dumps(runs, indent=2))  # after every run: a crash keeps them
    if calibration is not None:
        calibration.apply(keep="all")
        costs.save(args.costs)
        for variant in calibration.sync:
            print(engine_speed_line(variant, costs.variant(variant).service))
    costs = load_costs(args.costs)
    results = {}
    for name in runs:  # predicted only now: the cost file is complete once every calibration run is in
        overrides, lengths = CASES[name]
        steps = args.steps * STEP_SCALE.get(name, 1)
        result, w = predict(overrides, lengths, costs, steps)
        sens = sensitivity(w, model_for(costs, w), result)  # the prediction's bound side and tipping
        results[name] = {"predicted": result.samples_per_s, "measured": statistics.median(runs[name]),
                         "runs": runs[name], "rounds": rounds[name], "load": sum(loads[name]) / len(loads[name]),
                         "bound": sens.bottleneck + (" (tipping)" if sens.tipping else "") + ", " + sens.cell()}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    table = render(results)
    print(f"\nPredicted against measured (costs {args.costs}, {args.steps} steps, throughput after {WARMUP}, "
          f"{args.repeats} runs a case)\n")
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What this machine's noise allows: how often an unbiased simulator would meet the issue's targets.

    python bench/noise_budget.py RESULTS.json [RESULTS.json ...] [--runs 4,8,16] [--trials 20000]

``RESULTS.json``: the ``results.json`` of one ``bench/simulator.py`` invocation (every held-out run of every
case). For each, the run-to-run spread of its held-out runs, ``sigma``: the pooled standard deviation of the
runs' log throughput about each case's mean. Then a Monte Carlo of a simulator with no bias at all, on a machine
with that noise:

- a case's measured figure is the median of ``runs`` runs, each its true throughput times ``exp(N(0, sigma))``;
- its prediction is its true throughput times ``exp(N(0, sigma**2 / runs))``: the calibration runs are loop runs
  on the same machine, one a round, and their mean sets the service costs. One draw is shared by every case of
  one profile variant (sync with two threads a worker: variant 2; the rest: variant 1), as one cost file is
  (with a shift between rounds, below, the draws share the mean of the rounds' shifts);
- true throughputs are the invocation's measured medians.

``round_spread`` splits ``sigma`` into a shift shared by every case of a round (the machine's speed drifts over
minutes) and each run's own noise; the shift moves the cases' medians together, and a paired ratio (the median of
per-round ratios, as ``bench/simulator.py`` measures it since 2026-12-03) cancels it.

It prints ``sigma``, its share between rounds and, for each number of runs, the chance that every case is within
15% (``TOLERANCE``), that every async/sync ratio is within 0.15 (``RATIO_TOLERANCE``, as a ratio of medians and
paired), and both: what one invocation can show on this machine whatever the model. It leaves out the async
calibration's own noise (``async_floating`` is fitted on its own runs) and the profile's, so the chances it prints
are, if anything, too high.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.simulator import CASES, RATIOS  # noqa: E402

TOLERANCE = 0.15
RATIO_TOLERANCE = 0.15


def variant_of(name: str) -> str:
    """The profile variant whose costs predict case ``name``: ``2`` for sync with two threads a worker."""
    overrides = CASES[name][0]
    one = "workflow.mode=async" in overrides or "workflow.sync_worker_threads=1" in overrides
    return "1" if one else "2"


def pooled_sigma(results: dict) -> float:
    """The pooled standard deviation of log throughput of the runs about their case's mean (cases with one run
    add nothing)."""
    squares, dof = 0.0, 0
    for r in results.values():
        logs = np.log(np.asarray(r["runs"], dtype=float))
        squares += float(((logs - logs.mean()) ** 2).sum())
        dof += len(logs) - 1
    if dof == 0:
        raise ValueError("no case has more than one run: the spread is unknown")
    return (squares / dof) ** 0.5


def round_spread(results: dict) -> tuple[float, float]:
    """(between rounds, within a round): the standard deviations of a shift of log throughput that every case of a
    round shares and of each run's own, from an additive fit (case + round) over the rounds every case ran in
    (``results[name]["rounds"]``, or the runs' order in an older results.json)."""
    by_round = {n: dict(zip(r.get("rounds", range(len(r["runs"]))), r["runs"])) for n, r in results.items()}
    common = sorted(set.intersection(*(set(rounds) for rounds in by_round.values())))
    if len(results) < 2 or len(common) < 2:
        raise ValueError("the rounds' spread needs two cases run in at least two of the same rounds")
    logs = np.log(np.array([[by_round[n][r] for r in common] for n in results]))  # cases x rounds
    cases, rounds = logs.shape
    residual = logs - logs.mean(axis=1, keepdims=True) - logs.mean(axis=0, keepdims=True) + logs.mean()
    within = float((residual ** 2).sum()) / ((cases - 1) * (rounds - 1))
    shifts = logs.mean(axis=0) - logs.mean()  # each round's mean over cases also carries within / cases
    between = max(0.0, float(shifts.var(ddof=1)) - within / cases)
    return between ** 0.5, within ** 0.5


def chances(results: dict, sigma: float, runs: int, trials: int = 20000, seed: int = 0, round_sigma: float = 0.0,
            paired: bool = False) -> tuple[float, float, float]:
    """(every case within ``TOLERANCE``, every ratio within ``RATIO_TOLERANCE``, both) for an unbiased simulator,
    ``runs`` held-out runs a case and as many calibration rounds, on a machine with run-to-run noise ``sigma``, of
    which ``round_sigma`` is a shift shared by every run of one round. A measured ratio is the ratio of the two
    medians, or with ``paired`` the median of the per-round ratios (``bench.simulator.paired_ratio``), which the
    shift leaves alone."""
    rng = np.random.default_rng(seed)
    names = list(results)
    true = np.array([results[n]["measured"] for n in names])
    round_sigma = min(round_sigma, sigma)
    within = (sigma ** 2 - round_sigma ** 2) ** 0.5
    shift = rng.normal(0.0, round_sigma, (trials, 1, runs))
    variants = sorted({variant_of(n) for n in names})  # the calibration runs ran in the same rounds, beside them
    calib = {v: shift.mean(axis=2)[:, 0] + rng.normal(0.0, within / runs ** 0.5, trials) for v in variants}
    predicted = true * np.exp(np.stack([calib[variant_of(n)] for n in names], axis=1))
    noise = np.exp(shift + rng.normal(0.0, within, (trials, len(names), runs)))
    measured = true * np.median(noise, axis=2)
    cases_ok = (np.abs(predicted / measured - 1) <= TOLERANCE).all(axis=1)
    index = {n: i for i, n in enumerate(names)}
    pairs = [(index[a], index[s]) for a, s in RATIOS[:4] if a in index and s in index]
    ratios_ok = np.ones(trials, dtype=bool)
    for a, s in pairs:
        if paired:
            ratio = true[a] / true[s] * np.median(noise[:, a, :] / noise[:, s, :], axis=1)
        else:
            ratio = measured[:, a] / measured[:, s]
        ratios_ok &= np.abs(predicted[:, a] / predicted[:, s] - ratio) <= RATIO_TOLERANCE
    return float(cases_ok.mean()), float(ratios_ok.mean()), float((cases_ok & ratios_ok).mean())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results.json of bench/simulator.py invocations")
    parser.add_argument("--runs", default="4,8,16", help="held-out runs a case (and calibration rounds) to try")
    parser.add_argument("--trials", type=int, default=20000)
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.runs.split(",")]
    print("| invocation | cases | sigma (one run) | of it, between rounds | runs a case | P(cases within 15%) "
          "| P(ratios within 0.15), of medians | P(both), of medians | P(ratios), paired | P(both), paired |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in args.results:
        results = json.loads(Path(path).read_text())
        unknown = sorted(set(results) - set(CASES))
        if unknown:
            raise SystemExit(f"{path}: cases bench/simulator.py does not know: {unknown}")
        sigma = pooled_sigma(results)
        between, _ = round_spread(results)
        for runs in counts:
            c, r, both = chances(results, sigma, runs, args.trials, round_sigma=between)
            _, rp, both_p = chances(results, sigma, runs, args.trials, round_sigma=between, paired=True)
            print(f"| {path} | {len(results)} | {sigma:.1%} | {between:.1%} | {runs} | {c:.0%} | {r:.0%} | {both:.0%} "
                  f"| {rp:.0%} | {both_p:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

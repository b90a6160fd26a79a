"""What this machine's noise allows: how often an unbiased simulator would meet the issue's targets.

    python bench/noise_budget.py RESULTS.json [RESULTS.json ...] [--runs 4,8,16] [--trials 20000]

``RESULTS.json``: the ``results.json`` of one ``bench/simulator.py`` invocation (every held-out run of every
case). For each, the run-to-run spread of its held-out runs, ``sigma``: the pooled standard deviation of the
runs' log throughput about each case's mean. Then a Monte Carlo of a simulator with no bias at all, on a machine
with that noise:

- a case's measured figure is the median of ``runs`` runs, each its true throughput times ``exp(N(0, sigma))``;
- its prediction is its true throughput times ``exp(N(0, sigma**2 / runs))``: the calibration runs are loop runs
  on the same machine, one a round, and their mean sets the service costs. One draw is shared by every case of
  one profile variant (sync with two threads a worker: variant 2; the rest: variant 1), as one cost file is;
- true throughputs are the invocation's measured medians.

It prints ``sigma`` and, for each number of runs, the chance that every case is within 15% (``TOLERANCE``), that
every async/sync ratio is within 0.15 (``RATIO_TOLERANCE``), and both: what one invocation can show on this
machine whatever the model. It leaves out the async calibration's own noise (``async_floating`` is fitted on its
own runs) and the profile's, so the chances it prints are, if anything, too high.
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


def chances(results: dict, sigma: float, runs: int, trials: int = 20000, seed: int = 0) -> tuple[float, float, float]:
    """(every case within ``TOLERANCE``, every ratio within ``RATIO_TOLERANCE``, both) for an unbiased simulator,
    ``runs`` held-out runs a case and as many calibration rounds, on a machine with run-to-run noise ``sigma``."""
    rng = np.random.default_rng(seed)
    names = list(results)
    true = np.array([results[n]["measured"] for n in names])
    variants = sorted({variant_of(n) for n in names})
    calib = {v: rng.normal(0.0, sigma / runs ** 0.5, trials) for v in variants}
    predicted = true * np.exp(np.stack([calib[variant_of(n)] for n in names], axis=1))
    measured = true * np.median(np.exp(rng.normal(0.0, sigma, (trials, len(names), runs))), axis=2)
    cases_ok = (np.abs(predicted / measured - 1) <= TOLERANCE).all(axis=1)
    index = {n: i for i, n in enumerate(names)}
    pairs = [(index[a], index[s]) for a, s in RATIOS[:4] if a in index and s in index]
    ratios_ok = np.ones(trials, dtype=bool)
    for a, s in pairs:
        error = predicted[:, a] / predicted[:, s] - measured[:, a] / measured[:, s]
        ratios_ok &= np.abs(error) <= RATIO_TOLERANCE
    return float(cases_ok.mean()), float(ratios_ok.mean()), float((cases_ok & ratios_ok).mean())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results.json of bench/simulator.py invocations")
    parser.add_argument("--runs", default="4,8,16", help="held-out runs a case (and calibration rounds) to try")
    parser.add_argument("--trials", type=int, default=20000)
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.runs.split(",")]
    print("| invocation | cases | sigma (one run) | runs a case | P(cases within 15%) | P(ratios within 0.15) "
          "| P(both) |")
    print("|---|---|---|---|---|---|---|")
    for path in args.results:
        results = json.loads(Path(path).read_text())
        unknown = sorted(set(results) - set(CASES))
        if unknown:
            raise SystemExit(f"{path}: cases bench/simulator.py does not know: {unknown}")
        sigma = pooled_sigma(results)
        for runs in counts:
            c, r, both = chances(results, sigma, runs, args.trials)
            print(f"| {path} | {len(results)} | {sigma:.1%} | {runs} | {c:.0%} | {r:.0%} | {both:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

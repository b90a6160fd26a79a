"""``bench/noise_budget.py``: the spread of an invocation's runs, and the chance an unbiased simulator meets the
targets under it (docs/simulator.md, "What the noise allows")."""

import json
import math

import pytest

from bench.noise_budget import chances, main, pooled_sigma, round_spread, variant_of

CASES = ["longtail sync", "longtail sync 1 thread", "longtail async k=1", "short sync", "short async k=1"]


def results_with(spread: float) -> dict:
    """Three runs a case at ``exp(-spread)``, 1 and ``exp(spread)`` times its median, in that order: every case slow
    in round 0 and fast in round 2, a shift the rounds share."""
    out = {}
    for i, name in enumerate(CASES):
        median = 100.0 * (i + 1)
        out[name] = {"measured": median, "runs": [median * math.exp(-spread), median, median * math.exp(spread)]}
    return out


def test_variant_follows_the_threads_of_the_case():
    assert variant_of("longtail sync") == "2"
    assert variant_of("short sync") == "2"
    assert variant_of("longtail sync 1 thread") == "1"
    assert variant_of("short async k=1") == "1"


def test_pooled_sigma_is_the_spread_of_log_throughput():
    assert pooled_sigma(results_with(0.1)) == pytest.approx(0.1)
    lone = {"longtail sync": {"measured": 5.0, "runs": [5.0]}}
    with pytest.raises(ValueError, match="more than one run"):
        pooled_sigma(lone)


def test_a_quiet_machine_always_meets_the_targets_and_a_noisy_one_rarely():
    assert chances(results_with(0.0), 0.0, 4, trials=200) == (1.0, 1.0, 1.0)
    noisy_cases, noisy_ratios, noisy_both = chances(results_with(0.3), 0.3, 4, trials=4000)
    assert noisy_cases < 0.2 and noisy_ratios < 0.2 and noisy_both <= min(noisy_cases, noisy_ratios)
    more_cases, more_ratios, _ = chances(results_with(0.3), 0.3, 32, trials=4000)
    assert more_cases > noisy_cases and more_ratios > noisy_ratios  # more runs a case, a smaller error


def test_round_spread_tells_a_shared_shift_from_each_runs_own_noise():
    between, within = round_spread(results_with(0.1))
    assert between == pytest.approx(0.1) and within == pytest.approx(0.0, abs=1e-9)
    own = results_with(0.1)
    for i, r in enumerate(own.values()):  # each case's runs in its own order: no shift is shared any more
        r["runs"] = r["runs"][i % 3:] + r["runs"][:i % 3]
    between, within = round_spread(own)
    assert within > 0.05 and between < within
    with pytest.raises(ValueError, match="two cases"):
        round_spread({"longtail sync": {"measured": 1.0, "runs": [1.0, 2.0]}})


def test_a_paired_ratio_gains_when_the_rounds_share_most_of_the_noise():
    results = results_with(0.3)
    _, of_medians, _ = chances(results, 0.3, 4, trials=4000, round_sigma=0.28)
    _, paired, _ = chances(results, 0.3, 4, trials=4000, round_sigma=0.28, paired=True)
    assert of_medians < 0.3 and paired > of_medians
    # All the noise a shift of the whole round, the calibration runs' too: every ratio exact, however measured.
    assert chances(results, 0.3, 4, trials=500, round_sigma=0.3, paired=True)[1] == 1.0


def test_main_prints_a_row_per_invocation_and_count(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results_with(0.1)))
    assert main([str(path), "--runs", "4,8", "--trials", "500"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {path}")]
    assert len(rows) == 2 and "| 10.0% | 10.0% | 4 |" in rows[0] and "| 10.0% | 10.0% | 8 |" in rows[1]
    path.write_text(json.dumps({"no such case": {"measured": 1.0, "runs": [1.0, 2.0]}}))
    with pytest.raises(SystemExit, match="does not know"):
        main([str(path)])

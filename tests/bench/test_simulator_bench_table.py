"""``bench/simulator.py``'s table: predicted against measured, with the bound side of each prediction.

The numbers are made up (the bench itself takes about 50 minutes of real runs: docs/simulator.md); what is
checked is the rendering, including a results.json written before the bound column existed (``--table-from``).
"""

from bench.simulator import paired_ratio, render


def test_table_has_errors_ratios_and_the_bound_side():
    results = {
        "longtail sync": {"predicted": 50.0, "measured": 60.0, "runs": [55.0, 60.0, 70.0], "load": 2.0,
                          "slowdown": 1.0, "bound": "balanced, -5% / -4%"},
        "longtail async k=1": {"predicted": 110.0, "measured": 100.0, "runs": [100.0, 120.0, 77.0], "load": 2.5,
                               "slowdown": 1.0, "bound": "training (tipping), +4% / -9%"},
    }
    table = render(results).splitlines()
    assert table[0].endswith("| bound by, rollout / training +10% |")
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "| longtail sync | 50.0 | 60.0 | 55.0 / 60.0 / 70.0 | -17% |" in table[2]
    assert table[3].endswith("| training (tipping), +4% / -9% |")
    # Per round 100/55, 120/60, 77/70: the median 1.82; the ratio of the medians, 100/60, is shown beside it.
    assert ("| ratio longtail async k=1 / longtail sync | 2.20 | 1.82 | 1.82 / 2.00 / 1.10 (ratio of the medians "
            "1.67) | +0.38 |") in table[4]
    del results["longtail sync"]["bound"]  # an older results.json
    assert render(results).splitlines()[2].endswith("| - |")


def test_paired_ratio_takes_each_round_apart_and_skips_a_failed_run():
    # Round 1 ran twice as fast for both cases: the per-round ratios stay 2 whatever the round's speed, where the ratio
    # of the medians, 200 / 200, mixes rounds.
    results = {"a": {"measured": 200.0, "runs": [200.0, 400.0, 150.0], "rounds": [0, 1, 2]},
               "s": {"measured": 200.0, "runs": [100.0, 200.0, 300.0], "rounds": [0, 1, 3]}}
    ratio, per_round = paired_ratio(results, "a", "s")
    assert per_round == [2.0, 2.0] and ratio == 2.0  # round 2 of "a" has no "s" run, round 3 of "s" no "a" run
    results["s"]["rounds"] = [3, 4, 5]  # no round in common: the ratio of the medians
    assert paired_ratio(results, "a", "s") == (1.0, [])

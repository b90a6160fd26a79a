"""``bench/simulator.py``'s table: predicted against measured, with the bound side of each prediction.

The numbers are made up (the bench itself takes about 50 minutes of real runs: docs/simulator.md); what is
checked is the rendering, including a results.json written before the bound column existed (``--table-from``).
"""

from bench.simulator import render


def test_table_has_errors_ratios_and_the_bound_side():
    results = {
        "longtail sync": {"predicted": 50.0, "measured": 60.0, "runs": [55.0, 60.0, 70.0], "load": 2.0,
                          "slowdown": 1.0, "bound": "balanced, -5% / -4%"},
        "longtail async k=1": {"predicted": 110.0, "measured": 100.0, "runs": [100.0], "load": 2.5,
                               "slowdown": 1.0, "bound": "training (tipping), +4% / -9%"},
    }
    table = render(results).splitlines()
    assert table[0].endswith("| bound by, rollout / training +10% |")
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "| longtail sync | 50.0 | 60.0 | 55.0 / 60.0 / 70.0 | -17% |" in table[2]
    assert table[3].endswith("| training (tipping), +4% / -9% |")
    assert "| ratio longtail async k=1 / longtail sync | 2.20 | 1.67 | | +0.53 |" in table[4]
    del results["longtail sync"]["bound"]  # an older results.json
    assert render(results).splitlines()[2].endswith("| - |")

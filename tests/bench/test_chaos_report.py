"""The chaos benchmark's (``bench/chaos.py``) reading of a run: the processes the ``host`` fault kills, named by
program, and the cost of a rollout instance's death from two runs' step times and the generate spans. The runs
themselves (fault injection on fake engines, the two-host cluster) are the benchmark's, not part of the suite."""

from __future__ import annotations

import json
import subprocess
import time

import psutil

from bench.chaos import account, cost_exact, cost_table, generate_spans, over_own_pace, process_names, steps_wall


def test_the_processes_of_a_host_are_named_by_program():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(sleeper.pid).cmdline() != ["sleep", "30"] and time.monotonic() < deadline:
            time.sleep(0.01)  # forked, not yet exec'd
        assert process_names([sleeper.pid, sleeper.pid, 2**22 + 7]) == {"sleep": 2}  # the last one does not exist
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_cost_of_a_death_is_the_extra_step_time_against_the_regeneration_time(tmp_path):
    spans = [{"ph": "X", "name": "generate", "dur": 2e6, "args": {"rows": 4}},
             {"ph": "X", "name": "generate", "dur": 1e6, "args": {"rows": 2}},
             {"ph": "X", "name": "score", "dur": 9e6, "args": {"rows": 8}}]
    (tmp_path / "timeline.json").write_text(json.dumps({"traceEvents": spans}))
    assert generate_spans(tmp_path) == [(2.0, 4), (1.0, 2)]
    assert steps_wall([{"time/elapsed_s": 1.5}, {"time/elapsed_s": 2.0}, {"time/elapsed_s": 9.5}]) == 8.0
    # Steps of 1 s until step 5, then one of 3 s and 1 s again: 2 s over its pace; a step 0 of its start-up and a
    # faster step 2 do not move the median.
    times = [0.0, 10.0, 11.0, 11.5, 12.5, 13.5, 14.5, 17.5, 18.5]
    killed = [{"step": s, "time/elapsed_s": t} for s, t in enumerate(times)]
    assert over_own_pace(killed, 5, warm=1) == 2.0
    slow = [{"step": s, "time/elapsed_s": 2.0 * s} for s in range(9)]  # slower all along: nothing over its pace
    assert over_own_pace(slow, 5, warm=1) == 0.0
    assert over_own_pace(slow, 1, warm=1) is None and over_own_pace(slow, 8, warm=1) is None
    pair = {"healthy_s": 8.0, "killed_s": 11.0, "extra_s": 3.0, "detect_s": 0.1, "restart_s": 2.5,
            "released_rows": 12, "per_row_s": 0.5, "regen_s": 6.0, "ratio": 0.5, "paced_extra_s": 2.4,
            "paced_ratio": 0.4, "healthy_samples_per_s": 40.0, "lost": 0, "twice": 0, "corrupted": 0}
    spare = {**pair, "killed_s": 8.5, "extra_s": 0.5, "restart_s": 0.1, "ratio": 0.5 / 6.0, "twice": 4,
             "paced_ratio": None}
    cost = {"steps": 30, "spares": 1, "token_s": 0.05,
            "pairs": {"restart": [pair, {"error": "the run failed"}], "spare": [spare]},
            "medians": {"restart": pair, "spare": spare}}
    table = cost_table(cost)
    assert table.splitlines()[0] == ("| rollout-instance death, fake engines (0.05 s per engine step), median of pairs "
                                     "| no spare (restarted), 1 pair(s) | 1 warm spare(s) (promoted), 1 pair(s) |")
    assert "| healthy run, steps from the kill (step ~10) to 29, s | 8.0 | 8.0 |" in table
    assert "| death seen to the slot's loop running again, s | 2.50 | 0.10 |" in table
    assert "| ratio (target < 2) | 0.50 | 0.08 |" in table
    assert "| ratio of that (target < 2) | 0.40 | - |" in table
    assert "| samples lost / trained twice / corrupted, killed runs summed | 0 / 0 / 0 | 0 / 4 / 0 |" in table
    assert not cost_exact(cost) and cost_exact({**cost, "pairs": {"restart": [pair]}})
    assert "no spare (restarted): ratio of each pair: 0.50, failed" in table
    assert "no spare (restarted): ratio against each run's own pace of each pair: 0.40, failed" in table
    assert "1 warm spare(s) (promoted): ratio of each pair: 0.08" in table
    assert table.endswith("1 warm spare(s) (promoted): ratio against each run's own pace of each pair: -")
    assert cost_table({**cost, "medians": {}}).startswith("rollout-instance death cost: every pair failed")


def test_a_restart_from_checkpoint_that_trains_every_prompt_once_counts_nothing_lost():
    # 3 steps of 8 prompts x 4 samples (the benchmark's sizes): step 1 trained once, after the restart.
    trained = {str(s): [g for g in range(s * 8, (s + 1) * 8) for _ in range(4)] for s in range(3)}
    fault = {"kind": "host", "at_step": 0}
    assert account({"trained_groups": trained}, [fault], 3) == {"lost": 0, "twice": 0, "corrupted": 0}
    trained["2"] += [16] * 4  # a group of step 2 trained twice
    assert account({"trained_groups": trained}, [fault], 3)["twice"] == 4

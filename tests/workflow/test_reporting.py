"""The driver's reports: merging the reports of one step from several rollout instances
(``workflow.rollout_instances``), and which services' reports a step waits for before it is logged."""

import pytest

from asyncflow.workflow.reporting import merge_metric
from tests.recipe_runs import bare_reporter, service_report


def _merged(key: str, values: list[float]) -> float:
    value = values[0]
    for seen, new in enumerate(values[1:], start=1):
        value = merge_metric(key, value, new, seen)
    return value


def test_counts_add_up_and_extremes_are_kept():
    assert _merged("rollout/rows", [16, 16, 8]) == 40
    assert _merged("rollout/weight_swaps", [0, 2]) == 2
    assert _merged("agent/errors", [3, 4]) == 7
    # A token lag above the bound on one engine must not be hidden by another engine reporting after it.
    assert _merged("staleness/token_lag_max", [2, 0, 1]) == 2
    assert _merged("staleness/token_lag_min", [1, 0, 1]) == 0
    assert _merged("rollout/version", [5, 4, 5]) == 4  # the oldest version the step was generated with


def test_means_are_over_the_reports_and_other_values_the_latest():
    assert _merged("rollout/in_flight_mean", [16, 8, 12]) == pytest.approx(12)
    assert _merged("weights/received_mb_per_rank", [1.5, 2.5]) == 2.5


def test_a_step_is_logged_only_with_its_reward_report(tmp_path, shared_ray):
    """The reward worker posts its report after its last put, so the advantage and the actor can be done with the
    step before it arrives (seen in a suite run: a step logged without ``reward/failures``). The step waits for it.
    On the tests' Ray: the driver logs its object store."""
    reporter = bare_reporter(tmp_path, 2)
    reporter.collect([service_report(s, 0, {f"{s}/x": 1.0}) for s in ("rollout", "advantage", "actor")])
    assert reporter.trained_steps == 0 and not reporter.history
    reporter.collect([service_report("reward", 0, {"reward/failures": 0.0, "reward/rows": 32.0})])
    assert reporter.trained_steps == 1
    assert reporter.history[0]["reward/failures"] == 0.0 and reporter.history[0]["reward/rows"] == 32.0
    reporter.observer.close()


def test_a_step_ends_on_its_clock_when_the_trainers_last_span_ends(tmp_path, shared_ray):
    """``time/elapsed_s`` of a step is the end of the actor's last span of it, whatever the other services' reports
    carry: a rollout instance's load of the step's new weights may end after it and come with this step's report
    or the next one's (seen in a suite run: a step 0.08 s late), which made the per-step times depend on that."""
    reporter = bare_reporter(tmp_path, 2)
    t0 = reporter.t_start

    def span(group: str, end: float) -> dict:
        return {"group": group, "name": "work", "worker": 0, "start": t0 + 1.0, "end": t0 + end, "args": {}}

    # The rollout's load of the new weights ends after the actor staged them.
    ends = {"rollout": 12.0, "advantage": 5.0, "reward": 4.0, "actor": 10.0}
    reporter.collect([service_report(s, 0, {f"{s}/x": 1.0}, spans=[span(s, end)]) for s, end in ends.items()])
    assert reporter.history[0]["time/elapsed_s"] == pytest.approx(10.0)
    reporter.observer.close()

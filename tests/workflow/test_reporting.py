"""Merging the reports of one step from several rollout instances (``workflow.rollout_instances``)."""

import pytest

from asyncflow.workflow.reporting import merge_metric


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

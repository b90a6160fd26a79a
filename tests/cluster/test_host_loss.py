"""The loss of a whole host on the two-host cluster (``tools/two_host.py``), through the chaos benchmark's ``host``
fault (``bench.chaos.host_fault``): a fake-engine run over both hosts with a checkpoint every step, and SIGKILL of
every process in host B's network namespace (its Ray node, and the TransferQueue controller or storage units Ray
placed there) once three steps are logged. Checked: the run restarts from its checkpoint on host A alone and
finishes, every prompt trained once in its own step, and the kill took host B's Ray node and a TransferQueue server
with it. Making namespaces needs root: without it the test fails under ``CI`` and is skipped otherwise, as the other
cluster tests are."""

from __future__ import annotations

import argparse
import os

import pytest

from bench.chaos import host_fault


@pytest.mark.slow  # a cluster of its own (~17 s) and a run started twice
def test_a_lost_host_restarts_the_run_from_its_checkpoint_on_the_host_left(tmp_path, tiny_model_dir):
    args = argparse.Namespace(out=tmp_path, host_steps=10, seed=0)
    record, totals = host_fault(args, tiny_model_dir)
    if record.get("error", "").startswith("no two-host cluster"):
        (pytest.fail if os.environ.get("CI") else pytest.skip)(record["error"])
    assert "error" not in record, record
    assert record["how"] in ("restarted from checkpoint (storage lost)", "restarted from checkpoint (controller lost)")
    assert record["on_host_b"].get("raylet") == 1 and record["on_host_b"].get("_ServerActor", 0) >= 1, record
    assert totals == {"lost": 0, "twice": 0, "corrupted": 0}, totals
    assert record["recovered_s"] is not None and record["steps_redone"] == 0  # a checkpoint every step

"""The loss of a whole host on the two-host cluster (``tools/two_host.py``), through the chaos benchmark's host
faults, each a fake-engine run on a cluster of its own with a checkpoint every step and SIGKILL of every process in
host B's network namespace once three steps are logged (host A's Ray workers forked from the tests' server,
``tests.zygote.host_a_options``; host B's start the normal way):

- ``host`` (``bench.chaos.host_fault``): host B runs Ray-placed TransferQueue servers only. The run restarts from its
  checkpoint on host A alone and finishes, every prompt trained once in its own step.
- ``host-rollout`` (``bench.chaos.host_rollout_fault``): host B runs one of two rollout instances, fed through the
  weight relay. The run is not restarted: it goes on with host A's instance and leaves the lost one out.

Making namespaces needs root: without it the tests fail under ``CI`` and are skipped otherwise, as the other
cluster tests are."""

from __future__ import annotations

import argparse
import os

import pytest

from bench.chaos import host_fault, host_rollout_fault
from tests.zygote import enabled, host_a_options, session_server

STEPS = 22  # of the host-rollout run: the instance is left out about 12 steps in (5 s after the death is seen)


@pytest.mark.slow  # a cluster of its own (~17 s) and a run started twice
def test_a_lost_host_restarts_the_run_from_its_checkpoint_on_the_host_left(tmp_path, tiny_model_dir):
    args = argparse.Namespace(out=tmp_path, host_steps=10, seed=0, cluster_options=host_a_options())
    before = session_server().forks()
    record, totals = host_fault(args, tiny_model_dir)
    if record.get("error", "").startswith("no two-host cluster"):
        (pytest.fail if os.environ.get("CI") else pytest.skip)(record["error"])
    assert "error" not in record, record
    assert record["how"] in ("restarted from checkpoint (storage lost)", "restarted from checkpoint (controller lost)")
    assert record["on_host_b"].get("raylet") == 1 and record["on_host_b"].get("_ServerActor", 0) >= 1, record
    assert totals == {"lost": 0, "twice": 0, "corrupted": 0}, totals
    assert record["recovered_s"] is not None and record["steps_redone"] == 0  # a checkpoint every step
    assert session_server().forks() > before or not enabled()  # host A's workers were forked


@pytest.mark.slow  # a cluster of its own and a 22-step run across it
def test_a_lost_host_of_one_rollout_instance_leaves_it_out_and_the_run_goes_on(tmp_path, tiny_model_dir):
    """``bench.chaos.host_rollout_fault``: rollout instance 1 on host B reads the weights from the relay's mirror
    there; every process of host B is SIGKILLed mid-run. The run is not restarted: host A's instance takes the
    dead one's rows, the dead one cannot be placed again (host B's device is gone) and is left out after
    ``workflow.restart_timeout_s``, and the run trains every step with every prompt once, within the staleness
    bound, leaving no segment of its own in host A's /dev/shm (host B's went with its processes)."""
    args = argparse.Namespace(out=tmp_path, host_rollout_steps=STEPS, restart_timeout=5.0, seed=0,
                              cluster_options=host_a_options())
    before = session_server().forks()
    record, totals = host_rollout_fault(args, tiny_model_dir)
    if record.get("error", "").startswith("no two-host cluster"):
        (pytest.fail if os.environ.get("CI") else pytest.skip)(record["error"])
    assert "error" not in record, record
    # Host B ran one rollout instance, its relay mirror and its Ray node: nothing else of the run.
    assert record["on_host_b"].get("RolloutService") == 1 and record["on_host_b"].get("raylet") == 1, record
    assert not {n for n in record["on_host_b"] if n.endswith("Service") or n == "_ServerActor"} - {"RolloutService"}
    assert any("-wr" in name for name in record["shm_b_before_kill"]), record  # the relay's mirror of the weights
    assert record["how"] == "left out" and record["left_out_s"] is not None, record
    assert record["detected_s"] is not None and record["recovered_s"] is not None, record
    assert record["steps_after"] and record["steps_after"][-1] == STEPS - 1, record  # trained on after the loss
    assert totals == {"lost": 0, "twice": 0, "corrupted": 0, "staleness_ok": True, "steps": STEPS}, totals
    assert record["shm_left_a"] == [] and record["host_b_processes_after"] == 0, record
    assert session_server().forks() > before or not enabled()  # host A's workers were forked

"""A run that fails ends promptly with a clear message and leaves nothing behind (on the fake engines: the
failures are the loop's, and Ray, the TransferQueue, the services and the driver are real).

- DAPO with ``max_sampling_factor=1`` cannot fill step 0 (some groups of the untrained policy have equal
  rewards), so the driver raises while every service is blocked waiting for rows or weights that will never
  come. The driver makes those waits fail (``Pipeline.abort``) so that the services end and are stopped
  gracefully instead of after close()'s grace period, and the CLI prints the error without a traceback (a
  subprocess: its stderr and its processes are checked).
- A rollout instance whose weight apply fails retries once with the newest version, then stops the run with an
  error naming the instance and the version (in this process, on the shared Ray; the fault is a fake subclass,
  ``tests/fakes/faulty.py``).
"""

import sys

import pytest

from asyncflow.workflow.errors import WeightApplyError
from tests.recipe_runs import FAKE, REPO, SMALL, ray_leftovers, run_fake
from tests.workflow.processes import run_in_session

pytestmark = pytest.mark.faults


def test_failed_run_reports_the_error_and_stops_every_process(tmp_path, tiny_model_dir):
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", str(REPO / "recipes/tiny_cpu/dapo_async.yaml"),
           f"model.path={tiny_model_dir}", f"observability.output_dir={tmp_path / 'run'}", *FAKE,
           "algorithm.max_sampling_factor=1", "workflow.steps=3"]
    code, _, err, leftovers = run_in_session(cmd, tmp_path)
    assert code == 1, err[-3000:]
    assert "asyncflow: error: step 0:" in err and "max_sampling_factor" in err, err[-3000:]
    assert "Traceback" not in err
    assert not leftovers, f"processes of the failed run still alive: {leftovers}"


# Sync (k=0): version v is applied when step v is generated, so the fault hits version 2 at step 2.
SYNC = ["workflow.mode=sync", "workflow.max_staleness=0", *SMALL, "algorithm.kl_coef=0"]


def test_failed_apply_is_retried_once_then_stops_the_run_naming_it(tmp_path, tiny_model_dir, shared_ray):
    with pytest.raises(Exception) as failed:
        run_fake(tmp_path, tiny_model_dir, "run", *SYNC, "rollout.engine=tests.fakes.faulty.FailsApplyingFrom2")
    error = getattr(failed.value, "cause", None) or failed.value  # as the CLI prints it: the service's own error
    assert isinstance(error, WeightApplyError), repr(failed.value)
    # "twice": the first failure was retried (with the newest version, still 2 in sync mode) before giving up.
    assert str(error) == ("rollout instance 0 failed to apply weight version 2 twice: fake rollout: applying "
                          "weight version 2 failed on purpose"), str(error)
    actors, groups, servers = ray_leftovers()
    assert not (actors or groups or servers), (actors, groups, servers)

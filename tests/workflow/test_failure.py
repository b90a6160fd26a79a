"""A run that fails ends promptly with a clear message and leaves no process behind (on the fake engines: the
failures are the loop's, and Ray, the TransferQueue, the services and the driver are real).

- DAPO with ``max_sampling_factor=1`` cannot fill step 0 (some groups of the untrained policy have equal
  rewards), so the driver raises while every service is blocked waiting for rows or weights that will never
  come. The driver makes those waits fail (``Pipeline.abort``) so that the services end and are stopped
  gracefully instead of after close()'s grace period, and prints the error without a traceback.
- A rollout instance whose weight apply fails retries once with the newest version, then stops the run with an
  error naming the instance and the version.
- A rollout instance whose process dies while it applies a version stops the run with an error naming the
  instance and the version it was applying.
"""

import sys

from tests.recipe_runs import FAKE, REPO, SMALL
from tests.workflow.processes import run_in_session


def _cmd(tmp_path, model_dir, recipe: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "asyncflow.cli", "train", str(REPO / "recipes/tiny_cpu" / recipe),
            f"model.path={model_dir}", f"observability.output_dir={tmp_path / 'run'}", *FAKE, *overrides]


def test_failed_run_reports_the_error_and_stops_every_process(tmp_path, tiny_model_dir):
    code, _, err, leftovers = run_in_session(
        _cmd(tmp_path, tiny_model_dir, "dapo_async.yaml", "algorithm.max_sampling_factor=1", "workflow.steps=3"),
        tmp_path)
    assert code == 1, err[-3000:]
    assert "asyncflow: error: step 0:" in err and "max_sampling_factor" in err, err[-3000:]
    assert "Traceback" not in err
    assert not leftovers, f"processes of the failed run still alive: {leftovers}"


# Sync (k=0): version v is applied when step v is generated, so the fault hits version 2 at step 2.
SYNC = ["workflow.mode=sync", "workflow.max_staleness=0", *SMALL, "algorithm.kl_coef=0"]


def test_failed_apply_is_retried_once_then_stops_the_run_naming_it(tmp_path, tiny_model_dir):
    code, _, err, leftovers = run_in_session(_cmd(tmp_path, tiny_model_dir, "grpo_async.yaml", *SYNC), tmp_path,
                                             env={"ASYNCFLOW_FAKE_FAIL_APPLY": "2"})
    assert code == 1, err[-3000:]
    # "twice": the first failure was retried (with the newest version, still 2 in sync mode) before giving up.
    assert ("asyncflow: error: rollout instance 0 failed to apply weight version 2 twice: fake rollout: applying "
            "weight version 2 failed on purpose") in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not leftovers, f"processes of the failed run still alive: {leftovers}"

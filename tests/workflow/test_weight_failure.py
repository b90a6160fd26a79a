"""A rollout instance whose process dies while it applies a weight version stops the run with an error that
names the instance and the version, and leaves no process behind.

On the fake engines (``ASYNCFLOW_FAKE_DIE_APPLYING``: the rollout's process SIGKILLs itself when it starts
applying that version), so the death lands inside the apply every time, with the whole pipeline around it
real. A failed apply that the engine survives is ``test_failure``'s.
"""

import sys

from tests.recipe_runs import FAKE, REPO, SMALL
from tests.workflow.processes import run_in_session


def test_rollout_killed_while_applying_stops_the_run_naming_it(tmp_path, tiny_model_dir):
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"),
           f"model.path={tiny_model_dir}", f"observability.output_dir={tmp_path / 'run'}", *FAKE,
           "workflow.mode=sync", "workflow.max_staleness=0", *SMALL, "algorithm.kl_coef=0"]
    code, _, err, leftovers = run_in_session(cmd, tmp_path, env={"ASYNCFLOW_FAKE_DIE_APPLYING": "2"})
    assert code == 1, err[-3000:]
    assert "asyncflow: error: rollout instance 0 died while applying weight version 2" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not leftovers, f"processes of the failed run still alive: {leftovers}"

"""A run that fails mid-step ends promptly with a clear message and leaves no process behind.

DAPO with ``max_sampling_factor=1`` cannot fill step 0 (some groups of the untrained policy have equal
rewards), so the driver raises while every service is blocked waiting for rows or weights that will never
come. The driver makes those waits fail (``Pipeline.abort``) so that the services end and are stopped
gracefully (on this machine the failed run took 28 s in all, against 89 s when close() had to wait out
its 60 s grace period and kill them), and prints the error without a traceback.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.workflow.processes import reap_session

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_failed_run_reports_the_error_and_stops_every_process(tmp_path):
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", str(REPO / "recipes/tiny_cpu/dapo_async.yaml"),
           f"model.path={tmp_path / 'model'}", f"observability.output_dir={tmp_path / 'run'}",
           "algorithm.max_sampling_factor=1", "workflow.steps=3", "observability.tensorboard=false"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        leftovers = reap_session(proc.pid)
    assert proc.returncode == 1, err[-3000:]
    assert "asyncflow: error: step 0:" in err and "max_sampling_factor" in err, err[-3000:]
    assert "Traceback" not in err
    assert not leftovers, f"processes of the failed run still alive: {leftovers}"

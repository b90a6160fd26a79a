"""A vLLM worker killed while it applies a weight version stops the run within seconds, with an error that
names the rollout instance and the version, and leaves no process behind.

The rollout engine runs at vLLM TP2 in multi-process mode, so its workers are child processes of the rollout
service. With the smallest buckets and ``ASYNCFLOW_APPLY_PAUSE_S`` each apply holds after its first bucket (the
worker has part of the version), and the worker writes its pid and the version to ``ASYNCFLOW_APPLY_PAUSE_FILE``
as the hold begins, so the first apply is caught every time; polling for the milliseconds an unheld apply lasts
missed now and then, and finding the worker by its process title (``[asyncflow: applying weight version N]``)
once missed every apply of a CI run.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.workflow.processes import reap_session, session_processes

REPO = Path(__file__).resolve().parents[2]


def _title(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


@pytest.mark.slow
def test_worker_killed_while_applying_stops_the_run_naming_it(tmp_path):
    from asyncflow.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", family="qwen2")
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"),
           f"model.path={model}", f"observability.output_dir={tmp_path / 'run'}", "observability.tensorboard=false",
           "workflow.mode=sync", "workflow.max_staleness=0", "workflow.steps=4", "weight_sync.bucket_mb=1e-6",
           "workflow.prompts_per_step=8", "workflow.samples_per_prompt=4", "trainer.micro_batch_size=8",
           "rollout.tensor_parallel=2", "rollout.in_process=false",
           "algorithm.kl_coef=0"]  # no reference model: one Megatron process fewer, nothing here reads it
    # The worker appends "pid version" to the pause file as its hold begins (worker_extension's fault injection).
    pause_file = tmp_path / "paused"
    env = dict(os.environ, ASYNCFLOW_APPLY_PAUSE_S="20", ASYNCFLOW_APPLY_PAUSE_FILE=str(pause_file))
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    victim, version = None, None
    try:
        deadline = time.time() + 600
        while victim is None and proc.poll() is None and time.time() < deadline:
            lines = pause_file.read_text().split("\n") if pause_file.exists() else []
            if len(lines) > 1:  # a whole line: the worker wrote it before holding
                victim, version = map(int, lines[0].split())
                title = _title(victim) or ""
                os.kill(victim, signal.SIGKILL)
                # What an operator sees in ps; not asserted here (once on CI no worker's title ever showed in
                # /proc, cause unknown): tests/engines/vllm/test_proc_title.py checks the title itself.
                print(f"killed {victim} applying version {version}; its title: {title[-120:]}")
                break
            time.sleep(0.1)  # the apply holds for ASYNCFLOW_APPLY_PAUSE_S: no need to spin
        if victim is None:
            proc.kill()
            out, err = proc.communicate(timeout=60)
            raise AssertionError(f"no vLLM worker held an apply (exit {proc.returncode})\n{out[-2000:]}\n"
                                 f"{err[-4000:]}")
        killed_at = time.time()
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # say what was still running (once in a two-worker full run, 2026-12-02)
            alive = [f"{pid} {_title(pid)}" for pid in session_processes(proc.pid)]
            proc.kill()
            out, err = proc.communicate(timeout=60)
            raise AssertionError(f"the run did not stop within 120 s of the kill of {victim} (version {version}); "
                                 "still running:\n" + "\n".join(alive) + f"\n{out[-2000:]}\n{err[-4000:]}") from None
        stopped_after = time.time() - killed_at
    finally:
        leftovers = reap_session(proc.pid)
    assert proc.returncode == 1, err[-3000:]
    assert f"rollout instance 0 failed to apply weight version {version}" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert stopped_after < 60, stopped_after
    assert not leftovers, f"processes of the failed run still alive: {leftovers}"

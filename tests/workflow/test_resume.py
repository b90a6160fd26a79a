"""Kill a PPO run for real (SIGKILL of its whole process session, mid-step) and resume it, on the fake engines
(``asyncflow.engines.fake``: a fake critic too); Ray, the TransferQueue, the services, the driver and the run
checkpoints are real.

Checked: no prompt group is trained twice and none is skipped, every step is logged once, the weights
(actor and critic) and the weight version continue from the checkpoint, old checkpoints are pruned and
crashed staging folders are cleaned. The run is a few small steps, too few to learn: whether the fake policy
learns is ``test_loop``'s (``test_the_loop_carries_a_learning_signal``).

The run is in partial-rollout mode (a continuous stream, each token recording its version): resuming does not
depend on the rollout mode (the driver feeds the prompts after the checkpoint again, whatever rollout had in
flight), so chunked rollout, the recipe's default, is not killed apart. The first run's trainer is slowed down
(``ASYNCFLOW_FAKE_TRAIN_S``) so that the kill lands in the middle of the run. The engines' own checkpoints
(Megatron's distributed checkpoint at another parallel layout) are tested in ``tests/engines/megatron``.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.recipe_runs import FAKE, REPO
from tests.workflow.processes import kill_session

pytestmark = [pytest.mark.loop, pytest.mark.faults]

GROUP = 4
# (recipe, steps, prompts per step, checkpoint interval, overrides)
CASE = ("ppo_async.yaml", 9, 8, 3, ["rollout.partial=true", f"workflow.samples_per_prompt={GROUP}",
                                     "trainer.micro_batch_size=8", "critic.micro_batch_size=8"])


def _cmd(tmp_path: Path, model_dir, *extra: str) -> list[str]:
    recipe, steps, prompts, interval, overrides = CASE
    return [sys.executable, "-m", "asyncflow.cli", "train", str(REPO / "recipes/tiny_cpu" / recipe),
            f"model.path={model_dir}", f"observability.output_dir={tmp_path / 'run'}", *FAKE,
            f"workflow.steps={steps}", f"workflow.prompts_per_step={prompts}", f"checkpoint.interval={interval}",
            "checkpoint.keep_last=2", *overrides, *extra]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_killed_run_resumes_without_repeating_or_skipping_prompts(tmp_path, tiny_model_dir):
    # The responses in flight at the kill are lost with the process; their prompts are fed again after the
    # checkpoint and regenerated, never trained twice.
    _, steps, prompts, interval, _ = CASE
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    log = open(tmp_path / "first.log", "w")
    env = dict(os.environ, ASYNCFLOW_FAKE_TRAIN_S="0.1")
    proc = subprocess.Popen(_cmd(tmp_path, tiny_model_dir), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    try:
        deadline = time.time() + 600
        # Kill once the first checkpoint is committed: the services are then busy with the steps after it.
        kill_after = f"step_{interval:06d}"
        while not (ckpts / "latest").is_file() or (ckpts / "latest").read_text().strip() < kill_after:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
            assert time.time() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.05)
    finally:
        survivors = kill_session(proc.pid)
        proc.wait()
        log.close()
    assert not survivors, "processes of the killed run survived"
    assert not (run / "summary.json").exists(), "the first run finished before it was killed"
    killed_at = json.loads((ckpts / (ckpts / "latest").read_text().strip() / "meta.json").read_text())["step"]
    trained_before_kill = {m["step"] for m in _metrics(run)}
    (ckpts / "step_999999.tmp").mkdir()  # a crashed save's leftovers must not confuse the resume

    resumed = subprocess.run(_cmd(tmp_path, tiny_model_dir, "--resume"), cwd=tmp_path, capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert f"continuing from {ckpts / f'step_{killed_at:06d}'}" in resumed.stdout

    summary = json.loads((run / "summary.json").read_text())
    assert summary["first_step"] == killed_at and summary["steps"] == steps - killed_at
    # Exactly once: every step trained the groups fed to it, and every group id appears once overall.
    groups = {int(step): ids for step, ids in summary["trained_groups"].items()}
    assert sorted(groups) == list(range(steps))
    for step, ids in groups.items():  # one id per trained row: each prompt's group of GROUP samples
        assert ids == sorted(i for i in range(step * prompts, (step + 1) * prompts) for _ in range(GROUP)), step
    # The curve continues: one line per step, no repeats of the steps trained after the checkpoint.
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == list(range(steps))
    assert max(trained_before_kill) >= killed_at - 1
    first = metrics[killed_at]
    assert first["rollout/version"] == killed_at  # rollout got the checkpoint's weights as version n
    # A restart from scratch has KL exactly 0 and a zero value head at its first step; a resume does not.
    assert metrics[0]["actor/kl"] == 0.0 and metrics[0]["critic/value_mean"] == 0.0
    assert first["actor/kl"] > 0.3 * metrics[killed_at - 1]["actor/kl"] > 0
    assert first["critic/value_mean"] != 0.0
    # The killed run's TransferQueue arenas in /dev/shm were swept when the resumed run started.
    assert not list(Path("/dev/shm").glob(f"afq-{proc.pid}-*"))
    # Pruned to keep_last=2; crashed staging folders are gone.
    assert sorted(p.name for p in ckpts.glob("step_*")) == [f"step_{steps - interval:06d}", f"step_{steps:06d}"]
    # Partial rollout, per token: every token of a trained row came from a version that admitted its step.
    assert max(m["staleness/token_lag_max"] for m in metrics) <= 1
    assert min(m["staleness/token_lag_min"] for m in metrics) >= 0

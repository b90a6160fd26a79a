"""Runs of ``asyncflow train`` shared by several test files.

Real-stack runs (Megatron, vLLM) cost about 40 s of start-up each on 2 cores: ``demo_run`` (``tests/conftest.py``)
is the demo recipe's learning run, made once per session and read by ``tests/workflow/test_e2e.py``. Runs on the
fake engines (``asyncflow.engines.fake``, ``run_fake``) keep everything else real (Ray actors, the TransferQueue,
the version board, the services, the driver loop) and check the workflow's semantics in seconds.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS, PROMPTS, GROUP = 5, 8, 4
SMALL = [f"workflow.steps={STEPS}", f"workflow.prompts_per_step={PROMPTS}", f"workflow.samples_per_prompt={GROUP}",
         "workflow.rollout_chunk=12", "workflow.score_chunk=8", "trainer.micro_batch_size=8"]
# The demo recipe's own sizes (32 prompts x 8 samples a step), 70 steps: enough to learn add-one.
LEARN_STEPS, LEARN_PROMPTS, LEARN_GROUP = 70, 32, 8

FAKE = ["trainer.engine=asyncflow.engines.fake.FakeTrainEngine",
        "critic.engine=asyncflow.engines.fake.FakeCriticEngine",
        "rollout.engine=asyncflow.engines.fake.FakeRolloutEngine",
        # The fake policy is a small table: a larger step lets it learn add-one in tens of steps.
        "trainer.lr=0.05", "critic.lr=0.05", "observability.tensorboard=false"]
"""Overrides that put every engine of a recipe on the fakes."""


def train(cmd_args: list[str], cwd: Path, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """``asyncflow train`` in a subprocess, with the repository on the path of the run's workers too (tests name
    their own agent loops and rewards by dotted path, as a user names theirs)."""
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "asyncflow.cli", "train", *cmd_args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)


def _summary(out: Path, proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    summary["_out"], summary["_stdout"] = out, proc.stdout
    return summary


def run_recipe(tmp_path, mode: str, k: int, name: str, *extra: str, sizes: list[str] = SMALL) -> dict:
    """``asyncflow train`` of the demo recipe at ``sizes`` (a few small steps unless given) and ``extra``."""
    out = tmp_path / name
    proc = train([str(REPO / "recipes/tiny_cpu/grpo_async.yaml"), f"model.path={tmp_path / 'model'}",
                  f"observability.output_dir={out}", f"workflow.mode={mode}", f"workflow.max_staleness={k}", *sizes,
                  *extra], tmp_path)
    summary = _summary(out, proc)
    summary["_model_mb"] = (tmp_path / "model" / "model.safetensors").stat().st_size / 2**20
    return summary


def run_fake(tmp_path, model_dir, name: str, *extra: str, recipe: str = "grpo_async.yaml",
             env: dict | None = None) -> dict:
    """A recipe of ``recipes/tiny_cpu`` on the fake engines with ``extra`` overrides (``env``: fault and speed
    settings of ``asyncflow.engines.fake.FakeFaults``); its summary, with ``_out``."""
    out = tmp_path / name
    proc = train([str(REPO / "recipes/tiny_cpu" / recipe), f"model.path={model_dir}",
                  f"observability.output_dir={out}", *FAKE, *extra], tmp_path, env)
    return _summary(out, proc)


def records(run: dict) -> list[dict]:
    return [json.loads(line) for line in (run["_out"] / "metrics.jsonl").read_text().splitlines()]

"""Real runs of ``asyncflow train`` shared by several test files (each costs about 40 s of start-up on 2 cores).

``demo_run`` (``tests/conftest.py``) is the demo recipe's 70-step learning run, made once per session: the
end-to-end checks (``tests/workflow/test_e2e.py``) and the simulator's held-out prediction
(``tests/simulator/test_calibration.py``) both read it.
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


def run_recipe(tmp_path, mode: str, k: int, name: str, *extra: str, sizes: list[str] = SMALL) -> dict:
    """``asyncflow train`` of the demo recipe at ``sizes`` (a few small steps unless given) and ``extra``."""
    out = tmp_path / name
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"),
           f"model.path={tmp_path / 'model'}", f"observability.output_dir={out}",
           f"workflow.mode={mode}", f"workflow.max_staleness={k}", *sizes, *extra]
    # The repository on the path of the run's workers too: tests name their own agent loops by dotted path
    # (tests.agents...), as a user names theirs.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    summary["_out"], summary["_stdout"] = out, proc.stdout
    summary["_model_mb"] = (tmp_path / "model" / "model.safetensors").stat().st_size / 2**20
    return summary


def records(run: dict) -> list[dict]:
    return [json.loads(line) for line in (run["_out"] / "metrics.jsonl").read_text().splitlines()]

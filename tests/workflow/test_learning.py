"""Other algorithms through the real stack: DAPO's dynamic sampling in both modes.

GRPO's learning (`make demo`'s claim) is checked on the async run of ``test_e2e``, and PPO's with a Megatron
critic on the run that ``test_resume`` kills and resumes: each run costs about 40 s of start-up here.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _train(tmp_path, recipe: str, *overrides: str) -> tuple[dict, list[dict]]:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", str(REPO / recipe), f"model.path={tmp_path / 'model'}",
           f"observability.output_dir={out}", "observability.tensorboard=false", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), metrics


@pytest.mark.slow
@pytest.mark.parametrize("mode, steps", [("async", 6), ("sync", 3)])
def test_dapo_dynamic_sampling_trains_only_groups_with_signal(tmp_path, mode, steps):
    summary, metrics = _train(tmp_path, "recipes/tiny_cpu/dapo_async.yaml", f"workflow.mode={mode}",
                              f"workflow.steps={steps}")
    assert [m["step"] for m in metrics] == list(range(steps))
    for m in metrics:
        assert m["actor/rows"] == 256 and m["sampling/kept_rows"] == 256  # the step is full ...
        assert m["actor/flat_groups"] == 0  # ... with groups that carry signal only
        assert 0 < m["actor/entropy"] < 3.0  # entropy bonus on: log(19) = 2.94 is the maximum
        assert 0 < m["sampling/kept_reward_mean"] < 1  # every kept group mixes rewards (0..1 on add-one)
    assert sum(m["sampling/judged_rows"] for m in metrics) > steps * 256  # groups were dropped and topped up
    max_prompts = 4 * 32  # algorithm.max_sampling_factor x prompts_per_step: each step's own id range
    for step, ids in summary["trained_groups"].items():
        step = int(step)
        assert len(set(ids)) == 32 and all(step * max_prompts <= i < (step + 1) * max_prompts for i in ids)

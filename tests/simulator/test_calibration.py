"""``asyncflow profile`` on the tiny model, and the calibrate-predict-measure loop on one held-out run.

The profile times isolated engine calls (vLLM ``generate``, Megatron ``train_step``, weight staging, the
TransferQueue client) and calibrates the services around them on one real sync run of a calibration workload;
the held-out run is the demo recipe's run of the loop (``asyncflow train``), never seen by the fit. The issue's
acceptance bound is 15%; this test checks a factor of two (see the test's docstring) and prints both numbers
and the load average. Under ``make test``'s two xdist workers these tests run alone (``QUIET_MODULES`` in
tests/conftest.py): with the other worker's runs beside them, the async calibration run could not be fitted
(2026-12-02: ``async_floating`` at the bisection's ceiling).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.simulator.costs import load_costs

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profile")
    out = tmp / "costs.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "asyncflow.cli", "profile", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"),
           f"model.path={tmp / 'model'}", "trainer.micro_batch_size=32", "--out", str(out), "--variants", "1",
           "--reps", "1", "--quick", "--calibrate", "--calibration-runs", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return tmp, out, proc.stdout + proc.stderr


def test_profile_writes_a_valid_cost_file(profiled):
    _, out, _ = profiled
    costs = load_costs(out)  # typed: an unknown or mistyped key would raise
    model = costs.variant("1")
    data = json.loads(out.read_text())
    assert set(data["variants"]) == {"1"}
    for section in ("rollout", "train", "weight_sync", "queue", "light"):
        assert all(v >= 0 for v in data["variants"]["1"][section].values()), section
    # What holds on any machine: a decode step costs something and costs more with more sequences, a micro-batch
    # costs more with more tokens, a weight version and a queue request cost something, and the model has bytes.
    # Asked of the fitted costs at the profiled sizes, not of single terms: on a small grid the non-negative fit
    # may put a size's whole cost in one of two nearly collinear terms (CI, 2026-12-01: per-token 0, the
    # per-token-and-position term carried it), and either split prices the profiled calls alike.
    r, t = model.rollout, model.train
    for ctx in (8, 136):
        assert r.step_s + r.per_seq_s + r.per_ctx_token_s * ctx > 0 and r.per_seq_s + r.per_ctx_token_s * ctx > 0
    for seq in (16, 64, 136):
        assert 0 < t.micro_s(32 * seq, seq) < t.micro_s(64 * seq, seq), seq
    assert model.weight_sync.apply_per_byte_s > 0 and model.queue.per_request_s > 0
    assert model.weight_bytes == pytest.approx((Path(costs.hardware["model"]) / "model.safetensors").stat().st_size,
                                               rel=0.2)
    from asyncflow.simulator.profile import QUICK_GRIDS

    assert [len(data["samples"]["1"][k]) for k in ("rollout", "train", "reference")] == [len(g) for g in QUICK_GRIDS]
    assert costs.hardware["grid"] == "quick" and costs.hardware["seconds"] > 0
    # The calibration runs of the loop: its services cost at least their engine calls, a sync step has
    # hand-offs between its phases (the driver's Ray calls) on any machine, and the async run was fitted: either
    # reproduced, or, when the machine slowed it beyond any floating share the simulator can add (its steps are
    # then as slow as they get, CI 2026-12-03), set to the fit's ceiling with a warning.
    service = model.service
    assert min(service.generate_token_s, service.reference_call_s, service.train_micro_s) >= 0.0
    assert service.sync_handoff_s > 0 and 0.0 <= service.async_floating <= 4.0
    if service.async_floating > 3.9:
        assert "set to its ceiling" in profiled[2], profiled[2][-2000:]
    # The floating processes (TransferQueue, driver, board, light services, Ray) use CPU for every row.
    assert service.async_floating_row_s > 0
    # Each engine's speed in the loop, from its spans' engine seconds: measured (a ratio, never left at 1), and the
    # engine's seconds are part of their span.
    scales = (service.rollout_engine_scale, service.reference_engine_scale, service.train_engine_scale)
    assert all(0.05 < s < 20 and s != 1.0 for s in scales), scales
    assert "variant 1: in the loop's calibration runs the engines took rollout" in profiled[2]
    timelines = sorted(out.parent.glob(f"{out.stem}-calibration/*/*/timeline.json"))
    assert timelines
    for timeline in timelines:
        spans = [e for e in json.loads(timeline.read_text())["traceEvents"] if "engine_s" in e.get("args", {})]
        assert {e["name"] for e in spans} == {"generate", "ref_logprobs", "train"}, timeline
        assert all(0 < e["args"]["engine_s"] <= e["dur"] / 1e6 + 1e-3 for e in spans), timeline


def test_calibrated_prediction_of_a_held_out_run(profiled, demo_run):
    """The held-out run is the demo recipe's own (``demo_run``: async GRPO, staleness 1, 32 prompts x 8 samples,
    70 steps, the add-one task's 4-token responses), which no calibration run resembles: they generate
    long-tailed responses of up to 48 tokens at other sizes. The issue asks for 15%; ``bench/simulator.py`` (full
    grid, quiet machine) is where that is measured (docs/simulator.md). This test profiles the quick grid on a CI
    machine that may be shared with other jobs, so it checks a factor of two either way, which still catches a
    broken cost fit, calibration or event model, and prints the error for the log."""
    from bench.e2e import steady_throughput
    from bench.simulator import predict
    from tests.recipe_runs import LEARN_STEPS

    _, out, _ = profiled
    costs = load_costs(out)
    result, w = predict(["workflow.mode=async", "workflow.max_staleness=1"], None, costs, LEARN_STEPS)
    assert w.rows_per_step == 32 * 8  # the run's sizes are the recipe's own, as predicted
    real = steady_throughput(demo_run["_out"] / "metrics.jsonl")
    error = result.samples_per_s / real - 1
    assert real > 0 and result.samples_per_s > 0 and result.lag_max <= 1
    print(f"predicted {result.samples_per_s:.1f} samples/s, measured {real:.1f} ({error:+.1%}); "
          f"load average {os.getloadavg()[0]:.1f}")
    assert 0.5 < result.samples_per_s / real < 2.0

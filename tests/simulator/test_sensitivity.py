"""``simulator.sensitivity``: which side bounds a prediction, and when a 10% cost error tips the pipeline.

The costs are round numbers (``test_cli.MODEL``), the trainer's scaled to put the continuous-rollout pipeline far
from balance on either side or at the point where the actor falls a step behind (at 3x on 12 simulated steps).
The tipping point exists with micro-batches taken in arrival order (``trainer.row_order=arrival``); with the
default, shortest ready rows first, the actor a step behind pads little and catches up, and there is none.
"""

import dataclasses
from pathlib import Path

import pytest

from asyncflow.cli import main
from asyncflow.config import load_config
from asyncflow.simulator.costs import CostFile, ServiceCosts
from asyncflow.simulator.sensitivity import TILT, sensitivity
from asyncflow.simulator.sim import simulate
from asyncflow.simulator.workload import from_config
from tests.simulator.test_cli import MODEL

REPO = Path(__file__).resolve().parents[2]
ARGS = ["workflow.task=add1_longtail", "rollout.max_new_tokens=128", "rollout.max_model_len=160",
        "rollout.continuous=true",
        "trainer.row_order=arrival"]


def _workload(args):
    return dataclasses.replace(from_config(load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", args)), steps=12)


@pytest.fixture(scope="module")
def workload():
    return _workload(ARGS)


def test_tilted_scales_one_side_only():
    model = dataclasses.replace(MODEL, service=ServiceCosts(generate_token_s=1.0, reference_call_s=1.0,
                                                            train_micro_s=1.0, sync_handoff_s=1.0,
                                                            async_floating=0.5))
    tilted = model.tilted(rollout=2.0, train=3.0)
    assert tilted.rollout.step_s == 2 * model.rollout.step_s and tilted.rollout.per_seq_s == 2 * model.rollout.per_seq_s
    assert tilted.train.per_micro_s == 3 * model.train.per_micro_s
    assert tilted.train.ref_per_token_s == 3 * model.train.ref_per_token_s
    s = tilted.service
    assert (s.generate_token_s, s.reference_call_s, s.train_micro_s) == (2.0, 3.0, 3.0)
    assert (s.sync_handoff_s, s.async_floating) == (1.0, 0.5)  # neither side's
    assert (tilted.weight_sync, tilted.queue, tilted.light) == (model.weight_sync, model.queue, model.light)
    assert model.tilted() == model


@pytest.mark.parametrize("train,bound", [(1.0, "rollout"), (8.0, "training")])
def test_far_from_balance_only_the_bottleneck_moves_the_prediction(workload, train, bound):
    s = sensitivity(workload, MODEL.tilted(train=train))
    assert s.bottleneck == bound and not s.tipping
    moved, still = ("rollout", "train") if bound == "rollout" else ("train", "rollout")
    # A proportional bottleneck: 10% dearer is at most 1/1.1 the throughput, the other side moves it little.
    assert -TILT / (1 + TILT) - 0.01 < s.change(moved) < -0.05
    assert abs(s.change(still)) < 0.02


def test_near_balance_is_reported_as_a_tipping_point(workload):
    model = MODEL.tilted(train=3.0)
    s = sensitivity(workload, model)
    assert s.tipping and s.bottleneck == "training"
    # Not a reporting artefact: 10% dearer training costs more than 10% of throughput, as the actor, a step
    # behind, finds whole steps ready and pads its micro-batches to their longest rows.
    assert s.change("train") < -0.12
    behind = simulate(workload, model.tilted(train=1 + TILT))
    assert behind.samples_per_s == pytest.approx(s.train_dearer)


def test_shortest_rows_first_removes_the_tipping_point(workload):
    """The same costs with the actor taking the shortest ready rows: a step behind, it finds the step's rows
    ready and batches them by length, so it is cheaper behind than streaming, catches up, and the pipeline
    stays rollout-bound where arrival order tipped into the actor-bound state (and up to 5x the trainer's costs)."""
    shortest = _workload(ARGS[:-1] + ["trainer.row_order=shortest"])
    for train in (3.0, 4.0):
        s = sensitivity(shortest, MODEL.tilted(train=train))
        assert s.bottleneck == "rollout" and not s.tipping, (train, s)
        assert abs(s.change("train")) < 0.02
    arrival, first = simulate(workload, MODEL.tilted(train=4.0)), simulate(shortest, MODEL.tilted(train=4.0))
    assert first.samples_per_s > 1.2 * arrival.samples_per_s


def test_simulate_prints_the_bound_side_and_warns_near_a_tipping_point(tmp_path, capsys):
    costs = CostFile({"1": MODEL.tilted(train=3.0), "2": MODEL.tilted(train=3.0)}, {"host": "test"})
    path = costs.save(tmp_path / "costs.json")
    rc = main(["simulate", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"), *ARGS, "--costs", str(path),
               "--steps", "12", "--out", str(tmp_path / "sim")])
    out = capsys.readouterr().out
    assert rc == 0 and "| bound by | rollout / training +10% |" in out
    assert "warning: as configured (async, k=1): near a tipping point" in out
    far = CostFile({"1": MODEL, "2": MODEL}, {"host": "test"}).save(tmp_path / "far.json")
    rc = main(["simulate", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"), *ARGS, "--costs", str(far),
               "--steps", "12", "--out", str(tmp_path / "sim2")])
    out = capsys.readouterr().out
    assert rc == 0 and "tipping" not in out and "| rollout |" in out

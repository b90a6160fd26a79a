"""Service calibration (``asyncflow.simulator.calibrate``): the services' overhead beyond their engine calls,
from a real run's spans against the engine-only prediction, and how the simulator charges it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from asyncflow.simulator.calibrate import calls_per_step, predicted_spans, real_spans, service_costs
from asyncflow.simulator.costs import CostModel, ServiceCosts, load_costs
from asyncflow.simulator.sim import simulate
from tests.simulator.test_sim import ROLLOUT, TRAIN, _generation, _training, _workload


def test_per_call_overheads_and_sync_hand_off_add_to_the_sync_step_in_closed_form():
    w = _workload(mode="sync", max_staleness=0)  # 16 rollout rows and 4 micro-batches a step
    service = ServiceCosts(generate_row_s=0.01, train_micro_s=0.05, sync_handoff_s=0.25)
    result = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, service=service))
    work = _generation(w, 12) + 0.01 * 16 + _training(w, 12) + 0.05 * 4
    # A step ends when its weights are published; the driver's hand-off follows, before the next step.
    assert result.step_end_s == pytest.approx([work * (i + 1) + 0.25 * i for i in range(w.steps)])
    assert result.step_time_s == pytest.approx(work + 0.25)


def test_service_overhead_is_latency_not_device_time():
    """Two tasks on one device: the reference's overhead beyond its engine time does not slow generation."""
    w = _workload(mode="async", max_staleness=1, reference=True, placement="cpu")  # reference on rollout's core
    train = dataclasses.replace(TRAIN, ref_per_call_s=0.01, ref_per_token_s=1e-4)
    plain = simulate(w, CostModel(rollout=ROLLOUT, train=train))
    slow_ref = simulate(w, CostModel(rollout=ROLLOUT, train=train, service=ServiceCosts(reference_call_s=0.5)))
    gen = [predicted_spans(r)["generate"] for r in (plain, slow_ref)]
    assert gen[1] == pytest.approx(gen[0], rel=1e-9)
    assert predicted_spans(slow_ref)["ref_logprobs"] > predicted_spans(plain)["ref_logprobs"] + 0.4


def test_service_costs_are_span_excesses_per_call_never_below_zero_plus_the_time_outside_spans():
    real = {"generate": 0.6, "ref_logprobs": 0.2, "train": 0.4, "score": 0.05}
    predicted = {"generate": 0.5, "ref_logprobs": 0.1, "train": 0.5}
    costs = service_costs(real, 1.5, predicted, {"generate": 10, "ref_logprobs": 4, "train": 4})
    assert costs.generate_row_s == pytest.approx(0.01) and costs.reference_call_s == pytest.approx(0.025)
    assert costs.train_micro_s == 0.0  # faster than the engine-only prediction: never credited
    assert costs.sync_handoff_s == pytest.approx(1.5 - 1.25)
    w = _workload(rollout_chunk=8, score_chunk=4, micro_batch_size=2)  # 16 rows a step
    assert calls_per_step(w) == {"generate": 16, "ref_logprobs": 4, "train": 8}


def test_real_spans_average_the_steps_after_the_warm_up(tmp_path):
    events = [{"ph": "X", "name": "stage_weights", "ts": 0, "dur": 1}]  # version 0, before step 0
    t = 10
    for step in range(5):
        gen = 100 if step < 2 else 40  # warm-up steps are slow
        events += [{"ph": "X", "name": "generate", "ts": t, "dur": gen * 1e3},
                   {"ph": "X", "name": "train", "ts": t + gen * 1e3, "dur": 50e3},
                   {"ph": "X", "name": "stage_weights", "ts": t + (gen + 50) * 1e3 + 10e3, "dur": 0}]
        t += (gen + 60) * 1e3
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps({"traceEvents": events}))
    spans, step = real_spans(path, warmup=2)
    assert spans["generate"] == pytest.approx(0.040) and spans["train"] == pytest.approx(0.050)
    assert step == pytest.approx(0.100)


def test_a_cost_file_without_service_costs_loads_as_engine_only(tmp_path):
    """Cost files written before the calibration existed still load (every service term at its default)."""
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"variants": {"1": {"rollout": {"step_s": 0.01}}}}))
    assert load_costs(path).variant("1").service == ServiceCosts()


def test_floating_work_slows_a_busy_pinned_core_more_than_an_idle_one():
    """``async_floating`` f: a job of 1 s on one of two linked cores also adds f/2 s on each. Alone, it shares
    its core with its own f/2 (ends at 1 + f/2) while the other core absorbs the rest; with both cores busy,
    each core holds 1 + f of work (ends at 1 + f)."""
    from asyncflow.simulator.events import Device, Sim

    f = 0.4
    for both, expected in ((False, 1 + f / 2), (True, 1 + f)):
        sim = Sim()
        cores = [Device(sim, "core0"), Device(sim, "core1+")]
        for core in cores:
            core.spill = (f, cores)
        ends = []

        def job(core, sim=sim, ends=ends):
            yield core.run(1.0)
            ends.append(sim.now)

        for core in cores[:2 if both else 1]:
            sim.process(job(core))
        sim.run()
        assert ends == pytest.approx([expected] * len(ends))


def test_floating_work_applies_to_the_async_cpu_placement_only():
    service = ServiceCosts(async_floating=0.5)
    w = _workload(mode="async", max_staleness=1, placement="cpu")
    assert simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, service=service)).step_time_s > \
        1.1 * simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN)).step_time_s
    for other in (dict(mode="sync", max_staleness=0, placement="cpu"), dict(mode="async", placement="devices")):
        w = _workload(**other)
        assert simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, service=service)).step_end_s == \
            pytest.approx(simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN)).step_end_s)


def test_the_floating_work_is_fitted_back_from_a_run_simulated_with_a_known_value(tmp_path):
    """``fit_async_floating`` on a timeline the simulator made at 0.4 finds 0.4; a run the model without
    floating work already predicts as slow as measured gets 0 (never credited below)."""
    from pathlib import Path

    from asyncflow.config import load_config
    from asyncflow.simulator.calibrate import CALIBRATION_STEPS, WARMUP, fit_async_floating, overrides_for
    from asyncflow.simulator.workload import from_config

    recipe = Path(__file__).resolve().parents[2] / "recipes/tiny_cpu/grpo_async.yaml"
    model = CostModel(rollout=ROLLOUT, train=dataclasses.replace(TRAIN, ref_per_call_s=0.01, ref_per_token_s=1e-4))
    w = dataclasses.replace(from_config(load_config(recipe, overrides_for(1, "async")
                                                    + [f"workflow.steps={CALIBRATION_STEPS}"])), warmup_steps=WARMUP)
    for floating in (0.4, 0.0):
        run = simulate(w, dataclasses.replace(model, service=ServiceCosts(async_floating=floating)))
        events = [{"ph": "X", "name": "stage_weights", "ts": 0, "dur": 0}]  # version 0, staged before step 0
        events += run.timeline.to_chrome_trace()["traceEvents"]
        (tmp_path / "timeline.json").write_text(json.dumps({"traceEvents": events}))
        assert fit_async_floating(model, recipe, tmp_path) == pytest.approx(floating, abs=0.01)


def test_the_ready_view_is_built_in_index_order_at_the_first_request_then_in_readiness_order():
    """As the real partition's ``ReadyView``: rows ready before a task's first request come by index (a sync
    actor's micro-batches mix lengths); rows that become ready later, in the order they did."""
    from asyncflow.simulator.events import Sim
    from asyncflow.simulator.sim import SimQueue

    sim = Sim()
    w = _workload(prompts_per_step=2, samples_per_prompt=4)
    q = SimQueue(sim, w, {"actor": ("advantage",), "advantage": ("reward",)})
    q.put(0, "advantage", [5, 2, 7])
    first = q.take(0, "actor", 2)
    q.put(0, "advantage", [6, 0, 3, 1, 4])
    taken = [first.value] + [q.take(0, "actor", 2).value for _ in range(3)]
    assert taken == [[2, 5], [7, 6], [0, 3], [1, 4]]
    # Whole groups for the advantage task, likewise: group 1 (rows 4-7) was complete first but group 0 has the
    # lower index when the view is built.
    q.put(0, "reward", [4, 5, 6, 7, 0, 1, 2, 3])
    assert q.take(0, "advantage", 4).value == [0, 1, 2, 3]

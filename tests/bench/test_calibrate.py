"""Service calibration (``bench/calibrate.py``): the services' overhead beyond their engine calls, from a real
run's spans against the engine-only prediction, and the async run's floating work."""

from __future__ import annotations

import dataclasses
import json

import pytest

from asyncflow.simulator.costs import CostModel, ServiceCosts
from asyncflow.simulator.sim import simulate
from asyncflow.workflow.batching import fit_seq_len
from bench.calibrate import calls_per_step, overheads, predicted_spans, real_spans, service_costs
from tests.simulator.test_sim import ROLLOUT, TRAIN, _workload


def test_service_overhead_is_charged_on_the_rows_own_tokens_and_the_engine_on_the_padding():
    """One sync step, one micro-batch of a 1-token and a 9-token response (prompts of 6): the trainer pads both to
    the longer row (16 tokens each, 32 in all), while the service moves and packs the 22 tokens the rows hold.
    The engine's per-token cost is charged on the 32, the service's on the 22, and calibration counts the 22."""
    from bench.calibrate import predicted_tokens

    w = _workload(mode="sync", max_staleness=0, steps=2, prompts_per_step=1, samples_per_prompt=2, rollout_chunk=2,
                  micro_batch_size=2, ppo_epochs=1, max_new_tokens=10, warmup_steps=1)
    lengths = [[1, 9]] * 2
    assert fit_seq_len([[0] * 6] * 2, [[0], [0] * 9], w.seq_cap) == 16
    engine = CostModel(rollout=ROLLOUT, train=dataclasses.replace(TRAIN, per_token_s=1e-3))
    service = dataclasses.replace(engine, service=ServiceCosts(train_token_s=1e-2))
    train = [predicted_spans(simulate(w, m, lengths))["train"] for m in (engine, service)]
    # The engine alone: one pass of one micro-batch of 32 padded tokens plus the optimizer, per step.
    assert train[0] == pytest.approx(TRAIN.per_micro_s + 1e-3 * 32 + TRAIN.optimizer_s)
    assert train[1] - train[0] == pytest.approx(1e-2 * 22)
    assert predicted_tokens(simulate(w, service, lengths))["train"] == pytest.approx(22)


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
    costs = service_costs([overheads(real, 1.5, predicted, {"generate": 10, "ref_logprobs": 4, "train": 4})])
    assert costs.generate_token_s == pytest.approx(0.01) and costs.reference_call_s == pytest.approx(0.025)
    assert costs.train_micro_s == 0.0  # faster than the engine-only prediction: never credited
    assert costs.sync_handoff_s == pytest.approx(1.5 - 1.25)
    w = _workload(rollout_chunk=8, score_chunk=4, micro_batch_size=2)  # 16 rows a step
    lengths = [[3] * 16, [5] * 16]  # rollout's calls are its generated tokens: 48 and 80, 64 a step
    assert calls_per_step(w, lengths) == {"generate": 64, "ref_logprobs": 4, "train": 8}


def test_two_workloads_split_a_services_overhead_into_per_call_and_per_token():
    """Two calibration runs whose calls hold rows of 320 and 1,728 tokens: the overheads a service really has,
    2 ms a call + 4 us a token, are recovered (one run alone can only charge it per call); the per-token term of
    rollout is the two runs' excess over their tokens."""
    def run(tokens_per_call, gen_tokens):
        calls = {"generate": gen_tokens, "ref_logprobs": 4, "train": 4}
        tokens = {"ref_logprobs": 4 * tokens_per_call, "train": 4 * tokens_per_call}
        real = {name: 4 * (0.002 + 4e-6 * tokens_per_call) for name in ("ref_logprobs", "train")}
        real["generate"] = 1e-5 * gen_tokens
        return overheads(real, sum(real.values()) + 0.05, {}, calls, tokens)

    short, long = run(320, 512), run(1728, 3000)
    costs = service_costs([short, long])
    assert costs.train_micro_s == pytest.approx(0.002) and costs.train_token_s == pytest.approx(4e-6)
    assert costs.reference_call_s == pytest.approx(0.002) and costs.reference_token_s == pytest.approx(4e-6)
    assert costs.generate_token_s == pytest.approx(1e-5) and costs.sync_handoff_s == pytest.approx(0.05)
    one = service_costs([long])
    assert one.train_token_s == 0.0 and one.train_micro_s == pytest.approx(0.002 + 4e-6 * 1728)


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


def test_the_median_over_steps_leaves_out_a_step_slowed_by_another_job(tmp_path):
    events = [{"ph": "X", "name": "stage_weights", "ts": 0, "dur": 1}]
    t = 10
    for step in range(7):
        gen = 300 if step == 4 else 40  # one step of the five after the warm-up is slowed
        events += [{"ph": "X", "name": "generate", "ts": t, "dur": gen * 1e3},
                   {"ph": "X", "name": "stage_weights", "ts": t + gen * 1e3 + 10e3, "dur": 0}]
        t += (gen + 10) * 1e3
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps({"traceEvents": events}))
    spans, step = real_spans(path, warmup=2, median=True)
    assert spans["generate"] == pytest.approx(0.040) and step == pytest.approx(0.050)
    spans, step = real_spans(path, warmup=2)
    assert spans["generate"] == pytest.approx((4 * 0.040 + 0.300) / 5) and step == pytest.approx(0.102)


def test_the_cpu_sampler_counts_floating_processes_and_leaves_pinned_ones_out():
    """A parent that burns 0.6 s of CPU on any core and a child pinned to core 0 that burns 0.6 s: the sampler
    finds the parent's CPU time as floating, not the child's."""
    import subprocess
    import sys
    import time

    from bench.calibrate import CpuSampler

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
    child = f"import os\nos.sched_setaffinity(0, [0])\n{burn}"
    parent = (f"import subprocess, sys, time\nc = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
              f"{burn}c.wait()\ntime.sleep(0.5)\n")
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-c", parent])
    sampler = CpuSampler(proc.pid, interval=0.05)
    proc.wait()
    sampler.stop()
    floating = sampler.floating_seconds(start, time.time())
    assert 0.5 < floating < 0.85, floating  # the parent's 0.6 s and its interpreter start; not the child's 0.6 s


def test_floating_cpu_per_row_is_taken_over_the_steps_after_the_warm_up(tmp_path):
    from bench.calibrate import CpuSampler, floating_row_s

    sampler = CpuSampler.__new__(CpuSampler)  # its samples, without sampling a process
    # One floating process at 0.5 CPU s per wall s, a pinned one at 1; the steps end every 2 s from t = 10.
    # Both have exited by the last samples, as at the end of a run: the floating one still counts.
    sampler.samples = [(float(t), {1: (0.5 * t, False), 2: (1.0 * t, True)} if t < 37 else {})
                       for t in range(0, 40)]
    # timeline.json: version 0 staged at t = 8, step s's weights at t = 10 + 2 s (microseconds from t = 5).
    stages = [{"ph": "X", "name": "stage_weights", "ts": (t - 5.0) * 1e6, "dur": 0} for t in [8.0] +
              [10.0 + 2 * s for s in range(8)]]
    (tmp_path / "timeline.json").write_text(json.dumps({"traceEvents": stages, "otherData": {"start_unix_time": 5.0}}))
    # Steps 2..7 (after 2 warm-up steps): 12 s, 6 CPU s of floating work, 6 x 10 rows.
    assert floating_row_s(sampler, tmp_path, rows_per_step=10, warmup=2) == pytest.approx(6.0 / 60)
    assert sampler.floating_seconds(10.5, 11.25) == pytest.approx(0.375)  # linear between samples


def test_the_floating_work_is_fitted_back_from_a_run_simulated_with_a_known_value(tmp_path, capsys):
    """``fit_async_floating`` on a timeline the simulator made at 0.4 finds 0.4; a run the model without
    floating work already predicts as slow as measured gets 0 (never credited below)."""
    from pathlib import Path

    from asyncflow.config import load_config
    from asyncflow.simulator.workload import from_config
    from bench.calibrate import CALIBRATION_STEPS, WARMUP, fit_async_floating, overrides_for

    recipe = Path(__file__).resolve().parents[2] / "recipes/tiny_cpu/grpo_async.yaml"
    model = CostModel(rollout=ROLLOUT, train=dataclasses.replace(TRAIN, ref_per_call_s=0.01, ref_per_token_s=1e-4))
    w = dataclasses.replace(from_config(load_config(recipe, overrides_for(1, "async")
                                                    + [f"workflow.steps={CALIBRATION_STEPS}"])), warmup_steps=WARMUP)
    for floating, row_s in ((0.4, 0.0), (0.0, 0.0), (0.3, 0.002)):
        run = simulate(w, dataclasses.replace(model, service=ServiceCosts(async_floating=floating,
                                                                          async_floating_row_s=row_s)))
        events = [{"ph": "X", "name": "stage_weights", "ts": 0, "dur": 0}]  # version 0, staged before step 0
        events += run.timeline.to_chrome_trace()["traceEvents"]
        (tmp_path / "timeline.json").write_text(json.dumps({"traceEvents": events}))
        assert fit_async_floating(model, recipe, tmp_path, row_s) == pytest.approx(floating, abs=0.01)
    # A run three times slower than that last one: no floating share reproduces it (the simulated step stops growing
    # once both cores are always busy), so the fit says so and stays at its ceiling.
    for e in events:
        if e.get("ph") == "X":
            e["ts"], e["dur"] = 3 * e["ts"], 3 * e["dur"]
    (tmp_path / "timeline.json").write_text(json.dumps({"traceEvents": events}))
    assert fit_async_floating(model, recipe, tmp_path, row_s) == 4.0
    assert "set to its ceiling" in capsys.readouterr().out


def test_runs_the_machine_slowed_do_not_set_the_async_terms():
    """Several async calibration runs give the median of their fits, the runs at the bisection's ceiling (slowed
    by another job) left out: two of eight there would pull the mean far off, four of eight the median."""
    from bench.calibrate import async_terms

    floating = [4.0, 4.0, 0.103, 0.202, 0.103, 0.150, 0.464, 0.180]
    rows = [2e-3, 2e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3]
    row_s, share = async_terms(rows, floating)
    assert share == pytest.approx((0.150 + 0.180) / 2) and row_s == pytest.approx(1e-3)
    # Half the runs at the ceiling: the median of all eight would be about 2.3; the others' is kept.
    row_s, share = async_terms([3e-3] * 4 + [1e-3, 1.2e-3, 0.8e-3, 0.9e-3], [4.0] * 4 + [0.449, 0.228, 0.560, 0.0])
    assert share == pytest.approx((0.228 + 0.449) / 2) and row_s == pytest.approx((0.9e-3 + 1e-3) / 2)
    assert async_terms([1e-3], [0.4]) == (1e-3, 0.4)  # one run: its own
    assert async_terms([2e-3, 3e-3], [4.0, 4.0]) == (2.5e-3, 4.0)  # every run at the ceiling: the ceiling


def test_of_several_runs_of_a_workload_the_fastest_is_kept():
    from bench.calibrate import fastest, overheads

    runs = [overheads({"generate": 0.5}, step, {}, {"generate": 100}, workload=workload)
            for workload, step in ((0, 1.2), (1, 0.5), (0, 0.9), (1, 0.6))]
    kept = fastest(runs)
    assert [(r.workload, r.step_s) for r in kept] == [(0, 0.9), (1, 0.5)]
    assert kept[0].handoff == pytest.approx(0.4)  # the step outside its spans, of the kept run
    # Async runs: (step seconds, the run, floating CPU per row), one workload.
    assert fastest([(0.50, 1e-3, 0.3), (0.45, 9e-4, 0.2)], key=lambda run: (0, run[0])) == [(0.45, 9e-4, 0.2)]


def test_calibration_runs_take_turns_across_variants_and_modes():
    from bench.calibrate import calibration_order

    # Rounds: each variant's sync run (the two workloads alternating round by round), then the async run, so a
    # spell of other load on a shared machine falls on the runs of every variant and mode alike.
    assert calibration_order(["1", "2"], 3) == [
        ("1", "sync", 0), ("2", "sync", 0), ("1", "async", 0),
        ("1", "sync", 1), ("2", "sync", 1), ("1", "async", 0),
        ("1", "sync", 0), ("2", "sync", 0), ("1", "async", 0)]
    assert calibration_order(["2"], 2) == [("2", "sync", 0), ("2", "sync", 1)]  # no async run without variant 1


def test_a_profile_taken_while_the_machine_was_slow_is_rescaled_by_the_engines_time_in_the_loop(tmp_path):
    """The profile priced every engine call 2x (rollout), 1.5x (actor) and 1.25x (reference) what the loop's runs
    took: the runs' spans are shorter than the engine-only prediction, so the difference of spans alone clamps
    the services at 0 and predicts the steps slow. The spans' ``engine_s`` give each engine's speed in the loop;
    with it the services' own costs are recovered and the runs' steps are predicted as they ran."""
    from pathlib import Path

    from asyncflow.config import load_config
    from asyncflow.simulator.costs import ACTOR_TERMS, REFERENCE_TERMS, _scale
    from asyncflow.simulator.workload import draw_lengths, from_config
    from bench.calibrate import calibrate, overrides_for

    recipe = Path(__file__).resolve().parents[2] / "recipes/tiny_cpu/grpo_async.yaml"
    train = dataclasses.replace(TRAIN, ref_per_call_s=0.01, ref_per_token_s=1e-4)
    service = ServiceCosts(generate_token_s=2e-4, reference_call_s=0.004, train_micro_s=0.003)
    true = CostModel(rollout=ROLLOUT, train=train, service=service)
    profiled = CostModel(rollout=_scale(ROLLOUT, 2.0),
                         train=_scale(_scale(train, 1.5, ACTOR_TERMS), 1.25, REFERENCE_TERMS))
    runs, steps = [], {}
    for workload in (0, 1):
        w = from_config(load_config(recipe, overrides_for(2, "sync", workload) + ["workflow.steps=16"]))
        run = simulate(w, true, draw_lengths(w))
        steps[workload] = run.step_time_s
        events = [{"ph": "X", "name": "stage_weights", "ts": 0, "dur": 0}]  # version 0, staged before step 0
        events += run.timeline.to_chrome_trace()["traceEvents"]
        (tmp_path / f"{workload}").mkdir()
        (tmp_path / f"{workload}" / "timeline.json").write_text(json.dumps({"traceEvents": events}))
        runs.append(calibrate(profiled, recipe, tmp_path / f"{workload}", 2, workload))
    assert runs[0].beyond["generate"] == 0.0  # faster than the profile: the spans alone clamp it
    fitted = service_costs(runs)
    # Within 1%: the real spans are the median over the steps after the warm-up, the prediction a mean over all.
    assert fitted.rollout_engine_scale == pytest.approx(0.5, rel=0.01)
    assert fitted.train_engine_scale == pytest.approx(1 / 1.5, rel=0.01)
    assert fitted.reference_engine_scale == pytest.approx(0.8, rel=0.01)
    assert fitted.generate_token_s == pytest.approx(2e-4, rel=0.05)
    for run in runs:  # the actor's and the reference's services per step (4 calls each), within 5 ms of 12 and 16 ms
        # (split between per call and per token by the steps' spread in length: the median step against the mean)
        assert fitted.train_micro_s * 4 + fitted.train_token_s * run.tokens["train"] == pytest.approx(0.012, abs=5e-3)
        assert (fitted.reference_call_s * 4 + fitted.reference_token_s * run.tokens["ref_logprobs"]
                == pytest.approx(0.016, abs=5e-3))
    for workload in (0, 1):
        w = from_config(load_config(recipe, overrides_for(2, "sync", workload) + ["workflow.steps=16"]))
        rescaled = simulate(w, dataclasses.replace(profiled, service=fitted), draw_lengths(w))
        clamped = simulate(w, dataclasses.replace(profiled, service=service_costs(
            [dataclasses.replace(r, engine={}) for r in runs])), draw_lengths(w))
        assert rescaled.step_time_s == pytest.approx(steps[workload], rel=0.02)
        assert clamped.step_time_s > steps[workload] * 1.2


def test_profile_says_how_fast_the_engines_ran_in_the_loop_and_flags_a_changed_machine():
    from bench.calibrate import engine_speed_line

    line = engine_speed_line("1", ServiceCosts(rollout_engine_scale=1.19, reference_engine_scale=1.5,
                                               train_engine_scale=1.13))
    assert "rollout 1.19x, reference 1.50x, actor 1.13x" in line and "WARNING" not in line
    assert "WARNING" in engine_speed_line("2", ServiceCosts(rollout_engine_scale=0.47))


@pytest.mark.parametrize("rollout_model", ["chunked", "continuous"])
def test_finished_responses_are_put_sixteen_at_a_time_as_the_loop_does(rollout_model):
    """One engine call of 32 rows that finish one per segment (lengths 1..32): the loop puts every 16th row as it
    finishes, two requests in all, not one per segment that finished a row (32)."""
    from asyncflow.simulator.costs import QueueCosts

    w = _workload(mode="sync", max_staleness=0, steps=2, prompts_per_step=8, samples_per_prompt=4, rollout_chunk=32,
                  micro_batch_size=4, max_new_tokens=32, warmup_steps=1, rollout_model=rollout_model)
    lengths = [list(range(1, 33))] * 2
    model = CostModel(rollout=ROLLOUT, train=TRAIN, queue=QueueCosts(per_request_s=0.01))
    result = simulate(w, model, lengths)
    spans, engine = predicted_spans(result), predicted_spans(result, engine=True)
    # Beyond the engine: the prompts' get (one request) and two puts.
    assert spans["generate"] - engine["generate"] == pytest.approx(0.03)

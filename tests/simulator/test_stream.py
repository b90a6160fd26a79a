"""The sample stream and the colocated baseline (``simulator.stream``) on round-number costs: the staleness bound
per token, every prompt trained exactly once, the colocated engines' even shares and switching, and the packed
trainer's balance, pipeline bubble and all-reduce in closed form."""

import itertools

import pytest

from asyncflow.simulator import stream
from asyncflow.simulator.costs import CostModel, RolloutCosts, SwitchCosts, TrainCosts
from asyncflow.simulator.rollout_models import engine_batch
from asyncflow.simulator.sim import simulate
from asyncflow.simulator.workload import Workload

ROLLOUT = RolloutCosts(step_s=0.01, per_seq_s=1e-4, per_ctx_token_s=1e-6, prefill_per_token_s=2e-5)
TRAIN = TrainCosts(per_micro_s=0.02, per_token_s=1e-4, optimizer_s=0.05)


def _w(**kw) -> Workload:
    base = dict(mode="stream", steps=6, warmup_steps=2, prompts_per_step=4, samples_per_prompt=4, rollout_instances=2,
                max_num_seqs=8, data_parallel=2, reference=False, prompt_len=6, max_new_tokens=64,
                lengths="lognormal:6:1.2", placement="devices", packing=True, ppo_epochs=1, mini_batches=2)
    base.update(kw)
    return Workload(**base)


@pytest.mark.parametrize("k, model", itertools.product([0, 1, 2], ["continuous", "partial"]))
def test_every_trained_token_is_within_the_bound_and_every_prompt_is_trained_once(k, model):
    w = _w(max_staleness=k, rollout_model=model)
    result = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN))
    assert max(lag for step in result.lags for lag in step) <= k
    assert len(result.trained) == w.steps * w.prompts_per_step
    assert len(set(result.trained)) == len(result.trained)  # a dropped prompt is generated again, trained once


def test_a_group_out_of_the_bound_is_dropped_and_its_prompt_generated_again():
    """Partial rollout, k = 0 and a slow rollout against a fast trainer: a long response started under an old
    version finishes after its step, is dropped, and its prompt comes back."""
    w = _w(max_staleness=0, rollout_model="partial", stream_ahead=3, lengths="lognormal:6:1.5", steps=8)
    result = simulate(w, CostModel(rollout=ROLLOUT, train=TrainCosts(per_token_s=1e-6)))
    assert result.dropped > 0
    assert max(lag for step in result.lags for lag in step) == 0
    assert len(set(result.trained)) == w.steps * w.prompts_per_step


def test_colocated_deals_the_rows_evenly_over_every_engine_and_charges_the_switch():
    w = _w(mode="colocated", steps=3, prompts_per_step=2, samples_per_prompt=4, rollout_instances=4, max_num_seqs=8,
           mini_batches=1, lengths="constant:10", max_new_tokens=10, data_parallel=2, devices_per_replica=2)
    switch = SwitchCosts(offload_s=4.0, sleep_wake_s=2.0, reload_s=0.5)  # the state sharded over DP 2 x 2 devices
    plain = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN))
    switched = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, switch=switch))
    # 8 rows on 4 engines: 2 each (not 8 on the first engine, which max_num_seqs = 8 would allow).
    gen = sum(s for s, _ in engine_batch([10, 10], w.prompt_len, ROLLOUT, w.max_num_seqs))
    train = stream.trainer_s(w, CostModel(train=TRAIN), [10] * 8)
    assert plain.step_time_s == pytest.approx(gen + train)
    assert switched.step_time_s == pytest.approx(gen + train + 3.5)
    # The trainer's offload is its own span (verl times it inside update_actor), the engine's part another.
    spans = {}
    for e in switched.timeline.to_chrome_trace()["traceEvents"]:
        if e.get("ph") == "X" and e["name"] in ("offload", "switch"):
            spans.setdefault(e["name"], []).append(e["dur"] / 1e6)
    assert spans["offload"] == pytest.approx([1.0] * 3) and spans["switch"] == pytest.approx([2.5] * 3)


def test_colocated_times_the_old_log_probs_apart_from_the_training():
    w = _w(mode="colocated", steps=3, prompts_per_step=2, samples_per_prompt=4, rollout_instances=2, mini_batches=1,
           lengths="constant:10", max_new_tokens=10, old_logprob=True)
    costs = CostModel(rollout=ROLLOUT, train=TrainCosts(per_token_s=1e-4, ref_per_token_s=5e-5))
    spans = simulate(w, costs).spans_per_step()
    assert spans["old_logprob"] == pytest.approx(stream.forward_s(w, costs, [10] * 8))
    assert spans["train"] == pytest.approx(stream.trainer_s(w, costs, [10] * 8))


def test_packed_trainer_balances_tokens_and_charges_the_bubble_and_the_all_reduce():
    assert sorted(map(sorted, stream.balance([8, 1, 1, 6, 2], 2))) == [[1, 2, 6], [1, 8]]  # 9 tokens each
    w = _w(prompt_len=0, max_new_tokens=10, pipeline_parallel=2, data_parallel=2)
    tc = TrainCosts(per_micro_s=1.0, per_token_s=0.1, grad_allreduce_s=4.0, optimizer_s=0.5)
    # Two replicas of 10 tokens each, one micro-batch (budget 2 x 10 tokens), PP 2: a bubble of (2 - 1) / 1.
    seconds = stream.trainer_s(w, CostModel(train=tc), [10, 10])
    assert seconds == pytest.approx((1.0 + 0.1 * 10) * 2 + 4.0 * 2 * (2 - 1) / 2 + 0.5)


def test_a_trainer_bound_stream_runs_at_the_trainers_pace():
    w = _w(lengths="constant:8", max_new_tokens=8, max_staleness=1, rollout_instances=4, steps=8)
    slow = TrainCosts(per_micro_s=1.0, optimizer_s=0.5)
    result = simulate(w, CostModel(rollout=ROLLOUT, train=slow))
    per_mini = stream.trainer_s(w, CostModel(train=slow), [8] * (w.rows_per_step // w.mini_batches))
    assert result.step_time_s == pytest.approx(w.mini_batches * per_mini)
    assert result.idle_fraction["actor"] < 0.1


def test_mode_search_tries_rollout_shares_down_to_a_quarter_and_any_trainer_dp():
    from asyncflow.simulator.search import colocated_baseline, mode_search

    w = _w(steps=4, prompts_per_step=3, rollout_instances=1, data_parallel=1)  # 12 rows: no DP of 5 or 7 divides them
    model = CostModel(rollout=ROLLOUT, train=TRAIN)
    choices = mode_search(w, model, devices=8, trainer_mp=1, rollout_tp=1, staleness=(1,), models=("partial",))
    assert sorted(c.rollout_instances for c in choices) == [2, 3, 4, 5, 6]
    assert {c.trainer_dp for c in choices} == {6, 5, 4, 3, 2}
    rates = [c.result.samples_per_s for c in choices]
    assert rates == sorted(rates, reverse=True)
    assert "workflow.mode=stream" in choices[0].overrides()
    base = colocated_baseline(w, model, devices=8, trainer_mp=1, rollout_tp=1)
    assert base.workload.rollout_instances == 8 and base.workload.data_parallel == 8


def test_a_per_sample_estimator_streams_single_responses():
    # REINFORCE++ in the sample stream moves responses one by one (workflow.stream_unit=auto): the simulated
    # workload has as many one-response groups; GRPO keeps its groups, and so does every other mode.
    from asyncflow.config import load_config
    from asyncflow.simulator.workload import from_config
    from tests.recipe_runs import REPO

    def shape(*overrides):
        w = from_config(load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", [
            "workflow.prompts_per_step=16", "workflow.samples_per_prompt=8", *overrides]))
        return w.prompts_per_step, w.samples_per_prompt

    assert shape("workflow.mode=stream", "algorithm.advantage=reinforce_pp") == (128, 1)
    assert shape("workflow.mode=stream", "algorithm.advantage=reinforce_pp", "workflow.stream_unit=group") == (16, 8)
    assert shape("workflow.mode=stream") == (16, 8)
    assert shape("workflow.mode=async", "algorithm.advantage=reinforce_pp") == (16, 8)


@pytest.mark.parametrize("regenerated", ["redraw", "keep"])
def test_a_regenerated_group_draws_new_lengths_unless_the_task_fixes_them(regenerated):
    # A prompt generated again is a new sample of the policy (new lengths); a budgeted task (add1_heavytail) fixes
    # each response's length, and from_config keeps them for it.
    s = stream._Stream(_w(regenerated=regenerated, lengths="lognormal:6:1.5"), CostModel(rollout=ROLLOUT, train=TRAIN))
    first = s.next_group(0)
    lengths = list(first.lengths)
    s.retry.append(first)
    again = s.next_group(1)
    assert again.prompt == first.prompt
    assert (again.lengths == lengths) == (regenerated == "keep")
    # The trained lengths are what the stream trained: with k = 0 and long responses dropped, shorter than drawn.
    w = _w(max_staleness=0, rollout_model="partial", stream_ahead=3, lengths="lognormal:6:1.5", steps=8,
           regenerated=regenerated)
    result = simulate(w, CostModel(rollout=ROLLOUT, train=TrainCosts(per_token_s=1e-6)))
    assert result.dropped > 0 and len(result.trained_lengths) == w.steps * w.rows_per_step


def test_from_config_keeps_the_lengths_a_budgeted_task_fixes():
    from asyncflow.config import load_config
    from asyncflow.simulator.workload import from_config
    from tests.recipe_runs import REPO

    recipe = REPO / "recipes/tiny_cpu/grpo_async.yaml"
    assert from_config(load_config(recipe, ["workflow.task=add1_heavytail"])).regenerated == "keep"
    assert from_config(load_config(recipe, ["workflow.task=add1_heavytail"]), lengths="constant:8").regenerated \
        == "redraw"
    assert from_config(load_config(recipe, ["workflow.task=add1"])).regenerated == "redraw"

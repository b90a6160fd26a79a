"""The simulator's event logic on cases with closed-form answers, and the staleness bound.

Costs here are round numbers, not measurements: each test sets only the terms its formula needs, so that
the expected step time can be written down by hand.
"""

import dataclasses
import itertools
import json
import math

import pytest

from asyncflow.simulator.costs import CostModel, QueueCosts, RolloutCosts, TrainCosts, WeightSyncCosts, fit
from asyncflow.simulator.events import Device, Sim
from asyncflow.simulator.rollout_models import engine_batch
from asyncflow.simulator.sim import simulate
from asyncflow.simulator.workload import Workload, draw_lengths
from asyncflow.workflow.batching import fit_seq_len

ROLLOUT = RolloutCosts(step_s=0.01, per_seq_s=1e-4, per_ctx_token_s=1e-6, prefill_per_token_s=2e-5, per_request_s=1e-4)
TRAIN = TrainCosts(per_micro_s=0.02, per_token_s=1e-4, optimizer_s=0.05)


def _workload(**kw) -> Workload:
    base = dict(steps=6, prompts_per_step=4, samples_per_prompt=4, rollout_chunk=16, score_chunk=16,
                micro_batch_size=4, ppo_epochs=2, reference=False, prompt_len=6, max_new_tokens=12,
                lengths="constant:12", placement="devices", warmup_steps=2)
    base.update(kw)
    return Workload(**base)


def _generation(w: Workload, length: int, r: RolloutCosts = ROLLOUT) -> float:
    """One engine batch of every row of a step, all ``length`` tokens long (the loop's chunked rollout)."""
    b, p = w.rows_per_step, w.prompt_len
    first = r.step_s + r.per_seq_s * b + (r.prefill_per_token_s * p + r.per_request_s) * b
    decode = sum(r.step_s + r.per_seq_s * b + r.per_ctx_token_s * b * (p + t) for t in range(1, length))
    return first + decode


def _training(w: Workload, length: int, train: TrainCosts = TRAIN) -> float:
    """``ppo_epochs`` passes over the step's micro-batches, each padded like ``batching.fit_seq_len``."""
    width = fit_seq_len([[0] * w.prompt_len], [[0] * length], w.seq_cap)
    micro = w.rows_per_step // w.micro_batch_size
    tokens = w.micro_batch_size * width
    per_pass = micro * (train.per_micro_s + train.per_token_s * tokens + train.per_token_seq_s * tokens * width)
    return w.ppo_epochs * (per_pass + train.optimizer_s)


def test_engine_batch_finishes_rows_by_length_and_admits_waiting_rows():
    costs = RolloutCosts(step_s=1.0)  # every engine step costs 1 s, whatever it runs
    segments = engine_batch([3, 1, 2], prompt_len=4, costs=costs, max_seqs=8)
    assert segments == [(1.0, [1]), (1.0, [2]), (1.0, [0])]
    # Two slots: row 2 is admitted once row 1 finishes (after the first step) and ends 2 steps later.
    segments = engine_batch([3, 1, 2], prompt_len=4, costs=costs, max_seqs=2)
    assert [(s, sorted(f)) for s, f in segments] == [(1.0, [1]), (2.0, [0, 2])]


def test_processor_sharing_device_splits_its_speed():
    sim = Sim()
    device = Device(sim, "d")
    ends = {}

    def job(name, work, delay):
        yield sim.timeout(delay)
        yield device.run(work)
        ends[name] = sim.now

    sim.process(job("a", 2.0, 0.0))
    sim.process(job("b", 1.0, 1.0))
    sim.run()
    # a runs alone for 1 s (1 s left), then both at half speed: b's 1 s and a's last 1 s end together at 3 s.
    assert ends == pytest.approx({"a": 3.0, "b": 3.0})
    assert device.busy == pytest.approx(3.0)


def test_sync_step_is_generation_plus_training_with_equal_lengths():
    w = _workload(mode="sync", max_staleness=0)
    result = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN))
    step = _generation(w, 12) + _training(w, 12)
    assert result.step_end_s == pytest.approx([step * (i + 1) for i in range(w.steps)])
    # The attention term: per padded token and per token of its padded row.
    train = dataclasses.replace(TRAIN, per_token_seq_s=2e-6)
    result = simulate(w, CostModel(rollout=ROLLOUT, train=train))
    step = _generation(w, 12) + _training(w, 12, train)
    assert step > _generation(w, 12) + _training(w, 12) * 1.01
    assert result.step_end_s == pytest.approx([step * (i + 1) for i in range(w.steps)])
    assert result.samples_per_s == pytest.approx(w.rows_per_step / step)
    assert result.lag_max == 0


@pytest.mark.parametrize("slow", ["rollout", "train"])
def test_async_staleness_one_overlaps_generation_and_training(slow):
    w = _workload(mode="async", max_staleness=1)
    rollout = dataclasses.replace(ROLLOUT, step_s=0.05) if slow == "rollout" else ROLLOUT
    train = TRAIN if slow == "rollout" else TrainCosts(per_micro_s=0.5, per_token_s=1e-4, optimizer_s=0.05)
    result = simulate(w, CostModel(rollout=rollout, train=train))
    gen = _generation(w, 12, rollout)
    width = fit_seq_len([[0] * 6], [[0] * 12], w.seq_cap)
    tr = w.ppo_epochs * (4 * (train.per_micro_s + train.per_token_s * 4 * width) + train.optimizer_s)
    assert (gen > tr) == (slow == "rollout")
    # Steady state: the slower of the two sets the pace; the first step pays both.
    assert result.step_end_s[0] == pytest.approx(gen + tr)
    assert result.step_time_s == pytest.approx(max(gen, tr))
    assert result.lag_max == 1


def test_async_staleness_zero_serialises_generation_and_training():
    w = _workload(mode="async", max_staleness=0)
    result = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN))
    assert result.step_time_s == pytest.approx(_generation(w, 12) + _training(w, 12))


def test_weight_sync_and_queue_costs_add_to_the_sync_step():
    ws = WeightSyncCosts(stage_fixed_s=0.1, apply_fixed_s=0.2)
    w = _workload(mode="sync", max_staleness=0)
    base = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN)).step_time_s
    synced = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, weight_sync=ws)).step_time_s
    # Every steady step stages one version and applies one (the first step applies nothing: version 0).
    assert synced - base == pytest.approx(0.3)
    queued = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, queue=QueueCosts(per_request_s=1e-3))).step_time_s
    assert queued > base


def test_long_tail_costs_more_than_its_mean_in_sync():
    """A chunk lasts as long as its longest response: long-tailed lengths cost more than equal ones of the
    same mean, and async hides part of it."""
    kw = dict(prompts_per_step=16, samples_per_prompt=8, rollout_chunk=128, score_chunk=32, micro_batch_size=32,
              max_new_tokens=128, steps=8)
    tail = _workload(mode="sync", max_staleness=0, lengths="lognormal:24:1", **kw)
    mean = round(sum(map(sum, draw_lengths(tail))) / (tail.steps * tail.rows_per_step))
    flat = _workload(mode="sync", max_staleness=0, lengths=f"constant:{mean}", **kw)
    costs = CostModel(rollout=ROLLOUT, train=TRAIN)
    assert simulate(tail, costs).step_time_s > simulate(flat, costs).step_time_s
    asyn = _workload(mode="async", max_staleness=1, lengths="lognormal:24:1", **kw)
    assert simulate(asyn, costs).samples_per_s > simulate(tail, costs).samples_per_s


ROLLOUTS = [("chunked", 5), ("chunked", 16), ("continuous", 16), ("partial", 16)]
CASES = list(itertools.product(["async", "sync"], [0, 1, 2], [1, 3], ["cpu", "devices"], ROLLOUTS))


@pytest.mark.parametrize("mode,k,instances,placement,rollout", CASES)
def test_staleness_bound_is_never_exceeded(mode, k, instances, placement, rollout):
    model, chunk = rollout
    # Continuous engines with 6 slots for 16 rows a step: a step's tail and the next step's head overlap.
    w = _workload(mode=mode, max_staleness=k, rollout_instances=instances, placement=placement, rollout_chunk=chunk,
                  score_chunk=8, lengths="lognormal:6:1", steps=7, reference=True, seed=k + instances,
                  rollout_model=model, max_num_seqs=6 if model != "chunked" else 256)
    costs = CostModel(rollout=ROLLOUT, train=TRAIN, weight_sync=WeightSyncCosts(apply_fixed_s=0.05),
                      queue=QueueCosts(per_request_s=1e-3))
    result = simulate(w, costs)
    assert len(result.lags) == w.steps and all(len(step) == w.rows_per_step for step in result.lags)
    bound = 0 if mode == "sync" else k
    assert 0 <= min(min(s) for s in result.lags) and result.lag_max <= bound
    assert all(b > a for a, b in zip(result.step_end_s, result.step_end_s[1:]))


def test_fit_recovers_linear_costs_and_never_goes_negative():
    xs = [[1.0, b, b * c] for b in (1, 4, 16) for c in (8, 64)]
    ys = [0.01 + 0.002 * b + 1e-5 * b * c for _, b, bc in xs for c in [bc / b]]
    assert fit(xs, ys) == pytest.approx([0.01, 0.002, 1e-5], rel=1e-6)
    # A noisy grid that plain least squares would fit with a negative intercept: the term is dropped.
    coef = fit([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], [0.9, 2.1, 3.2])
    assert min(coef) >= 0 and math.isclose(coef[0], 0.0)


def test_fit_minimises_relative_error_so_the_smallest_calls_are_fitted_too():
    # One call 100x shorter than the others: plain least squares misses it by 92% (and, unconstrained, gives a
    # negative fixed cost); the relative fit keeps every sample within 3%.
    features, seconds = [[1.0, 1.0], [1.0, 100.0], [1.0, 200.0]], [0.02, 1.0, 2.1]
    coef = fit(features, seconds)
    errors = [(f[0] * coef[0] + f[1] * coef[1]) / s - 1 for f, s in zip(features, seconds)]
    assert max(abs(e) for e in errors) < 0.03


def test_replayed_lengths_follow_each_steps_mean(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"step": s, "rollout/tokens": 128 * m, "actor/rows": 128})
                                 for s, m in enumerate([10, 40])) + "\n")
    w = _workload(lengths=f"replay:{metrics}", steps=2, prompts_per_step=64, samples_per_prompt=8,
                  max_new_tokens=400, replay_sigma=0.3)
    means = [sum(step) / len(step) for step in draw_lengths(w)]
    assert means[0] == pytest.approx(10, rel=0.1) and means[1] == pytest.approx(40, rel=0.1)


def test_rollout_model_registry_names_the_valid_models():
    from asyncflow.registry import RegistryError

    w = _workload(rollout_model="continuous-someday")
    with pytest.raises(RegistryError, match="valid: chunked"):
        simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN))


def _one_slot_costs(**rollout) -> CostModel:
    """Every engine step costs 1 s; training costs ``optimizer_s`` 2 s a step; nothing else costs anything."""
    return CostModel(rollout=RolloutCosts(step_s=1.0, **rollout), train=TrainCosts(optimizer_s=2.0))


def _spans(result, name: str) -> list[dict]:
    return [e for e in result.timeline.to_chrome_trace()["traceEvents"] if e.get("ph") == "X" and e["name"] == name]


def test_continuous_rollout_admits_the_next_steps_prompts_into_slots_the_tail_leaves():
    """Two rows a step, two slots, staleness 1; step 0 is one 8-token row and one 1-token row, step 1 two 1-token
    rows. Chunked: step 1 starts once step 0's 8-token row is done (t = 8) and ends at 9. Continuous: step 1's
    rows take the slot the short row left, at t = 1 and 2, and are done at t = 3, so the engine is never idle
    and done at 8. Training (2 s a step) sets the step ends either way: 10 and 12."""
    w = _workload(mode="async", max_staleness=1, steps=2, prompts_per_step=1, samples_per_prompt=2, rollout_chunk=2,
                  max_num_seqs=2, micro_batch_size=2, ppo_epochs=1, max_new_tokens=8)
    lengths = [[8, 1], [1, 1]]
    chunked = simulate(w, _one_slot_costs(), lengths)
    continuous = simulate(dataclasses.replace(w, rollout_model="continuous"), _one_slot_costs(), lengths)
    assert chunked.step_end_s == pytest.approx([8 + 2, 8 + 2 + 2])  # step 1's rows are in at 9, before 10
    assert continuous.step_end_s == pytest.approx([10, 12])
    # The rollout instance is busy 0-9 chunked (two chunks) and 0-8 continuous (one engine, never drained).
    assert [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in _spans(chunked, "generate")] == [(0, 8), (8, 9)]
    assert [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in _spans(continuous, "generate")] == [(0, 8)]
    assert continuous.lags == [[0, 0], [1, 1]]


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_partial_rollout_swaps_weights_under_a_running_tail_and_recomputes_its_prefix(kv):
    """Staleness 1, four slots; step 1 has a 30-token row. The first engine step admits both steps' rows (1 s
    and 4 x 6 prompt tokens at 0.1 s: t = 3.4) and finishes the 1-token ones. Step 2 needs version 1, published
    at 5.4 after step 0's 2 s of training. Continuous: the engine drains the 30-token row first (t = 32.4), then
    loads version 1. Partial: it swaps at its first look after 5.4, 16 engine steps on (t = 19.4), under the
    running row; ``recompute`` prefills that row's prompt and 17 tokens again, ``keep`` does not."""
    w = _workload(mode="async", max_staleness=1, steps=3, prompts_per_step=1, samples_per_prompt=2, rollout_chunk=2,
                  max_num_seqs=4, micro_batch_size=2, ppo_epochs=1, max_new_tokens=30, prompt_len=6)
    lengths = [[1, 1], [30, 1], [1, 1]]
    costs = _one_slot_costs(prefill_per_token_s=0.1)
    continuous = simulate(dataclasses.replace(w, rollout_model="continuous"), costs, lengths)
    partial = simulate(dataclasses.replace(w, rollout_model="partial", partial_kv=kv), costs, lengths)
    loads = {e["args"]["version"]: (e["ts"] / 1e6, e["dur"] / 1e6) for e in _spans(partial, "load_weights")}
    swap = 0.1 * (6 + 17) if kv == "recompute" else 0.0
    assert loads[1] == pytest.approx((3.4 + 16, swap))
    drained = {e["args"]["version"]: e["ts"] / 1e6 for e in _spans(continuous, "load_weights")}
    assert drained[1] == pytest.approx(3.4 + 29)
    # Step 2 was generated by version 1 either way (its oldest token's version: lag 1); step 1's long row keeps
    # the version of its first token (0) although most of its tokens came from version 1.
    assert partial.lags == continuous.lags == [[0, 0], [1, 1], [1, 1]]


def test_data_parallel_replicas_meet_only_at_the_end_of_the_pass():
    """DP 2, one-row micro-batches and reference chunks, rows of 10, 1, 1 and 10 tokens handed out in that order:
    replica 0 gets rows 0 and 2, replica 1 rows 1 and 3. Each replica's pass is one long and one short row,
    and the step costs the slowest replica's sum (the reference forward then the actor's pass, in sync), not
    two long rows (each micro-batch's slowest piece, as if the replicas waited for each other every time)."""
    w = _workload(mode="sync", max_staleness=0, steps=2, prompts_per_step=1, samples_per_prompt=4, rollout_chunk=4,
                  score_chunk=1, micro_batch_size=1, data_parallel=2, ppo_epochs=1, reference=True,
                  max_new_tokens=10, warmup_steps=1, row_order="arrival")
    costs = CostModel(rollout=RolloutCosts(), train=TrainCosts(per_token_s=0.01, ref_per_token_s=0.001))
    result = simulate(w, costs, [[10, 1, 1, 10]] * 2)
    long, short = (fit_seq_len([[0] * w.prompt_len], [[0] * n], w.seq_cap) for n in (10, 1))
    step = (0.01 + 0.001) * (long + short)
    assert step < (0.01 + 0.001) * 2 * long * 0.95
    assert result.step_end_s == pytest.approx([step, 2 * step])


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_sync_actor_takes_the_shortest_rows_first(data_parallel):
    """Every row of a sync step is ready when the actor asks: with ``row_order="shortest"`` its micro-batches are
    the step's rows sorted by length (dealt to the replicas in turn), padded to about their own length; in
    arrival order (index order here) each micro-batch mixes short and long rows and pads to a long one."""
    lengths = [30, 2, 25, 3, 28, 1, 27, 4]
    costs = CostModel(rollout=RolloutCosts(), train=TrainCosts(per_token_s=0.01))
    width = {n: fit_seq_len([[0] * 6], [[0] * n], 6 + 32) for n in lengths}

    def step_time(order: str) -> float:
        w = _workload(mode="sync", max_staleness=0, steps=2, prompts_per_step=2, samples_per_prompt=4,
                      rollout_chunk=8, score_chunk=8, micro_batch_size=4 // data_parallel, ppo_epochs=1,
                      max_new_tokens=32, warmup_steps=1, data_parallel=data_parallel, row_order=order)
        return simulate(w, costs, [lengths] * 2).step_end_s[0]

    if data_parallel == 1:  # micro-batches {1, 2, 3, 4} and {25, 27, 28, 30} against {30, 2, 25, 3} and {28, 1, 27, 4}
        shortest, arrival = 4 * (width[4] + width[30]), 4 * (width[30] + width[28])
    else:  # each replica two rows of a request: {1, 3}, {25, 28} and {2, 4}, {27, 30}; in index order {30, 2} ...
        shortest = 2 * max(width[3] + width[28], width[4] + width[30])
        arrival = 2 * max(width[30] + width[28], width[25] + width[27])
    assert step_time("shortest") == pytest.approx(0.01 * shortest)
    assert step_time("arrival") == pytest.approx(0.01 * arrival)
    assert shortest < 0.75 * arrival


def test_a_profile_whose_calls_were_disturbed_reports_how_far_its_fit_misses_them():
    from asyncflow.simulator.profile import FIT_MISS_WARNING, _fit_group

    features = [[length, batch * length] for batch in (1, 8, 32, 128) for length in (16, 64)]
    seconds = [0.003 * f[0] + 1e-5 * f[1] for f in features]
    coef, miss = _fit_group(features, seconds)
    assert coef == pytest.approx([0.003, 1e-5], rel=1e-6) and miss < 1e-6
    # All calls but the last slowed 15x by another job: no line through them fits every call.
    disturbed = [s * 15 for s in seconds[:-1]] + seconds[-1:]
    _, miss = _fit_group(features, disturbed)
    assert miss > FIT_MISS_WARNING

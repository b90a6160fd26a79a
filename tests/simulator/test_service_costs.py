"""The services' costs beyond their engine calls (``ServiceCosts``) as the simulator charges them, and the
floating work of the async CPU placement (``events.Pool``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from asyncflow.simulator.costs import CostModel, ServiceCosts, load_costs
from asyncflow.simulator.sim import simulate
from asyncflow.workflow.batching import fit_seq_len
from tests.simulator.test_sim import ROLLOUT, TRAIN, _generation, _training, _workload


def test_per_call_overheads_and_sync_hand_off_add_to_the_sync_step_in_closed_form():
    w = _workload(mode="sync", max_staleness=0)  # 16 rollout rows of 12 tokens and 4 micro-batches a step
    service = ServiceCosts(generate_token_s=0.001, train_micro_s=0.05, sync_handoff_s=0.25)
    result = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, service=service))
    work = _generation(w, 12) + 0.001 * 16 * 12 + _training(w, 12) + 0.05 * 4
    # A step ends when its weights are published; the driver's hand-off follows, before the next step.
    assert result.step_end_s == pytest.approx([work * (i + 1) + 0.25 * i for i in range(w.steps)])
    assert result.step_time_s == pytest.approx(work + 0.25)
    # Per padded token of the first pass's micro-batches too (4 of micro_batch_size rows of ``width`` tokens).
    width = fit_seq_len([[0] * w.prompt_len], [[0] * 12], w.seq_cap)
    per_token = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, service=dataclasses.replace(
        service, train_token_s=1e-4)))
    assert per_token.step_time_s == pytest.approx(work + 0.25 + 1e-4 * w.rows_per_step * width)


def test_a_cost_file_without_service_costs_loads_as_engine_only(tmp_path):
    """Cost files written before the calibration existed still load (every service term at its default)."""
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"variants": {"1": {"rollout": {"step_s": 0.01}}}}))
    assert load_costs(path).variant("1").service == ServiceCosts()


def _pool_run(jobs: dict[int, float], floating: float = 0.0, spill: float = 0.0, at: float = 0.0):
    """Two cores linked by a ``Pool``: ``jobs`` (core index -> seconds of work, started at 0), ``floating`` seconds
    of floating work added at ``at``; returns (each job's end, the pool, the cores)."""
    from asyncflow.simulator.events import Device, Pool, Sim

    sim = Sim()
    cores = [Device(sim, "core0"), Device(sim, "core1+")]
    pool = Pool(sim, cores)
    for core in cores:
        core.spill = spill
    ends = {}

    def job(i, work):
        yield cores[i].run(work)
        ends[i] = sim.now

    def add():
        yield sim.timeout(at)
        pool.add(floating)

    for i, work in jobs.items():
        sim.process(job(i, work))
    sim.process(add())
    sim.run()
    return ends, pool, cores


def test_floating_work_runs_on_an_idle_core_and_leaves_a_busy_one_alone():
    """A 1 s job on core 0 and 0.6 s of floating work: core 1 is idle, so it runs all of the floating work at
    full speed (as the OS moves a runnable process to an idle core) and the job still ends at 1 s."""
    ends, pool, cores = _pool_run({0: 1.0}, floating=0.6)
    assert ends == pytest.approx({0: 1.0})
    assert pool.served == pytest.approx({"core0": 0.0, "core1+": 0.6})
    assert [c.busy for c in cores] == pytest.approx([1.0, 0.6])


def test_floating_work_takes_a_fair_share_of_each_core_only_when_none_is_idle():
    """Both cores busy with 1 s jobs and 0.6 s of floating work: it is one more job on each core, so each job
    runs at half speed until the pool is drained (at 0.6 s: 0.3 s of it on each core, 0.3 s of each job done),
    then at full speed: both end at 0.6 + 0.7 = 1.3 s, each core slowed by its half of the floating work."""
    ends, pool, cores = _pool_run({0: 1.0, 1: 1.0}, floating=0.6)
    assert ends == pytest.approx({0: 1.3, 1: 1.3})
    assert pool.served == pytest.approx({"core0": 0.3, "core1+": 0.3})
    assert sum(c.busy for c in cores) == pytest.approx(2.0 + 0.6)


def test_floating_work_moves_to_a_core_as_soon_as_it_goes_idle():
    """Jobs of 0.5 s on core 0 and 2 s on core 1, 2 s of floating work from the start. Until 1 s the pool shares
    both cores (each job at half speed): core 0's job ends at 1 s, the pool has had 0.5 s of each core. Then core
    0 is idle and runs the pool's last 1 s alone, at full speed, while core 1's job runs undisturbed: its last
    1.5 s end at 2.5 s."""
    ends, pool, cores = _pool_run({0: 0.5, 1: 2.0}, floating=2.0)
    assert ends == pytest.approx({0: 1.0, 1: 2.5})
    assert pool.served == pytest.approx({"core0": 1.5, "core1+": 0.5})
    assert [c.busy for c in cores] == pytest.approx([2.0, 2.5])


def test_spilled_work_goes_into_the_pool():
    """``Device.spill`` f: a job of 1 s adds f of floating work, which the other, idle core absorbs."""
    ends, pool, _ = _pool_run({0: 1.0}, spill=0.4)
    assert ends == pytest.approx({0: 1.0})
    assert sum(pool.served.values()) == pytest.approx(0.4)
    ends, pool, _ = _pool_run({0: 1.0, 1: 1.0}, spill=0.4)  # both busy: 0.8 s of pool, 0.4 s on each core
    assert ends == pytest.approx({0: 1.4, 1: 1.4})


def test_floating_work_applies_to_the_async_cpu_placement_only():
    service = ServiceCosts(async_floating=0.5)
    w = _workload(mode="async", max_staleness=1, placement="cpu")
    assert simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, service=service)).step_time_s > \
        1.1 * simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN)).step_time_s
    for other in (dict(mode="sync", max_staleness=0, placement="cpu"), dict(mode="async", placement="devices")):
        w = _workload(**other)
        assert simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, service=service)).step_end_s == \
            pytest.approx(simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN)).step_end_s)


def test_floating_rows_add_their_cpu_time_to_the_pinned_cores_in_async_cpu_placement_only():
    """``async_floating_row_s`` x: every trained row adds x seconds of work nobody waits for, served by the pinned
    cores, so their busy time grows by exactly x x rows (no core idles while there is floating work). This
    workload's actor core is the busy one and the rollout core idles most of the time: a little floating work
    fits in those idle gaps and costs no step time; more than fits slows the step."""
    row_s = 0.002
    w = _workload(mode="async", max_staleness=1, placement="cpu", reference=True)
    plain = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN))
    floating = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, service=ServiceCosts(async_floating_row_s=row_s)))
    added = sum(floating.busy_s[c] - plain.busy_s[c] for c in ("core0", "core1+"))
    assert added == pytest.approx(row_s * w.rows_per_step * w.steps, rel=1e-6)
    assert floating.step_time_s == pytest.approx(plain.step_time_s)
    assert plain.busy_s["core0"] + row_s * w.rows_per_step * w.steps < plain.busy_s["core1+"]  # it fitted
    heavy = simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, service=ServiceCosts(async_floating_row_s=25 * row_s)))
    assert heavy.step_time_s > 1.05 * plain.step_time_s
    for other in (dict(mode="sync", max_staleness=0, placement="cpu"), dict(mode="async", placement="devices")):
        w = _workload(**other)
        assert simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN, service=ServiceCosts(async_floating_row_s=row_s))
                        ).step_end_s == pytest.approx(simulate(w, CostModel(rollout=ROLLOUT, train=TRAIN)).step_end_s)


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


def test_the_engine_scales_multiply_their_engines_terms_once_and_are_ratios():
    service = ServiceCosts(generate_token_s=1e-3, async_floating=0.3, rollout_engine_scale=0.5,
                           reference_engine_scale=2.0, train_engine_scale=0.25)
    model = CostModel(rollout=ROLLOUT, train=dataclasses.replace(TRAIN, ref_per_call_s=0.01), service=service)
    loop = model.in_loop()
    assert loop.rollout.step_s == pytest.approx(ROLLOUT.step_s * 0.5)
    assert loop.rollout.per_seq_s == pytest.approx(ROLLOUT.per_seq_s * 0.5)
    assert loop.train.per_micro_s == pytest.approx(TRAIN.per_micro_s * 0.25)
    assert loop.train.optimizer_s == pytest.approx(TRAIN.optimizer_s * 0.25)
    assert loop.train.ref_per_call_s == pytest.approx(0.02)
    assert loop.service.generate_token_s == 1e-3  # the services' own costs are measured in the loop already
    assert loop.in_loop() == loop  # applied once
    slow = model.scaled(2.0)  # a slower machine: times double, ratios stay
    assert slow.service.generate_token_s == pytest.approx(2e-3)
    assert (slow.service.rollout_engine_scale, slow.service.async_floating) == (0.5, 0.3)
    # The simulator runs on the scaled engines: a rollout engine at half its profiled cost halves its spans' engine.
    w = _workload(mode="sync", max_staleness=0)
    engine = [simulate(w, m).spans_per_step(engine=True)["generate"]
              for m in (CostModel(rollout=ROLLOUT, train=TRAIN),
                        CostModel(rollout=ROLLOUT, train=TRAIN, service=ServiceCosts(rollout_engine_scale=0.5)))]
    assert engine[1] == pytest.approx(engine[0] * 0.5)

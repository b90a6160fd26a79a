"""Rollout instances on the continuous stream (continuous and partial rollout, agent loops) that die are started
again, and the rows they held generated again from their prompts (``redo_rows.RedoRows``), on the fake
engines: the rollout instances are real Ray actors, SIGKILLed (``os.kill`` of the worker's pid) while they generate,
as in ``test_restart.py``. Rollout is the runs' bottleneck (``tests/fakes/slower.BusyTokens``), so an instance
always holds rows in flight when it dies; the trainer waits at a gate (``GatedTrainer``) until the killed instance
is up again, so the run cannot end before its restart.

Checked on each run: it finishes, every prompt of every step is trained once in its own step with its whole group,
every token comes from a version that admitted its step (``max_staleness``), and the restart is recorded in
``summary.json``, ``restarts.jsonl`` and the metrics with the rows handed out again. A continuous run also scales
from 2 instances to 3 and back to 1 while it goes on.
"""

import json
import os
import signal
import threading
import time

import pytest

from tests.recipe_runs import check_staleness_and_exactly_once, records, run_fake
from tests.workflow.test_restart import GROUP, PROMPTS, RUN, STEPS, Killer, _logged, scaling

pytestmark = [pytest.mark.loop, pytest.mark.faults]

BUSY = ["rollout.engine=tests.fakes.slower.BusyTokens", "rollout.max_num_seqs=4",
        "trainer.engine=tests.fakes.slowed.GatedTrainer"]
TWO = ["workflow.rollout_instances=2", "workflow.max_service_restarts=2"]
TOOL = ["workflow.task=calc", "algorithm.reward=calc", "rollout.max_new_tokens=12", "rollout.max_model_len=32",
        "agent.max_turns=2", "agent.loop=calculator"]


def _restarts(out) -> list[dict]:
    path = out / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _held_run(tmp_path, model_dir, name: str, *extra: str) -> tuple[dict, list[int]]:
    """A run whose rollout instance of the lowest pid is SIGKILLed once 2 steps are logged; the trainer goes past
    step 4 only once the instance is up again. Returns the summary and the pids killed."""
    import ray

    from tests.fakes.slowed import GATE, Gate

    gate = ray.remote(Gate).options(name=GATE).remote()
    ray.get(gate.open.remote(4))
    out, killer = tmp_path / name, Killer(tmp_path / name, "rollout", [])

    def kill() -> None:
        give_up = time.monotonic() + 300  # a run that never logs or never restarts: the assertions say so
        try:
            while _logged(out) < 2 and time.monotonic() < give_up:
                time.sleep(0.05)
            pid = killer._pid()
            if pid is None:
                return
            os.kill(pid, signal.SIGKILL)
            killer.killed.append(pid)
            while not any(e["restart"] for e in _restarts(out)) and time.monotonic() < give_up:
                time.sleep(0.05)
        finally:
            ray.get(gate.open.remote(STEPS))  # never leave the run held

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    try:
        return run_fake(tmp_path, model_dir, name, *RUN, *BUSY, *extra), killer.killed
    finally:
        thread.join(10)
        ray.kill(gate)


def _check(summary) -> None:
    """The run's contract after one kill of a rollout instance that was restarted."""
    check_staleness_and_exactly_once(summary, 1, STEPS, PROMPTS, GROUP)
    rows = records(summary)
    assert all(0 <= r["staleness/token_lag_min"] and r["staleness/token_lag_max"] <= 1 for r in rows)
    # Rows generated twice (given back at the death, or held by two instances) count once, as written; the rows the
    # dead instance wrote in a step it had not reported yet are in no report.
    assert all(r["rollout/rows"] <= PROMPTS * GROUP for r in rows)
    events = summary["service_restarts"]
    assert [(e["service"], e["restart"]) for e in events] == [("rollout", 1)], events
    assert events[0]["released_rows"] > 0, events  # it died generating: its rows were handed out again
    assert events[0]["recovered_at"] > events[0]["detected_at"]
    assert _restarts(summary["_out"]) == events
    assert sum(r.get("supervisor/restarts", 0.0) for r in rows) == 1.0


@pytest.mark.parametrize("mode", ["continuous", "partial"])
def test_a_killed_instance_on_the_continuous_stream_is_restarted_and_its_rows_generated_again(
        tmp_path, tiny_model_dir, shared_ray, mode):
    summary, killed = _held_run(tmp_path, tiny_model_dir, mode, *TWO, f"rollout.{mode}=true")
    assert len(killed) == 1, "the run ended before the kill"
    _check(summary)
    if mode == "partial":  # weights changed under running responses
        assert sum(r["rollout/weight_swaps"] for r in records(summary)) > 0


def test_a_killed_instance_running_agent_loops_is_restarted(tmp_path, tiny_model_dir, shared_ray):
    # One instance: every trajectory it held (between turns too) comes back and is generated again from its prompt.
    # Trajectories are longer (two turns of up to 12 tokens): more slots keep the run short, and still the bottleneck.
    summary, killed = _held_run(tmp_path, tiny_model_dir, "agent", *TOOL, "workflow.max_service_restarts=1",
                                "rollout.max_num_seqs=16")
    assert len(killed) == 1, "the run ended before the kill"
    _check(summary)
    assert all(r["agent/turns_mean"] >= 1 for r in records(summary))


def test_continuous_rollout_scales_up_and_down_while_the_run_goes_on(tmp_path, tiny_model_dir, shared_ray):
    # 2 -> 3 once step 0 is logged, 3 -> 1 once step 3 is
    with scaling(tmp_path / "scale", ((1, 3, 4), (4, 1, STEPS))) as seen:
        summary = run_fake(tmp_path, tiny_model_dir, "scale", *RUN, *BUSY, *TWO, "rollout.continuous=true")
    assert seen == [3, 1], seen
    check_staleness_and_exactly_once(summary, 1, STEPS, PROMPTS, GROUP)
    events = sorted((e["worker"], e["error"]) for e in summary["service_restarts"])
    assert events == [(1, "removed"), (2, "added"), (2, "removed")], events

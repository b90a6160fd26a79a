"""A warm spare rollout instance (``workflow.rollout_spares``) takes the place of one that dies, on the fake engines:
the instances are real Ray actors and the test SIGKILLs one that runs its loop (``os.kill`` of its pid) while it
generates, as in ``test_restart.py``. Rollout is the run's bottleneck (``tests/fakes/slower.BusyTokens``), so the
instance holds rows in flight when it dies; the trainer waits at a gate (``GatedTrainer``) until the new spare that
refills the pool is up, so the run cannot end before it.

Checked: the spare took over (the restart is recorded as ``spare promoted``, the dead process was not started
again: the run's last layout has a new process in the dead one's slot and no Ray restart), the pool was refilled
(``spare started``, started once the promoted spare reported its first step and recorded once its process answered,
in the CPU's background (``SCHED_IDLE``) while the instances serve normally), every prompt of every step was trained
once in its own step with its whole group, the staleness bound held, and no actor (the new spare included) outlived
the run. The chunked run lays rollout out on declared GPUs (``ray.accelerator``): the spare has a device of its own,
keeps it when it takes the slot, and the new spare gets the dead instance's (the only one free).
"""

import json
import os
import signal
import threading
import time

import psutil
import pytest

from tests.recipe_runs import check_staleness_and_exactly_once, check_stream, ray_leftovers, records, run_fake
from tests.workflow import test_restart_stream
from tests.workflow.test_restart import GROUP, PROMPTS, RUN, STEPS, _logged
from tests.workflow.test_restart_continuous import BUSY

SPARE = ["workflow.rollout_instances=2", "workflow.max_service_restarts=2", "workflow.rollout_spares=1"]
# Four declared GPUs (the shared Ray's): the trainer's one, the two instances' and the spare's.
DEVICES = ["ray.accelerator=GPU", "ray.local_devices=4", "ray.num_cpus=4", "ray.cpus_per_device=1"]
RUNS = {"chunked-gpu": [*RUN, *BUSY, *SPARE, *DEVICES],
        "stream": [*test_restart_stream.RUN, "trainer.engine=tests.fakes.slowed.GatedTrainer", *SPARE]}

pytestmark = [pytest.mark.loop, pytest.mark.faults]
AHEAD = 4
"""Train steps the gate allows past those logged until the kill; then it holds there until the pool is refilled."""


def _restarts(out) -> list[dict]:
    path = out / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _running_instances() -> list[int]:
    """The pids of the rollout instances that run their loop now: Ray names an actor's process after the method it
    runs (``ray::RolloutService.run``), and an idle spare's after its class only."""
    import ray

    pids = [a["Pid"] for a in ray._private.state.actors().values()
            if a["ActorClassName"] == "RolloutService" and a["State"] == "ALIVE"]
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).cmdline()[0].startswith("ray::RolloutService.run"):
                running.append(pid)
        except (psutil.Error, IndexError):
            continue
    return sorted(running)


@pytest.mark.parametrize("mode", ["chunked-gpu", "stream"])
def test_a_spare_takes_a_killed_instances_place_and_the_pool_is_refilled(tmp_path, tiny_model_dir, shared_ray,
                                                                          mode):
    import ray

    from tests.fakes.slowed import GATE, Gate

    gate = ray.remote(Gate).options(name=GATE).remote()
    ray.get(gate.open.remote(AHEAD))
    out, killed = tmp_path / "spare", []

    def kill() -> None:
        give_up = time.monotonic() + 300  # a run that never logs or never refills: the assertions say so
        try:
            # The gate stays AHEAD steps past the steps logged, so the trainer never waits at it before the kill
            # and rollout, the bottleneck, keeps generating: a trainer held at the gate would let both instances
            # fill their window and idle, and the one killed would hold no rows (seen on a loaded machine).
            while (logged := _logged(out)) < 2 and time.monotonic() < give_up:
                ray.get(gate.open.remote(logged + AHEAD))
                time.sleep(0.05)
            running = _running_instances()
            if not running:
                return
            os.kill(running[0], signal.SIGKILL)
            killed.append(running[0])
            while (not any(e["error"] == "spare started" for e in _restarts(out))
                   and time.monotonic() < give_up):
                time.sleep(0.05)
        finally:
            ray.get(gate.open.remote(10**6))  # never leave the run held

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    try:
        summary = run_fake(tmp_path, tiny_model_dir, "spare", *RUNS[mode])
    finally:
        thread.join(10)
        ray.kill(gate)
    assert len(killed) == 1, "the run ended before the kill"
    if mode == "stream":  # every prompt of the stream once, whole, in one step
        check_stream(summary, 1, test_restart_stream.STEPS, PROMPTS, GROUP)
    else:
        check_staleness_and_exactly_once(summary, 1, STEPS, PROMPTS, GROUP)
    rows = records(summary)
    events = summary["service_restarts"]
    promoted = [e for e in events if e["service"] == "rollout"]
    assert [(e["restart"], e["how"]) for e in promoted] == [(1, "spare promoted")], events
    assert promoted[0]["released_rows"] > 0, events  # it died generating: its rows were handed out again
    assert promoted[0]["recovered_at"] > promoted[0]["detected_at"]
    refilled = [e for e in events if e["service"] == "rollout spare"]
    assert [(e["error"], e["replaces"]) for e in refilled] == [("spare started", promoted[0]["worker"])], events
    assert refilled[0]["recovered_at"] > refilled[0]["detected_at"]
    # Refilled only once the promoted spare had reported its first step: a process start beside the regeneration of
    # the dead one's rows slowed it on shared cores.
    assert refilled[0]["after_step_reported"] >= promoted[0]["resumed_at_step"], events
    assert _restarts(summary["_out"]) == events
    # The slot runs a process other than the dead one's, and the instances are the two of the run.
    layout = json.loads((summary["_out"] / "layout.json").read_text())
    pids = [row["pid"] for row in layout["rollout"]]
    assert len(pids) == 2 and killed[0] not in pids, (pids, killed)
    if mode == "chunked-gpu":  # on devices: the promoted spare kept its own, the refill took the dead one's
        devices = [tuple(row["devices"]["GPU"]) for row in layout["rollout"] + layout["rollout_spares"]]
        trainer = {tuple(row["devices"]["GPU"]) for row in layout["actor"]}
        assert len(devices) == 3 and len(set(devices)) == 3 and not set(devices) & trainer, layout
    # The refill spare warms up in the CPU's background where it can leave it again (as root, in CI); the promoted
    # spare, a refill itself in the chunked run or not, serves as the other instance does.
    from asyncflow.workflow import priority

    assert [row["cpu_policy"] for row in layout["rollout"]] == ["normal", "normal"], layout["rollout"]
    assert [row["cpu_policy"] for row in layout["rollout_spares"]] == [
        "idle" if priority.can_leave_idle() else "normal"], layout["rollout_spares"]
    assert sum(r.get("supervisor/restarts", 0.0) for r in rows) == 1.0
    actors, groups, servers = ray_leftovers()  # the spare that refilled the pool is stopped with the rest
    assert not (actors or groups or servers), (actors, groups, servers)


@pytest.mark.parametrize(("overrides", "problem"), [
    ({"mode": "sync"}, "needs rollout instances that are restarted"),
    ({"max_service_restarts": 0}, "needs rollout instances that are restarted"),
    ({"mode": "stream", "dynamic_sampling": True}, "needs rollout instances that are restarted"),
    ({"accelerator": "GPU"}, None),
    ({"rollout_spares": -1}, "workflow.rollout_spares=-1 must be at least 0"),
    ({}, None),
    ({"mode": "stream"}, None),
])
def test_spares_only_where_rollout_instances_are_restarted_in_place(overrides, problem):
    from asyncflow.config import AsyncFlowConfig
    from asyncflow.config_rules import spares

    cfg = AsyncFlowConfig()
    cfg.workflow.mode, cfg.workflow.max_service_restarts = overrides.get("mode", "async"), \
        overrides.get("max_service_restarts", 2)
    cfg.workflow.rollout_spares = overrides.get("rollout_spares", 1)
    cfg.algorithm.dynamic_sampling = overrides.get("dynamic_sampling", False)
    cfg.ray.accelerator = overrides.get("accelerator")
    found = spares(cfg)
    assert (found == []) if problem is None else (len(found) == 1 and problem in found[0]), found

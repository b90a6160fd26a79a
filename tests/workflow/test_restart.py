"""Stateless services that die are started again and their rows made again, exactly once (the supervisor,
``asyncflow.workflow.supervisor``), on the fake engines: the worker processes are real Ray actors, and the test
SIGKILLs them (``os.kill`` of the worker's pid) in the middle of a run.

Checked: the run finishes, every prompt of every step is trained once in its own step with its whole group
(``check_staleness_and_exactly_once``, the resume tests' check), the staleness bound holds, and the summary and
the metrics record the restarts. Past ``workflow.max_service_restarts`` the run restarts from its checkpoint (or
stops with an error naming the service without one), or, for a rollout instance while another runs, goes on
without it. The trainer is slowed down
(``tests/fakes/slowed.SlowTrainer``) so that the kills land mid-run.
"""

import contextlib
import json
import os
import signal
import threading
import time

import pytest

from tests.recipe_runs import SMALL, check_staleness_and_exactly_once, ray_leftovers, records, run_fake

pytestmark = [pytest.mark.loop, pytest.mark.faults]

STEPS, PROMPTS, GROUP = 8, 8, 4
# The default put lease (120 s): a put a killed worker prepared and never committed is rolled back by the supervisor
# before its successor runs (``rolled_back_puts``), not when that lease runs out.
RUN = [*SMALL, f"workflow.steps={STEPS}", "trainer.engine=tests.fakes.slowed.SlowTrainer", "algorithm.kl_coef=0"]


class Killer(threading.Thread):
    """SIGKILLs the process of one worker of ``service`` each time the run has logged the steps in ``after``."""

    def __init__(self, out, service: str, after: list[int], instance: int = 0, exact: bool = False):
        """``instance``: the rank of the worker's pid among the live ones (any instance but one), or with ``exact``
        rollout instance ``instance`` itself (``_pid``)."""
        super().__init__(daemon=True)
        self.out, self.service, self.after, self.instance, self.exact = out, service, after, instance, exact
        self.killed: list[int] = []  # pids, in kill order
        self.stop = False

    def run(self) -> None:
        for logged in self.after:
            while not self.stop and self._logged() < logged:
                time.sleep(0.05)
            if self.stop:
                return
            pid = self._pid()
            while not self.stop and (pid is None or pid in self.killed):  # a worker being started again
                time.sleep(0.05)
                pid = self._pid()
            if self.stop:
                return
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)

    def _logged(self) -> int:
        return _logged(self.out)

    def _pid(self) -> int | None:
        """The pid of the worker's process, as Ray's actor table has it (the public state API needs the dashboard,
        which the tests' Ray does not start). With ``exact``, the rollout instance is found by its index in the
        ``layout.json`` the run writes once it is up: the order of the pids is not the instances' (Ray hands out
        the worker processes it started in any order)."""
        pids = self._alive()
        if self.exact:
            try:
                pid = json.loads((self.out / "layout.json").read_text())["rollout"][self.instance]["pid"]
            except (OSError, ValueError, KeyError, IndexError):  # not written yet, or being written
                return None
            return pid if pid in pids else None
        return pids[min(self.instance, len(pids) - 1)] if pids else None

    def _alive(self) -> list[int]:
        """The pids of the service's live workers, in order."""
        import ray

        name = {"reward": "RewardService", "rollout": "RolloutService", "actor": "ActorService"}[self.service]
        return sorted(a["Pid"] for a in ray._private.state.actors().values()
                      if a["ActorClassName"] == name and a["State"] == "ALIVE")


def _run_with_kills(tmp_path, model_dir, name: str, service: str, after: list[int], *extra: str, run=RUN):
    killer = Killer(tmp_path / name, service, after)
    killer.start()
    try:
        return run_fake(tmp_path, model_dir, name, *run, *extra), killer
    finally:
        killer.stop = True
        killer.join(10)


def test_a_killed_reward_worker_is_restarted_and_every_prompt_trained_once(tmp_path, tiny_model_dir, shared_ray):
    summary, killer = _run_with_kills(tmp_path, tiny_model_dir, "reward", "reward", [2])
    assert len(killer.killed) == 1, "the run ended before the kill"
    check_staleness_and_exactly_once(summary, 1, STEPS, PROMPTS, GROUP)
    events = summary["service_restarts"]
    assert [(e["service"], e["worker"], e["restart"]) for e in events] == [("reward", 0, 1)], events
    assert events[0]["resumed_at_step"] >= 2
    assert events[0]["rolled_back_puts"] in (0, 1), events  # one put at a time: killed before, during or after it
    assert sum(r.get("supervisor/restarts", 0.0) for r in records(summary)) == 1.0


def test_killed_rollout_instances_are_replaced_then_left_out_and_the_run_goes_on(tmp_path, tiny_model_dir,
                                                                                 shared_ray):
    # Two of two instances' deaths with a bound of 1: the first is restarted, the second left out (the run ends
    # on the other instance).
    summary, killer = _run_with_kills(tmp_path, tiny_model_dir, "rollout", "rollout", [2, 4],
                                      "workflow.rollout_instances=2", "workflow.max_service_restarts=1")
    assert len(killer.killed) == 2, "the run ended before the kills"
    check_staleness_and_exactly_once(summary, 1, STEPS, PROMPTS, GROUP)
    # The restart is recorded when the worker is up again, which may come after the other instance was left out.
    events = sorted(summary["service_restarts"], key=lambda e: e["error"] == "dropped")
    assert [(e["service"], e["restart"]) for e in events] == [("rollout", 1), ("rollout", None)], events
    assert events[1]["error"] == "dropped"
    assert all(e["rolled_back_puts"] in (0, 1) for e in events), events
    actors, groups, servers = ray_leftovers()  # the instance left out is stopped with the rest
    assert not (actors or groups or servers), (actors, groups, servers)


def test_a_killed_rollout_instance_fed_by_the_relay_rejoins_it(tmp_path, tiny_model_dir, shared_ray):
    # Every pair relays (weight_sync.transport=relay): the one rollout instance owns its host's receiver. Its death
    # breaks the relay group; the instance Ray starts again asks into the next generation and gets the newest
    # version through it, and the run trains every prompt once.
    summary, killer = _run_with_kills(tmp_path, tiny_model_dir, "relay", "rollout", [2],
                                      "weight_sync.transport=relay", "workflow.max_service_restarts=1")
    assert len(killer.killed) == 1, "the run ended before the kill"
    check_staleness_and_exactly_once(summary, 1, STEPS, PROMPTS, GROUP)
    assert [(e["service"], e["restart"]) for e in summary["service_restarts"]] == [("rollout", 1)]
    layout = json.loads((summary["_out"] / "layout.json").read_text())
    [sender] = [row["weights"] for row in layout["actor"] if row["weights"].get("sends_to")]
    assert sender["relay_generation"] >= 1 and sender["relay_members"] == [0], sender
    [rollout] = [row["weights"] for row in layout["rollout"]]
    assert rollout["relay_versions"] > 0 and min(rollout["relay_generations"]) >= 1, rollout  # the new receiver's
    assert rollout["read_bytes"]["relay"] > 0 and rollout["read_bytes"]["shm"] == 0, rollout


def test_a_death_past_the_bound_restarts_the_run_from_its_checkpoint(tmp_path, tiny_model_dir, shared_ray, capsys):
    # The first death is restarted in place; the second, past workflow.max_service_restarts=1, is a
    # ``ServiceLostError``: the run restarts from its checkpoint (without checkpoints it would stop with that
    # message, as test_weight_failure's run does).
    summary, killer = _run_with_kills(tmp_path, tiny_model_dir, "bound", "reward", [1, 3],
                                      "workflow.max_service_restarts=1", "checkpoint.interval=2",
                                      "workflow.max_restarts=1")
    assert len(killer.killed) == 2, "the run ended before the kills"
    [event] = summary["run_restarts"]
    died, point = event["died_at_step"], event["checkpoint_step"]
    assert (event["cause"], event["group"], event["rank"]) == ("service", "reward", 0), event
    check_staleness_and_exactly_once({**summary, "steps": STEPS}, 1, STEPS, PROMPTS, GROUP)
    out = capsys.readouterr().out
    assert "reward worker 0 died; starting it again (1 of at most 1)" in out, out[-3000:]
    assert f"reward worker 0 died at step {died}; restart 1/1 from the checkpoint at step {point}\n" in out


def _logged(out) -> int:
    """Steps the run writing to ``out`` has logged."""
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _alive(name: str) -> int:
    import ray

    return sum(1 for a in ray._private.state.actors().values() if a["ActorClassName"] == name and a["State"] == "ALIVE")


@contextlib.contextmanager
def scaling(out, plan):
    """Requests to scale rollout while the run writing to ``out`` goes on, its trainer held at a gate
    (``tests.fakes.slowed``): for each ``(logged, wanted, then)`` of ``plan``, once ``logged`` steps are logged ask
    for ``wanted`` instances, wait until that many are alive, and let the trainer go up to step ``then``. Yields the
    list of instance counts seen after each request (filled as the run goes on)."""
    import ray

    from asyncflow.workflow.supervisor import request_scale
    from tests.fakes.slowed import GATE, Gate

    gate = ray.remote(Gate).options(name=GATE).remote()
    seen: list[int] = []

    def scale() -> None:
        give_up = time.monotonic() + 300  # a run that never logs: the caller's assertions say so
        try:
            for logged, wanted, then in plan:
                while _logged(out) < logged and time.monotonic() < give_up:
                    time.sleep(0.05)
                request_scale(out, wanted)
                deadline = time.monotonic() + 120
                while _alive("RolloutService") != wanted and time.monotonic() < deadline:
                    time.sleep(0.05)
                seen.append(_alive("RolloutService"))
                ray.get(gate.open.remote(then))
        finally:
            ray.get(gate.open.remote(plan[-1][2]))  # never leave the run held

    ray.get(gate.open.remote(plan[0][0]))
    thread = threading.Thread(target=scale, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        thread.join(10)
        ray.kill(gate)


def test_rollout_instances_are_added_and_removed_on_request_while_the_run_goes_on(tmp_path, tiny_model_dir,
                                                                                   shared_ray):
    # The trainer waits at a gate (``GatedTrainer``), so each request lands while the run still has steps to go,
    # however slowly an added instance starts on a loaded machine. 1 -> 2 once step 0 is logged, 2 -> 1 once step 3 is.
    with scaling(tmp_path / "scale", ((1, 2, 4), (4, 1, STEPS))) as seen:
        summary = run_fake(tmp_path, tiny_model_dir, "scale", *RUN, "trainer.engine=tests.fakes.slowed.GatedTrainer")
    assert seen == [2, 1], seen
    check_staleness_and_exactly_once(summary, 1, STEPS, PROMPTS, GROUP)
    events = [(e["service"], e["worker"], e["error"]) for e in summary["service_restarts"]]
    assert events == [("rollout", 1, "added"), ("rollout", 1, "removed")], events
    actors, groups, servers = ray_leftovers()
    assert not (actors or groups or servers), (actors, groups, servers)

"""A trainer rank that dies restarts the run from its newest checkpoint (``workflow.max_restarts``), on the fake
engines: the actor rank is a real Ray actor process and the test SIGKILLs it (``os.kill`` of its pid) mid-run.

Checked: the run finishes all its steps, every prompt of every step is trained once in its own step across the
restart (``check_staleness_and_exactly_once``), the restart is printed, recorded in the summary and in
``restarts.jsonl`` with the steps redone since the checkpoint, and nothing of the dead attempt is left in Ray. With
``workflow.max_restarts=0``, or without checkpoints, a trainer death stops the run with the one-line error as before.
The time rule of checkpoints (``checkpoint.every_minutes``) is checked on its decision function with a fake clock.

The reference: a one-rank reference SIGKILLed twice is restarted in place (its rows read again), then, past
``workflow.max_service_restarts``, restarts the run from its checkpoint; a dead reference actor of a group not
restarted in place is turned into a trainer death (``Pipeline.explain``); ``restartable`` decides which layouts
restart it in place.
"""

import json

import pytest

from asyncflow.config import load_config
from asyncflow.workflow.checkpoints import CheckpointManager
from asyncflow.workflow.errors import TrainerDiedError, WorkerDiedError
from asyncflow.workflow.resume import CheckpointSchedule
from asyncflow.workflow.supervisor import restartable
from tests.recipe_runs import REPO, SMALL, check_staleness_and_exactly_once, ray_leftovers, run_fake
from tests.workflow.test_restart import Killer, _run_with_kills

pytestmark = pytest.mark.faults

STEPS, PROMPTS, GROUP = 6, 8, 4
RUN = [*SMALL, f"workflow.steps={STEPS}", "trainer.engine=tests.fakes.slowed.SlowTrainer", "algorithm.kl_coef=0",
       "checkpoint.interval=2"]
DIED = "actor rank 0 died (its process exited; see its log in Ray's session folder)"


def _run_killing_the_actor(tmp_path, model_dir, name: str, *extra: str):
    return _run_with_kills(tmp_path, model_dir, name, "actor", [3], *extra, run=RUN)


@pytest.mark.loop
def test_a_killed_actor_rank_restarts_the_run_from_its_checkpoint(tmp_path, tiny_model_dir, shared_ray, capsys):
    summary, killer = _run_killing_the_actor(tmp_path, tiny_model_dir, "restart", "workflow.max_restarts=1")
    assert len(killer.killed) == 1, "the run ended before the kill"
    [event] = summary["trainer_restarts"]
    died, point = event["died_at_step"], event["checkpoint_step"]
    # The summary is the last attempt's, as after ``--resume``: its steps start at the checkpoint, and its record of
    # trained prompts (restored from the checkpoint) covers every step.
    assert (summary["first_step"], summary["steps"]) == (point, STEPS - point), summary
    check_staleness_and_exactly_once({**summary, "steps": STEPS}, 1, STEPS, PROMPTS, GROUP)
    # Killed once 3 steps were logged; checkpoints every 2 steps are committed as steps complete.
    assert died >= 3 and point == died - died % 2, event
    assert (event["group"], event["rank"], event["restart"]) == ("actor", 0, 1), event
    assert event["steps_redone"] == died - point
    out = capsys.readouterr().out
    assert (f"trainer rank 0 (actor) died at step {died}; restart 1/1 from the checkpoint at step {point}\n"
            in out), out[-3000:]
    assert f"resume: continuing from {tmp_path / 'restart' / 'checkpoints'}/step_{point:06d}" in out
    lines = [json.loads(line) for line in (summary["_out"] / "restarts.jsonl").read_text().splitlines()]
    assert [(r["service"], r["restart"], r["steps_redone"]) for r in lines] == [("actor", 1, died - point)], lines
    # The metrics of the steps redone are written once, by the attempt that finished them.
    logged = [json.loads(line)["step"] for line in (summary["_out"] / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(STEPS)), logged
    actors, groups, servers = ray_leftovers()
    assert not (actors or groups or servers), (actors, groups, servers)


@pytest.mark.loop
def test_a_killed_rollout_instance_in_sync_mode_restarts_the_run_from_its_checkpoint(tmp_path, tiny_model_dir,
                                                                                     shared_ray, capsys):
    # Sync mode restarts no service in place (the driver runs each step's tasks in lock-step): a service death is
    # a ``ServiceLostError``, and the run goes on from its checkpoint as for a trainer death.
    summary, killer = _run_with_kills(tmp_path, tiny_model_dir, "sync", "rollout", [3], "workflow.mode=sync",
                                      "workflow.max_staleness=0", "workflow.max_restarts=1", run=RUN)
    assert len(killer.killed) == 1, "the run ended before the kill"
    [event] = summary["run_restarts"]
    died, point = event["died_at_step"], event["checkpoint_step"]
    assert (event["cause"], event["group"], event["rank"]) == ("service", "rollout", 0), event
    assert summary["trainer_restarts"] == [] and point == died - died % 2 and died >= 3, event
    check_staleness_and_exactly_once({**summary, "steps": STEPS}, 0, STEPS, PROMPTS, GROUP)
    assert (f"rollout instance 0 died at step {died}; restart 1/1 from the checkpoint at step {point}\n"
            in capsys.readouterr().out)
    actors, groups, servers = ray_leftovers()
    assert not (actors or groups or servers), (actors, groups, servers)


@pytest.mark.loop
def test_without_restarts_a_killed_actor_rank_stops_the_run(tmp_path, tiny_model_dir, shared_ray):
    # Checkpoints by time only, every 6 ms: each step boundary gets one, the trainer's part and the driver's commit
    # at the same steps (a boundary the two saw differently would fail the commit, or leave no actor part).
    with pytest.raises(WorkerDiedError) as failed:
        _run_killing_the_actor(tmp_path, tiny_model_dir, "norestart", "workflow.max_restarts=0",
                               "checkpoint.interval=0", "checkpoint.every_minutes=0.0001")
    assert str(failed.value) == DIED, str(failed.value)
    assert not (tmp_path / "norestart" / "restarts.jsonl").exists()
    root = tmp_path / "norestart" / "checkpoints"
    steps = CheckpointManager(root, 0).list()
    assert len(steps) == 2 and steps[1] == steps[0] + 1 and steps[1] >= 3, steps  # keep_last=2
    assert all((root / f"step_{s:06d}" / "actor").is_dir() for s in steps)


class ReferenceKiller(Killer):
    """``Killer`` of the reference rank's process."""

    def _pid(self) -> int | None:
        import ray

        pids = [a["Pid"] for a in ray._private.state.actors().values()
                if a["ActorClassName"] == "ReferenceService" and a["State"] == "ALIVE"]
        return pids[0] if pids else None


@pytest.mark.loop
def test_a_killed_reference_rank_is_restarted_in_place_then_past_the_bound_from_the_checkpoint(
        tmp_path, tiny_model_dir, shared_ray, capsys):
    # One rank (trainer world size 1): the first death is restarted in place (its rows read again), the second,
    # past workflow.max_service_restarts=1, restarts the run from its checkpoint as an actor rank's death does.
    # Eight steps: at the second kill (4 steps logged) the reference, at most max_staleness + 1 steps ahead of the
    # trainer, has steps left to do, so its death is seen.
    steps = 8
    killer = ReferenceKiller(tmp_path / "reference", "reference", [1, 4])
    killer.start()
    try:
        summary = run_fake(tmp_path, tiny_model_dir, "reference", *RUN, f"workflow.steps={steps}",
                           "algorithm.kl_coef=0.05", "workflow.max_service_restarts=1", "workflow.max_restarts=1",
                           "transfer_queue.put_lease_s=20")
    finally:
        killer.stop = True
        killer.join(10)
    assert len(killer.killed) == 2, "the run ended before the kills"
    check_staleness_and_exactly_once({**summary, "steps": steps}, 1, steps, PROMPTS, GROUP)
    [event] = summary["trainer_restarts"]
    died, point = event["died_at_step"], event["checkpoint_step"]
    assert (event["group"], event["rank"], event["restart"]) == ("reference", 0, 1), event
    assert died >= 4 and point == died - died % 2 and event["steps_redone"] == died - point, event
    assert (summary["first_step"], summary["steps"]) == (point, steps - point), summary
    out = capsys.readouterr().out
    assert "reference rank 0 died; starting it again (1 of at most 1)" in out, out[-3000:]
    assert "reference rank 0 is up again" in out
    assert (f"trainer rank 0 (reference) died at step {died}; restart 1/1 from the checkpoint at step {point}\n"
            in out), out[-3000:]
    lines = [json.loads(line) for line in (summary["_out"] / "restarts.jsonl").read_text().splitlines()]
    assert [(r["service"], r["worker"], r["restart"]) for r in lines] == [("reference", 0, 1)] * 2, lines
    assert lines[0]["resumed_at_step"] >= 1 and "steps_redone" not in lines[0], lines
    assert lines[1]["steps_redone"] == died - point, lines
    logged = [json.loads(line)["step"] for line in (summary["_out"] / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(steps)), logged
    actors, groups, servers = ray_leftovers()
    assert not (actors or groups or servers), (actors, groups, servers)


def test_the_reference_is_restarted_in_place_only_when_each_rank_is_a_group_of_its_own(tmp_path):
    assert "reference" in restartable(_cfg(tmp_path))
    for layout in ("trainer.data_parallel=2", "trainer.tensor_parallel=2"):
        assert "reference" not in restartable(_cfg(tmp_path, layout)), layout
    assert "reference" not in restartable(_cfg(tmp_path, "workflow.max_service_restarts=0"))
    assert "reference" not in restartable(_cfg(tmp_path, "workflow.mode=sync"))


class _Rank:
    """A stand-in Ray actor for a reference rank whose process dies."""

    def die(self) -> None:
        import os

        os._exit(1)


def test_a_dead_reference_rank_is_explained_as_a_trainer_death(shared_ray):
    # The path of a reference not restarted in place (a model-parallel group, sync and stream modes): the driver
    # turns its actor's death into a TrainerDiedError, which restarts the run from its checkpoint.
    import ray

    from asyncflow.workflow.pipeline import Pipeline

    rank = ray.remote(_Rank).options(num_cpus=0).remote()
    with pytest.raises(ray.exceptions.RayActorError) as died:
        ray.get(rank.die.remote(), timeout=120)
    pipe = Pipeline(None, None, None, None, {"reference": [rank]}, None, 0, [], [])
    explained = pipe.explain(died.value)
    assert isinstance(explained, TrainerDiedError), explained
    assert (explained.group, explained.rank) == ("reference", 0)
    assert str(explained) == "reference rank 0 died (its process exited; see its log in Ray's session folder)"


def _cfg(tmp_path, *extra: str):
    return load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", [f"observability.output_dir={tmp_path}", *extra])


def test_without_checkpoints_a_trainer_death_is_not_restarted(tmp_path):
    from asyncflow.workflow.loop import _restart
    from asyncflow.workflow.signals import StopSignals

    died = TrainerDiedError(DIED, "actor", 0, 3)
    with pytest.raises(TrainerDiedError) as failed:
        _restart(_cfg(tmp_path, "workflow.max_restarts=2"), died, [], StopSignals(0))
    assert failed.value is died
    restarts = [{"restart": 1}]  # spent: the error says so
    with pytest.raises(TrainerDiedError) as failed:
        _restart(_cfg(tmp_path, "workflow.max_restarts=1", "checkpoint.interval=2"), died, restarts, StopSignals(0))
    assert str(failed.value) == (f"{DIED}; the run was restarted from its checkpoint 1 times already "
                                 "(workflow.max_restarts=1)")


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_minutes_checkpoints_the_first_boundary_after_the_time_and_every_caller_agrees():
    clock = Clock()
    schedule = CheckpointSchedule(interval=5, steps=12, every_minutes=2.0, clock=clock)
    answers = []
    # (seconds, steps trained): the run starts at 0 s; boundaries reached at these times
    for clock.now, trained in ((100, 1), (125, 2), (200, 3), (245, 4), (251, 4), (260, 5), (300, 6), (381, 7),
                               (390, 12)):
        answers.append(schedule.due(trained))
    # 2: the first boundary 2 min after the start; 4: 2 min after 2's (asked again 6 s later by another caller:
    # the same answer); 5: the interval, which restarts the time; 7: 2 min after 5's; 12: the last step.
    assert answers == [False, True, False, True, True, True, False, True, True]
    clock.now = 1000.0
    assert schedule.due(1) is False and schedule.due(6) is False  # decided once, whatever the clock says later
    off = CheckpointSchedule(interval=0, steps=4, every_minutes=0.0, clock=clock)
    clock.now = 1e6
    assert [off.due(t) for t in range(1, 5)] == [False] * 4

"""A TransferQueue storage unit that dies with rows the run still needs restarts the run from its newest checkpoint,
as a trainer rank's death does (``workflow.max_restarts``), on the fake engines: the storage unit is a real server
process of the run's TransferQueue and the test SIGKILLs it mid-run, while the steps fed ahead of the trainer have
rows on it.

Checked: the run finishes all its steps, every prompt of every step is trained once in its own step across the
restart, and the restart is printed and recorded (``run_restarts`` in the summary, ``restarts.jsonl``) with its
cause, the unit and the steps redone.
"""

import json
import os
import signal
import threading
import time

import psutil
import pytest

from tests.recipe_runs import check_staleness_and_exactly_once, ray_leftovers, run_fake
from tests.workflow.test_trainer_restart import GROUP, PROMPTS, RUN, STEPS

pytestmark = pytest.mark.faults

KILL_AFTER = 3
"""Steps logged before the kill: the feeder keeps prompts of the steps after them in the TransferQueue."""


def storage_unit_pids() -> list[int]:
    """The pids of this process's TransferQueue storage units (its ``_server`` children but the controller, which
    the deployment starts first)."""
    servers = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "asyncflow.transfer_queue._server" in " ".join(child.cmdline()):
                servers.append((child.create_time(), child.pid))
        except psutil.Error:  # exited meanwhile
            continue
    return [pid for _, pid in sorted(servers)[1:]]


class UnitKiller(threading.Thread):
    """SIGKILLs one storage unit of the run writing to ``out`` once it has logged ``after`` steps."""

    def __init__(self, out, after: int):
        super().__init__(daemon=True)
        self.out, self.after = out, after
        self.killed: list[int] = []
        self.stop = False

    def run(self) -> None:
        metrics = self.out / "metrics.jsonl"
        while not self.stop and (not metrics.exists() or len(metrics.read_text().splitlines()) < self.after):
            time.sleep(0.05)
        pids = storage_unit_pids()
        if not self.stop and pids:
            os.kill(pids[-1], signal.SIGKILL)
            self.killed.append(pids[-1])


@pytest.mark.loop
def test_a_killed_storage_unit_restarts_the_run_from_its_checkpoint(tmp_path, tiny_model_dir, shared_ray, capsys):
    killer = UnitKiller(tmp_path / "storage", KILL_AFTER)
    killer.start()
    try:
        summary = run_fake(tmp_path, tiny_model_dir, "storage", *RUN, "workflow.max_restarts=1",
                           "transfer_queue.put_lease_s=20")
    finally:
        killer.stop = True
        killer.join(10)
    assert len(killer.killed) == 1, "the run ended before the kill"
    [event] = summary["run_restarts"]
    assert summary["trainer_restarts"] == []
    died, point = event["died_at_step"], event["checkpoint_step"]
    assert (event["cause"], event["group"], event["restart"]) == ("storage", "storage", 1), event
    assert died >= KILL_AFTER and point == died - died % 2 and event["steps_redone"] == died - point, event
    # Every prompt once, in its own step: the steps after the checkpoint were trained again from the same prompts.
    assert (summary["first_step"], summary["steps"]) == (point, STEPS - point), summary
    check_staleness_and_exactly_once({**summary, "steps": STEPS}, 1, STEPS, PROMPTS, GROUP)
    out = capsys.readouterr().out
    unit = event["rank"]
    assert (f"TransferQueue storage unit {unit} died at step {died}; restart 1/1 from the checkpoint at step {point}\n"
            in out), out[-3000:]
    lines = [json.loads(line) for line in (summary["_out"] / "restarts.jsonl").read_text().splitlines()]
    assert [(r["service"], r["cause"], r["steps_redone"]) for r in lines] == [("storage", "storage", died - point)]
    logged = [json.loads(line)["step"] for line in (summary["_out"] / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(STEPS)), logged
    actors, groups, servers = ray_leftovers()
    assert not (actors or groups or servers), (actors, groups, servers)

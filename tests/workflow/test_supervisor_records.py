"""The supervisor's account of restarts (``summary.json``'s ``service_restarts``, ``restarts.jsonl``): a death whose
worker was still being started again when the run ended is recorded too, not dropped (a restart can outlast the rest
of a short run on a loaded machine)."""

import json

from asyncflow.config import load_config
from asyncflow.workflow.supervisor import Supervisor


def test_a_restart_still_starting_at_the_end_of_the_run_is_recorded(tmp_path):
    cfg = load_config(None, [f"observability.output_dir={tmp_path}", "workflow.mode=stream"])
    supervisor = Supervisor(cfg, pipe=None, reporter=None)
    event = {"service": "rollout", "worker": 1, "restart": 1, "error": "ActorDiedError", "detected_at": 10.0,
             "recovered_at": None, "released_rows": 8, "rolled_back_puts": 0, "resumed_at_step": 2,
             "how": "process restarted", "down_since": 10.0}
    supervisor.starting["ping"] = ("rollout", 1, None, "rollout instance 1", event)
    done = {**event, "recovered_at": 11.0, "worker": 0}
    supervisor._record(done)

    records = supervisor.finish()

    assert records == supervisor.events and len(records) == 2 and not supervisor.starting
    assert records[0] == done
    assert records[1]["recovered_at"] is None and records[1]["released_rows"] == 8
    assert records[1]["how"] == "process restarted; not up again when the run ended"
    lines = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert lines == records

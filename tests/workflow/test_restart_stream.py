"""Restarts in the sample stream (``workflow.mode: stream``): a rollout instance or the reward worker whose process
dies is started again, and what a dead instance held on the board's ledger goes back (``StreamLedger.forget``).

The fake run SIGKILLs one of two rollout instances' Ray worker processes, then the reward worker's, mid-run (the
processes are real Ray actors; the TransferQueue and the driver are real), and checks that the run finishes, every
prompt is trained once, whole, in one step (``check_stream``: group ids count the stream's prompts), no token is
trained more than ``max_staleness`` versions after the version that made it, and both restarts are recorded. The
ledger tests go through each thing a dead instance can leave half-done.
"""

import json
import threading
import time

import pytest

from asyncflow.workflow.stream_ledger import StreamLedger
from tests.recipe_runs import GROUP, PROMPTS, SMALL, check_stream, records, run_fake
from tests.workflow.test_restart import Killer, _logged

pytestmark = [pytest.mark.loop, pytest.mark.faults]

STEPS = 10
# Rollout is the bottleneck (``BusyTokens``, two groups in each engine), so the instance killed holds prompts in its
# engine, claims and puts. A worker killed while its get waits in the TransferQueue may be handed the next rows
# after its death; they come back when their lease runs out (``row_lease_s``, 600 s by default; 20 s here).
RUN = [*SMALL, "workflow.mode=stream", f"workflow.steps={STEPS}", "workflow.rollout_instances=2",
       "rollout.engine=tests.fakes.slower.BusyTokens", "rollout.max_num_seqs=8", "algorithm.kl_coef=0",
       "transfer_queue.put_lease_s=20", "transfer_queue.row_lease_s=20"]


def _scale(out, requests: list[tuple[int, int]], stop: threading.Event) -> None:
    """``request_scale(out, wanted)`` once the run has logged ``logged`` steps and the killed instance is up again
    (``Supervisor.scale`` counts the instances whose loops run), for each ``(logged, wanted)``."""
    from asyncflow.workflow.supervisor import request_scale

    def restarted() -> bool:
        path = out / "restarts.jsonl"
        return path.exists() and '"service": "rollout", "worker": 1, "restart": 1' in path.read_text()

    for logged, wanted in requests:
        while not stop.is_set() and (_logged(out) < logged or not restarted()):
            time.sleep(0.05)
        if stop.is_set():
            return
        request_scale(out, wanted)


def test_killed_stream_rollout_instance_and_reward_worker_restart_and_every_prompt_is_trained_once(
        tmp_path, tiny_model_dir, shared_ray):
    # Instance 1 is killed (restarted), the reward worker too; then the run is scaled to 3 instances and back to 1
    # (instances 2 and 1 removed: what they held goes back as a dead instance's does).
    out, stop = tmp_path / "stream", threading.Event()
    rollout = Killer(out, "rollout", [2], instance=1, exact=True)  # the one ``_scale`` waits for
    reward = Killer(out, "reward", [5])
    threads = [rollout, reward, threading.Thread(target=_scale, args=(out, [(3, 3), (6, 1)], stop), daemon=True)]
    for thread in threads:
        thread.start()
    try:
        summary = run_fake(tmp_path, tiny_model_dir, "stream", *RUN)
    finally:
        rollout.stop = reward.stop = True
        stop.set()
        for thread in threads:
            thread.join(10)
    assert len(rollout.killed) == 1 and len(reward.killed) == 1, "the run ended before the kills"
    check_stream(summary, 1, STEPS, PROMPTS, GROUP)
    for m in records(summary):  # per token, as the rollout saw it
        assert 0 <= m["staleness/token_lag_min"] <= m["staleness/token_lag_max"] <= 1, m
    events = sorted((e["service"], e["worker"], str(e["restart"]), e["error"]) for e in summary["service_restarts"])
    assert [e[:3] for e in events] == [("reward", 0, "1"), ("rollout", 1, "1"), ("rollout", 1, "None"),
                                       ("rollout", 2, "None"), ("rollout", 2, "None")], events
    assert [e[3] for e in events[2:]] == ["removed", "added", "removed"], events
    # The prompts in a dead or removed instance's engine went back to the stream. Whether the killed one held any
    # at the instant of its SIGKILL depends on timing (it may be waiting at the staleness bound), so this counts
    # the death and the two removals together.
    gone = [e for e in summary["service_restarts"] if e["service"] == "rollout" and e["error"] != "added"]
    assert sum(e["released_rows"] or 0 for e in gone) > 0, gone
    lines = (summary["_out"] / "restarts.jsonl").read_text().splitlines()
    assert sorted((e["service"], e["worker"], str(e["restart"]), e["error"]) for e in map(json.loads, lines)) == events
    assert sum(r.get("supervisor/restarts", 0.0) for r in records(summary)) == 2.0


def test_restartable_in_stream_mode():
    from dataclasses import replace

    from asyncflow.config import load_config
    from asyncflow.workflow.supervisor import restartable
    from tests.recipe_runs import REPO

    cfg = load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", ["workflow.mode=stream"])
    assert restartable(cfg) == {"reward", "rollout", "advantage"}
    # Dynamic sampling: a step takes any number of groups, and the advantage task counts as it judges.
    assert restartable(replace(cfg, algorithm=replace(cfg.algorithm, dynamic_sampling=True))) == {"reward"}
    assert restartable(replace(cfg, workflow=replace(cfg.workflow, max_service_restarts=0))) == set()


# ---------------------------------------------------------------------------------------------- the ledger


def _ledger() -> StreamLedger:
    return StreamLedger(first=0, last=2, groups_per_step=2, group_size=4, max_staleness=1)


def test_forget_gives_back_reservations_and_the_prompts_admitted_not_claimed():
    ledger = _ledger()
    assert ledger.reserve(3, version=0, holder="0:a") == 3
    assert ledger.reserve(9, version=0, holder="1:b") == 1  # steps 0 and 1: four groups
    ledger.admitted("0:a", {7: [0, 1, 2, 3], 8: [4, 5, 6, 7]})
    assert sorted(ledger.forget("0")) == list(range(8))
    assert ledger.reserved == 1  # instance 1's
    assert ledger.reserve(9, version=0, holder="1:b") == 3
    assert ledger.reserve(1, version=0, holder="0:a") == 0  # a call of the dead loop that arrives late


def test_a_dead_claimers_slot_waits_for_its_prompts_copy_and_a_confirmed_one_turns_copies_away():
    ledger = _ledger()
    ledger.reserve(4, version=0, holder="0:a")
    ledger.admitted("0:a", {7: [0, 1, 2, 3], 8: [4, 5, 6, 7]})
    assert ledger.claim(0, gid=7, holder="0:a") == ("ok", 0, 0)
    assert ledger.claim(0, gid=8, holder="0:a") == ("ok", 0, 1)
    ledger.done("0:a", [8])  # group 8 is put and confirmed; group 7's put may or may not have committed
    assert ledger.bound == {7: (0, 0), 8: (0, 1)}
    assert sorted(ledger.forget("0")) == [0, 1, 2, 3]
    # Slot 0 of step 0 is an orphan: the step is open again and the copy of prompt 7 has a reservation.
    assert ledger.open_step() == 0 and ledger.state()["orphans"] == 1
    assert ledger.reserve(9, version=0, holder="0:c") == 3  # step 1's two groups and the copy
    assert ledger.claim(0, gid=9, holder="0:c") == ("ok", 1, 0)  # new groups go on filling step 1
    assert ledger.claim(0, gid=7, holder="0:c") == ("ok", 0, 1)  # the copy takes its slot back
    assert ledger.bound[7] == (0, 0) and ledger.state()["orphans"] == 0
    assert ledger.claim(1, gid=8, holder="0:c")[0] == "dup"  # a copy of a confirmed group
    assert ledger.claim(1, gid=7, holder="1:d")[0] == "dup"  # the slot has a live claimer
    assert ledger.claimed == {0: 2, 1: 1}  # each prompt counted once


def test_a_claim_that_reaches_the_board_after_its_holders_death_leaves_an_orphan():
    ledger = _ledger()
    ledger.reserve(1, version=0, holder="0:a")
    ledger.forget("0")
    assert ledger.claim(0, gid=3, holder="0:a") == ("ok", 0, 0)  # the dead loop's claim, late
    assert ledger.open_step() == 0 and ledger.state()["orphans"] == 1
    ledger.done("0:a", [3])  # and its confirmation, late too: the put was committed, the slot is filled
    assert ledger.state()["orphans"] == 0

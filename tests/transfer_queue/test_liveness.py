"""Liveness of storage units on a busy host: a unit that is slow (stopped, starved) for seconds is not declared dead
and keeps its rows, while a unit whose process was killed is declared dead at once, from its closed connection,
not after the heartbeat timeout (``asyncflow.transfer_queue.membership``). Processes are stopped and killed for
real; nothing is asserted about timing: every wait polls for a state and fails only after a generous limit."""

from __future__ import annotations

import os
import signal
import time

import torch

from asyncflow.transfer_queue import TransferQueueConfig
from tests.transfer_queue.test_tq_failures import spread_rows, unit_state, wait_until


def _frozen(pids: list[int], seconds: float) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _healthy(client, before: dict) -> None:
    """Every unit alive in the incarnation it had, its rows not lost (checked over many of the controller's
    50 ms checks)."""
    for _ in range(20):
        status = client.status("p")
        assert all(u["alive"] for u in status["units"].values()), status["units"]
        time.sleep(0.1)
    assert {uid: unit_state(client, uid)["incarnation"] for uid in before} == before
    assert status["partitions"]["p"]["lost_rows"] == 0
    assert torch.equal(client.get("p", "t", ["x"], 8)["x"], torch.zeros(8, 16))


def test_a_unit_stalled_for_seconds_stays_alive_under_the_default_timeout(make_tq):
    # The default timeout, not the tests' short one: a unit stopped 1.5 times as long as the old default (3 s) once lost
    # its rows and rejoined, round after round, on a loaded machine.
    tq = make_tq(deployment="processes", heartbeat_timeout_s=TransferQueueConfig.heartbeat_timeout_s)
    with tq.client() as client:
        client.create_partition("p")
        spread_rows(client, "p")
        before = {uid: unit_state(client, uid)["incarnation"] for uid in (0, 1)}
        _frozen([tq.unit_pids[1]], 4.5)
        _healthy(client, before)


def test_a_stalled_controller_declares_no_unit_dead(make_tq):
    # Only the controller stops (its host swapped it out): the units kept beating, nobody listened; the gap is the
    # controller's own and is not counted against them.
    tq = make_tq(deployment="processes", heartbeat_timeout_s=1.0)
    with tq.client() as client:
        client.create_partition("p")
        spread_rows(client, "p")
        before = {uid: unit_state(client, uid)["incarnation"] for uid in (0, 1)}
        _frozen([tq.procs[0].pid], 4.0)
        _healthy(client, before)


def test_a_killed_unit_is_declared_dead_from_its_closed_connection(make_tq):
    # A timeout no wait below could outlast: the death is known from the link, not from silence.
    tq = make_tq(deployment="processes", heartbeat_timeout_s=3600.0)
    with tq.client() as client:
        client.create_partition("p")
        spread_rows(client, "p")
        tq.kill_unit(1)
        wait_until(lambda: not unit_state(client, 1)["alive"], timeout=120)
        assert unit_state(client, 0)["alive"]
        assert client.status("p")["partitions"]["p"]["lost_rows"] == 4
        # The survivor still serves, and the dead unit's replacement joins as a new incarnation.
        before = unit_state(client, 1)["incarnation"]
        tq.restart_unit(1)
        wait_until(lambda: unit_state(client, 1)["alive"], timeout=120)
        assert unit_state(client, 1)["incarnation"] != before


def test_a_stopped_unit_is_still_declared_dead_once_silent_past_the_timeout(make_tq):
    # Silence alone still counts (a host or network gone closes no connection): a unit stopped past a short timeout.
    tq = make_tq(deployment="processes", heartbeat_timeout_s=1.0)
    with tq.client() as client:
        client.create_partition("p")
        spread_rows(client, "p")
        pid = tq.unit_pids[1]
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: not unit_state(client, 1)["alive"])
        finally:
            os.kill(pid, signal.SIGCONT)

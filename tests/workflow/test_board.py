"""The version board without Ray: a version is visible only once every exporting rank staged it, per domain."""

import asyncio

import pytest

from asyncflow.workflow.board import VersionBoard, admitted_version


def test_version_visible_once_every_source_staged_it_in_that_domain():
    async def scenario():
        board = VersionBoard()
        await board.set_plan({"tp": 2}, ["0.0.0", "1.0.0"])
        await board.publish(0, "0.0.0", "seg-a")
        assert await board.version() == -1  # half a model is never handed out
        await board.publish(0, "1.0.0", "seg-b")
        version, staging = await board.wait_for_version(0, timeout_s=1)
        assert version == 0 and staging == {"plan": {"tp": 2}, "segments": {"0.0.0": "seg-a", "1.0.0": "seg-b"},
                                            "via": {"0.0.0": "shm", "1.0.0": "shm"}}
        # A relay domain has its own segments and its own pace.
        assert await board.version("rollout0") == -1
        with pytest.raises(TimeoutError, match="weight version 0"):
            await board.wait_for_version(0, timeout_s=0.05, domain="rollout0")
        for src in ("0.0.0", "1.0.0"):
            await board.publish(1, src, f"mirror-{src}", domain="rollout0", via="relay")
        version, staging = await board.wait_for_version(1, timeout_s=1, domain="rollout0")
        assert version == 1 and set(staging["segments"].values()) == {"mirror-0.0.0", "mirror-1.0.0"}
        assert staging["via"] == {"0.0.0": "relay", "1.0.0": "relay"}  # readers count bytes by the way they came
        with pytest.raises(ValueError, match="must increase"):
            await board.publish(1, "0.0.0", "mirror-0.0.0", domain="rollout0")
        await board.abort("trainer died")
        with pytest.raises(RuntimeError, match="trainer died"):
            await board.wait_for_version(5, timeout_s=1)

    asyncio.run(scenario())


def test_waiters_wake_when_the_last_source_arrives():
    async def scenario():
        board = VersionBoard()
        await board.set_plan({}, ["0.0.0", "0.1.0"])
        waiter = asyncio.create_task(board.wait_for_version(admitted_version(3, 1), timeout_s=2))
        for v in (0, 1, 2):
            for src in ("0.0.0", "0.1.0"):
                await board.publish(v, src, "s")
                await asyncio.sleep(0)
                if not (v == 2 and src == "0.1.0"):
                    assert not waiter.done()
        assert (await waiter)[0] == 2

    asyncio.run(scenario())


def test_receivers_wait_until_every_exporting_rank_said_where_it_runs():
    async def scenario():
        board = VersionBoard()
        await board.set_plan({"tp": 2}, ["0.0.0", "1.0.0"], {"0.0.0": "node-a"})
        waiter = asyncio.create_task(board.wait_for_plan(timeout_s=2, hosts=True))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # rank 1.0.0's host is unknown: a receiver could not tell whether to mirror it
        await board.set_plan({"tp": 2}, ["0.0.0", "1.0.0"], {"1.0.0": "node-b"})
        assert (await waiter)["hosts"] == {"0.0.0": "node-a", "1.0.0": "node-b"}

    asyncio.run(scenario())
